"""Scale benchmark: how a swarm of N real `p2p-diloco peer` processes does as N grows.

For each N of ``--peers`` (default 2, 4, 8, 16, 24): a bootstrap node and N peers on 127.0.0.1, all
started together with ``--wait-for-peers N`` (so that none takes its first outer steps alone), each
with OMP_NUM_THREADS=1 (one torch thread per peer) and its own identity, metrics file, log and
checkpoint directory, on one run config: ``--config`` (default peers/demo.toml) with
``inner.steps_per_outer`` replaced by ``--steps-per-outer`` (default 10; the copy used is written to
``--out``). Once the swarm's frontier (the highest outer step any peer recorded) reaches
``--outer-steps`` (default 4), and every running peer has recorded that step or a round it did not
apply (at most 30 s more), every process the benchmark started is stopped (SIGTERM, then SIGKILL of
the process and its descendants) and it checks by PID that none is left, p2pd included. Peers get no
``--max-outer-steps``, as in benchmarks/churn.py: a peer that missed the last round would find the
swarm gone and train on alone. From the peers' metrics files it reports, per N:

* seconds per outer step: the median and the longest gap between the first records of consecutive
  outer steps, from step 1 to 2 on (step 1 also measures process start-up, reported apart as
  "start → step 1": from the start of the processes to the first record of step 1);
* per outer step up to the target: the group sizes recorded (each distinct ``group_size`` with how
  many peers recorded it: ``3×2+1×1`` is two peers in a group of 3 that lost its third member,
  and one alone), how many distinct θ_global (``global_sha256``) the peers recorded (should be 1),
  and how many of the N peers did not record the step;
* state downloads (``state_loaded`` records) after the first record of step 1, by reason, and every
  other record about the rounds toward steps 1..T by event and reason: rounds not applied
  (``round_failed``, ``round_skipped``, ``round_rejected``, ``state_refused``, ``state_load_failed``),
  failed attempts retried within a round (``attempt_failed``), ``excluded``, and any event a later
  version adds (only ``reachability``, ``join``, ``outer_step``, ``state_loaded``, ``exit`` and
  ``round_stopped``, the final stop's, are left out);
* the share of the swarm's inner work that counted: Σ over steps 1..T of (peers that recorded the
  step) / (N × T);
* the mean bytes each peer sent per outer step after step 1 (``bytes_sent``: parts sent, averaged parts
  returned and, with ``--relay-group``, parts relayed for others; since issue 43 also the reports, the
  audit, the records and the probes: p2p_diloco/traffic.py);
* the mean ``blocked_seconds`` of the ``outer_step`` records after step 1: a peer's wall seconds
  between two outer steps not spent on inner steps (waiting for groupmates, matchmaking, the
  all-reduce and commit beyond what the overlapped inner steps hid, checkpointing). The metrics have
  no record of the moment a peer is ready to average, so the time from "ready" to the applied step
  is not measured directly; if the ``outer_step`` records carry ``ready_time`` (a time.time() like
  ``time``), its mean distance to ``time`` is reported too.

With ``--kill-mid-round K``, the last peer of each swarm (the victim) runs with
``P2P_DILOCO_FAULTS="allreduce_delay=<--kill-pause-s>,allreduce_delay_round=K"`` (p2p_diloco/faults.py):
as a reducer in its K-th all-reduce, the round that makes outer step K, it holds back its averaged
parts for that long after the first one, so its groupmates sit mid all-reduce waiting on it. Once the
frontier has reached K − 1, the benchmark watches the victim's log for "fault injection: pausing mid
all-reduce" and then SIGKILLs the victim and its process tree (hivemind's DHT and averager processes
and p2pd, snapshotted before the kill: benchmarks/churn.py's crash_tree); it is not restarted. The
report says whether the survivors still applied step K in that round (group size N − 1, possibly after
failed attempts within the round; no state download) or lost it (a ``round_failed`` or other record of
a round not applied first), how long after the kill the last survivor had step K, and, per survivor,
its records from the kill to step K. If the victim never pauses before the frontier passes K, it is
killed then, and the report says so.

Run::

    python benchmarks/scale.py                                    # N = 2, 4, 8, 16, 24; 4 outer steps
    python benchmarks/scale.py --peers 2,3 --outer-steps 3 --out /tmp/scale-check
    python benchmarks/scale.py --peers 3 --outer-steps 3 --kill-mid-round 2
    python benchmarks/scale.py --peers 16 --outer-steps 5 --relay-group 4      # rounds through relays

Every wait is bounded: ``--timeout-s`` (default 900) per N from the start of its processes to the
target step. Prints a Markdown table for docs/benchmarks.md; writes ``results.json``, ``table.md``,
``run.toml`` and one folder per N (``n<N>/``: peer metrics, logs, checkpoints, bootstrap.log) to
``--out`` (default bench-out/scale). Ctrl+C (or SIGTERM) stops every process it started.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.churn import (  # noqa: E402 (the repository is on the path now)
    LEDGER_EVERY_POLLS, POLL_S, SETTLE_TIMEOUT_S, ProcessLedger, Slot, clean_run_dir, crash_tree, first_step_times,
    fmt, frontier, interrupted, normalize_reason, read_slot_metrics, reap_leftovers, scan_logs, start_benchmark,
    start_slot, step_gaps, step_records, stop_slots,
)
from p2p_diloco.demo import DEFAULT_CONFIG, start_bootstrap, stop_process  # noqa: E402
from p2p_diloco.process_tree import descendant_pids, is_running, wait_gone  # noqa: E402

logger = logging.getLogger("benchmarks.scale")

PAUSE_LINE = "fault injection: pausing mid all-reduce"
LOG_POLL_S = 0.1  # how often the victim's log is read once its round has come
NOT_APPLIED = ("round_failed", "round_skipped", "round_rejected", "state_refused", "state_load_failed")
# records that are not counted as events by reason (round_stopped: the final stop cut a round short)
ROUTINE = ("reachability", "join", "outer_step", "state_loaded", "exit", "round_stopped")


# ----- processes ----------------------------------------------------------------------------------
def session_members(session_ids: set[int]) -> list[int]:
    """Every live process in one of these sessions. Each peer leads a session of its own
    (start_new_session), and its DHT and averager processes and their p2pd stay in it even when they
    outlive it: this finds what a snapshot of its descendants could have missed."""
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) in session_ids and fields[0] != "Z":
            found.append(int(entry))
    return found


def note_processes(ledger: ProcessLedger, slots: list[Slot], bootstrap: subprocess.Popen,
                   sessions: set[int]) -> None:
    pids = [p for p in [bootstrap.pid, *(s.proc.pid for s in slots if s.running())] if is_running(p)]
    ledger.add(pid for p in pids for pid in descendant_pids(p))
    ledger.add(session_members(sessions))


class LogWatch:
    """Reads what a log file gained since the last look."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def saw(self, text: str) -> bool:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return False
        # keep the tail, in case the line is being written
        found = text.encode() in chunk
        self.offset += max(0, len(chunk) - len(text))
        return found


