"""Hostile peers: held-out loss, seconds per outer step and bytes of a 5-peer swarm with 0, 1 or 2 attackers.

    python benchmarks/hostile.py                                   # the whole matrix (long: see below)
    python benchmarks/hostile.py --attacks scale:100,alie --hostile 1 --defence on,off
    python benchmarks/hostile.py --cells "on/0/clean,on/1/scale:100,off/1/scale:100" --jobs 2

Each cell is one swarm of real processes on 127.0.0.1: a bootstrap node and --peers peers (default 5),
of which 0, 1 or 2 are hostile (tests/hostile_peer.py: the project's own `p2p-diloco peer`, patched to
alter what it sends), all on one run config, starting together, until the honest peers have taken
--outer-steps outer steps (or --timeout). Attacks (tests/hostile_peer.py says exactly what each sends):

* ``scale:100``, ``scale:3``: K·Δ; ``flip``: −Δ; ``noise:100``: Gaussian noise of 100·‖Δ‖;
* ``samples``, ``samples:10``: its own Δ with a claim of 2^48 samples, or of 10 × its real samples;
* ``samples+flip``: −Δ weighted by a claim of 2^48 samples (with the exact mean, the liar's −Δ is the mean);
* ``alie``: "A Little Is Enough" (arXiv 1902.06156), μ − z·σ of the colluders' own Δ, z from the paper's
  formula for n = --peers and f = the cell's hostile count (one colluder: Δ − z·|Δ|);
* ``garbage-reducer``: as a reducer, 100 × the mean plus noise, the same to everyone;
* ``equivocating-reducer``: as a reducer, (i + 2) × the mean to sender i.

Defence ``on`` is the shipped default (``outer.aggregation = "centered-clip"``, sample claims counted up to
``claim_cap`` × the group's median while no minority outweighs the rest, norms clipped to the median norm,
the update check ``outer.max_update_growth``); ``old`` is the rule before issue 44 (claims capped at the
median, norms at 2 × the median: ``claim_cap = 1``, ``norm_clip = 2``); ``off`` is DiLoCo's exact weighted
mean with the update check off (``aggregation = "mean"``, ``max_update_growth = 0``). Cell ``D/0/clean`` (no
attacker) is each defence's reference: a cell's loss is compared with the clean run of its own defence,
and the clean runs with each other say what the defence costs an honest swarm. Cell ``D/0/island`` is an
honest swarm whose first peer is an island of 2 ranks (``torchrun --standalone --nproc-per-node 2``, gloo on
the CPU: its rendezvous store listens on every interface while the cell runs), twice a plain peer's samples
per inner step; the column "group samples" (the median of the honest peers' ``group_samples``) shows what
the rule counted of them.

The run config is peers/demo.toml (0.69M-parameter Llama, the shipped [outer] defaults: 4-bit
pseudo-gradients with error feedback, τ = 5, α = 0.5) on peers/data/tinyshakespeare.txt (as
benchmarks/quality.py), with H = --inner-steps (default 25, the demo's). Per cell, from the honest peers:

* the held-out loss of the final θ_global: the state that most honest peers recorded at their highest
  common outer step, from that peer's checkpoint, evaluated as `p2p-diloco demo` does;
* seconds per outer step: the median over honest peers of (last − first outer_step record) / steps between;
* MB per peer: sent + received tensor payload (the metrics' bytes_sent + bytes_received), mean over
  honest peers, for the whole run;
* whether the honest peers held one θ_global at every outer step, their rounds not applied
  (round_failed, round_rejected), and how many rounds the attackers altered.

Every peer stops at --outer-steps, so cells compare at equal steps; a cell whose honest peers do not all
get there within --timeout is marked "timed out" and its loss is at the step they reached. A cell took
3–5 minutes with two at a time on 2 cores that others were loading (load average 15–30); the whole
matrix (8 attacks × 2 counts × 2 defences + 2 clean) is 34 cells, so choose cells with --cells, or
--attacks, --hostile and --defence. Prints a Markdown table; writes results.json and each cell's config,
metrics, logs, checkpoints, run.json and eval.json under --out; --report prints the table of cells
already there again (held-out losses are kept in eval.json, not evaluated twice).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
import tomllib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from codec_quality import parse_variant
from utilization import CLI, DEMO_CONFIG, ENV, REPO, Processes, read_address, write_toml

from p2p_diloco.demo import evaluate  # noqa: E402 (utilization puts the repository on the path)
from p2p_diloco.metrics import read_metrics  # noqa: E402

TEXT = REPO / "peers" / "data" / "tinyshakespeare.txt"
ATTACKS = ("scale:100", "scale:3", "flip", "noise:100", "samples", "samples:10", "samples+flip", "alie",
           "garbage-reducer", "equivocating-reducer")
HONEST = ("clean", "island")  # the cells of 0 hostile peers: all plain peers, or the first of them an island
DEFENCES = {"on": {},  # [outer] settings
            # the rule before issue 44: the median cap, 2 × the median norm, −Δ counted
            "old": {"claim_cap": 1.0, "norm_clip": 2.0, "drop_opposed": False},
            "off": {"aggregation": "mean", "max_update_growth": 0}}
ISLAND = sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "p2p_diloco.cli"
HOSTILE = sys.executable, "-m", "tests.hostile_peer"
POLL_S = 1.0


@dataclass(frozen=True)
class Cell:
    """One swarm of the matrix: the defence, how many of the peers are hostile, and their attack."""

    defence: str
    hostile: int
    attack: str  # "clean" when hostile == 0

    @property
    def name(self) -> str:
        return f"{self.defence}/{self.hostile}/{self.attack}"

    @property
    def folder(self) -> str:
        return self.name.replace("/", "-").replace(":", "x").replace("+", "-")


def parse_cell(text: str) -> Cell:
    """'on/1/scale:100' -> Cell('on', 1, 'scale:100'); raises ValueError with what is allowed."""
    parts = text.strip().split("/")
    if len(parts) != 3 or parts[0] not in DEFENCES or not parts[1].isdigit():
        raise ValueError(f"cell {text!r}: DEFENCE/HOSTILE/ATTACK, e.g. on/1/scale:100 or off/0/clean")
    defence, hostile, attack = parts[0], int(parts[1]), parts[2]
    if (hostile == 0) != (attack in HONEST):
        raise ValueError(f"cell {text!r}: 0 hostile peers is a cell of {' or '.join(HONEST)}, and those have 0")
    if attack not in HONEST and attack not in ATTACKS:
        raise ValueError(f"cell {text!r}: unknown attack; known: {', '.join(ATTACKS)}")
    return Cell(defence, hostile, attack)


def matrix(attacks: list[str], counts: list[int], defences: list[str]) -> list[Cell]:
    """Every attack × hostile count × defence, and each defence's clean cell first."""
    return [Cell(d, 0, "clean") for d in defences] + [Cell(d, n, a) for a in attacks for n in counts for d in defences]


