"""How far ahead of its pseudo-gradient a peer announces that it is ready, so its group forms meanwhile.

A round's fixed costs come before any tensor moves: waiting for the last groupmate to be ready, the
membership plan, joining the leader (:mod:`p2p_diloco.sync.membership`). A peer that announces only
once its Δ is taken idles through all of them (the demo on loopback: about 1 s of a 3.6 s round,
docs/benchmarks.md). hivemind.Optimizer begins its matchmaking ahead of the moment it expects to be
ready and starts the all-reduce on a trigger (``DecentralizedAverager.step(require_trigger=True)``);
a peer here does the same. It says "ready" that many inner steps before its Δ is due, its round is
planned and its group formed while it trains them, and its all-reduce begins the moment it hands its
Δ over (:class:`~p2p_diloco.sync.outer_sync.PendingDelta`). The Δ itself is taken at the same inner
step as without the lead: the outer step's arithmetic is DiLoCo's (arXiv 2311.08105, Alg. 1), and
only when the waiting happens changes.

The lead comes from the peer's own measurements: the seconds from its plan to its group's assembly
in its last rounds (the median, with a margin, plus the moment its record takes to be read), over its
recent seconds per inner step. The wait for groupmates' announcements is left out: a peer that
counted it announced earlier the more it had waited, waited longer for it, and ran away from the
others (measured: leads of 11 and 6 inner steps in one 3-peer run, the early peer's Δ idle and the
late one's group waiting for it). It is capped at :data:`MAX_LEAD_FRACTION` of a round's inner steps and at ``max_s``: groupmates that
handed over their Δ wait for the slowest one's, and that wait is bounded by ``next_chunk_timeout``.
"""

from __future__ import annotations

import collections
import math
import statistics

WINDOW = 5  # rounds whose matching time the lead follows
MARGIN = 1.25  # the lead covers this much more than the median matching time
RECORD_READ_S = 0.1  # and this: a groupmate reads a "ready" record a DHT store and a poll after it is written
MAX_LEAD_FRACTION = 0.5  # of a round's inner steps: most of a round is trained before its group forms


class MatchLead:
    """How many inner steps before its Δ is due this peer announces it (0 when `enabled` is false, and
    until a round has been measured)."""

    def __init__(self, enabled: bool, max_s: float):
        self.enabled = enabled
        self.max_s = max_s  # the most seconds ahead: groupmates wait that long, at most, for this peer's Δ
        self._matching_s: collections.deque[float] = collections.deque(maxlen=WINDOW)

    def record(self, matching_s: float) -> None:
        """The seconds from this peer's plan to its group's assembly in a round that formed one."""
        self._matching_s.append(max(matching_s, 0.0))

    @property
    def seconds(self) -> float:
        """How long ahead of its Δ this peer announces it, in seconds."""
        if not self.enabled or not self._matching_s:
            return 0.0
        return min(MARGIN * statistics.median(self._matching_s) + RECORD_READ_S, self.max_s)

    def steps(self, step_s: float, steps_per_round: int) -> int:
        """The lead in inner steps of `step_s` seconds each, in a round of `steps_per_round` of them."""
        if step_s <= 0 or self.seconds == 0:
            return 0
        return min(math.ceil(self.seconds / step_s), int(MAX_LEAD_FRACTION * steps_per_round))