# ----- one swarm ----------------------------------------------------------------------------------
@dataclass
class SwarmRun:
    num_peers: int
    run_dir: Path
    target: int
    started: float = 0.0  # time.time() of the start of the peers
    wall_s: float = 0.0
    reached_target: bool = False
    why_not: str = ""
    unexpected_exits: list[dict] = field(default_factory=list)
    kill: Optional[dict] = None
    leftover_pids: list[str] = field(default_factory=list)

    def records_by_slot(self) -> dict[int, list[dict]]:
        return {i: read_slot_metrics(self.run_dir, i) for i in range(self.num_peers)}


def settled(records: list[dict], target: int) -> bool:
    """The peer recorded the target step, or a round toward it (or past it) that it did not apply."""
    return any((r["event"] == "outer_step" and r["outer_step"] >= target)
               or (r["event"] in NOT_APPLIED and r.get("outer_step", -1) >= target - 1) for r in records)


def wait_settled(slots: list[Slot], target: int, timeout_s: float) -> list[int]:
    """Wait until every running peer has settled the target step; returns the slots that did not."""
    deadline = time.monotonic() + timeout_s
    while True:
        pending = [s.index for s in slots if s.running() and not settled(s.records(), target)]
        if not pending or time.monotonic() >= deadline:
            return pending
        time.sleep(POLL_S)


