"""Simulated averaging rounds: groups that form from each member's membership plan, and what they produce.

A member asks the leaders of its plan (:func:`p2p_diloco.protocol.membership.plan_membership`) in order. A
round is keyed by (outer step, θ_global, leader): it opens when its first member arrives, and once the leader
itself comes it starts when every member of the opener's plan has joined, or a window after the leader came
(hivemind's matchmaking as :mod:`p2p_diloco.sync.membership` drives it). A member whose leader is dead, frozen, on
the other side of a partition, a member of another's round, not come within a window, or whose round has already
started, asks the next leader; with no leader left the
attempt fails before any tensor moved. A round that started ends `duration` later: if every member is still
there, with the group's aggregate under the run's robust rule (:func:`p2p_diloco.sync.robust.aggregate`, the
real one, on small pseudo-gradients); else void for every survivor, who learn it `failure_detection_s` later
(a reducer's parts never came, or its report).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from p2p_diloco.protocol.membership import has_quorum
from p2p_diloco.sync.robust import AggregationRule, aggregate


@dataclass
class SimRound:
    step: int
    sha256: str
    leader: str
    planned: frozenset[str]  # the opener's plan
    parts: dict[str, tuple[torch.Tensor, float]] = field(default_factory=dict)  # member -> (what it sends, claim)
    leading: Optional[float] = None  # when the leader itself came: it takes members from then on
    started: Optional[float] = None
    started_apart: bool = False  # it started while a partition was on: its members saw one side of the run
    ends: float = math.inf  # when its all-reduce, reports and audit are over
    outcome: Optional["RoundOutcome"] = None


@dataclass
class RoundOutcome:
    members: tuple[str, ...]
    mean: Optional[torch.Tensor]  # None: the round failed (a member was lost)
    known_at: float  # when the members learn it
    failed: tuple[str, ...] = ()  # members lost mid-round
    formed: bool = True  # False: fewer than two members came; nothing moved
    formed_apart: bool = False  # its group formed while a partition was on (SimRound.started_apart)
    applied: Optional[tuple] = None  # what its members apply, computed once (SimSwarm.commit)


@dataclass
class SimAverager:
    """Every open round of the simulated run."""

    rule: AggregationRule
    window_s: float  # a leader takes members for this long (3 × matchmaking_time)
    failure_detection_s: float  # how long the survivors of a round that lost a member wait to know it
    present: Callable[[str, str], bool]  # whether a peer is alive, not frozen, and reachable from another
    partitioned: Callable[[], bool]  # whether a partition is on
    rounds: dict[tuple[int, str, str], SimRound] = field(default_factory=dict)
    member_of: dict[str, SimRound] = field(default_factory=dict)  # peer -> the round it joined last

    def _follows_another(self, leader: str, step: int, sha256: str, now: float) -> bool:
        """Whether `leader` is itself a member of another leader's round at (`step`, `sha256`) that has not
        ended: it looks for no group of its own then (hivemind's averager is a follower, or in an all-reduce)."""
        joined = self.member_of.get(leader)
        return (joined is not None and joined.leader != leader and (joined.step, joined.sha256) == (step, sha256)
                and leader in joined.parts and now < joined.ends)

    def join(self, peer: str, step: int, sha256: str, leader: str, planned: frozenset[str], part: torch.Tensor,
             claim: float, now: float) -> Optional[SimRound]:
        """`peer` asks `leader` to take it into the round at (`step`, `sha256`): the round, or None if the leader
        is not there or its round started already."""
        if leader != peer and (not self.present(leader, peer) or self._follows_another(leader, step, sha256, now)):
            return None
        key = (step, sha256, leader)
        found = self.rounds.get(key)
        if found is not None and found.started is not None and now < found.ends:
            return None  # its round runs: too late to join
        if found is None or found.started is not None:  # none yet, or the last one is over: the leader opens one
            found = self.rounds[key] = SimRound(step, sha256, leader, planned)
        found.parts[peer] = (part, claim)
        self.member_of[peer] = found
        if peer == leader and found.leading is None:
            found.leading = now
        return found

    def leader_absent(self, found: SimRound, asked_at: float, now: float) -> bool:
        """Whether the leader of `found` has not come to lead it a window after a member asked at `asked_at`: the
        member asks the next leader (:mod:`p2p_diloco.sync.membership`: a leader holds a planned member's request
        until it leads, and a member whose leader does not take it within the window moves on)."""
        return found.leading is None and now >= asked_at + self.window_s

    def tick(self, found: SimRound, now: float, duration: float) -> None:
        """Start `found` when its leader leads it and the planned members are in, or the leader's window is over."""
        if found.leading is None:
            return
        if found.started is None and (set(found.planned) <= set(found.parts) or now >= found.leading + self.window_s):
            found.started, found.started_apart = now, self.partitioned()
            if not has_quorum(len(found.parts), len(found.planned)):  # a leader alone, or a minority of its plan,
                # disbands: no tensor moved (protocol.membership.has_quorum)
                found.ends = now
                found.outcome = RoundOutcome(tuple(found.parts), None, now, formed=False)
                return
            found.ends = now + duration

    def outcome(self, found: SimRound, now: float) -> Optional[RoundOutcome]:
        """The round's outcome once it has ended (computed once, at its end), else None."""
        if found.started is None or now < found.ends:
            return None
        if found.outcome is None:
            members = tuple(sorted(found.parts))
            lost = tuple(m for m in members if not all(self.present(m, other) for other in members if other != m))
            if lost:
                found.outcome = RoundOutcome(members, None, found.ends + self.failure_detection_s, lost,
                                             formed_apart=found.started_apart)
            else:
                parts = [found.parts[m][0] for m in members]
                claims = [found.parts[m][1] for m in members]
                found.outcome = RoundOutcome(members, aggregate(parts, claims, self.rule), found.ends,
                                             formed_apart=found.started_apart)
        return found.outcome
