"""One membership per outer step: every peer ready at step t averages in the same group.

hivemind's matchmaking elects leaders by the expiration each averager declares on the DHT: a
follower asks the potential leaders that expire before it, and a leader runs the all-reduce with
whoever joined within ``matchmaking_time``. With many peers not all of them meet in time, and one
step was averaged by 2-3 groups at once (16 peers: 10 + 4 + 2, 11 + 3 + 2, ...), each with its own
mean; the peers outside the largest group then downloaded its state and lost their inner steps.

Here the membership comes from the progress records every peer reads anyway
(:mod:`p2p_diloco.swarm.progress`), the way torchft forms a quorum from a shared view instead of an
election. Once no peer at the step is still training (``round_wait_timeout``), each peer computes
:func:`~p2p_diloco.protocol.membership.plan_membership`: the ready peers at its step and state, and from those that others can dial, an
order of leaders that changes every step and attempt (sha256 of the step, θ_global, the attempt
and the peer ID). Every member
asks the first leader of that order to take it in (:class:`PlannedMatchmaking`); the leader starts the
all-reduce as soon as every member of its own plan has joined, or with whoever came once no member of
its plan has joined for a window (3 × ``matchmaking_time``), and after two windows at most: members
that read a groupmate's record later than the leader did come seconds later, and a fixed window of the
leader's left 3 of 16 out of a step in a benchmark run. A peer it did not plan (one that arrived at the
step after the leader read the records, or a stranger that copies the plan) is taken in if it comes
before the group starts, but fills no member's place: when a late joiner counted like a member, it took
the place of a planned member that joined a moment later (a NAT test in CI), and that member lost the
step. A member whose leader does not take it within the window asks the next leader of the order, and
so does the next leader itself: a leader that died costs one window, not the step, and one that takes
members in and never starts costs them three. A peer that misses the group keeps its inner steps for
the next step, as before.

The leader puts the group in the plan's order too (:func:`group_order`; hivemind's leader shuffles it at
random): the order of the senders in each reducer's aggregate and of the reducers' shares. So the
same members averaging the same pseudo-gradients get the same bytes whoever leads, and whatever route
the parts take (:mod:`p2p_diloco.sync.relay`).

Peers that hold the same records compute the same plan, so they meet in one group. Two views that
differ name the same first leader unless they differ in that leader itself; then the step may split
as before, which the commit protocol (:mod:`p2p_diloco.sync.commit`) and the state check keep safe.

The plan travels in each member's gathered metadata (``leaders``, ``expected``:
:class:`~p2p_diloco.sync.group_screen.GroupMetadata`), checked like the rest of it. Metadata without
a plan (an assistant's, or a round in which nobody can be dialled) goes through hivemind's own
matchmaking, and a planned leader declares itself on the DHT so that those still find it.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Optional

from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.dht.routing import DHTID
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time

import p2p_diloco.faults as faults
from p2p_diloco.protocol.membership import has_quorum, leader_rank
from p2p_diloco.sync.group_screen import GroupMetadata, ScreenedMatchmaking, parse_gathered

WINDOW_MATCHMAKING_TIMES = 3  # a window, in matchmaking_time: time for every member to join
LEAD_WINDOWS = 2  # a leader takes members for at most this many windows (its members wait three for it)
RETRY_S = 0.5  # between two join requests to a leader that is not taking members yet
HOLD_S = RETRY_S  # how long a leader that is not leading yet holds a planned member's request, at most


def group_order(outer_step: int, global_sha256: str, peer_ids) -> list:
    """The members of a planned round (PeerIDs) in the group's order: by sha256 of the step, θ_global
    and the peer ID (:func:`leader_rank` of an attempt 0, which no leader order uses), as unpredictable
    before step t − 1 is committed as hivemind's random order, and the same whoever leads."""
    return sorted(peer_ids, key=lambda peer: leader_rank(outer_step, global_sha256, peer.to_base58(), attempt=0))