# ----- one cell -----------------------------------------------------------------------------------
def run_config(cell: Cell, inner_steps: int, cell_dir: Path, outer: Optional[dict] = None) -> Path:
    """peers/demo.toml on tinyshakespeare with H = `inner_steps`, the cell's defence, then the `outer` settings
    (``--outer``), a run name of its own."""
    raw = tomllib.loads(DEMO_CONFIG.read_text())
    raw["run"]["name"] = f"hostile-{cell.folder}"
    raw["data"] = {**raw["data"], "source": "files", "paths": [str(TEXT)]}
    raw["inner"]["steps_per_outer"] = inner_steps
    raw["outer"].update(DEFENCES[cell.defence])
    raw["outer"].update(outer or {})
    raw["swarm"].pop("initial_peers", None)  # the cell's own bootstrap node
    return write_toml(raw, cell_dir / "run.toml")


def peer_argv(config: Path, maddr: str, cell_dir: Path, name: str, args: argparse.Namespace) -> list[str]:
    """The arguments of `p2p-diloco peer` for one peer of the cell (after the word `peer`). Each peer stops at
    --outer-steps, so every cell's θ_global is compared at the same outer step (a peer that fell behind then
    ends alone on a state of its own, which the majority outvotes in :func:`final_state_holder`)."""
    return ["--config", str(config), "--host", "127.0.0.1", "--initial-peers", maddr,
            "--metrics-file", str(cell_dir / f"{name}.jsonl"), "--checkpoint-dir", str(cell_dir / name),
            "--wait-for-peers", str(args.peers), "--max-outer-steps", str(args.outer_steps)]


