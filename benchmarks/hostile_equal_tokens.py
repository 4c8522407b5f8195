"""Hostile peers at equal tokens: what one liar (or one fast honest peer) does to the held-out loss, repeatably.

    python benchmarks/hostile_equal_tokens.py --peers 3 --attacks scale:3,scale:100,flip,samples+flip
    python benchmarks/hostile_equal_tokens.py --peers 3 --attacks fast --defences on,old,off --seeds 0,1,2

benchmarks/hostile.py runs real processes, and a round there ends when its fastest peer is ready: a cell's
inner steps vary with timing, and its held-out loss by about 1 % from run to run, as much as the effects it
measures. Here every peer trains exactly H inner steps per outer step (benchmarks/quality.py's DiLoCo run:
DiLoCoPeers in threads of one process, real DHTs on 127.0.0.1, the real all-reduce and robust rule), so a
cell repeats, and the difference between two cells of a seed is the attack's or the defence's. (A real round
ends when its fastest peer is ready, and the others stop after their lead: here every peer's
``RoundSync.round_is_closing`` says no, so each trains all H steps and the faster ones wait for it.)

The last --hostile peers send as tests/hostile_peer.py's sender attacks (``make_hostile``: ``scale:K``,
``flip``, ``noise:K``, ``samples``, ``samples:K``, ``samples+flip``, ``alie``). Cell ``fast`` has no liar: its
first peer trains batches of --fast-factor × the others' sequences and claims them, as a peer that many times
faster or an island of that many ranks does; its "counted" column is the median of the groups' counted
samples (``group_samples``) against the samples trained. Defences as in hostile.py: ``on`` (the shipped
rule), ``old`` (the rule before issue 44), ``off`` (the exact weighted mean, no update check).

The run is the demo's (peers/demo.toml: its model of 0.69M parameters, its inner optimizer and learning-rate
schedule, its sync of 4-bit pseudo-gradients with error feedback, τ = 5, α = 0.5) with τ fixed (``--outer``
changes the sync), on peers/data/tinyshakespeare.txt.
Each cell is compared with the clean cell of the same defence and seed; with several --seeds the table gives
the mean and the standard deviation of those gaps, and the clean cells of ``old`` and ``off`` against ``on``'s
say what the shipped defence costs an honest swarm. Prints a Markdown table; writes results.json to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import tomllib
from pathlib import Path

import torch

from codec_quality import parse_variant
from hostile import DEFENCES  # (its utilization module puts the repository on the path)
from utilization import DEMO_CONFIG
from quality import add_run_arguments, benchmark_config, checked_run_arguments, percent_gap, run_diloco

from p2p_diloco.node_runner import setup_logging
from p2p_diloco.train.data import TextData
from tests.hostile_peer import Colluders, make_hostile, parse_attacks, sender_attacks

DEMO_SYNC = "codec=fp4-e3m0 error_feedback=true sync_delay=5 merge_alpha=0.5 fixed_sync_delay=true"
HONEST = ("clean", "fast")
ROUND_WAIT_S = 300.0  # how long ready peers wait for one still training: all of its H steps, on loaded cores


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attacks", default="scale:3,scale:100,flip,samples+flip",
                        help="comma-separated sender attacks of tests/hostile_peer.py, or 'fast' (no liar)")
    parser.add_argument("--hostile", type=int, default=1, help="how many of the peers attack (the last ones)")
    parser.add_argument("--defences", default="on", help=f"comma-separated, of {', '.join(DEFENCES)}")
    parser.add_argument("--seeds", help="comma-separated run seeds, each cell once per seed (default: --seed)")
    parser.add_argument("--fast-factor", type=int, default=2, help="cell 'fast': its first peer's batch, × the others'")
    parser.add_argument("--outer", default=DEMO_SYNC, help="[outer] settings of every cell, KEY=VALUE ...")
    add_run_arguments(parser, out="bench-out/hostile-equal-tokens")
    parser.set_defaults(outer_steps=5, inner_steps=25, peers=3)
    args = checked_run_arguments(parser)
    args.attacks = [a.strip() for a in args.attacks.split(",") if a.strip()]
    for attack in args.attacks:
        if attack in HONEST:
            continue
        try:
            sender_attacks(attack)
        except ValueError as e:
            parser.error(f"--attacks: {e}")
    args.defences = [d.strip() for d in args.defences.split(",") if d.strip()]
    unknown = [d for d in args.defences if d not in DEFENCES]
    if unknown:
        parser.error(f"--defences: unknown {', '.join(unknown)}; known: {', '.join(DEFENCES)}")
    try:
        args.seeds = [args.seed] if args.seeds is None else [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds: {args.seeds!r} is not a comma-separated list of integers")
    if not 1 <= args.hostile < args.peers:
        parser.error(f"--hostile must be at least 1 and fewer than --peers ({args.peers})")
    if args.fast_factor < 1:
        parser.error("--fast-factor must be at least 1")
    args.outer = parse_variant(parser, args.outer, option="--outer")
    args.demo_inner = tomllib.loads(Path(DEMO_CONFIG).read_text())["inner"]  # the demo's inner optimizer and schedule
    return args


def run_cell(args, data: TextData, defence: str, attack: str, seed: int, collude_root: Path) -> dict:
    """One swarm: the held-out loss of its final θ_global and what its groups counted."""
    cfg = benchmark_config(args.text, seed, args.inner_steps, args.outer_steps * args.inner_steps)
    cfg = cfg.replace(inner={**args.demo_inner, "steps_per_outer": args.inner_steps},
                      outer={**args.outer, **DEFENCES[defence]},
                      swarm={"round_wait_timeout": ROUND_WAIT_S})
    batch = cfg.inner.batch_size
    batch_sizes = [args.fast_factor * batch] if attack == "fast" else []
    first_hostile = args.peers - (0 if attack in HONEST else args.hostile)
    colluders = None
    if attack not in HONEST and any(a.kind == "alie" for a in parse_attacks(attack)):
        colluders = Colluders(collude_root / f"{defence}-{attack}-{seed}", args.hostile, args.peers)

    def prepare(index: int, peer) -> None:
        peer.round_sync.round_is_closing = lambda step: False  # every peer trains all H steps of a round
        if index >= first_hostile:
            make_hostile(peer.sync, attack, colluders)

    started = time.perf_counter()
    result = run_diloco(cfg, data, args.peers, args.outer_steps * cfg.outer.fragments, batch_sizes, prepare)
    trained = sum(batch_sizes) + batch * (args.peers - len(batch_sizes))
    return dict(defence=defence, attack=attack, seed=seed, final_eval_loss=result.final_eval_loss,
                group_samples=result.details["group_samples"],
                trained_samples_per_round=trained * args.inner_steps,
                one_global_state=result.details["identical_global_model_every_step"],
                seconds=time.perf_counter() - started)


def gap_summary(gaps: list[float]) -> str:
    if len(gaps) == 1:
        return f"{gaps[0]:+.2f} %"
    return f"{statistics.mean(gaps):+.2f} % (sd {statistics.stdev(gaps):.2f})"


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    setup_logging(verbose=False)
    torch.set_num_threads(1)  # one thread per peer, as benchmarks/quality.py
    data = TextData(benchmark_config(args.text, args.seeds[0], args.inner_steps,
                                     args.outer_steps * args.inner_steps).data)
    attacks = ["clean"] + [a for a in args.attacks if a != "clean"]
    defences = ["on"] + [d for d in args.defences if d != "on"]  # the shipped rule: every defence's cost is to it
    rows = []
    with tempfile.TemporaryDirectory(prefix="hostile-colluders-") as collude_root:
        for seed in args.seeds:
            for defence in defences:
                for attack in attacks:
                    row = run_cell(args, data, defence, attack, seed, Path(collude_root))
                    print(f"{defence}/{attack} seed {seed}: held-out loss {row['final_eval_loss']:.4f}, "
                          f"counted {row['group_samples']:.0f} of {row['trained_samples_per_round']} samples "
                          f"a round, {row['seconds']:.0f} s", flush=True)
                    rows.append(row)
    loss = {(r["defence"], r["attack"], r["seed"]): r["final_eval_loss"] for r in rows}
    print(f"\n{args.peers} peers ({args.hostile} hostile), H = {args.inner_steps}, K = {args.outer_steps}, "
          f"seeds {','.join(map(str, args.seeds))}; [outer] {' '.join(f'{k}={v}' for k, v in args.outer.items())}\n")
    print("| defence | cell | held-out loss (mean of seeds) | vs the clean run of its defence | vs `on`'s clean run "
          "| samples counted a round / trained | one θ_global every step |")
    print("|---|---|---:|---:|---:|---:|---|")
    for defence in defences:
        for attack in attacks:
            cell = [r for r in rows if r["defence"] == defence and r["attack"] == attack]
            own = [percent_gap(loss[defence, attack, s], loss[defence, "clean", s]) for s in args.seeds]
            shipped = [percent_gap(loss[defence, attack, s], loss["on", "clean", s]) for s in args.seeds]
            counted = statistics.mean(r["group_samples"] for r in cell)
            print(f"| {defence} | {attack} | {statistics.mean(r['final_eval_loss'] for r in cell):.4f} | "
                  f"{'' if attack == 'clean' else gap_summary(own)} | "
                  f"{'' if (defence, attack) == ('on', 'clean') else gap_summary(shipped)} | "
                  f"{counted:.0f} / {cell[0]['trained_samples_per_round']} | "
                  f"{all(r['one_global_state'] for r in cell)} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(dict(args=vars(args), rows=rows), indent=2))
    print(f"\nwrote {out / 'results.json'}; benchmark wall time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