def run_swarm(n: int, args: argparse.Namespace, config: Path, out: Path) -> SwarmRun:
    run_dir = out / f"n{n}"
    clean_run_dir(run_dir)
    (out / "keys").mkdir(parents=True, exist_ok=True)
    run = SwarmRun(n, run_dir, args.outer_steps)
    ledger = ProcessLedger()
    slots = [Slot(i, run_dir, out / "keys" / f"peer-{i}.key") for i in range(n)]
    victim = slots[-1] if args.kill_mid_round else None
    faults = (f"allreduce_delay={args.kill_pause_s:g},allreduce_delay_round={args.kill_mid_round}"
              if victim else "")
    sessions: set[int] = set()
    started_mono = time.monotonic()
    bootstrap, maddr = start_bootstrap(run_dir)
    ledger.add([bootstrap.pid])
    logger.info("N = %d: bootstrap node at %s; starting %d peers%s", n, maddr, n,
                f" (peer {victim.index} with P2P_DILOCO_FAULTS={faults})" if victim else "")
    run.started = time.time()
    try:
        for slot in slots:
            start_slot(slot, config, maddr, ledger, "--wait-for-peers", str(n),
                       faults=faults if slot is victim else "", benchmark="scale")
            sessions.add(slot.proc.pid)
        deadline = started_mono + args.timeout_s
        watch = LogWatch(victim.log_path) if victim else None
        polls = 0
        run.why_not = f"outer step {args.outer_steps} not reached within {args.timeout_s:.0f} s"
        while time.monotonic() < deadline:
            records = {s.index: s.records() for s in slots}
            top = frontier(records)
            if top >= args.outer_steps:
                run.reached_target = True
                break
            for slot in slots:
                if slot.proc.poll() is not None and not slot.signalled and not slot.exit_noted:
                    slot.exit_noted = True
                    run.unexpected_exits.append(dict(slot=slot.index, returncode=slot.proc.returncode,
                                                     time=time.time(), log=slot.log_path.name))
                    logger.error("peer %d exited by itself (status %s); see %s", slot.index,
                                 slot.proc.returncode, slot.log_path)
            if not any(s.running() for s in slots):
                run.why_not = f"every peer exited before outer step {args.outer_steps}"
                break
            polls += 1
            if polls % LEDGER_EVERY_POLLS == 0:  # so that a child a peer leaves behind on exit is known
                note_processes(ledger, slots, bootstrap, sessions)
            if victim is not None and run.kill is None and top >= args.kill_mid_round - 1:
                run.kill = watch_and_kill(victim, watch, slots, ledger, args, deadline)
                continue
            time.sleep(POLL_S)
        if run.reached_target:
            pending = wait_settled(slots, args.outer_steps, SETTLE_TIMEOUT_S)
            if pending:
                logger.warning("N = %d: peers %s recorded neither outer step %d nor a failed round toward it "
                               "within %.0f s", n, pending, args.outer_steps, SETTLE_TIMEOUT_S)
        else:
            logger.error("N = %d: %s", n, run.why_not)
    finally:
        note_processes(ledger, slots, bootstrap, sessions)
        try:
            stop_slots(slots, ledger)
        finally:
            stop_process(bootstrap)
            ledger.add(session_members(sessions))  # whatever a stop left behind in the peers' sessions
            run.leftover_pids = reap_leftovers(ledger)
            stray = wait_gone(session_members(sessions), 3.0)
            if stray:  # reap_leftovers killed what the ledger knew; nothing else may remain
                logger.error("processes still running in the peers' sessions: %s", stray)
                run.leftover_pids += [f"{pid} (in a peer's session)" for pid in stray]
    run.wall_s = time.time() - run.started
    logger.info("N = %d: %s outer step %d after %.0f s", n, "reached" if run.reached_target else "did NOT reach",
                args.outer_steps, run.wall_s)
    return run