@functools.lru_cache(maxsize=1024)
def planned_metadata(gathered: bytes) -> Optional[GroupMetadata]:
    """The metadata in a member's gathered bytes if they are well-formed and hold a membership plan, else None.

    Cached: the same bytes are asked for on every join request (this peer's own plan) and on every poll
    of a leader's window (each follower's). The metadata is frozen (StrictModel) and never changed."""
    member, _ = parse_gathered(gathered)
    return member.metadata if member is not None and member.metadata.leaders else None


class PlannedMatchmaking(ScreenedMatchmaking):
    """hivemind's matchmaking, which forms a round's group by its membership plan when the round's
    gathered metadata holds one (see the module's docstring), and as hivemind does otherwise.

    A planned member neither declares itself on the DHT nor leads a group unless the plan's earlier
    leaders failed it; a planned leader takes join requests for its window only, whatever expiration
    the requester declared (the plan, not the expiration, decides who leads)."""

    def __init__(self, *args, **kwargs):
        self.join_window_end: Optional[float] = None  # loop time: the end of the window to join the leader asked now
        super().__init__(*args, **kwargs)
        self.began_leading = asyncio.Event()  # set while this peer leads a planned group
        # (the token of a round, its planned members): set by the averager before the round's step
        self.planned_members: tuple[str, frozenset[str]] = ("", frozenset())
        self.follow_until: Optional[float] = None  # DHT time until which this member waits for the leader it joined

    @property
    def leading(self) -> bool:
        """Whether this peer leads a planned group now (:meth:`_lead`)."""
        return self.began_leading.is_set()

    def _plan(self) -> Optional[GroupMetadata]:
        """This peer's own metadata for the round being matched, if it holds a membership plan."""
        return None if self.step_control is None else planned_metadata(self.step_control.data_for_gather)

    @property
    def window_s(self) -> float:
        return WINDOW_MATCHMAKING_TIMES * self.min_matchmaking_time

    @property
    def request_timeout(self) -> float:
        """How long hivemind's follower waits for a leader's first answer to a join request: the configured
        ``request_timeout``, but while this peer asks a planned leader, until the window to join it ends.

        A follower that stops waiting closes its request, and the leader learns it only when it reads the
        close; an answer it had sent meanwhile took the follower in. A member whose event loop stalled
        past ``request_timeout`` (a loaded CPU) gave up on a leader that had taken it in, and the leader
        began the round with it: the group waited for its parts until the all-reduce timed out, and the
        member asked the leaders again in vain ("could not find a group": CI runs with
        ``swarm.match_ahead`` on, and 1 of 255 benchmark rounds at 1000 Mbit/s with a profiler attached).
        A planned leader answers or refuses at once, or is gone, so waiting out the window costs at most
        what asking it again until then did."""
        if self.join_window_end is None:
            return self._request_timeout
        return max(self._request_timeout, self.join_window_end - asyncio.get_event_loop().time())

    @request_timeout.setter
    def request_timeout(self, seconds: float) -> None:
        self._request_timeout = seconds

    async def _request_join_potential_leaders(self, step: StepControl) -> GroupInfo:
        plan = self._plan()
        if plan is None:
            return await super()._request_join_potential_leaders(step)
        me = self.peer_id.to_base58()
        loop = asyncio.get_event_loop()
        for leader in plan.leaders:
            if leader == me:
                group = await self._lead(plan)
            else:
                group = await self._join(PeerID.from_base58(leader), loop.time() + self.window_s)
            if group is not None:
                return group
        return await self._give_up()

    async def _join(self, leader: PeerID, window_end: float) -> Optional[GroupInfo]:
        """Ask `leader` to take this peer in until it does or its window ends (it may not be matching yet).
        Once taken in, wait for the all-reduce to begin until two more windows have passed (the leader may
        have begun its window later): a leader that takes members and never begins costs them three
        windows, not the round."""
        loop = asyncio.get_event_loop()
        self.follow_until = get_dht_time() + window_end - loop.time() + 2 * self.window_s
        self.join_window_end = window_end
        try:
            while loop.time() < window_end and not self.assembled_group.done():
                group = await self._request_join_group(leader)
                if group is not None:
                    return group
                if self.screen.refuses(leader):
                    return None
                await asyncio.sleep(RETRY_S)
            return self.assembled_group.result() if self.assembled_group.done() else None
        finally:
            self.join_window_end = None

    async def _lead(self, plan: GroupMetadata) -> Optional[GroupInfo]:
        """Take members until every one the plan names has joined, or none has joined for a window (since
        the last one did, or since this peer began to lead), or :data:`LEAD_WINDOWS` windows have passed;
        then run with whoever came if they are more than half of the plan (:func:`has_quorum`), or disband,
        and its members ask the next leader. A member that joined waits
        three windows from its first request (:meth:`_join`), so it never gives up before this leader has
        decided."""
        loop = asyncio.get_event_loop()
        key = self.group_key_manager.current_key
        began = loop.time()
        end = began + LEAD_WINDOWS * self.window_s
        expiration = get_dht_time() + LEAD_WINDOWS * self.window_s
        leaders = self.potential_leaders
        # hivemind's rpc_join_group keeps each follower until this expiration, then runs with what it has
        leaders.declared_group_key, leaders.declared_expiration_time = key, expiration
        self.began_leading.set()
        try:
            # declared on the DHT too, for members without a plan (an assistant) to find this leader
            await self.group_key_manager.declare_averager(key, self.peer_id, expiration_time=expiration)
            joined, last_joined = 0, began
            while loop.time() < min(end, last_joined + self.window_s) and not self.assembled_group.done():
                planned = self._planned_followers(plan)
                if planned > joined:
                    joined, last_joined = planned, loop.time()
                if joined + 1 >= max(self._quorum_size(plan), self.min_group_size):
                    async with self.lock_request_join_group:
                        if not self.assembled_group.done():
                            return await self.leader_assemble_group()
                await asyncio.sleep(0.1)
            async with self.lock_request_join_group:
                if self.assembled_group.done():
                    return self.assembled_group.result()
                if has_quorum(len(self.current_followers) + 1, self._quorum_size(plan), self.min_group_size):
                    return await self.leader_assemble_group()
                await self.leader_disband_group()
                return None
        finally:
            self.began_leading.clear()
            leaders.declared_group_key, leaders.declared_expiration_time = None, float("inf")
            await self.group_key_manager.declare_averager(key, self.peer_id, expiration, looking_for_group=False)

    async def leader_assemble_group(self) -> GroupInfo:
        """hivemind's, with the members in :func:`group_order` when this round has a plan (hivemind's order
        is random)."""
        plan = self._plan()
        if plan is None:
            return await super().leader_assemble_group()
        assert not self.assembled_group.done()
        members = group_order(plan.outer_step, plan.global_sha256, [*self.current_followers, self.peer_id])
        gathered = tuple(self.step_control.data_for_gather if peer == self.peer_id else self.current_followers[peer].gather
                         for peer in members)
        group_info = GroupInfo(DHTID.generate().to_bytes(), tuple(members), gathered)
        await self.group_key_manager.update_key_on_group_assembled(group_info)
        self.assembled_group.set_result(group_info)
        return group_info

    def _quorum_size(self, plan: GroupMetadata) -> int:
        """How many peers this leader's group is planned for: its plan's members, and the peers the training
        process read ready at the step since (:func:`~p2p_diloco.protocol.membership.quorum_of`, handed over with
        the members by :meth:`~p2p_diloco.sync.exact_allreduce.ExactMeanAverager.plan_members`)."""
        token, members = self.planned_members
        return max(plan.expected, len(members)) if token == plan.token else plan.expected

    def _planned_followers(self, plan: GroupMetadata) -> int:
        """Followers that this peer's plan names: others may join too, but fill no member's place. None
        counts when the averager holds no member list for this round (the leader then waits out its
        window and runs with whoever came)."""
        token, members = self.planned_members
        if token != plan.token:
            return 0
        return sum(peer.to_base58() in members for peer in self.current_followers)

    async def _give_up(self) -> Optional[GroupInfo]:
        """No leader of the plan took this peer in: end the matchmaking now with no group (it keeps its
        inner steps), not at the step's deadline."""
        async with self.lock_request_join_group:
            if self.assembled_group.done():
                return self.assembled_group.result()
            self.assembled_group.set_result(None)
        return None

    def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext):
        """hivemind's; a request from a planned member that names this peer a leader of its round, while
        this peer does not lead yet, is held until it does, for :attr:`hold_s` at most (then hivemind's
        answers, and refuses it if it still does not lead); a fault test pauses this leader's acceptances
        (:mod:`p2p_diloco.faults`).

        Peers begin a round's matchmaking moments apart, and a member whose leader had not begun was
        refused and asked again :data:`RETRY_S` later: 0.5 s of a third of the rounds' matchmaking in the
        all-reduce benchmark, whose peers all begin at one instant. The hold answers as soon as the
        leader begins."""
        answers = super().rpc_join_group(request, context)
        if not self.leading and self._names_me_leader(request):
            answers = self._after_leading_begins(answers)
        if faults.join_answer_pause_s():
            answers = self._rpc_join_group_paused(answers)
        return answers

    def _names_me_leader(self, request: averaging_pb2.JoinRequest) -> bool:
        plan = planned_metadata(request.gather)
        return plan is not None and self.peer_id.to_base58() in plan.leaders

    @property
    def hold_s(self) -> float:
        """:data:`HOLD_S`, or half of ``request_timeout`` where that is shorter: a member waits at least
        ``request_timeout`` for its answer (the run's peers share it), and one that gave up on an answer
        that then took it in would leave a group that counts it."""
        return min(HOLD_S, self._request_timeout / 2)

    async def _after_leading_begins(self, answers):
        try:
            try:
                await asyncio.wait_for(self.began_leading.wait(), self.hold_s)
            except asyncio.TimeoutError:
                pass  # hivemind's handler refuses it: this peer does not lead (yet)
            async for message in answers:
                yield message
        finally:
            await answers.aclose()

    @staticmethod
    async def _rpc_join_group_paused(answers):
        try:
            async for message in answers:
                if message.code == averaging_pb2.ACCEPTED:
                    await asyncio.sleep(faults.join_answer_pause_s())
                yield message
        finally:
            await answers.aclose()

    def get_request_expiration_time(self) -> float:
        if self._plan() is not None and self.follow_until is not None:
            return self.follow_until  # a planned leader ignores it; hivemind's follower waits for the leader until it
        return super().get_request_expiration_time()

    def _check_reasons_to_reject(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> Optional[averaging_pb2.MessageFromLeader]:
        refusal = self._screen_refusal(request, context)
        if refusal is not None or self._plan() is None:
            return refusal or super()._check_reasons_to_reject(request, context)
        code = None
        if not self.leading or self.assembled_group.done():
            if self.current_leader is not None:
                return averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_A_LEADER,
                                                       suggested_leader=self.current_leader.to_bytes())
            code = averaging_pb2.NOT_LOOKING_FOR_GROUP
        elif request.schema_hash != self.schema_hash:
            code = averaging_pb2.BAD_SCHEMA_HASH
        elif request.group_key != self.group_key_manager.current_key:
            code = averaging_pb2.BAD_GROUP_KEY
        elif context.remote_id == self.peer_id or context.remote_id in self.current_followers:
            code = averaging_pb2.DUPLICATE_PEER_ID
        return None if code is None else averaging_pb2.MessageFromLeader(code=code)
