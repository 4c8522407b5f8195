"""Compute utilization of a training run (each peer's inner seconds / wall seconds), and the bytes per peer per outer step.

    python benchmarks/utilization.py              # 2 layouts × 7 variants; needs root for 100mbit (see below)
    python benchmarks/utilization.py --layouts loopback --variants fp32-blocking,fp16 --outer-steps 2
    sudo python benchmarks/utilization.py --layouts 100mbit --mbit 50 --outer-steps 3 --out /tmp/util

The default run takes about 10 minutes on 2 otherwise idle cores (estimated: ~3.5 on loopback, ~6.5
at 100 Mbit/s); with other benchmarks busy on the same 2 cores (load average ~11) about 18 (~6 + ~12).

Per layout, one bootstrap node runs for all variants; per variant (a "setting"), --peers peers
start as real `p2p-diloco peer` processes with a run name of their own, wait for each other, train
K rounds of H inner steps (K·P outer steps of one fragment each with P fragments: the same K·H
inner steps) and exit. K is --outer-steps (default 3 on loopback, 2 at 100 Mbit/s).

Layouts:
- `loopback`: every process on 127.0.0.1 (no shaping), `peers/demo.toml` (0.69M parameters) with
  one change: inner.steps_per_outer 25 → 24, so that P = 2 fragments divide it (every variant of
  the layout uses 24, so they compare).
- `100mbit`: the bootstrap node and each peer in a network namespace of its own on one bridge
  (tests/netns.py), every link shaped with `tc tbf` to --mbit in each direction; the demo config
  with a 14.7M-parameter model (benchmarks/quality.py's MODEL_SIZES["14.7m"]: 58.7 MB in fp32) and a
  cheaper inner step (INNER_15M: batch 4 × 64 tokens, H = 20), so that 3 peers train on 2 cores. Needs root,
  `ip`, `iptables` and `tc`; without them the layout is skipped, and the output says why.

Variants (names for --variants; [outer] settings, see p2p_diloco/config.py):
- `fp32-blocking`: codec none, blocking: the sync of today;
- one per --codecs entry (default fp16, int8, nf4, fp4-e3m0), blocking;
- `streaming`: codec none, P fragments (P = 2 for the 2-layer demo model, 4 for the 15M one), blocking;
- `streaming-overlap-4bit`: codec fp4-e3m0 with error feedback, P fragments, sync_delay 5, merge_alpha 0.5;
- `overlap-max-4bit`: the same with one fragment and the longest overlap, sync_delay H − 1;
- `defaults`: the shipped [outer] and [swarm] defaults, the lead of ``swarm.match_ahead`` included (a peer
  says it is ready a few inner steps before its Δ is taken: p2p_diloco/train/match_ahead.py);
- `defaults-ahead`: the same with ``swarm.match_ahead = true`` said outright (the default since issue 24);
- `defaults-no-lead`: the same with ``swarm.match_ahead = false``;
- `defaults-fixed-tau-5`: the defaults with the overlap of before issue 24's adaptive τ, exactly 5 inner steps
  beside every sync (``outer.sync_delay = 5``, ``outer.fixed_sync_delay = true``).
Every variant but the `defaults` ones starts from DiLoCo's blocking fp32 sync (DILOCO) and changes what it names.

Per setting and peer, from its metrics file (`outer_step` records):
- utilization after the first outer step: Σ inner seconds / Σ wall seconds of records 2..end (the
  first record also holds the peers' start and the first round's matchmaking); and the median of
  every record's own compute_utilization;
- seconds per H inner steps (the wall seconds of records 2..end, per round of H inner steps);
- the averaging payload bytes sent + received per H inner steps (the run's total / K), against
  the butterfly all-reduce's 4·(N−1)/N · bytes per parameter of the codec · parameters; and the
  peak: the largest single sync's bytes (with fragments, the first and last carry the embeddings
  and the LM head);
- inner steps that ran while a sync was in flight (sync_delay > 0);
- whether every peer recorded every outer step with a full group and one θ_global hash, and the
  rounds that failed or were skipped, and state downloads, if any.

It prints a Markdown table, then where each variant's sync seconds went (the median per phase of each
peer's ``sync_phases``: waiting for groupmates, matchmaking, waiting for a late member's Δ, the all-reduce,
the reports, the audit; and the lead in inner steps), and writes results.json, and per setting the run config, the peers'
metrics and logs, under --out. Each setting's peers, with every child process they were seen to
have, are stopped by PID before the next setting starts; the bootstrap node after the layout's last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import selectors
import signal
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from p2p_diloco.config import ConfigError, load_config  # noqa: E402
from p2p_diloco.metrics import read_metrics  # noqa: E402
from p2p_diloco.process_tree import (  # noqa: E402
    TORCH_SHM_MANAGER, command_name, descendant_pids, is_running, start_ticks,
)
from p2p_diloco.config import OuterConfig  # noqa: E402
from p2p_diloco.sync.codecs import CODECS, bytes_per_parameter  # noqa: E402
from tests.netns import Topology, unavailable  # noqa: E402
from benchmarks.quality import MODEL_SIZES  # noqa: E402

DEMO_CONFIG = REPO / "peers" / "demo.toml"
LAYOUTS = ("loopback", "100mbit")
DEFAULT_CODECS = ("fp16", "int8", "nf4", "fp4-e3m0")
INNER_15M = {"batch_size": 4, "steps_per_outer": 20}
DEFAULT_OUTER_STEPS = {"loopback": 3, "100mbit": 2}  # K; the run time is in the module docstring
STOP_GRACE_S = 20.0  # SIGTERM, then SIGKILL after this long
ADDRESS_TIMEOUT_S = 60.0  # for the bootstrap node to print its multiaddr


# ----- configs ------------------------------------------------------------------------------------
def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError(f"cannot write {value!r} to TOML")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string for the simple strings of a run config
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise ValueError(f"cannot write {value!r} to TOML")


def write_toml(raw: dict, path: Path) -> Path:
    lines = []
    for section, values in raw.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {toml_value(value)}" for key, value in values.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def layout_base(layout: str) -> dict:
    """The layout's run config (as a TOML dict) before the variant's [outer] settings."""
    raw = tomllib.loads(DEMO_CONFIG.read_text())
    if layout == "loopback":
        raw["inner"]["steps_per_outer"] = 24  # 25 has no divisor P = 2
    else:
        raw["model"].update(MODEL_SIZES["14.7m"])  # 14.7M parameters with the demo's 1024-token vocabulary
        raw["inner"].update(INNER_15M)
    return raw


def fragments_for(raw: dict) -> int:
    """P for the streaming variants: 2 for the 2-layer demo model, 4 for a model of >= 4 layers."""
    return 4 if raw["model"]["num_layers"] >= 4 else 2


# an overlap that a variant asks for is Streaming DiLoCo's fixed τ
DILOCO = {"codec": "none", "error_feedback": False, "fragments": 1, "sync_delay": 0, "fixed_sync_delay": True,
          "merge_alpha": 0.0}


def variants(codecs: list[str], fragments: int) -> dict[str, dict]:
    """name -> the [outer] settings of each variant: DiLoCo's blocking fp32 sync with some settings changed
    ("defaults": the shipped defaults of p2p_diloco/config.py, whatever they are)."""
    table = {"fp32-blocking": dict(DILOCO)}
    table.update({codec: {**DILOCO, "codec": codec} for codec in codecs if codec != "none"})  # none: fp32-blocking
    table["streaming"] = {**DILOCO, "fragments": fragments}
    overlap_4bit = {"codec": "fp4-e3m0", "error_feedback": True, "merge_alpha": 0.5}
    table["streaming-overlap-4bit"] = {**DILOCO, **overlap_4bit, "fragments": fragments, "sync_delay": 5}
    table["overlap-max-4bit"] = {**DILOCO, **overlap_4bit, "sync_delay": 1000}  # lowered to H − 1
    table["defaults"] = {}
    table["defaults-ahead"], table["defaults-no-lead"] = {}, {}  # with SWARM_SETTINGS' change
    table["defaults-fixed-tau-5"] = {"sync_delay": 5, "fixed_sync_delay": True}
    return table


# variants that change [swarm] settings too (each peer's own, outside the run's fingerprint)
SWARM_SETTINGS = {"defaults-ahead": {"match_ahead": True}, "defaults-no-lead": {"match_ahead": False}}
PHASES = ("wait", "match", "late", "allreduce", "commit", "audit")  # an outer_step record's sync_phases


def count_parameters(config: Path) -> int:
    """Trainable parameters of the config's model; also trains and caches the tokenizer once, before
    N peers would each do it at the same time."""
    from p2p_diloco.train.data import TextData
    from p2p_diloco.train.model import build_model, trainable_parameters

    cfg = load_config(config)
    data = TextData(cfg.data)
    model = build_model(cfg.model, data.vocab_size, cfg.run.seed)
    return sum(p.numel() for p in trainable_parameters(model))


# ----- processes ----------------------------------------------------------------------------------
class Processes:
    """The processes of one setting and every process seen below them; :meth:`stop` ends them all."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.seen: dict[int, Optional[int]] = {}  # descendant pid -> its start ticks

    def start(self, argv: list[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(argv, start_new_session=True, **kwargs)  # a Ctrl+C reaches only this script
        self.procs.append(proc)
        return proc

    def note_descendants(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                for pid in descendant_pids(proc.pid):
                    self.seen.setdefault(pid, start_ticks(pid))

    def stop(self) -> list[int]:
        """SIGTERM what still runs (in reverse order of start), SIGKILL it after STOP_GRACE_S, then the
        same for any descendant still running; returns the PIDs left behind."""
        self.note_descendants()
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        # the same process as the one seen (not a later reuse of its PID), still running
        alive = lambda pid: is_running(pid) and start_ticks(pid) == self.seen[pid]  # noqa: E731
        deadline = time.monotonic() + 10.0  # hivemind's children and torch's shm manager exit by themselves
        while any(alive(pid) for pid in self.seen) and time.monotonic() < deadline:
            time.sleep(0.2)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            targets = [pid for pid in self.seen if alive(pid) and command_name(pid) != TORCH_SHM_MANAGER]
            for pid in targets:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            if targets:
                time.sleep(2.0)
        return [pid for pid in self.seen if alive(pid)]


def read_address(proc: subprocess.Popen, log: Path) -> str:
    """The first multiaddr the bootstrap node prints."""
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + ADDRESS_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        if selector.select(timeout=1.0):
            line = proc.stdout.readline().strip()
            if line.startswith("/"):
                return line
    raise RuntimeError(f"the bootstrap node printed no address within {ADDRESS_TIMEOUT_S:.0f} s; see {log}")


ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
CLI = [sys.executable, "-m", "p2p_diloco.cli"]


class Swarm:
    """A layout's hosts and its bootstrap node, kept for all of its variants (each variant's run has a
    run name of its own, so its DHT keys and groups never meet another's); a context manager."""

    def __init__(self, layout: str, num_peers: int, mbit: float, out: Path):
        self.layout = layout
        self.topology = Topology() if layout != "loopback" else _Loopback()
        self.bootstrap = Processes()
        try:
            names = ["bootstrap"] + [f"peer{i}" for i in range(num_peers)]
            hosts = [self.topology.add_public(name) for name in names]
            if layout != "loopback":
                for host in hosts:
                    self.topology.limit_rate(host, mbit)
            self.boot, self.peers = hosts[0], hosts[1:]
            log = out / "bootstrap.log"
            port = "0" if layout == "loopback" else "31337"
            proc = self.bootstrap.start(
                self.topology.command(self.boot, [*CLI, "bootstrap", "--host", self.boot.ip, "--port", port]),
                stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, env=ENV)
            self.maddr = read_address(proc, log)
            if layout != "loopback":
                print(f"{layout}: namespaces dl{self.topology.tag}-*, bootstrap node at {self.maddr}", file=sys.stderr)
        except BaseException:
            self.close()
            raise

    def run(self, config: Path, run_dir: Path, max_outer_steps: int, timeout: float) -> dict:
        """The peers of one variant, until they exit (or `timeout`); returns how it went."""
        peers = Processes()
        started = time.monotonic()
        finished = False
        try:
            for host in self.peers:
                metrics = run_dir / f"{host.name}.jsonl"
                metrics.unlink(missing_ok=True)
                peers.start(
                    self.topology.command(host, [*CLI, "peer", "--config", str(config), "--host", host.ip,
                                                 "--initial-peers", self.maddr, "--metrics-file", str(metrics),
                                                 "--max-outer-steps", str(max_outer_steps),
                                                 "--wait-for-peers", str(len(self.peers))]),
                    stdout=open(run_dir / f"{host.name}.log", "w"), stderr=subprocess.STDOUT, env=ENV)
            deadline = started + timeout
            while any(p.poll() is None for p in peers.procs) and time.monotonic() < deadline:
                peers.note_descendants()
                time.sleep(1.0)
            finished = all(p.poll() is not None for p in peers.procs)
        finally:
            left = peers.stop()
        return dict(wall_seconds=round(time.monotonic() - started, 1), finished_in_time=finished,
                    exit_codes=[p.returncode for p in peers.procs], left_behind=left)

    def close(self) -> list[int]:
        try:
            return self.bootstrap.stop()
        finally:
            self.topology.close()

    def __enter__(self) -> "Swarm":
        return self

    def __exit__(self, *exc) -> None:
        if left := self.close():
            print(f"warning: processes of the {self.layout} bootstrap node left behind: {left}", file=sys.stderr)


class _Loopback:
    """Topology's interface for processes on this machine's own network, on 127.0.0.1."""

    class Host:
        def __init__(self, name: str):
            self.name, self.ip = name, "127.0.0.1"

    def add_public(self, name: str) -> "_Loopback.Host":
        return self.Host(name)

    def command(self, host, argv: list[str]) -> list[str]:
        return list(argv)

    def close(self) -> None:
        pass


# ----- analysis -----------------------------------------------------------------------------------
def analyse(run_dir: Path, num_peers: int, outer_steps: int, fragments: int) -> dict:
    """Per peer: utilization, seconds and bytes per H inner steps; and the swarm's agreement."""
    expected_steps = outer_steps * fragments
    peers, other_events, by_step = {}, {}, {}
    for i in range(num_peers):
        path = run_dir / f"peer{i}.jsonl"
        records = read_metrics(path) if path.exists() else []
        steps = [r for r in records if r["event"] == "outer_step"]
        for r in records:
            if r["event"] in ("round_failed", "round_skipped", "state_loaded", "excluded"):
                other_events[r["event"]] = other_events.get(r["event"], 0) + 1
        for r in steps:
            by_step.setdefault(r["outer_step"], []).append((r["global_sha256"], r["group_size"]))
        later = steps[1:]  # records 2..end: without start-up and the first round's matchmaking
        inner = sum(r["inner_seconds"] for r in later)
        wall = sum(r["inner_seconds"] + r["blocked_seconds"] for r in later)
        totals = [r["bytes_sent"] + r["bytes_received"] for r in steps]
        increments = [b - a for a, b in zip([0] + totals, totals)]
        inner_steps = [r["inner_steps"] for r in steps]
        peers[f"peer{i}"] = dict(
            outer_steps=len(steps),
            utilization_after_first=round(inner / wall, 4) if wall > 0 else None,
            median_record_utilization=statistics.median(r["compute_utilization"] for r in steps) if steps else None,
            seconds_per_h=round(wall * fragments / len(later), 2) if later else None,
            mb_per_h=round(totals[-1] / 1e6 * fragments / len(steps), 3) if steps else None,
            peak_mb_per_sync=round(max(increments) / 1e6, 3) if steps else None,
            inner_steps_per_h=round(inner_steps[-1] * fragments / len(steps), 1) if steps else None,
            steps_while_syncing=sum(r.get("steps_while_syncing", 0) for r in steps),
            group_sizes=sorted({r["group_size"] for r in steps}),
            # where each sync's seconds went (records 2..end, the median per phase), and the inner steps it
            # trained after saying it was ready (train/match_ahead.py), and each sync's blocked seconds
            phases={phase: statistics.median(r["sync_phases"].get(phase, 0.0) for r in later)
                    for phase in PHASES} if later and all("sync_phases" in r for r in later) else None,
            lead_steps=statistics.mean(r.get("lead_steps", 0) for r in later) if later else None,
            overlap_steps=statistics.mean(r.get("overlap_steps", 0) for r in later) if later else None,  # τ run
            blocked_per_sync=statistics.median(r["blocked_seconds"] for r in later) if later else None,
        )
    one_hash = (sorted(by_step) == list(range(1, expected_steps + 1))
                and all(len(v) == num_peers and len(set(v)) == 1 and v[0][1] == num_peers for v in by_step.values()))
    return dict(peers=peers, every_peer_every_step_full_group_one_hash=one_hash, other_events=other_events,
                steps_recorded=len(by_step))


def mean_range(values: list, fmt: str) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    text = format(statistics.mean(values), fmt)
    if len(values) > 1 and min(values) != max(values):
        text += f" ({format(min(values), fmt)}–{format(max(values), fmt)})"
    return text


def table(results: list[dict]) -> str:
    rows = ["| layout | variant | codec | P | τ | α | utilization after step 1: mean (min–max) | median per-sync "
            "utilization | s per H inner steps | MB per peer per H, sent+received (expected) | peak MB per sync | "
            "inner steps while syncing | full groups, one hash per step |",
            "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in results:
        outer, peers = r["outer"], list(r["analysis"]["peers"].values())
        agreement = "yes" if r["analysis"]["every_peer_every_step_full_group_one_hash"] else "no"
        agreement += f" ({r['analysis']['steps_recorded']}/{r['expected_outer_steps']} steps"
        if r["analysis"]["other_events"]:
            agreement += "; " + ", ".join(f"{k} ×{v}" for k, v in sorted(r["analysis"]["other_events"].items()))
        sizes = sorted({g for p in peers for g in p["group_sizes"]})
        if sizes and sizes != [r["peers"]]:
            agreement += f"; group sizes {sizes}"
        if not r["run"]["finished_in_time"]:
            agreement += "; timed out"
        agreement += ")"
        rows.append(
            f"| {r['layout']} | {r['variant']} | {outer.get('codec', 'none')} | {outer.get('fragments', 1)} | "
            f"{outer.get('sync_delay', 0)} | {outer.get('merge_alpha', 0)} | "
            f"{mean_range([p['utilization_after_first'] for p in peers], '.2f')} | "
            f"{mean_range([p['median_record_utilization'] for p in peers], '.2f')} | "
            f"{mean_range([p['seconds_per_h'] for p in peers], '.1f')} | "
            f"{mean_range([p['mb_per_h'] for p in peers], '.2f')} ({r['expected_mb_per_h']:.2f}) | "
            f"{max((p['peak_mb_per_sync'] for p in peers if p['peak_mb_per_sync'] is not None), default=0):.2f} | "
            f"{sum(p['steps_while_syncing'] for p in peers)} | {agreement} |")
    return "\n".join(rows)


def phase_table(results: list[dict]) -> str:
    """Where the syncs' seconds went: per variant, the mean over peers of each peer's median per phase."""
    rows = ["| layout | variant | lead inner steps | τ run | " + " | ".join(f"{phase} s" for phase in PHASES) +
            " | blocked s per sync |", "|---|---|---:|---:|" + "---:|" * (len(PHASES) + 1)]
    for r in results:
        peers = list(r["analysis"]["peers"].values())
        cells = [mean_range([p["phases"][phase] if p["phases"] else None for p in peers], ".2f") for phase in PHASES]
        steps = [mean_range([p[key] for p in peers], ".1f") for key in ("lead_steps", "overlap_steps")]
        blocked = mean_range([p["blocked_per_sync"] for p in peers], ".2f")
        rows.append(f"| {r['layout']} | {r['variant']} | " + " | ".join(steps + cells) + f" | {blocked} |")
    return "\n".join(rows)


# ----- main ---------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of: " + ", ".join(LAYOUTS))
    parser.add_argument("--codecs", default=",".join(DEFAULT_CODECS),
                        help="comma-separated outer.codec values, one blocking variant each")
    parser.add_argument("--variants", default="",
                        help="comma-separated subset of variant names (fp32-blocking, the codecs, streaming, "
                             "streaming-overlap-4bit); default all")
    parser.add_argument("--peers", type=int, default=3, help="peers per setting (plus a bootstrap node)")
    parser.add_argument("--outer-steps", type=int, default=None,
                        help="K: rounds of H inner steps per setting (K·P outer steps with P fragments); >= 2 "
                             "for a utilization after the first step (default: " +
                             ", ".join(f"{k} {v}" for k, v in DEFAULT_OUTER_STEPS.items()) + ")")
    parser.add_argument("--mbit", type=float, default=100.0, help="rate of every link of the 100mbit layout, "
                                                                  "each direction")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per setting before giving up (default: 120 + 60 per round of H inner steps)")
    parser.add_argument("--out", default="bench-out/utilization",
                        help="where results.json and each setting's config, metrics and logs go (default %(default)s)")
    args = parser.parse_args()
    args.layouts = [s.strip() for s in args.layouts.split(",") if s.strip()]
    if bad := [s for s in args.layouts if s not in LAYOUTS]:
        parser.error(f"unknown layout(s) {', '.join(bad)}; valid: {', '.join(LAYOUTS)}")
    args.codecs = [s.strip() for s in args.codecs.split(",") if s.strip()]
    if bad := [s for s in args.codecs if s not in CODECS]:
        parser.error(f"unknown codec(s) {', '.join(bad)}; valid: {', '.join(CODECS)}")
    args.variants = [s.strip() for s in args.variants.split(",") if s.strip()]
    known = list(variants(args.codecs, 2))
    if bad := [s for s in args.variants if s not in known]:
        parser.error(f"unknown variant(s) {', '.join(bad)}; valid: {', '.join(known)}")
    if args.peers < 2 or (args.outer_steps is not None and args.outer_steps < 1):
        parser.error("--peers must be >= 2 and --outer-steps >= 1")
    return args


def layout_configs(layout: str, args, out: Path, skipped: dict) -> tuple[dict, dict[str, tuple[dict, Path]]]:
    """The layout's model description and, per variant to run, its [outer] settings and run config."""
    base = layout_base(layout)
    model = dict(model={k: v for k, v in base["model"].items() if k != "name"},
                 steps_per_outer=base["inner"]["steps_per_outer"], batch_size=base["inner"]["batch_size"],
                 seq_len=base["data"]["seq_len"])
    configs = {}
    for name, outer in variants(args.codecs, fragments_for(base)).items():
        if args.variants and name not in args.variants:
            continue
        run_dir = out / layout / name
        run_dir.mkdir(parents=True, exist_ok=True)
        raw = json.loads(json.dumps(base))
        raw["run"]["name"] = f"util-{layout}-{name}"
        raw["outer"].update(outer)
        raw.setdefault("swarm", {}).update(SWARM_SETTINGS.get(name, {}))
        config = write_toml(raw, run_dir / "run.toml")
        try:
            load_config(config)
        except ConfigError as e:
            print(f"skipping {layout} / {name}: {e}", file=sys.stderr)
            skipped[f"{layout} / {name}"] = str(e)
            continue
        configs[name] = ({**dataclasses.asdict(OuterConfig()), **outer}, config)  # every setting, defaults filled in
    if configs:
        model["parameters"] = count_parameters(next(iter(configs.values()))[1])
        print(f"{layout}: {model['parameters'] / 1e6:.2f}M parameters, {model}", file=sys.stderr)
    return model, configs


def main() -> int:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skipped = {}
    if "100mbit" in args.layouts and (why := unavailable()) is not None:
        skipped["100mbit"] = why
        print(f"skipping the 100mbit layout: {why}", file=sys.stderr)
    results, models = [], {}
    began = time.monotonic()

    def save() -> None:
        (out / "results.json").write_text(json.dumps(dict(
            results=results, models=models, skipped=skipped, args=vars(args),
            wall_seconds=round(time.monotonic() - began, 1)), indent=2))

    for layout in [layout for layout in args.layouts if layout not in skipped]:
        models[layout], configs = layout_configs(layout, args, out, skipped)
        if not configs:
            continue
        K = models[layout]["outer_steps"] = args.outer_steps or DEFAULT_OUTER_STEPS[layout]
        with Swarm(layout, args.peers, args.mbit, out / layout) as swarm:
            for name, (outer, config) in configs.items():
                P = outer.get("fragments", 1)
                print(f"{layout} / {name}: {args.peers} peers, {K * P} outer steps ...", file=sys.stderr)
                run_dir = config.parent
                run = swarm.run(config, run_dir, K * P, args.timeout or 120.0 + 60.0 * K)
                analysis = analyse(run_dir, args.peers, K, P)
                params = models[layout]["parameters"]
                expected = 4 * (args.peers - 1) / args.peers * bytes_per_parameter(outer["codec"]) * params / 1e6
                results.append(dict(layout=layout, variant=name, outer=outer, peers=args.peers,
                                    outer_steps=K, expected_outer_steps=K * P,
                                    mbit=args.mbit if layout != "loopback" else None, parameters=params,
                                    expected_mb_per_h=round(expected, 3), run=run, analysis=analysis))
                print(f"  {run['wall_seconds']:.0f} s; {table(results[-1:]).splitlines()[-1]}", file=sys.stderr)
                if run["left_behind"]:
                    print(f"  warning: processes left behind: {run['left_behind']}", file=sys.stderr)
                save()
    save()
    print(f"\n{args.peers} peers per setting; {time.monotonic() - began:.0f} s in all")
    for layout, model in models.items():
        where = "127.0.0.1" if layout == "loopback" else f"{args.mbit:g} Mbit/s links (tc tbf), one namespace each"
        print(f"- {layout}: {where}; {model.get('parameters', 0) / 1e6:.2f}M parameters ({model['model']}), "
              f"H = {model['steps_per_outer']}, batch {model['batch_size']} × {model['seq_len']} tokens, "
              f"K = {model.get('outer_steps', '–')} rounds of H inner steps per setting")
    for what, why in skipped.items():
        print(f"- skipped {what}: {why}")
    print()
    print(table(results))
    print()
    print(phase_table(results))
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
