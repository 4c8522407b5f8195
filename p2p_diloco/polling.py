"""Intervals between the reads of a value that a wait expects to change soon, and may not for long.

A round's waits (groupmates' progress records, their round reports) mostly end within a few DHT
round trips, and the first reads decide how long a round idles; but a wait can last its whole
timeout (a slow groupmate, a report that never comes), and reading a DHT key many times a second
for that long loads the nodes that store it. The intervals start short and grow geometrically to a
cap: a wait that ends at once ends within a few tens of milliseconds, and a long one reads at the cap.
"""

from __future__ import annotations

from typing import Iterator


def poll_intervals(first: float, cap: float, factor: float = 1.5) -> Iterator[float]:
    """first, first·factor, first·factor², ... up to `cap`, then `cap` for ever."""
    interval = min(first, cap)
    while True:
        yield interval
        interval = min(interval * factor, cap)
