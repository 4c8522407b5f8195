"""Churn benchmark: a swarm of real `p2p-diloco peer` processes while peers crash, leave and come back.

Two runs of the same swarm (a bootstrap node and N peers on 127.0.0.1, the same run config, the same
peer identities and so the same data orders), each until θ_global reaches the target outer step:

A. **churn**: roughly ``--events-per-step`` chaos events per outer step. Each time the swarm's
   frontier (the highest outer step any peer recorded) passes another step, an event is scheduled
   at a random point of the next round (uniform over the recent step time), so that it lands in
   inner steps, matchmaking, all-reduce or commit alike. The event picks a random peer that has
   joined and either SIGKILLs it together with its descendants (hivemind's DHT and averager
   processes and the p2pd daemon, snapshotted before the kill: a crash; torch's shared-memory
   manager is left to clean up and exit by itself) or SIGTERMs it (a clean leave), 50/50 from a
   seeded RNG. The peer is started again after a random downtime (``--downtime``, counted from its
   exit) in the same slot: same identity key, checkpoint directory, metrics file and log, so it
   resumes from its checkpoint and downloads the state if the swarm moved on. At least
   ``--min-alive`` peers that have joined stay up. The chaos stops once the frontier reaches the
   target; restarts still pending are dropped.
B. **baseline**: the same swarm without churn (skip it with ``--no-baseline``).

Once the frontier reaches the target, and every member of the group that made it has recorded it
too, the benchmark stops every process it started (SIGTERM, then SIGKILL of the process and its
descendants) and checks by PID that none is left. (Peers do not get ``--max-outer-steps``: a peer that
missed the last round would then find the swarm gone and train on alone, a fork that only the end of
the benchmark causes.) It then reads the peers' metrics files and the chaos log and reports:

* outer steps completed (highest step recorded, and how many distinct steps were);
* the gaps between consecutive outer steps (time from the first record of step s−1 to the first
  record of step s, for s ≥ 2: step 1 also measures process start-up), the longest one, and what
  happened in it: chaos events, failed rounds, state downloads, the group size that closed it;
* disagreements: steps at which peers recorded different θ_global (sha256; the commit protocol
  should keep this at 0), every ``round_failed`` record (a round some peer did not apply) with how
  it was resolved (what that peer recorded next), and every ``state_loaded`` record by reason;
* the held-out loss of the final θ_global (from the checkpoints of the peers that hold the agreed
  final state, evaluated as `p2p-diloco demo` does), churn against baseline;
* warnings, errors and tracebacks in the peer logs, grouped by message, and peers that exited
  without being signalled.

The run config is ``--config`` (default peers/demo.toml) with ``inner.steps_per_outer`` replaced by
``--steps-per-outer`` (default 10 instead of 25: both runs then take about 6 minutes on 2 idle CPU
cores, 9 under other load); the copy actually used is written to ``--out``. Children run with OMP_NUM_THREADS=1 and in their own session
(a Ctrl+C reaches only this script, which then stops them in order).

Run::

    python benchmarks/churn.py                         # both runs, 6 peers, 20 outer steps
    python benchmarks/churn.py --peers 4 --outer-steps 8 --no-baseline --out /tmp/churn

Prints a markdown table; writes ``results.json``, ``table.md``, ``outer_steps.png`` and one folder per
run (``chaos.jsonl``, peer metrics, logs, checkpoints) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

from p2p_diloco.demo import DEFAULT_CONFIG, cli_command, evaluate, start_bootstrap, stop_process
from p2p_diloco.metrics import read_metrics
from p2p_diloco.process_tree import (
    command_name, descendant_pids, is_running, kill_tree, start_ticks, stop_processes, wait_gone,
)

logger = logging.getLogger("benchmarks.churn")

POLL_S = 0.5  # how often the orchestrator reads the metrics files
LEAVE_TIMEOUT_S = 30.0  # a SIGTERMed peer that has not exited by then is SIGKILLed (and that is reported)
STOP_GRACE_S = 20.0  # final stop: SIGTERM, then SIGKILL after this long
LEFT_BEHIND_GRACE_S = 3.0  # a departed peer's children still running this long after it are left behind
DEFAULT_STEP_S = 10.0  # step time assumed before two steps were observed
SETTLE_TIMEOUT_S = 30.0  # at the end: how long the last group's members may take to commit the last step
LEDGER_EVERY_POLLS = 10  # how often the descendants of running peers are noted down


# ----- configuration ------------------------------------------------------------------------------
def write_run_config(base: Path, steps_per_outer: Optional[int], dest: Path) -> Path:
    """A copy of `base` (comments kept) with ``steps_per_outer`` replaced, if given."""
    text = base.read_text()
    if steps_per_outer is not None:
        text, count = re.subn(r"(?m)^steps_per_outer\s*=.*$", f"steps_per_outer = {steps_per_outer}", text)
        if count != 1:
            raise SystemExit(f"error: {base} has no single `steps_per_outer = ...` line to replace")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text)
    return dest


def prepare_tokenizer(config: Path) -> None:
    """Train and cache the tokenizer once, before N peers would each do it at the same time."""
    from p2p_diloco.config import load_config
    from p2p_diloco.train.data import TextData

    TextData(load_config(config).data)


# ----- processes ----------------------------------------------------------------------------------
class ProcessLedger:
    """Every process this benchmark started or saw below one, so that none is left behind."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, Optional[int]], str] = {}  # (pid, start ticks) -> command name

    def add(self, pids: Iterable[int]) -> None:
        for pid in pids:
            self._seen.setdefault((pid, start_ticks(pid)), command_name(pid))

    def still_running(self) -> dict[int, str]:
        """PID -> command name of each noted process that still runs (not a later reuse of its PID)."""
        return {pid: name for (pid, ticks), name in self._seen.items()
                if ticks is not None and is_running(pid) and start_ticks(pid) == ticks}


