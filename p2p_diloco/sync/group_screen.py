"""Who may average with this peer: the metadata each groupmate gathers, checked before it is used.

Every member of an averaging group announces, through hivemind's all-gather, a small record: the
outer step and state it starts from, the samples its pseudo-gradient holds (its weight in the mean)
and a random token that names this attempt in the round reports (:mod:`p2p_diloco.sync.commit`).
hivemind wraps it in an envelope of its own: ``[bandwidth, averaging mode, our bytes]``.

A stranger can send anything there. :class:`GroupScreen` checks each envelope against a strict
schema. A peer that sends a malformed one (or, in the all-reduce, a malformed tensor part; see
:mod:`p2p_diloco.sync.exact_allreduce`) is banned from this peer's groups for the rest of the run
and logged once: as a leader this peer refuses its join requests, as a follower it does not ask
to join its group, and a group that already holds it is void before any tensor is sent
(:class:`ScreenedMatchmaking` and :meth:`GroupScreen.check_group`).

A private run (``run.allowed_peers``) admits its listed peers alone, in the same three places: the
averager's DHT node names them (:attr:`~p2p_diloco.swarm.node.SwarmDHT.members`), and any other
identity is refused as a follower, not asked as a leader, and voids a group that holds it, before
any tensor is sent; it is logged once per identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import pydantic.v1 as pydantic
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer

from p2p_diloco.remote_input import (
    MAX_COUNT, MAX_TENSORS, OuterStep, Sha256Hex, StrictModel, Token, parse, warn_once,
)


PeerIdText = pydantic.constr(strict=True, regex=r"^[1-9A-HJ-NP-Za-km-z]{32,64}$")  # a base58 libp2p peer ID
MAX_PLANNED_LEADERS = 8


class GroupMetadata(StrictModel):
    """What each groupmate announces for a round."""

    outer_step: OuterStep
    global_sha256: Sha256Hex
    samples: pydantic.conint(strict=True, ge=0, le=MAX_COUNT)  # its weight in the mean (an assistant has none)
    token: Token
    role: Literal["peer", "assistant"]  # an assistant reduces for the others and sends nothing (sync/assistant.py)
    fragment: pydantic.conint(strict=True, ge=0, le=MAX_TENSORS) = 0  # which Streaming DiLoCo fragment is averaged
    # the membership plan this member follows (p2p_diloco.sync.membership): its leaders in order, and how
    # many members it expects; none for an assistant, or when nobody at the step can be dialled
    leaders: pydantic.conlist(PeerIdText, max_items=MAX_PLANNED_LEADERS) = []
    expected: pydantic.conint(strict=True, ge=0, le=MAX_COUNT) = 0
    # the largest group the member's all-reduce lays out before parts go through relays (sync/relay.py); 0: flat
    relay_group: pydantic.conint(strict=True, ge=0, le=MAX_COUNT) = 0


class HivemindEnvelope(StrictModel):
    """hivemind's gathered triple, named."""

    bandwidth: Optional[pydantic.confloat(strict=True, ge=0, allow_inf_nan=False)]
    mode: pydantic.conint(strict=True, ge=min(m.value for m in AveragingMode), le=max(m.value for m in AveragingMode))
    user_data: pydantic.StrictBytes


class MalformedGroupData(ValueError):
    """A groupmate's gathered metadata does not match the schema: the round is void."""


class NotAMember(MalformedGroupData):
    """A group holds a peer that the private run does not list: the round is void."""


class NoReducer(RuntimeError):
    """No member of the group can reduce (all of them are unreachable): the round cannot run."""


@dataclass(frozen=True)
class Member:
    metadata: GroupMetadata
    reduces: bool  # hivemind assigns it parts to reduce: not a client, and a bandwidth other than 0


def parse_gathered(data: bytes) -> tuple[Optional[Member], Optional[str]]:
    """One groupmate's gathered bytes -> (the member, None), or (None, why they are malformed)."""
    try:
        triple = MSGPackSerializer.loads(data)
        if not isinstance(triple, (list, tuple)) or len(triple) != 3:
            return None, "the gathered data is not hivemind's [bandwidth, mode, data] triple"
        envelope, problem = parse(HivemindEnvelope, dict(zip(("bandwidth", "mode", "user_data"), triple)))
        if envelope is None:
            return None, problem
        metadata, problem = parse(GroupMetadata, MSGPackSerializer.loads(envelope.user_data))
        if metadata is None:
            return None, problem
        assistant = envelope.mode == AveragingMode.AUX.value
        if (metadata.role == "assistant") != assistant or (metadata.samples == 0) != assistant:
            return None, (f"role {metadata.role!r} with {metadata.samples} samples in hivemind mode {envelope.mode}: "
                          f"an assistant is an auxiliary member with no samples, a peer a sender with some")
        reduces = envelope.mode != AveragingMode.CLIENT.value and envelope.bandwidth != 0
        return Member(metadata, reduces), None
    except Exception as e:  # not msgpack at all
        return None, f"undecodable gathered data ({type(e).__name__})"


