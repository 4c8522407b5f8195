"""The bytes a peer sends and receives per round, by phase, with the spot-check audit and with a full one.

    python benchmarks/bytes_per_phase.py                       # 4 peers, 2M parameters, 3 rounds: ~2 min
    python benchmarks/bytes_per_phase.py --peers 3 --params 690000 --rounds 3   # the demo model's size

N peers (--peers) start a DHT node each on 127.0.0.1 and average --rounds rounds of random Δ (--params
values in 8 tensors, randn · 1e-3) with ``OuterSync.average`` as the training loop does, in the run's
codec and aggregation (--codec, --aggregation: the shipped defaults), every round planned with every
peer (tests/allreduce_case.py runs them): the all-reduce, the round reports and the audit. Twice: with
the spot checks (p2p_diloco/sync/spot_check.py: one chunk in 12), and with every chunk audited (the
audit as it was before them: it fetched all of a reducer's inputs; here with their hash lists, 32 bytes
a chunk more).

Per phase (p2p_diloco/traffic.py) the table gives the bytes a peer sent plus received per round, the
mean over peers and rounds, and its share of the all-reduce's; "counted before" is what ``bytes_sent``
+ ``bytes_received`` counted before every phase was counted (the all-reduce alone). The records, the
probes and the state are not exercised here: no peer trains, joins or waits (their counts are 0).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests/allreduce_case.py

from p2p_diloco.sync import spot_check  # noqa: E402
from p2p_diloco.traffic import PHASES  # noqa: E402
from tests.allreduce_case import START, average_rounds  # noqa: E402

TENSORS = 8


def case(peers: int, params: int, rounds: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    shapes = [torch.Size([params // TENSORS])] * TENSORS
    return {"rounds": [{"inputs": [[torch.randn(s, generator=generator) * 1e-3 for s in shapes] for _ in range(peers)],
                        "starts": [START] * peers, "leaders": list(range(peers))} for _ in range(rounds)],
            "samples": [64] * peers, "error_feedback": True}


def per_round(result: dict, rounds: int) -> dict[str, float]:
    """phase -> bytes sent plus received per peer and round, the mean over peers (rounds that failed count too)."""
    return {phase: statistics.mean(p[phase]["sent"] + p[phase]["received"] for p in result["by_phase"]) / rounds
            for phase in PHASES}


def run(args, sample_one_in: int) -> tuple[dict[str, float], int]:
    spot_check.SAMPLE_ONE_IN = sample_one_in  # before the averagers fork: theirs, and the reducers' bound
    spec = f"{args.codec}"
    cased = case(args.peers, args.params, args.rounds)
    cased["aggregation"] = args.aggregation
    result = average_rounds([spec], cased)["runs"][spec]
    failed = sum(e is not None for r in result["rounds"] for e in r["errors"])
    return per_round(result, args.rounds), failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--params", type=int, default=2_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--codec", default="fp4-e3m0")
    parser.add_argument("--aggregation", default="centered-clip")
    args = parser.parse_args()
    after, failed_after = run(args, spot_check.SAMPLE_ONE_IN)
    before, failed_before = run(args, 1)

    def cell(counts: dict[str, float], phase: str) -> str:
        share = counts[phase] / counts["allreduce"] if counts["allreduce"] else float("nan")
        return f"{counts[phase] / 1e6:.3f} MB ({share:.1%})" if phase != "allreduce" else f"{counts[phase] / 1e6:.3f} MB"

    print(f"{args.peers} peers, {args.params:,} parameters, {args.codec}, {args.aggregation}, {args.rounds} rounds "
          f"(failed peer-rounds: {failed_before} before, {failed_after} after)\n")
    print("| phase | counted before | before: full audit | after: spot checks |")
    print("|---|---|---|---|")
    for phase in PHASES:
        counted = f"{before['allreduce'] / 1e6:.3f} MB" if phase == "allreduce" else "not counted"
        print(f"| {phase} | {counted} | {cell(before, phase)} | {cell(after, phase)} |")
    total = {k: sum(v.values()) for k, v in (("before", before), ("after", after))}
    print(f"| total | {before['allreduce'] / 1e6:.3f} MB | {total['before'] / 1e6:.3f} MB | {total['after'] / 1e6:.3f} MB |")


if __name__ == "__main__":
    main()
