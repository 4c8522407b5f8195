"""How much of a peer's time goes to training: compute utilization, as OpenDiLoCo measures it.

Between two ``outer_step`` records a peer spends wall seconds on inner steps and on everything
else: waiting for groupmates, the all-reduce, the commit, loading the state. Only the inner steps
train the model. ``compute_utilization = inner seconds / wall seconds`` is the share that did
(OpenDiLoCo, Jaghouar et al. 2024, arXiv 2407.07852, §4: 14 % with hivemind's default timeouts
on a small model). ``blocked_seconds`` is the rest: with a blocking sync, the inner loop stood
still for that long.
"""

from __future__ import annotations

import collections
import time
from contextlib import contextmanager
from typing import Iterator


def compute_utilization(inner_s: float, wall_s: float) -> float:
    """Inner seconds over wall seconds (0 for no time at all)."""
    return round(inner_s / wall_s, 4) if wall_s > 0 else 0.0


class ComputeClock:
    """Inner seconds against wall seconds since the last :meth:`lap`."""

    def __init__(self):
        self.last_step_s = 0.0  # the seconds of the latest inner step (for a throughput over recent steps)
        self.reset()

    def reset(self) -> None:
        self._since = time.perf_counter()
        self._inner_s = 0.0

    @contextmanager
    def inner_step(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.last_step_s = time.perf_counter() - start
            self._inner_s += self.last_step_s

    def lap(self) -> dict:
        """The metrics since the last lap (or reset), then start counting anew."""
        wall_s = time.perf_counter() - self._since
        lap = dict(inner_seconds=round(self._inner_s, 4), blocked_seconds=round(max(wall_s - self._inner_s, 0.0), 4),
                   compute_utilization=compute_utilization(self._inner_s, wall_s))
        self.reset()
        return lap


class RecentRate:
    """Samples per second over the last `window` inner steps (their compute time, not the waits between)."""

    def __init__(self, window: int = 20):
        self._steps: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)

    def add(self, samples: int, seconds: float) -> None:
        self._steps.append((samples, seconds))

    def step_s(self) -> float:
        """Mean seconds per inner step over the window (0 before the first)."""
        return sum(s for _, s in self._steps) / len(self._steps) if self._steps else 0.0

    def rate(self) -> float:
        seconds = sum(s for _, s in self._steps)
        return sum(n for n, _ in self._steps) / seconds if seconds > 0 else 0.0