def hostile_argv(cell: Cell, cell_dir: Path, peers: int) -> list[str]:
    """tests/hostile_peer.py's options for the cell's attack (ALIE's colluders share a folder of the cell)."""
    argv = ["--attack", cell.attack]
    if cell.attack == "alie":
        argv += ["--collude-dir", str(cell_dir / "colluders"), "--colluders", str(cell.hostile), "--workers", str(peers)]
    return argv


def run_cell(cell: Cell, args: argparse.Namespace, out: Path) -> dict:
    """Start the cell's swarm, wait until every honest peer took --outer-steps outer steps (or --timeout),
    stop every process by PID, and measure."""
    cell_dir = out / cell.folder
    cell_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*cell_dir.glob("*.jsonl"), *cell_dir.glob("*/checkpoint.pt"), *cell_dir.glob("colluders/*/*"),
                  *cell_dir.glob("eval.json")]:
        stale.unlink()  # a peer would resume from an earlier run's checkpoint
    config = run_config(cell, args.inner_steps, cell_dir, args.outer)
    honest = [f"honest{i}" for i in range(args.peers - cell.hostile)]
    hostile = [f"hostile{i}" for i in range(cell.hostile)]
    processes = Processes()
    started = time.monotonic()
    reached = False
    try:
        log = cell_dir / "bootstrap.log"
        bootstrap = processes.start([*CLI, "bootstrap", "--host", "127.0.0.1", "--port", "0"],
                                    stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, env=ENV)
        maddr = read_address(bootstrap, log)
        for name in honest + hostile:
            argv = peer_argv(config, maddr, cell_dir, name, args)
            command = [*CLI, "peer", *argv] if name in honest else \
                [*HOSTILE, *hostile_argv(cell, cell_dir, args.peers), "--", *argv]
            if cell.attack == "island" and name == honest[0]:
                command = [*ISLAND, "peer", *argv]
            processes.start(command, stdout=open(cell_dir / f"{name}.log", "w"), stderr=subprocess.STDOUT, env=ENV,
                            cwd=REPO)
        deadline = started + args.timeout
        while time.monotonic() < deadline:
            processes.note_descendants()
            last = last_states(cell_dir, honest)
            if len(last) == len(honest) and all(step >= args.outer_steps for step, _ in last.values()):
                reached = True
                break
            time.sleep(POLL_S)
    finally:
        left = processes.stop()
    run = dict(wall_s=round(time.monotonic() - started, 1), reached=reached, left_behind=left)
    (cell_dir / "run.json").write_text(json.dumps(run))
    return measure(cell, cell_dir)


def final_state_holder(last: dict[str, tuple[int, str]]) -> tuple[Optional[str], int]:
    """A peer whose checkpoint holds the final θ_global, and its outer step: of the peers' `last` states, the
    one most of them hold, the later one on a tie. (None, 0) if no peer has a state yet."""
    if not last:
        return None, 0
    votes = Counter(last.values())
    step, sha = max(votes, key=lambda state: (votes[state], state[0]))
    return next(name for name, state in last.items() if state == (step, sha)), step


def seconds_per_step(steps: list[dict]) -> Optional[float]:
    if len(steps) < 2:
        return None
    return (steps[-1]["time"] - steps[0]["time"]) / (steps[-1]["outer_step"] - steps[0]["outer_step"])


def last_states(cell_dir: Path, names: list[str]) -> dict[str, tuple[int, str]]:
    """Each peer's last (outer step, θ_global sha256): its last outer_step or state_loaded record, which its
    checkpoint holds."""
    last = {}
    for name in names:
        path = cell_dir / f"{name}.jsonl"
        states = [r for r in read_metrics(path) if r["event"] in ("outer_step", "state_loaded")] if path.exists() else []
        if states:
            last[name] = (states[-1]["outer_step"], states[-1]["global_sha256"])
    return last


def agreement(steps: dict[str, list[dict]], last: dict[str, tuple[int, str]]) -> str:
    """"one" if the honest peers recorded one θ_global at every outer step; else at how many steps two groups
    committed different means (docs/design.md: the smaller then downloads the larger's state), and whether
    they still held different states when the cell was stopped (a split in its last round, or a timeout)."""
    by_step: dict[int, set[str]] = {}
    for rs in steps.values():
        for r in rs:
            by_step.setdefault(r["outer_step"], set()).add(r["global_sha256"])
    split = sum(len(shas) > 1 for shas in by_step.values())
    if not split:
        return "one"
    held = len(set(last.values()))
    return f"split at {split} step{'s' if split > 1 else ''}, " + \
        ("one at the end" if held == 1 else f"{held} states at the stop")