def watch_and_kill(victim: Slot, watch: LogWatch, slots: list[Slot], ledger: ProcessLedger,
                   args: argparse.Namespace, deadline: float) -> dict:
    """Wait for the victim to pause mid all-reduce in the round toward step K, then SIGKILL its tree."""
    k = args.kill_mid_round
    paused_at = None
    reason = "paused mid all-reduce"
    looks = 0
    while time.monotonic() < deadline:
        if watch.saw(PAUSE_LINE):
            paused_at = time.time()
            break
        if not victim.running():
            reason = "the victim exited before its pause"
            break
        looks += 1
        if looks % round(POLL_S / LOG_POLL_S) == 0 and frontier({s.index: s.records() for s in slots}) > k:
            reason = f"no pause logged before the frontier passed outer step {k}"
            break
        time.sleep(LOG_POLL_S)
    else:
        reason = "no pause logged before the timeout"
    records = {s.index: s.records() for s in slots}
    top = frontier(records)
    victim_steps = step_records(records[victim.index])
    kill = dict(slot=victim.index, pid=victim.proc.pid, requested_step=k, landed=reason,
                frontier_at_kill=top, victim_step_at_kill=victim_steps[-1]["outer_step"] if victim_steps else 0,
                paused_at=paused_at)
    victim.signalled = True
    if victim.running():
        descendants = crash_tree(victim.proc, ledger)
        kill.update(time=time.time(), descendants=len(descendants))
        logger.info("SIGKILL peer %d (%d descendants) at frontier %d: %s", victim.index, len(descendants), top, reason)
    else:
        kill.update(time=time.time(), descendants=0, returncode=victim.proc.returncode)
    return kill


# ----- analysis -----------------------------------------------------------------------------------
def per_step(records_by_slot: dict[int, list[dict]], n: int, target: int) -> list[dict]:
    steps = []
    for s in range(1, target + 1):
        recs = {i: next(r for r in step_records(rs) if r["outer_step"] == s)
                for i, rs in records_by_slot.items() if any(r["outer_step"] == s for r in step_records(rs))}
        sizes = Counter(r["group_size"] for r in recs.values())
        steps.append(dict(step=s, peers_recorded=len(recs), missing=n - len(recs),
                          group_sizes=dict(sorted(sizes.items(), reverse=True)),
                          hashes=len({r["global_sha256"] for r in recs.values()}),
                          missing_slots=sorted(set(records_by_slot) - set(recs))))
    return steps


def other_events(records_by_slot: dict[int, list[dict]], target: int) -> dict[str, dict[str, int]]:
    """event -> reason -> count of every record about the rounds toward steps 1..target that is neither an
    outer step nor a state download: rounds not applied (round_failed, round_skipped, ...), failed attempts
    within a round, exclusions, and whatever other event a later version writes."""
    found: dict[str, Counter] = defaultdict(Counter)
    for rs in records_by_slot.values():
        for r in rs:
            if r["event"] not in ROUTINE and r.get("outer_step", 0) < target:
                found[r["event"]][normalize_reason(str(r.get("reason", "")))] += 1
    return {event: dict(c) for event, c in found.items()}


def _describe(record: dict, since: float) -> str:
    if record["event"] == "outer_step":
        attempt = f", attempt {record['attempt']}" if "attempt" in record else ""
        return (f"outer_step {record['outer_step']} (group of {record.get('group_size')}{attempt}) "
                f"at +{record['time'] - since:.1f} s")
    reason = normalize_reason(str(record.get("reason", "")))
    return f"{record['event']}" + (f" ({reason})" if reason else "") + f" at +{record['time'] - since:.1f} s"