def metrics_path(run_dir: Path, index: int) -> Path:
    return run_dir / f"peer-{index}.metrics.jsonl"


def read_slot_metrics(run_dir: Path, index: int) -> list[dict]:
    path = metrics_path(run_dir, index)
    return read_metrics(path) if path.exists() else []


@dataclass
class Slot:
    """One peer position: its files survive restarts, its process does not."""

    index: int
    run_dir: Path
    key_path: Path
    proc: Optional[subprocess.Popen] = None
    started_at: float = 0.0  # time.time() of the latest start
    starts: int = 0
    leaving_since: Optional[float] = None  # SIGTERM sent at (time.time()), until it exits
    leaving_children: list[int] = field(default_factory=list)
    restart_at: Optional[float] = None  # scheduled restart (time.time()) while down
    signalled: bool = False  # this process was sent SIGKILL or SIGTERM (its exit is expected)
    exit_noted: bool = False  # its exit without a signal was logged

    @property
    def metrics_path(self) -> Path:
        return metrics_path(self.run_dir, self.index)

    @property
    def log_path(self) -> Path:
        return self.run_dir / f"peer-{self.index}.log"

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / f"peer-{self.index}"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def records(self) -> list[dict]:
        return read_slot_metrics(self.run_dir, self.index)


def child_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.pop("P2P_DILOCO_FAULTS", None)  # the faults here are real signals, nothing is slowed down
    return env


