"""Groups for size: the all-reduce of a large group travels through relays, and stays exact.

A butterfly all-reduce among N members has every member send a part to every other: N − 1
connections per peer, each a dial (often a NAT traversal) before any byte moves, which dominates a
round past a few dozen members (docs/benchmarks.md, the simulation). The usual cure, a two-tier
average (groups reduce, then the group results are combined: HALoS, DiLoCoX, Moshpit), gives a mean
that depends on the grouping, and none at all for a robust rule: a median or CenteredClip of group
results is not the median of the senders.

So the reduction itself stays flat, and only the route changes. Members in the group's order are laid
out in a grid of k = ⌈N / G⌉ rows (*groups*) and G columns: member i sits in group i mod k, column
i div k, so groups differ in size by one at most. A sender S talks directly to the members of its own
group and of its own column; a part for a reducer R elsewhere goes through the *relay* T in S's group
and R's column (or, where S's group has nobody in that column, the member in R's group and S's
column). T forwards S's stream to R untouched, the encoded bytes and R's averaged parts back, so R
reduces all N senders' parts of its share exactly as in a flat round, in the same sender order, with
the same rule: every peer gets the bytes one flat round among the same members in the same order
would give. Each peer dials at most (G − 1) + (k − 1) others (plus a fallback where a column is
short), against N − 1; the price is the relayed share of the parts, which crosses two links:
at most about twice a butterfly's bytes (measured in docs/benchmarks.md).

G is the smallest ``relay_group`` among the members' gathered metadata (``swarm.relay_group_size``;
0 in any member's means a flat round): any value gives the same result, so a member can choose only
how many dials the round takes. A relay is a member that others can dial (one that reduces); a relay
that tampers with what it forwards is caught like a reducer and a sender that disagree: the digests
of the round reports differ and the round is void (:mod:`p2p_diloco.sync.audit`), but nobody is
banned for it, since the relay, the sender and the reducer each could have lied
(:func:`p2p_diloco.sync.commit.judge`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from hivemind.p2p import PeerID


def relay_group_size(requested: Iterable[int]) -> int:
    """The G of a round from what each member (of role "peer") gathered: the smallest, or 0 (a flat round)
    if any member asked for none."""
    sizes = list(requested)
    return 0 if not sizes or 0 in sizes else min(sizes)


@dataclass(frozen=True)
class RelayLayout:
    """Which member relays each sender's parts to each reducer in a group laid out in groups of at most
    `group_size` (see the module's docstring); `can_relay` says for each member, in the group's order,
    whether others can dial it. A `group_size` of 0, or one at least the group's size, is a flat round."""

    peer_ids: tuple[PeerID, ...]
    can_relay: tuple[bool, ...]
    group_size: int

    def __post_init__(self):
        if len(self.peer_ids) != len(self.can_relay):
            raise ValueError(f"{len(self.peer_ids)} members with {len(self.can_relay)} relay flags")
        if self.group_size < 0:
            raise ValueError(f"group size {self.group_size}: 0 (flat) or more")
        object.__setattr__(self, "_index", {peer_id: i for i, peer_id in enumerate(self.peer_ids)})

    @property
    def flat(self) -> bool:
        return self.group_size == 0 or self.group_size >= len(self.peer_ids)

    @property
    def groups(self) -> int:
        """k, the number of groups (rows) of the grid."""
        return 1 if self.flat else math.ceil(len(self.peer_ids) / self.group_size)

    def cell(self, peer_id: PeerID) -> tuple[int, int]:
        """(group, column) of a member."""
        index = self._index[peer_id]
        return index % self.groups, index // self.groups

    def member_at(self, group: int, column: int) -> Optional[PeerID]:
        index = column * self.groups + group
        return self.peer_ids[index] if index < len(self.peer_ids) else None

    def relay(self, sender: PeerID, reducer: PeerID) -> Optional[PeerID]:
        """The member that forwards `sender`'s parts to `reducer`, or None when the sender sends directly
        (a flat round, the same group or column, or no member that could relay between them)."""
        if self.flat:
            return None
        (sender_group, sender_column), (reducer_group, reducer_column) = self.cell(sender), self.cell(reducer)
        if sender_group == reducer_group or sender_column == reducer_column:
            return None
        for candidate in (self.member_at(sender_group, reducer_column), self.member_at(reducer_group, sender_column)):
            if candidate is not None and self.can_relay[self._index[candidate]]:
                return candidate
        return None

    def first_hop(self, sender: PeerID, reducer: PeerID) -> PeerID:
        """Whom `sender` dials to reach `reducer`: its relay, or the reducer itself."""
        return self.relay(sender, reducer) or reducer

    def dialled_by(self, peer_id: PeerID, reducers: Sequence[PeerID]) -> set[PeerID]:
        """The members `peer_id` opens streams to in a round whose reducers are `reducers`: as a sender
        (its first hops) and as a relay (the reducers it forwards to)."""
        dialled = {self.first_hop(peer_id, reducer) for reducer in reducers}
        group, column = self.cell(peer_id)
        # a relay shares its group with the sender (or, as the fallback, its column)
        senders = [s for s in self.peer_ids if s != peer_id and (self.cell(s)[0] == group or self.cell(s)[1] == column)]
        dialled |= {reducer for sender in senders for reducer in reducers if self.relay(sender, reducer) == peer_id}
        return dialled - {peer_id}
