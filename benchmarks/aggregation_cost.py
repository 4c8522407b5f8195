"""What a reducer's aggregation rule costs: CPU milliseconds per part, per rule and group size.

    python benchmarks/aggregation_cost.py [--senders 3,5,16] [--values 932067] [--repeats 3]

Each cell runs :func:`p2p_diloco.sync.robust.aggregate` on `senders` random float32 parts of `values`
values (the size hivemind gives a part of the 4-bit codecs), on one thread, and keeps the best of
`--repeats` runs of the process's CPU time (not wall time: it is what the reducer's worker thread
spends, and is far less disturbed by other processes on a shared machine). It prints a markdown table.
"""

from __future__ import annotations

import argparse
import time

import torch

from p2p_diloco.sync.robust import RULES, AggregationRule, aggregate


def cpu_seconds(parts: list[torch.Tensor], rule: AggregationRule, repeats: int) -> float:
    claims = [128.0] * len(parts)
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        aggregate(parts, claims, rule)
        best = min(best, time.process_time() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--senders", default="3,5,16", help="group sizes, comma-separated")
    parser.add_argument("--values", type=int, default=932_067, help="values per part")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell; the best is kept")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| senders | rule | ms per part (CPU) | ns per value and sender |")
    print("|---:|---|---:|---:|")
    for senders in (int(n) for n in args.senders.split(",")):
        generator = torch.Generator().manual_seed(senders)
        parts = [torch.randn(args.values, generator=generator) for _ in range(senders)]
        for name in RULES:
            seconds = cpu_seconds(parts, AggregationRule(name), args.repeats)
            print(f"| {senders} | {name} | {seconds * 1e3:.1f} | {seconds / (args.values * senders) * 1e9:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