def kill_outcome(kill: dict, records_by_slot: dict[int, list[dict]], n: int) -> dict:
    """Did the survivors apply the step of the round the kill landed in, or lose it? Each survivor's records
    after the kill, up to its record of that step (or a state download past it), say what happened."""
    step = kill["frontier_at_kill"] + 1  # the round in flight at the kill
    t = kill["time"]
    survivors = {i: rs for i, rs in records_by_slot.items() if i != kill["slot"]}
    per_peer, in_round, lost, applied_at, sizes = {}, [], [], [], Counter()
    for i, rs in survivors.items():
        before = next((r for r in step_records(rs) if r["outer_step"] == step and r["time"] <= t), None)
        if before is not None:
            per_peer[i] = f"had applied step {step} before the kill (group of {before.get('group_size')})"
            in_round.append(i)
            sizes[before.get("group_size")] += 1
            continue
        trail = []
        for r in (r for r in rs if r["time"] > t and r["event"] not in ("reachability", "exit")):
            if r["event"] == "outer_step" and r["outer_step"] < step:
                continue
            trail.append(r)
            if (r["event"] == "outer_step" and r["outer_step"] >= step) or \
                    (r["event"] == "state_loaded" and r["outer_step"] >= step):
                break
        decisive = next((r for r in trail if r["event"] == "outer_step" or r["event"] in NOT_APPLIED), None)
        if decisive is not None and decisive["event"] == "outer_step" and decisive["outer_step"] == step:
            in_round.append(i)
        elif decisive is not None and decisive["event"] in NOT_APPLIED:
            lost.append(i)
        got = next((r for r in trail if r["event"] in ("outer_step", "state_loaded") and r["outer_step"] >= step), None)
        if got is not None:
            applied_at.append(got["time"] - t)
            if got["event"] == "outer_step" and got["outer_step"] == step:
                sizes[got.get("group_size")] += 1
        text, previous, repeats = [], None, 0
        for r in trail:  # repeated events once, with a count
            described = _describe(r, t)
            key = (r["event"], normalize_reason(str(r.get("reason", ""))))
            if key == previous and r["event"] != "outer_step":
                repeats += 1
                text[-1] = described.rsplit(" at +", 1)[0] + f" ×{repeats + 1}, last at +{r['time'] - t:.1f} s"
            else:
                previous, repeats = key, 0
                text.append(described)
        per_peer[i] = " → ".join(text) or f"recorded nothing about step {step} after the kill"
    downloads = [dict(slot=i, outer_step=r["outer_step"], reason=normalize_reason(str(r.get("reason", ""))))
                 for i, rs in survivors.items() for r in rs if r["event"] == "state_loaded" and r["time"] > t]
    attempts = sum(1 for rs in survivors.values() for r in rs
                   if r["event"] == "attempt_failed" and r["time"] > t and r.get("outer_step") == step - 1)
    sizes_text = ", ".join(f"{size}×{count}" for size, count in sizes.items()) or "none"
    if len(in_round) == n - 1 and set(sizes) == {n - 1}:
        verdict = f"applied: all {n - 1} survivors applied step {step} in that round (group of {n - 1})"
    elif lost:
        verdict = (f"lost: {len(lost)} of {n - 1} survivors did not apply step {step} in that round"
                   + (f", {len(in_round)} did" if in_round else "") + f" (group sizes {sizes_text})")
    else:
        verdict = (f"step {step}: {len(in_round)} of {n - 1} survivors applied it in that round "
                   f"(group sizes {sizes_text})")
    if attempts:
        verdict += f"; {attempts} failed attempt(s) retried within the round"
    if applied_at:
        verdict += f"; the last survivor had step {step} {max(applied_at):.0f} s after the kill"
    if len(applied_at) < n - 1:
        verdict += f"; {n - 1 - len(applied_at)} survivor(s) never got step {step}"
    verdict += f"; {len(downloads)} state download(s)"
    if kill["landed"] != "paused mid all-reduce":
        verdict += f" (kill not mid all-reduce: {kill['landed']})"
    return dict(kill, round_step=step, survivors=per_peer, survivors_in_round=in_round, survivors_lost=lost,
                seconds_to_step=applied_at, state_loaded_after_kill=downloads, verdict=verdict)


def bytes_sent_per_step(records: dict[int, list[dict]], target: int) -> list[int]:
    """Each peer's all-reduce bytes sent (parts, relayed ones included) between two consecutive outer
    steps it recorded, for steps 2..target: the metrics hold running totals."""
    sent = []
    for rs in records.values():
        totals = {r["outer_step"]: r["bytes_sent"] for r in step_records(rs) if "bytes_sent" in r}
        sent += [totals[s] - totals[s - 1] for s in range(2, target + 1) if s in totals and s - 1 in totals]
    return sent


