"""Virtual time: an event queue of (time, sequence, callback), and processes written as generators.

A process yields the seconds it sleeps; the loop resumes it then. A process that is frozen resumes when it
thaws; one that crashed never resumes. Nothing here reads a clock.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Generator, Optional

Process = Generator[float, None, None]


class Loop:
    """The simulation's clock and event queue; `after_event` runs after every event (the invariants)."""

    def __init__(self, after_event: Optional[Callable[[], None]] = None):
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self.after_event = after_event
        self.events = 0

    def at(self, when: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (max(when, self.now), next(self._order), callback))

    def run(self, until: float) -> None:
        while self._queue and self._queue[0][0] <= until:
            self.now, _, callback = heapq.heappop(self._queue)
            callback()
            self.events += 1
            if self.after_event is not None:
                self.after_event()
        self.now = until


class Task:
    """A running process: resumed by the loop after each sleep, unless it crashed; delayed while frozen."""

    def __init__(self, loop: Loop, process: Process, start: float):
        self.loop = loop
        self.process = process
        self.crashed = False
        self.frozen_until = 0.0
        self.done = False
        loop.at(start, self._resume)

    def _resume(self) -> None:
        if self.crashed or self.done:
            return
        if self.frozen_until > self.loop.now:
            self.loop.at(self.frozen_until, self._resume)
            return
        try:
            sleep = next(self.process)
        except StopIteration:
            self.done = True
            return
        self.loop.at(self.loop.now + max(sleep, 0.0), self._resume)

    def crash(self) -> None:
        self.crashed = True

    def freeze(self, until: float) -> None:
        self.frozen_until = max(self.frozen_until, until)