def evaluated(cell_dir: Path, holder: str, sha256: str) -> tuple[float, float]:
    """Held-out loss of the initial model and of the θ_global (`sha256`) in `holder`'s checkpoint, as `p2p-diloco
    demo` evaluates it; kept in the cell's eval.json, so that --report does not evaluate a state twice."""
    cache = cell_dir / "eval.json"
    known = json.loads(cache.read_text()) if cache.exists() else {}
    if known.get("global_sha256") != sha256:
        initial, final = evaluate(cell_dir / "run.toml", [cell_dir / holder])
        known = dict(global_sha256=sha256, initial_eval_loss=initial, final_eval_loss=final)
        cache.write_text(json.dumps(known))
    return known["initial_eval_loss"], known["final_eval_loss"]


def measure(cell: Cell, cell_dir: Path) -> dict:
    """The cell's row, from what its run left in `cell_dir`: final held-out loss of θ_global, s per outer
    step, MB per peer, agreement of the honest peers, rounds not applied, rounds attacked."""
    honest = sorted(path.stem for path in cell_dir.glob("honest*.jsonl"))
    hostile = sorted(path.stem for path in cell_dir.glob("hostile*.log"))
    records = {name: read_metrics(cell_dir / f"{name}.jsonl") for name in honest}
    steps = {name: [r for r in rs if r["event"] == "outer_step"] for name, rs in records.items()}
    last = last_states(cell_dir, honest)
    holder, final_step = final_state_holder(last)
    initial, final = evaluated(cell_dir, holder, last[holder][1]) if holder else (None, None)
    not_applied = Counter(r["event"] for rs in records.values() for r in rs
                          if r["event"] in ("round_failed", "round_rejected", "round_skipped"))
    timing = [s for s in (seconds_per_step(rs) for rs in steps.values()) if s is not None]
    traffic = [rs[-1]["bytes_sent"] + rs[-1]["bytes_received"] for rs in steps.values() if rs]
    attacked = sum((cell_dir / f"{name}.log").read_text().count("attacked ") for name in hostile)
    return dict(cell=cell.name, defence=cell.defence, hostile=cell.hostile, attack=cell.attack,
                run=json.loads((cell_dir / "run.json").read_text()),
                final_outer_step=final_step, initial_eval_loss=initial, final_eval_loss=final,
                seconds_per_outer_step=statistics.median(timing) if timing else None,
                mb_per_peer=statistics.mean(traffic) / 1e6 if traffic else None,
                global_state=agreement(steps, last), rounds_not_applied=dict(not_applied), rounds_attacked=attacked,
                group_samples=statistics.median(r["group_samples"] for rs in steps.values() for r in rs)
                if any(steps.values()) else None)


# ----- report -------------------------------------------------------------------------------------
def fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def versus_clean(row: dict, clean: dict[str, dict]) -> str:
    reference = clean.get(row["defence"], {}).get("final_eval_loss")
    if row["final_eval_loss"] is None or reference is None:
        return "–"
    return f"{100 * (row['final_eval_loss'] - reference) / reference:+.1f} %"


def markdown_table(rows: list[dict], outer_steps: int, peers: int) -> str:
    clean = {r["defence"]: r for r in rows if r["attack"] == "clean"}
    lines = [f"| defence | hostile of {peers} | attack | final held-out loss | vs clean | outer steps | s per outer step | "
             "MB per peer | honest peers' θ_global | rounds not applied (honest) | rounds attacked | "
             "group samples | wall s |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|---|---:|---:|---:|"]
    for r in rows:
        steps = f"{r['final_outer_step']}/{outer_steps}" + ("" if r["run"]["reached"] else " (timed out)")
        not_applied = ", ".join(f"{n} {event}" for event, n in sorted(r["rounds_not_applied"].items())) or "0"
        lines.append(f"| {r['defence']} | {r['hostile']} | {r['attack']} | {fmt(r['final_eval_loss'], '.4f')} | "
                     f"{versus_clean(r, clean)} | {steps} | {fmt(r['seconds_per_outer_step'], '.1f')} | "
                     f"{fmt(r['mb_per_peer'], '.2f')} | {r['global_state']} | "
                     f"{not_applied} | {r['rounds_attacked']} | {fmt(r.get('group_samples'), '.0f')} | "
                     f"{r['run']['wall_s']:.0f} |")
    return "\n".join(lines)


