"""What ``diloco.step()`` costs a training loop per inner step (p2p_diloco.DiLoCo, docs/api.md).

    python benchmarks/library_step.py                      # 20,000 inner steps, H = 500, ~1 minute
    python benchmarks/library_step.py --steps 50000 --sync-every 1000

One peer, alone in its run on 127.0.0.1 (no bootstrap node), trains a 1-layer MLP whose inner step is nearly free
(one tiny forward, backward and SGD step), first without DiLoCo, then inside ``with DiLoCo(...)``; each call is
timed by the wall clock. The cost per inner step is the difference of the two loops' medians (the hand-over of
the model to the driver thread and back, train/user_loop.py), and the mean over all steps includes the outer
steps themselves (the pseudo-gradient, the round alone, the outer Nesterov step), spread over H inner steps.
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import p2p_diloco  # noqa: E402


def timed_steps(steps: int, after_step) -> list[float]:
    """Seconds of each of `steps` inner steps of a tiny MLP, `after_step()` included."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        after_step(model, optimizer)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000, help="inner steps of each loop")
    parser.add_argument("--sync-every", type=int, default=500, help="H: inner steps per outer step")
    args = parser.parse_args()
    torch.set_num_threads(1)

    plain = timed_steps(args.steps, lambda model, optimizer: None)
    holder: dict = {}

    def with_diloco(model, optimizer):
        if "diloco" not in holder:  # built on the loop's own model, on its first step
            holder["diloco"] = p2p_diloco.DiLoCo(model, optimizer, run="library-step", host="127.0.0.1",
                                                 sync_every=args.sync_every).__enter__()
        holder["diloco"].step(samples=4)

    try:
        timed = timed_steps(args.steps, with_diloco)
    finally:
        if "diloco" in holder:
            holder["diloco"].close()
    timed = timed[1:]  # the first call joined the swarm
    outer_steps = holder["diloco"].outer_step
    us = 1e6
    print(f"| loop | inner steps | outer steps | median µs/step | mean µs/step | p99 µs/step |")
    print("|---|---|---|---|---|---|")
    for name, times, outer in (("plain PyTorch", plain, 0), ("with DiLoCo", timed, outer_steps)):
        p99 = sorted(times)[int(0.99 * len(times))]
        print(f"| {name} | {len(times):,} | {outer} | {statistics.median(times) * us:.1f} | "
              f"{statistics.fmean(times) * us:.1f} | {p99 * us:.1f} |")
    print(f"\ndiloco.step() per inner step: {(statistics.median(timed) - statistics.median(plain)) * us:.1f} µs "
          f"(median), {(statistics.fmean(timed) - statistics.fmean(plain)) * us:.1f} µs (mean, outer steps "
          f"included; H = {args.sync_every})")


if __name__ == "__main__":
    main()