class GroupScreen:
    """The peers this peer refuses to average with, and the checks that put them there.

    Lives in the averager's process (matchmaking and the all-reduce run there). ``members`` holds
    the peer IDs (base58) of a private run, None in a public run: anyone may join who behaves.
    """

    def __init__(self, members: Optional[frozenset[str]] = None):
        self.banned: set[PeerID] = set()
        self.members = members

    def refuses(self, peer_id: PeerID, what: str = "an offer to average") -> bool:
        """Whether `peer_id` may not average with this peer: banned, or not a member of a private run
        (logged once per identity and `what` it asked for)."""
        if peer_id in self.banned:
            return True
        if self.members is not None and peer_id.to_base58() not in self.members:
            warn_once(peer_id.to_base58(), what, "this identity is not in run.allowed_peers")
            return True
        return False

    def ban(self, peer_id: PeerID, what: str, problem: str) -> None:
        """Never average with `peer_id` again: it sent `what`, malformed as `problem` says."""
        self.banned.add(peer_id)
        warn_once(peer_id.to_base58(), what, f"{problem}; not averaging with it again")

    def admits(self, peer_id: PeerID, gathered: bytes) -> bool:
        """Whether a join request from `peer_id` with this gathered data may enter our group."""
        if self.refuses(peer_id):
            return False
        _, problem = parse_gathered(gathered)
        if problem is not None:
            self.ban(peer_id, "malformed group metadata", problem)
            return False
        return True

    def check_group(self, group_info: GroupInfo) -> dict[PeerID, GroupMetadata]:
        """Every member's metadata. Raises NotAMember if a member is refused (:meth:`refuses`),
        MalformedGroupData (and bans the culprits) if any is malformed, and NoReducer if no member can
        reduce: every member would send its parts and nobody take them."""
        refused = [peer_id.to_base58() for peer_id in group_info.peer_ids if self.refuses(peer_id)]
        if refused:
            raise NotAMember(f"the group holds peers this peer does not average with: {', '.join(refused)}")
        members, culprits = {}, []
        for peer_id, gathered in zip(group_info.peer_ids, group_info.gathered):
            members[peer_id], problem = parse_gathered(gathered)
            if problem is not None:
                self.ban(peer_id, "malformed group metadata", problem)
                culprits.append(peer_id.to_base58())
        if culprits:
            raise MalformedGroupData(f"malformed group metadata from {', '.join(culprits)}")
        if not any(member.reduces for member in members.values()):
            raise NoReducer("no member of the group can reduce: every one is unreachable, and no assistant joined")
        return {peer_id: member.metadata for peer_id, member in members.items()}


class ScreenedMatchmaking(Matchmaking):
    """hivemind's matchmaking, which keeps banned and malformed peers, and in a private run every
    identity it does not list, out of this peer's groups.

    hivemind builds it in the averager's process with the averager's DHT node, whose ``members``
    (a :class:`~p2p_diloco.swarm.node.SwarmDHT`'s; None for any other DHT) become the screen's.
    """

    def __init__(self, p2p, schema_hash: bytes, dht, *args, screen: GroupScreen, **kwargs):
        super().__init__(p2p, schema_hash, dht, *args, **kwargs)
        self.screen = screen
        self.screen.members = getattr(dht, "members", None)

    def _screen_refusal(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> Optional[averaging_pb2.MessageFromLeader]:
        """The answer to a join request from a peer the screen does not admit, or None."""
        if not self.screen.admits(context.remote_id, request.gather):
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        return None

    def _check_reasons_to_reject(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> Optional[averaging_pb2.MessageFromLeader]:
        return self._screen_refusal(request, context) or super()._check_reasons_to_reject(request, context)

    async def _request_join_group(self, leader: PeerID) -> Optional[GroupInfo]:
        if self.screen.refuses(leader):
            return None
        return await super()._request_join_group(leader)