# ----- main ---------------------------------------------------------------------------------------
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--cells", default="", help="comma-separated DEFENCE/HOSTILE/ATTACK cells, e.g. "
                                                    "on/0/clean,on/1/scale:100 (replaces the three options below)")
    parser.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated attacks of the matrix")
    parser.add_argument("--hostile", default="1,2", help="comma-separated counts of hostile peers")
    parser.add_argument("--defence", default="on,off",
                        help="on (the shipped defaults), old (the rule before issue 44), off (exact mean, no check)")
    parser.add_argument("--peers", type=int, default=5, help="peers per swarm, hostile ones included")
    parser.add_argument("--outer-steps", type=int, default=5, help="outer steps the honest peers take per cell")
    parser.add_argument("--inner-steps", type=int, default=25, help="H, inner steps per outer step")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per cell before giving up")
    parser.add_argument("--jobs", type=int, default=1, help="cells run at a time")
    parser.add_argument("--out", type=Path, default=Path("bench-out/hostile"), help="output directory")
    parser.add_argument("--outer", default="",
                        help="[outer] settings for every cell, after its defence's, e.g. 'fixed_sync_delay=true': "
                             "a fixed overlap makes every cell's inner steps the same from run to run")
    parser.add_argument("--report", action="store_true",
                        help="run nothing: measure again the chosen cells that --out holds, and print their table")
    args = parser.parse_args(argv)
    args.outer = parse_variant(parser, args.outer, "--outer")
    try:
        if args.cells:
            args.cells = [parse_cell(text) for text in args.cells.split(",") if text.strip()]
        else:
            attacks = [a.strip() for a in args.attacks.split(",") if a.strip()]
            counts = [int(n) for n in args.hostile.split(",") if n.strip()]
            defences = [d.strip() for d in args.defence.split(",") if d.strip()]
            args.cells = [parse_cell(c.name) for c in matrix(attacks, counts, defences)]
    except ValueError as e:
        parser.error(str(e))
    if any(c.hostile >= args.peers for c in args.cells) or args.outer_steps < 2 or args.jobs < 1:
        parser.error("every cell needs an honest peer (hostile < --peers), --outer-steps >= 2, --jobs >= 1")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report:  # the cells already run under --out, measured again
        rows = [measure(c, args.out / c.folder) for c in args.cells if (args.out / c.folder / "run.json").exists()]
    else:
        rows = run_cells(args)
    initial = next((r["initial_eval_loss"] for r in rows if r["initial_eval_loss"] is not None), math.nan)
    print(f"\n{args.peers} peers per swarm, H = {args.inner_steps}, {args.outer_steps} outer steps; initial held-out "
          f"loss {initial:.4f}; {time.monotonic() - began:.0f} s in all\n")
    print(markdown_table(rows, args.outer_steps, args.peers))
    return 0


def run_cells(args: argparse.Namespace) -> list[dict]:
    """Run every cell of `args.cells`, --jobs at a time; their rows in that order (also in results.json)."""
    from p2p_diloco.config import load_config
    from p2p_diloco.train.data import TextData

    TextData(load_config(run_config(args.cells[0], args.inner_steps, args.out, args.outer)).data)  # the tokenizer, cached once
    rows: list[dict] = []

    def one(cell: Cell) -> dict:
        print(f"{cell.name}: starting", file=sys.stderr, flush=True)
        row = run_cell(cell, args, args.out)
        print(f"{cell.name}: {row['run']['wall_s']:.0f} s, loss {fmt(row['final_eval_loss'], '.4f')}, "
              f"step {row['final_outer_step']}", file=sys.stderr, flush=True)
        rows.append(row)
        (args.out / "results.json").write_text(json.dumps(dict(args={**vars(args), "out": str(args.out),
                                                                     "cells": [c.name for c in args.cells]},
                                                               rows=rows), indent=2, default=str))
        return row

    with ThreadPoolExecutor(args.jobs) as pool:
        done = {row["cell"]: row for row in pool.map(one, args.cells)}
    return [done[c.name] for c in args.cells]


if __name__ == "__main__":
    sys.exit(main())
