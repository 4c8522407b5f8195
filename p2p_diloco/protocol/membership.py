"""Who averages toward outer step t + 1, and whom they ask to lead, from the records a peer read.

The rule and why it is so are in :mod:`p2p_diloco.sync.membership`, which forms the group with hivemind's
matchmaking; the plan itself is pure: peers that hold the same records compute the same plan.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Collection, Optional

from p2p_diloco.protocol.view import DIRECT, PeerProgress, ready_at

MAX_LEADERS = 3  # leaders a plan names, in order: a dead first leader costs one window, two cost two


@dataclass(frozen=True)
class Membership:
    """Who averages toward outer step t + 1, as this peer plans it from the progress records."""

    leaders: tuple[str, ...]  # peer IDs (base58), in the order members ask them
    members: tuple[str, ...]  # the ready peers at the step and state, this one included, sorted: whom a leader waits for
    # the members others can dial, sorted: those whose silence in the round says they left or crashed
    dialable: tuple[str, ...] = ()

    @property
    def expected(self) -> int:
        return len(self.members)

    def as_gathered(self) -> dict:
        """What travels in the gathered metadata: the leaders and the count, not the members (a leader keeps
        its own list, :meth:`~p2p_diloco.sync.exact_allreduce.ExactMeanAverager.plan_members`)."""
        return dict(leaders=list(self.leaders), expected=self.expected)


def leader_rank(outer_step: int, global_sha256: str, peer_id: str, attempt: int = 1) -> bytes:
    """A peer's place in the order of leaders of the round from the θ_global `global_sha256` at `outer_step`,
    in this peer's `attempt`-th attempt at that step: every peer computes the same order from the same
    peers, and it changes every step and every attempt, so no one peer leads every round. θ_global is
    known only once the step before is committed, so an identity cannot be ground in advance to come
    first in every round. Without the attempt, a step whose rounds kept failing had the same leader in
    every one of them: a leader that took in a peer that a member had banned formed a group that member
    refused, every round, and the swarm never left the step (the hostile-reducer test, 2 runs in 5)."""
    return hashlib.sha256(f"{outer_step}:{global_sha256}:{attempt}:{peer_id}".encode()).digest()


def plan_membership(records: dict[str, PeerProgress], outer_step: int, global_sha256: str, peer_id: str,
                    reachability: str, attempt: int = 1, among: Optional[Collection[str]] = None) -> Optional[Membership]:
    """The membership of the round toward `outer_step + 1` for this peer (`peer_id`, which holds the
    θ_global `global_sha256` and is ready) in its `attempt`-th attempt at the step: the peers whose records
    say ready at the step with the same state, and the first :data:`MAX_LEADERS` of them that others can
    dial, in :func:`leader_rank` order.

    A round that is already forming comes first: when ready records at the step and state name the leader their
    authors ask (:attr:`~p2p_diloco.protocol.view.PeerProgress.leader`), the leader most of them name (ties: the
    :func:`leader_rank` order) is this peer's first, if it is a dialable member of the plan itself; the rank
    order follows. A peer that became ready later than the first planners (a joiner that loaded the step, a peer
    that waited longer for it) otherwise ranked a new first leader among more peers and formed a second group
    beside the first at the same step: two states at one step (the simulation, 16 peers, seed 8).

    `among`: a retry plans among the members of the attempt that failed (those whose records still stand):
    a peer that became ready at the step meanwhile was not in that round, so the retry neither waits for it
    nor asks it to lead (in a churn check a retry's planned leader was such a joiner, which found no group).

    None when none of them can be dialled: then only an assistant can reduce, and it finds the group
    through hivemind's matchmaking."""
    ready = ready_at(records, outer_step, global_sha256)
    members = {pid: r.reachability for pid, r in ready.items() if among is None or pid in among}
    members[peer_id] = reachability
    dialable = sorted(pid for pid, mode in members.items() if mode == DIRECT)
    leaders = sorted(dialable, key=lambda pid: leader_rank(outer_step, global_sha256, pid, attempt))
    if among is None:
        asked = Counter(r.leader for pid, r in ready.items() if r.leader in dialable)
        if asked:
            forming = max(leaders, key=lambda pid: asked[pid])  # max keeps the first of equals: the rank order
            leaders = [forming] + [pid for pid in leaders if pid != forming]
    leaders = leaders[:MAX_LEADERS]
    if not leaders:
        return None
    return Membership(tuple(leaders), tuple(sorted(members)), tuple(dialable))


def quorum_of(planned: Collection[str], records: dict[str, PeerProgress], outer_step: int,
              global_sha256: str) -> frozenset[str]:
    """The peers a group at `outer_step` from `global_sha256` must hold more than half of (:func:`has_quorum`): the
    members of the leader's plan and every peer its records, read again while the group forms, show ready at the
    step from that state. A plan made from records read before the others were (a partition that healed while the
    leader waited for its first leader's window) held 5 of the 15 peers ready at the step: 3 of them formed a group,
    and the 9 others a second one at the same step (the simulation, 16 peers, seeds 73 and 78)."""
    return frozenset(planned) | frozenset(ready_at(records, outer_step, global_sha256))


def has_quorum(came: int, planned: int, min_group_size: int = 2) -> bool:
    """Whether a leader runs the round with the `came` peers it holds (itself included) once its windows are over:
    at least ``min_group_size``, and more than half of the `planned` members of its plan (and of the peers read
    ready at the step since, :func:`quorum_of`), so that no two groups of one plan commit at one step. Two halves of a plan that each met a leader of its own (members that failed over
    from an absent or frozen leader ask the next leader of their own plan) each committed a state at the step: 4
    one-state events in 200 seeds of 4 peers, 8 in 100 of 16 (the simulation); a minority group disbands and its
    members ask the next leader, or try the step again at their next round."""
    return came >= min_group_size and 2 * came > planned