def analyze(run: SwarmRun) -> dict:
    records = run.records_by_slot()
    target = run.target
    step_times = {s: t for s, t in first_step_times(records).items() if s <= target}
    gaps = [g["seconds"] for g in step_gaps(step_times)]
    steps = per_step(records, run.num_peers, target)
    t1 = step_times.get(1)
    loaded = [dict(slot=i, outer_step=r["outer_step"], reason=normalize_reason(str(r.get("reason", ""))),
                   time=r["time"]) for i, rs in records.items() for r in rs
              if r["event"] == "state_loaded" and t1 is not None and r["time"] > t1]
    later = [r for rs in records.values() for r in step_records(rs) if 2 <= r["outer_step"] <= target]
    blocked = [r["blocked_seconds"] for r in later if "blocked_seconds" in r]
    sent = bytes_sent_per_step(records, target)
    ready = [r["time"] - r["ready_time"] for r in later if isinstance(r.get("ready_time"), (int, float))]
    return dict(
        peers=run.num_peers,
        reached_target=run.reached_target,
        why_not=None if run.reached_target else run.why_not,
        wall_s=run.wall_s,
        start_to_step_1_s=(t1 - run.started) if t1 is not None else None,
        step_times=step_times,
        gaps_s=gaps,
        median_gap_s=statistics.median(gaps) if gaps else None,
        max_gap_s=max(gaps) if gaps else None,
        per_step=steps,
        state_loaded_after_step_1=loaded,
        state_loaded_by_reason=dict(Counter(r["reason"] for r in loaded)),
        events_by_reason=other_events(records, target),
        work_share=sum(s["peers_recorded"] for s in steps) / (run.num_peers * target),
        mean_blocked_s=statistics.mean(blocked) if blocked else None,
        mean_mb_sent_per_step=statistics.mean(sent) / 1e6 if sent else None,
        mean_ready_to_applied_s=statistics.mean(ready) if ready else None,
        kill=kill_outcome(run.kill, records, run.num_peers) if run.kill and "time" in run.kill else run.kill,
        unexpected_exits=run.unexpected_exits,
        log_findings=scan_logs(run.run_dir),
        leftover_pids=run.leftover_pids,
    )


# ----- report -------------------------------------------------------------------------------------
def _sizes(step: dict) -> str:
    return "+".join(f"{size}×{count}" for size, count in step["group_sizes"].items()) or "none"


def _by_reason(counts: dict[str, int]) -> str:
    total = sum(counts.values())
    return f"{total}" + (" (" + "; ".join(f"{c}× {r}" for r, c in counts.items()) + ")" if total else "")


def _events(by_event: dict[str, dict[str, int]]) -> str:
    parts = [f"{sum(c.values())} {event}: " + "; ".join(f"{n}× {r}" for r, n in c.items())
             for event, c in by_event.items()]
    return "; ".join(parts) or "0"


def markdown_table(results: list[dict], kill_step: Optional[int]) -> str:
    header = ["N", "s per outer step (median / max)", "start → step 1", "group sizes per step",
              "hashes per step", "peers missing per step", "state downloads after step 1",
              "rounds not applied, failed attempts (by event)", "share of work counted",
              "s not training per step (mean)", "MB sent per peer per step (mean)"]
    if any(r["mean_ready_to_applied_s"] is not None for r in results):
        header.append("ready → applied (mean)")
    if kill_step:
        header.append(f"SIGKILL mid all-reduce of step {kill_step}")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        steps = r["per_step"]
        cells = [
            str(r["peers"]) + ("" if r["reached_target"] else " (timed out)"),
            "–" if r["median_gap_s"] is None else f"{r['median_gap_s']:.1f} / {r['max_gap_s']:.1f} s",
            fmt(r["start_to_step_1_s"], ".0f") + (" s" if r["start_to_step_1_s"] is not None else ""),
            " / ".join(_sizes(s) for s in steps),
            " / ".join(str(s["hashes"]) for s in steps),
            " / ".join(str(s["missing"]) for s in steps),
            _by_reason(r["state_loaded_by_reason"]),
            _events(r["events_by_reason"]),
            f"{r['work_share']:.0%}",
            fmt(r["mean_blocked_s"]) + (" s" if r["mean_blocked_s"] is not None else ""),
            fmt(r["mean_mb_sent_per_step"], ".2f"),
        ]
        if "ready → applied (mean)" in header:
            cells.append(f"{fmt(r['mean_ready_to_applied_s'])} s")
        if kill_step:
            kill = r["kill"]
            cells.append("–" if not kill else kill.get("verdict", kill.get("landed", "–")))
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def notes(results: list[dict], args: argparse.Namespace, config: Path) -> str:
    import tomllib

    inner_steps = tomllib.loads(config.read_text())["inner"]["steps_per_outer"]
    lines = [f"Outer steps 1–{args.outer_steps} of {config.name}, H = {inner_steps} inner steps per "
             f"outer step; per-step columns list steps 1, 2, … separated by \" / \"; a group size cell "
             f"\"g×c\" is c peers that recorded a group of g."]
    for r in results:
        kill = r["kill"]
        if kill and "survivors" in kill:
            lines.append(f"N = {r['peers']}: SIGKILL of peer {kill['slot']} ({kill['descendants']} descendants) at "
                         f"frontier {kill['frontier_at_kill']} ({kill['landed']}); survivors:")
            lines += [f"  - peer {i}: {what}" for i, what in kill["survivors"].items()]
    return "\n".join(lines)


