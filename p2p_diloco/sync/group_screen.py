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
"""

from __future__ import annotations

from typing import Optional

import pydantic.v1 as pydantic
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer

from p2p_diloco.remote_input import (
    MAX_COUNT, OuterStep, Sha256Hex, StrictModel, Token, parse, warn_once,
)


class GroupMetadata(StrictModel):
    """What each groupmate announces for a round."""

    outer_step: OuterStep
    global_sha256: Sha256Hex
    samples: pydantic.conint(strict=True, ge=1, le=MAX_COUNT)  # its weight in the mean
    token: Token


class HivemindEnvelope(StrictModel):
    """hivemind's gathered triple, named."""

    bandwidth: Optional[pydantic.confloat(strict=True, ge=0, allow_inf_nan=False)]
    mode: pydantic.conint(strict=True, ge=min(m.value for m in AveragingMode), le=max(m.value for m in AveragingMode))
    user_data: pydantic.StrictBytes


class MalformedGroupData(ValueError):
    """A groupmate's gathered metadata does not match the schema: the round is void."""


def parse_gathered(data: bytes) -> tuple[Optional[GroupMetadata], Optional[str]]:
    """One groupmate's gathered bytes -> (its metadata, None), or (None, why they are malformed)."""
    try:
        triple = MSGPackSerializer.loads(data)
        if not isinstance(triple, (list, tuple)) or len(triple) != 3:
            return None, "the gathered data is not hivemind's [bandwidth, mode, data] triple"
        envelope, problem = parse(HivemindEnvelope, dict(zip(("bandwidth", "mode", "user_data"), triple)))
        if envelope is None:
            return None, problem
        return parse(GroupMetadata, MSGPackSerializer.loads(envelope.user_data))
    except Exception as e:  # not msgpack at all
        return None, f"undecodable gathered data ({type(e).__name__})"


class GroupScreen:
    """The peers this peer refuses to average with, and the checks that put them there.

    Lives in the averager's process (matchmaking and the all-reduce run there).
    """

    def __init__(self):
        self.banned: set[PeerID] = set()

    def ban(self, peer_id: PeerID, what: str, problem: str) -> None:
        """Never average with `peer_id` again: it sent `what`, malformed as `problem` says."""
        self.banned.add(peer_id)
        warn_once(peer_id.to_base58(), what, f"{problem}; not averaging with it again")

    def admits(self, peer_id: PeerID, gathered: bytes) -> bool:
        """Whether a join request from `peer_id` with this gathered data may enter our group."""
        if peer_id in self.banned:
            return False
        _, problem = parse_gathered(gathered)
        if problem is not None:
            self.ban(peer_id, "malformed group metadata", problem)
            return False
        return True

    def check_group(self, group_info: GroupInfo) -> dict[PeerID, GroupMetadata]:
        """Every member's metadata; raises MalformedGroupData (and bans the culprits) if any is malformed."""
        metadata, culprits = {}, []
        for peer_id, gathered in zip(group_info.peer_ids, group_info.gathered):
            parsed, problem = parse_gathered(gathered)
            if parsed is None:
                self.ban(peer_id, "malformed group metadata", problem)
                culprits.append(peer_id.to_base58())
            metadata[peer_id] = parsed
        if culprits:
            raise MalformedGroupData(f"malformed group metadata from {', '.join(culprits)}")
        return metadata


class ScreenedMatchmaking(Matchmaking):
    """hivemind's matchmaking, which keeps banned and malformed peers out of this peer's groups."""

    def __init__(self, *args, screen: GroupScreen, **kwargs):
        super().__init__(*args, **kwargs)
        self.screen = screen

    def _check_reasons_to_reject(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> Optional[averaging_pb2.MessageFromLeader]:
        if not self.screen.admits(context.remote_id, request.gather):
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        return super()._check_reasons_to_reject(request, context)

    async def _request_join_group(self, leader: PeerID) -> Optional[GroupInfo]:
        if leader in self.screen.banned:
            return None
        return await super()._request_join_group(leader)