def start_slot(slot: Slot, config: Path, maddr: str, ledger: ProcessLedger, *extra: str, faults: str = "",
               benchmark: str = "churn") -> None:
    """Start the slot's peer (`extra`: more `peer` options; `faults`: its P2P_DILOCO_FAULTS, none by default)."""
    env = child_env()
    if faults:
        env["P2P_DILOCO_FAULTS"] = faults
    slot.starts += 1
    with open(slot.log_path, "a") as log:
        log.write(f"===== {benchmark} benchmark: start #{slot.starts} of peer {slot.index} at {time.ctime()}"
                  f"{f' with P2P_DILOCO_FAULTS={faults}' if faults else ''}\n")
        log.flush()
        slot.proc = subprocess.Popen(
            cli_command(
                "peer", "--config", str(config), "--host", "127.0.0.1", "--initial-peers", maddr,
                "--identity-path", str(slot.key_path), "--metrics-file", str(slot.metrics_path),
                "--checkpoint-dir", str(slot.checkpoint_dir), *extra,
            ),
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    slot.started_at = time.time()
    slot.restart_at, slot.signalled, slot.exit_noted = None, False, False
    ledger.add([slot.proc.pid])


def _pid(proc_or_slot) -> Optional[int]:
    proc = proc_or_slot.proc if isinstance(proc_or_slot, Slot) else proc_or_slot
    return proc.pid if proc is not None and proc.poll() is None else None


def crash_tree(proc: subprocess.Popen, ledger: ProcessLedger) -> list[int]:
    """SIGKILL a peer and its descendants (see :func:`kill_tree`); the ledger checks that torch's
    shared-memory manager, which is spared, does exit by itself. Returns the descendants it had."""
    descendants = kill_tree(proc.pid)
    ledger.add(descendants)
    proc.wait(10)
    return descendants


def stop_slots(slots: list[Slot], ledger: ProcessLedger, grace_s: float = STOP_GRACE_S) -> dict[int, float]:
    """SIGTERM every running peer at once (a second SIGTERM would make a peer skip its cleanup),
    wait up to `grace_s`, SIGKILL the trees that are still up, then stop any leftover child.
    Returns, for the peers that the chaos had already told to leave, how long they took."""
    children: list[int] = []
    for slot in slots:
        if slot.running():
            children += descendant_pids(slot.proc.pid)
            if slot.leaving_since is None:
                slot.proc.send_signal(signal.SIGTERM)
            slot.signalled = True
    ledger.add(children)
    deadline = time.monotonic() + grace_s
    leave_s = {}
    for slot in slots:
        if slot.proc is None:
            continue
        try:
            slot.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("peer %d did not stop within %.0f s of SIGTERM; killing it", slot.index, grace_s)
            crash_tree(slot.proc, ledger)
        if slot.leaving_since is not None:
            leave_s[slot.index] = time.time() - slot.leaving_since  # an upper bound: waited in turn
    stop_processes([pid for pid in children if is_running(pid)], grace_s=3.0)
    return leave_s


def reap_leftovers(ledger: ProcessLedger) -> list[str]:
    """SIGKILL whatever this benchmark started that still runs after a grace period (PIDs are
    checked against reuse)."""
    wait_gone(list(ledger.still_running()), LEFT_BEHIND_GRACE_S)
    leftovers = ledger.still_running()
    if leftovers:
        logger.error("processes left running: %s; killing them", leftovers)
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return [f"{pid} ({name})" for pid, name in leftovers.items()]


# ----- swarm progress -----------------------------------------------------------------------------
def step_records(records: Iterable[dict]) -> list[dict]:
    return [r for r in records if r["event"] == "outer_step"]


def frontier(records_by_slot: dict[int, list[dict]]) -> int:
    return max((r["outer_step"] for rs in records_by_slot.values() for r in step_records(rs)), default=0)


def first_step_times(records_by_slot: dict[int, list[dict]]) -> dict[int, float]:
    """Outer step -> when the first peer recorded it."""
    first: dict[int, float] = {}
    for record in (r for rs in records_by_slot.values() for r in step_records(rs)):
        step = record["outer_step"]
        first[step] = min(first.get(step, record["time"]), record["time"])
    return dict(sorted(first.items()))


def has_joined(slot: Slot, records: list[dict]) -> bool:
    return slot.running() and any(r["event"] == "join" and r["time"] >= slot.started_at for r in records)


def recent_step_s(step_times: dict[int, float]) -> float:
    times = list(step_times.values())[-6:]
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else DEFAULT_STEP_S


# ----- chaos --------------------------------------------------------------------------------------
class EventLog:
    """What happened to the peer processes (``chaos.jsonl``): signals, exits, restarts."""

    def __init__(self, path: Path):
        self.path = path
        self.events: list[dict] = []

    def log(self, kind: str, slot: Slot, **fields) -> None:
        event = dict(time=time.time(), kind=kind, slot=slot.index, **fields)
        self.events.append(event)
        with open(self.path, "a") as f:
            f.write(json.dumps(event) + "\n")
        logger.info("chaos: %s peer %d %s", kind, slot.index, fields or "")

    def note_unexpected_exits(self, slots: list[Slot]) -> None:
        """A peer that exits without being signalled crashed by itself: a bug to report (no restart)."""
        for slot in slots:
            if slot.proc is not None and not slot.running() and not slot.signalled and not slot.exit_noted:
                slot.exit_noted = True
                self.log("exited_unexpectedly", slot, returncode=slot.proc.returncode, log=slot.log_path.name)


class Chaos:
    """Kills and restarts peers: about `rate` events per outer step, each logged to the event log."""

    def __init__(self, rng: random.Random, rate: float, downtime: tuple[float, float], min_alive: int,
                 events: EventLog, ledger: ProcessLedger):
        self.rng, self.rate, self.downtime, self.min_alive = rng, rate, downtime, min_alive
        self.events, self.ledger = events, ledger
        self.log = events.log
        self.fired = 0
        self.skipped = 0
        self.next_event_at: Optional[float] = None

    def tick(self, slots: list[Slot], records_by_slot: dict[int, list[dict]],
             restart: Callable[[Slot], None]) -> None:
        """One look at the swarm: settle leaving peers, restart due ones, fire an event if it is time."""
        now = time.time()
        for slot in slots:
            if slot.leaving_since is not None:
                self._settle_leave(slot, now)
            elif slot.restart_at is not None and now >= slot.restart_at:
                restart(slot)
                self.log("restart", slot, pid=slot.proc.pid, start=slot.starts)
        step_times = first_step_times(records_by_slot)
        top = frontier(records_by_slot)
        due = int(top * self.rate)
        if self.next_event_at is None and self.fired < due:
            self.skipped += max(0, due - self.fired - 1)  # events the swarm outran: dropped, not bunched
            self.fired = max(self.fired, due - 1)
            self.next_event_at = now + self.rng.uniform(0.0, recent_step_s(step_times))
        if self.next_event_at is not None and now >= self.next_event_at:
            if self._strike(slots, records_by_slot, top):
                self.fired += 1
                self.next_event_at = None

    def _strike(self, slots: list[Slot], records_by_slot: dict[int, list[dict]], top: int) -> bool:
        # only peers that have joined: a peer still starting up may not have its signal handlers yet,
        # nor all of its child processes (which a SIGKILL must find and kill too)
        joined = [s for s in slots if s.leaving_since is None and has_joined(s, records_by_slot[s.index])]
        if len(joined) <= self.min_alive:
            return False  # try again at the next tick
        victim = self.rng.choice(joined)
        last = step_records(records_by_slot[victim.index])
        where = dict(pid=victim.proc.pid, swarm_step=top, peer_step=last[-1]["outer_step"] if last else 0)
        victim.signalled = True
        if self.rng.random() < 0.5:
            descendants = crash_tree(victim.proc, self.ledger)
            self.log("SIGKILL", victim, descendants=len(descendants), **where)
            self._schedule_restart(victim, time.time())
        else:
            victim.leaving_children = descendant_pids(victim.proc.pid)
            self.ledger.add(victim.leaving_children)
            victim.proc.send_signal(signal.SIGTERM)
            victim.leaving_since = time.time()
            self.log("SIGTERM", victim, **where)
        return True

    def _settle_leave(self, slot: Slot, now: float) -> None:
        if slot.proc.poll() is None:
            if now - slot.leaving_since < LEAVE_TIMEOUT_S:
                return
            crash_tree(slot.proc, self.ledger)
            self.log("leave_timeout", slot, after_s=round(now - slot.leaving_since, 1))
        leave_s = now - slot.leaving_since
        # children may take a moment to follow their parent (torch_shm_manager exits once it sees it gone)
        left_behind = {pid: command_name(pid) for pid in wait_gone(slot.leaving_children, LEFT_BEHIND_GRACE_S)}
        stop_processes(list(left_behind), grace_s=0.0)
        self.log("exited", slot, returncode=slot.proc.returncode, leave_s=round(leave_s, 1),
                 children_left_behind=sorted(left_behind.values()))
        slot.leaving_since, slot.leaving_children = None, []
        self._schedule_restart(slot, now)

    def _schedule_restart(self, slot: Slot, down_since: float) -> None:
        slot.restart_at = down_since + self.rng.uniform(*self.downtime)

    def cancel_restarts(self, slots: list[Slot]) -> None:
        for slot in slots:
            if slot.restart_at is not None:
                self.log("restart_cancelled", slot)
                slot.restart_at = None


# ----- one run ------------------------------------------------------------------------------------
@dataclass
class RunOutcome:
    name: str
    run_dir: Path
    num_peers: int
    target: int
    started: float  # time.time()
    wall_s: float
    reached_target: bool
    chaos_events: list[dict]
    chaos_dropped: int  # events not fired because the swarm had moved more than one step past them
    leftover_pids: list[str]

    def records_by_slot(self) -> dict[int, list[dict]]:
        return {i: read_slot_metrics(self.run_dir, i) for i in range(self.num_peers)}


def clean_run_dir(run_dir: Path) -> None:
    """Remove this benchmark's files of an earlier run (peers would resume from its checkpoints)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for pattern in ("peer-*.metrics.jsonl", "peer-*.log", "peer-*/checkpoint.pt", "chaos.jsonl", "bootstrap.log"):
        for stale in run_dir.glob(pattern):
            stale.unlink()


def wait_for_final_group(slots: list[Slot], step: int, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    """Let every member of the group that made `step` record it (its commit may lag the first one's)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = {s.index: s.records() for s in slots}
        holders = [i for i, rs in records.items() if any(r["outer_step"] == step for r in step_records(rs))]
        if len(holders) >= group_size_of(records, step):
            return
        time.sleep(POLL_S)
    logger.warning("not every member of the group of outer step %d recorded it within %.0f s", step, timeout_s)


def run_swarm(name: str, args: argparse.Namespace, config: Path, out: Path, churn: bool) -> RunOutcome:
    run_dir = out / name
    clean_run_dir(run_dir)
    (out / "keys").mkdir(parents=True, exist_ok=True)
    ledger = ProcessLedger()
    slots = [Slot(i, run_dir, out / "keys" / f"peer-{i}.key") for i in range(args.peers)]
    events = EventLog(run_dir / "chaos.jsonl")
    chaos = Chaos(random.Random(args.seed), args.events_per_step, tuple(args.downtime), args.min_alive,
                  events, ledger) if churn else None
    started = time.time()
    bootstrap, maddr = start_bootstrap(run_dir)
    ledger.add([bootstrap.pid])
    logger.info("%s run: bootstrap node at %s; starting %d peers", name, maddr, args.peers)
    reached, why = False, f"outer step {args.outer_steps} not reached within {args.timeout} s"
    try:
        for slot in slots:
            start_slot(slot, config, maddr, ledger)
        deadline, polls = time.monotonic() + args.timeout, 0
        while time.monotonic() < deadline:
            records = {s.index: s.records() for s in slots}
            if frontier(records) >= args.outer_steps:
                reached = True
                break
            events.note_unexpected_exits(slots)
            if chaos is not None:
                chaos.tick(slots, records, lambda s: start_slot(s, config, maddr, ledger))
            if not any(s.running() or s.restart_at is not None for s in slots):
                why = f"every peer exited before outer step {args.outer_steps}"
                break
            polls += 1
            if polls % LEDGER_EVERY_POLLS == 0:  # so that a child a peer leaves behind on exit is known
                ledger.add(pid for s in [*slots, bootstrap] if _pid(s) for pid in descendant_pids(_pid(s)))
            time.sleep(POLL_S)
        if chaos is not None:
            chaos.cancel_restarts(slots)
        if reached:
            wait_for_final_group(slots, args.outer_steps)
        else:
            logger.error("%s run: %s", name, why)
    finally:
        ledger.add(descendant_pids(bootstrap.pid))
        try:
            for index, seconds in stop_slots(slots, ledger).items():
                events.log("exited", slots[index], returncode=slots[index].proc.returncode,
                           leave_s=round(seconds, 1), children_left_behind=[], at_final_stop=True)
        finally:
            stop_process(bootstrap)
            leftovers = reap_leftovers(ledger)
    wall_s = time.time() - started
    logger.info("%s run: %s outer step %d after %.0f s", name, "reached" if reached else "did NOT reach",
                args.outer_steps, wall_s)
    return RunOutcome(name, run_dir, args.peers, args.outer_steps, started, wall_s, reached,
                      events.events, chaos.skipped if chaos else 0, leftovers)


# ----- analysis -----------------------------------------------------------------------------------
def normalize_reason(reason: str) -> str:
    """A reason without its numbers and peer IDs, so that equal causes count together."""
    reason = reason.split(";")[0].replace("Unable to run All-Reduce: ", "")
    reason = re.sub(r"groupmate \S+", "groupmate X", reason)
    reason = re.sub(r"\b\d+(\.\d+)?\b", "N", reason)
    return reason[:120]


def step_gaps(step_times: dict[int, float]) -> list[dict]:
    """Gaps between consecutive outer steps, from step 1 on (step 1 also measures start-up)."""
    return [dict(step=s, seconds=step_times[s] - step_times[s - 1], start=step_times[s - 1], end=step_times[s])
            for s in step_times if s - 1 in step_times and s >= 2]


def records_between(records_by_slot: dict[int, list[dict]], event: str, start: float, end: float) -> list[dict]:
    return [dict(r, slot=i) for i, rs in records_by_slot.items() for r in rs
            if r["event"] == event and start < r["time"] <= end]


def group_size_of(records_by_slot: dict[int, list[dict]], step: int) -> int:
    return max((r["group_size"] for rs in records_by_slot.values() for r in step_records(rs)
                if r["outer_step"] == step), default=0)


def explain_gap(gap: dict, records_by_slot: dict[int, list[dict]], chaos_events: list[dict]) -> dict:
    """What happened between two outer steps: chaos, failed rounds, state downloads, the group size."""
    start, end = gap["start"], gap["end"]
    chaos = [e for e in chaos_events if start < e["time"] <= end and e["kind"] in ("SIGKILL", "SIGTERM", "restart")]
    failed = records_between(records_by_slot, "round_failed", start, end)
    loaded = records_between(records_by_slot, "state_loaded", start, end)
    down = peers_down_at(chaos_events, start)
    parts = [f"peers {down} down at its start"] if down else []
    parts += [f"{e['kind']} peer {e['slot']} at +{e['time'] - start:.1f} s" for e in chaos]
    parts += _by_reason(failed, "round failed", start) + _by_reason(loaded, "state loaded", start)
    parts.append(f"step {gap['step']} applied by a group of {group_size_of(records_by_slot, gap['step'])}")
    return dict(gap, peers_down_at_start=down, chaos=chaos, round_failed=failed, state_loaded=loaded,
                cause="; ".join(parts))


def _by_reason(records: list[dict], what: str, start: float) -> list[str]:
    """'3× what from +12.0 s (reason)' per distinct reason, in order of first occurrence."""
    first: dict[str, float] = {}
    counts: Counter = Counter()
    for r in sorted(records, key=lambda r: r["time"]):
        reason = normalize_reason(r["reason"])
        first.setdefault(reason, r["time"] - start)
        counts[reason] += 1
    return [f"{counts[reason]}× {what} from +{t:.1f} s ({reason})" for reason, t in first.items()]


def rejoin_seconds(chaos_events: list[dict], records_by_slot: dict[int, list[dict]]) -> list[float]:
    """For each restart: seconds until that peer applied an outer step with the swarm again
    (restarts that were struck again before that are left out)."""
    seconds = []
    for restart in (e for e in chaos_events if e["kind"] == "restart"):
        slot, t = restart["slot"], restart["time"]
        applied = next((r["time"] for r in step_records(records_by_slot[slot]) if r["time"] > t), None)
        struck = next((e["time"] for e in chaos_events if e["slot"] == slot and e["time"] > t
                       and e["kind"] in ("SIGKILL", "SIGTERM")), None)
        if applied is not None and (struck is None or applied < struck):
            seconds.append(applied - t)
    return seconds


def peers_down_at(chaos_events: list[dict], when: float) -> list[int]:
    """Slots that were killed or told to leave before `when` and not restarted by then."""
    state: dict[int, str] = {}
    for event in (e for e in chaos_events if e["time"] <= when):
        if event["kind"] in ("SIGKILL", "SIGTERM", "restart"):
            state[event["slot"]] = event["kind"]
    return sorted(slot for slot, kind in state.items() if kind != "restart")


def next_record(records: list[dict], after: float) -> Optional[dict]:
    """The first record after `after`, leaving out the start-up's `reachability` (a restart reads as its `join`)."""
    return next((r for r in records if r["time"] > after and r["event"] != "reachability"), None)


def resolution(record: dict, records: list[dict]) -> str:
    """How a peer got past a round it did not apply: what it recorded next."""
    nxt = next_record(records, record["time"])
    if nxt is None:
        return "no later record (stopped at the end of the run)"
    if nxt["event"] == "outer_step":
        how = "retried" if nxt["outer_step"] == record["outer_step"] + 1 else "applied"
        return f"{how}: applied step {nxt['outer_step']} with a group of {nxt['group_size']}"
    if nxt["event"] == "state_loaded":
        return f"downloaded step {nxt['outer_step']} from peers ({normalize_reason(nxt['reason'])})"
    if nxt["event"] == "exit":
        return "left the swarm before retrying (SIGTERM)"
    if nxt["event"] == "join":
        return "crashed before retrying (SIGKILL); restarted at step {}".format(nxt["outer_step"])
    return nxt["event"]


def disagreements(records_by_slot: dict[int, list[dict]], target: int) -> dict:
    """Different θ_global at one step; rounds not applied (up to the target step) and how each was
    resolved; state downloads by reason."""
    hashes: dict[int, set[str]] = defaultdict(set)
    for rs in records_by_slot.values():
        for r in step_records(rs):
            hashes[r["outer_step"]].add(r["global_sha256"])
    failed = [dict(slot=i, outer_step=r["outer_step"], reason=r["reason"], resolution=resolution(r, rs), time=r["time"])
              for i, rs in records_by_slot.items() for r in rs
              if r["event"] == "round_failed" and r["outer_step"] < target]  # later: cut short by the final stop
    loaded = [dict(slot=i, outer_step=r["outer_step"], reason=r["reason"], time=r["time"])
              for i, rs in records_by_slot.items() for r in rs if r["event"] == "state_loaded"]
    return dict(
        steps_with_different_global_models={s: sorted(h) for s, h in hashes.items() if len(h) > 1},
        round_failed=sorted(failed, key=lambda r: r["time"]),
        round_failed_by_reason=dict(Counter(normalize_reason(r["reason"]) for r in failed)),
        state_loaded_by_reason=dict(Counter(normalize_reason(r["reason"]) for r in loaded)),
    )


def agreed_final_state(records_by_slot: dict[int, list[dict]], step: int) -> tuple[Optional[str], list[int]]:
    """The θ_global most peers recorded at `step`, and the slots whose last record holds it."""
    last = {i: next((r for r in reversed(rs) if "global_sha256" in r), None)
            for i, rs in records_by_slot.items()}
    shas = Counter(r["global_sha256"] for r in last.values() if r is not None and r["outer_step"] == step)
    if not shas:
        return None, []
    agreed = shas.most_common(1)[0][0]
    return agreed, [i for i, r in last.items() if r is not None and r["global_sha256"] == agreed]


LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ (\w+) (\S+): (.*)$")  # ours: level, logger, message
HIVEMIND_LOG_LINE = re.compile(r"^\w{3} \d+ [\d:.]+ \[(\w+)\] \[([^\]]+)\] (.*)$")  # hivemind's


def scan_logs(run_dir: Path) -> list[dict]:
    """Warnings, errors and tracebacks in the peer and bootstrap logs, grouped by message."""
    found: dict[str, dict] = {}
    for path in sorted(run_dir.glob("*.log")):
        lines = path.read_text(errors="replace").splitlines()
        for number, line in enumerate(lines, 1):
            match = LOG_LINE.match(line) or HIVEMIND_LOG_LINE.match(line)
            if match and match.group(1) in ("WARN", "WARNING", "ERROR", "CRITICAL"):
                message = f"{match.group(1)} {match.group(2)}: {normalize_reason(match.group(3))}"
            elif line.startswith("Traceback"):
                tail = next((l for l in lines[number:] if l and not l.startswith((" ", "Traceback"))), "?")
                message = f"Traceback: {normalize_reason(tail)}"
            else:
                continue
            entry = found.setdefault(message, dict(message=message, count=0, first=f"{path.name}:{number}"))
            entry["count"] += 1
    return sorted(found.values(), key=lambda e: -e["count"])


def analyze(outcome: RunOutcome, config: Path) -> dict:
    records = outcome.records_by_slot()
    step_times = first_step_times(records)
    gaps = step_gaps(step_times)
    longest = max(gaps, key=lambda g: g["seconds"]) if gaps else None
    agreed, holders = agreed_final_state(records, max(step_times, default=0))
    initial, final = evaluate(config, [outcome.run_dir / f"peer-{i}" for i in holders]) if holders else (None, None)
    all_steps = [r for rs in records.values() for r in step_records(rs)]
    kinds = Counter(e["kind"] for e in outcome.chaos_events)
    leaves = [e for e in outcome.chaos_events if e["kind"] == "exited" and not e.get("at_final_stop")]
    rejoins = rejoin_seconds(outcome.chaos_events, records)
    return dict(
        name=outcome.name,
        reached_target=outcome.reached_target,
        wall_s=outcome.wall_s,
        highest_outer_step=max(step_times, default=0),
        distinct_outer_steps=len(step_times),
        seconds_to_first_step=(min(step_times.values()) - outcome.started) if step_times else None,
        seconds_step_1_to_last=(max(step_times.values()) - min(step_times.values())) if step_times else None,
        step_times=step_times,
        mean_gap_s=statistics.mean(g["seconds"] for g in gaps) if gaps else None,
        median_gap_s=statistics.median(g["seconds"] for g in gaps) if gaps else None,
        longest_gap=explain_gap(longest, records, outcome.chaos_events) if longest else None,
        mean_group_size=statistics.mean(group_size_of(records, s) for s in step_times) if step_times else None,
        samples_averaged=sum(max(r["group_samples"] for r in all_steps if r["outer_step"] == s) for s in step_times),
        outer_step_records=len(all_steps),
        chaos_counts=dict(kinds),
        chaos_events_dropped=outcome.chaos_dropped,
        unexpected_exits=[e for e in outcome.chaos_events if e["kind"] == "exited_unexpectedly"],
        restart_to_outer_step_s=dict(median=statistics.median(rejoins), max=max(rejoins), count=len(rejoins))
        if rejoins else None,
        sigterm_leave_s_max=max((e["leave_s"] for e in leaves), default=None),
        sigterm_nonzero_exits=[e for e in leaves if e["returncode"] != 0],
        sigterm_children_left_behind=[name for e in leaves for name in e["children_left_behind"]],
        disagreements=disagreements(records, outcome.target),
        final_global_sha256=agreed,
        final_state_holders=holders,
        initial_eval_loss=initial,
        final_eval_loss=final,
        log_findings=scan_logs(outcome.run_dir),
        leftover_pids=outcome.leftover_pids,
        chaos_events=outcome.chaos_events,
    )


# ----- report -------------------------------------------------------------------------------------
def fmt(value, spec: str = ".1f") -> str:
    return "–" if value is None else format(value, spec)


def _counts(by_reason: dict) -> str:
    total = sum(by_reason.values())
    return f"{total}" + (": " + "; ".join(f"{n}× {r}" for r, n in by_reason.items()) if total else "")


def markdown_table(results: list[dict]) -> str:
    def row(label: str, cell) -> str:
        return f"| {label} | " + " | ".join(cell(r) for r in results) + " |"

    def longest(r: dict) -> str:
        g = r["longest_gap"]
        return "–" if g is None else f"{g['seconds']:.1f} s (step {g['step'] - 1}→{g['step']})"

    lines = [
        "| | " + " | ".join(r["name"] for r in results) + " |",
        "|---|" + "---|" * len(results),
        row("outer steps completed (distinct)", lambda r: f"{r['highest_outer_step']} ({r['distinct_outer_steps']})"),
        row("chaos events", lambda r: ", ".join(f"{r['chaos_counts'].get(k, 0)} {k}"
                                                for k in ("SIGKILL", "SIGTERM", "restart")) if r["chaos_counts"] else "none"),
        row("peer processes that exited on their own (crashed)", lambda r: str(len(r["unexpected_exits"]))),
        row("run wall time (start-up to stop)", lambda r: f"{r['wall_s']:.0f} s"),
        row("time from step 1 to the last step", lambda r: fmt(r["seconds_step_1_to_last"], ".0f") + " s"),
        row("median / mean gap between outer steps", lambda r: f"{fmt(r['median_gap_s'])} s / {fmt(r['mean_gap_s'])} s"),
        row("longest gap between outer steps", longest),
        row("cause of the longest gap", lambda r: r["longest_gap"]["cause"] if r["longest_gap"] else "–"),
        row("mean group size per step", lambda r: fmt(r["mean_group_size"], ".2f")),
        row("samples averaged into θ_global (Σ over steps)", lambda r: f"{r['samples_averaged']:,}"),
        row("restart → next outer step applied (median / max)", lambda r: "–" if not r["restart_to_outer_step_s"]
            else "{median:.0f} s / {max:.0f} s".format(**r["restart_to_outer_step_s"])),
        row("SIGTERM → process exited (max)", lambda r: fmt(r["sigterm_leave_s_max"]) + " s"
            if r["sigterm_leave_s_max"] is not None else "–"),
        row("steps where peers held different θ_global",
            lambda r: str(len(r["disagreements"]["steps_with_different_global_models"]))),
        row("rounds not applied (round_failed records)", lambda r: _counts(r["disagreements"]["round_failed_by_reason"])),
        row("state downloads (state_loaded records)", lambda r: _counts(r["disagreements"]["state_loaded_by_reason"])),
        row("final eval loss (θ_global, held-out)", lambda r: fmt(r["final_eval_loss"], ".4f")),
    ]
    return "\n".join(lines)


def resolution_table(result: dict) -> str:
    failed = result["disagreements"]["round_failed"]
    if not failed:
        return f"{result['name']}: no round_failed records."
    lines = [f"Rounds not applied in the {result['name']} run and how each was resolved:", "",
             "| round for step | peer | reason | resolution |", "|---|---|---|---|"]
    lines += [f"| {r['outer_step'] + 1} | {r['slot']} | {r['reason'][:90]} | {r['resolution']} |" for r in failed]
    return "\n".join(lines)


def plot_steps(results: list[dict], path: Path) -> None:
    """Outer step against time for each run, with the churn run's signals as ticks on the time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for r in (r for r in results if r["step_times"]):
        times = r["step_times"]
        t0 = min(times.values())
        ax.step([t - t0 for t in times.values()], list(times), where="post", marker=".", label=r["name"])
        for kind, color in (("SIGKILL", "red"), ("SIGTERM", "purple")):
            xs = [e["time"] - t0 for e in r["chaos_events"] if e["kind"] == kind]
            if xs:
                ax.vlines(xs, 0, 0.6, colors=color, label=f"{kind} ({r['name']})")
    ax.set_xlabel("seconds since the first outer step")
    ax.set_ylabel("outer step (first peer to record it)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(results: list[dict], args: argparse.Namespace, config: Path, out: Path, wall_s: float) -> None:
    table = markdown_table(results)
    resolutions = "\n\n".join(resolution_table(r) for r in results)
    print(f"\n{table}\n\n{resolutions}\n")
    for r in results:
        if r["initial_eval_loss"] is not None:
            print(f"{r['name']}: initial eval loss {r['initial_eval_loss']:.4f}, final state held by peers "
                  f"{r['final_state_holders']} ({(r['final_global_sha256'] or '')[:12]})")
        for finding in r["log_findings"][:12]:
            print(f"{r['name']} logs: {finding['count']}× {finding['message']} (first: {finding['first']})")
        if r["leftover_pids"]:
            print(f"{r['name']}: processes left running and killed at the end: {r['leftover_pids']}")
    (out / "table.md").write_text(f"{table}\n\n{resolutions}\n")
    (out / "results.json").write_text(json.dumps(
        dict(args=vars(args), config=str(config), wall_s=wall_s, runs=results), indent=2, default=str))
    plot_steps(results, out / "outer_steps.png")
    print(f"wrote {out / 'results.json'}, {out / 'table.md'} and {out / 'outer_steps.png'}; "
          f"benchmark wall time {wall_s:.0f} s")


# ----- main ---------------------------------------------------------------------------------------
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=6, help="peer processes in the swarm")
    parser.add_argument("--outer-steps", type=int, default=20, help="target outer step of both runs")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="run config (TOML)")
    parser.add_argument("--steps-per-outer", type=int, default=10,
                        help="override inner.steps_per_outer of --config (0: keep the config's value)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the chaos (victims, signals, timing)")
    parser.add_argument("--events-per-step", type=float, default=1.0, help="chaos events per outer step")
    parser.add_argument("--downtime", type=float, nargs=2, default=(2.0, 8.0), metavar=("MIN", "MAX"),
                        help="seconds a killed or departed peer stays down before its restart")
    parser.add_argument("--min-alive", type=int, default=2, help="joined peers that the chaos always leaves up")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run without churn")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run before giving up")
    parser.add_argument("--out", type=Path, default=Path("bench-out/churn"), help="output directory")
    args = parser.parse_args(argv)
    if args.peers < args.min_alive + 1:
        parser.error(f"--peers must exceed --min-alive ({args.min_alive})")
    return args


def _interrupt(signum: int, _frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def start_benchmark(args: argparse.Namespace) -> tuple[float, Path]:
    """What a swarm benchmark does first: log with times, make Ctrl+C and SIGTERM a KeyboardInterrupt that
    stops every process it started (a background shell may have set SIGINT to "ignore", and SIGTERM would
    otherwise end the script without its cleanup), and write the run config (``args.config`` with
    ``args.steps_per_outer``) to ``args.out`` with its tokenizer. Returns (start time, config path)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    config = write_run_config(args.config, args.steps_per_outer or None, args.out / "run.toml")
    prepare_tokenizer(config)
    return time.time(), config


def interrupted(e: KeyboardInterrupt) -> int:
    print(f"interrupted ({e}); every process this benchmark started has been stopped", file=sys.stderr)
    return 130


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    started, config = start_benchmark(args)
    try:
        outcomes = [run_swarm("churn", args, config, args.out, churn=True)]
        if not args.no_baseline:
            outcomes.append(run_swarm("baseline", args, config, args.out, churn=False))
    except KeyboardInterrupt as e:
        return interrupted(e)
    results = [analyze(o, config) for o in outcomes]
    report(results, args, config, args.out, time.time() - started)
    return 0 if all(o.reached_target and not o.leftover_pids for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