def report(results: list[dict], args: argparse.Namespace, config: Path, out: Path, wall_s: float) -> None:
    table = markdown_table(results, args.kill_mid_round)
    text = f"{table}\n\n{notes(results, args, config)}\n"
    print(f"\n{text}")
    for r in results:
        for finding in r["log_findings"][:8]:
            print(f"N = {r['peers']} logs: {finding['count']}× {finding['message']} (first: {finding['first']})")
        for e in r["unexpected_exits"]:
            print(f"N = {r['peers']}: peer {e['slot']} exited by itself with status {e['returncode']} (see {e['log']})")
        if r["leftover_pids"]:
            print(f"N = {r['peers']}: processes left running and killed at the end: {r['leftover_pids']}")
    (out / "table.md").write_text(text)
    (out / "results.json").write_text(json.dumps(
        dict(args=vars(args), config=str(config), wall_s=wall_s, runs=results), indent=2, default=str))
    print(f"wrote {out / 'results.json'} and {out / 'table.md'}; benchmark wall time {wall_s:.0f} s")


# ----- main ---------------------------------------------------------------------------------------
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--peers", default="2,4,8,16,24", help="comma-separated swarm sizes N, one run each")
    parser.add_argument("--outer-steps", type=int, default=4, help="target outer step of each run")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="run config (TOML)")
    parser.add_argument("--steps-per-outer", type=int, default=10,
                        help="override inner.steps_per_outer of --config (0: keep the config's value)")
    parser.add_argument("--timeout-s", type=float, default=900.0,
                        help="seconds per N, from the start of its processes to the target step")
    parser.add_argument("--kill-mid-round", type=int, default=None, metavar="K",
                        help="SIGKILL the last peer (with its process tree) mid all-reduce of the round that "
                             "makes outer step K, and report whether the others still applied it")
    parser.add_argument("--kill-pause-s", type=float, default=8.0,
                        help="with --kill-mid-round: seconds the victim holds back its averaged parts "
                             "(P2P_DILOCO_FAULTS allreduce_delay)")
    parser.add_argument("--relay-group", type=int, default=None, metavar="G",
                        help="swarm.relay_group_size of every peer: rounds of more than G members go through "
                             "relays (0: always flat; default: the config's)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/scale"), help="output directory")
    args = parser.parse_args(argv)
    try:
        args.peer_counts = [int(n) for n in args.peers.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--peers: expected comma-separated integers, got {args.peers!r}")
    if not args.peer_counts or min(args.peer_counts) < 1:
        parser.error("--peers: every N must be at least 1")
    if args.outer_steps < 2:
        parser.error("--outer-steps must be at least 2 (step 1 includes start-up)")
    if args.relay_group is not None and args.relay_group < 0:
        parser.error("--relay-group must be at least 0")
    if args.kill_mid_round is not None:
        if not 1 <= args.kill_mid_round <= args.outer_steps:
            parser.error("--kill-mid-round K needs 1 <= K <= --outer-steps")
        if min(args.peer_counts) < 2:
            parser.error("--kill-mid-round needs N >= 2 (a victim and a survivor)")
    return args


def set_relay_group(config: Path, group: int) -> None:
    """Set ``swarm.relay_group_size`` in the benchmark's copy of the run config (its [swarm] table)."""
    text = config.read_text()
    text = re.sub(r"(?m)^relay_group_size\s*=.*\n", "", text)
    text, count = re.subn(r"(?m)^\[swarm\]\s*$", f"[swarm]\nrelay_group_size = {group}", text)
    if count != 1:
        raise SystemExit(f"error: {config} has no single [swarm] table to set relay_group_size in")
    config.write_text(text)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    started, config = start_benchmark(args)
    if args.relay_group is not None:
        set_relay_group(config, args.relay_group)
    runs = []
    try:
        for n in args.peer_counts:
            runs.append(run_swarm(n, args, config, args.out))
    except KeyboardInterrupt as e:
        return interrupted(e)
    results = [analyze(r) for r in runs]
    report(results, args, config, args.out, time.time() - started)
    return 0 if all(r.reached_target and not r.leftover_pids for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
