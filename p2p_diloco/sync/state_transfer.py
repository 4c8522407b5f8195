"""Global state transfer: what a joiner downloads, and the checks before it is used.

The state is θ_global and the outer momentum (fp32), with metadata: the outer step, the sha256 of
both (the state hash every peer publishes) and the inner step count (a joiner aligns its lr schedule
to it). It is served through hivemind's ``rpc_download_state`` and downloaded from the donor with
the highest declared priority that answers. A peer downloads exactly the state that the swarm's
progress records vouch for (an outer step and its sha256, see :func:`p2p_diloco.protocol.plans.plan_round`):
a donor cannot hand it any other state, however well-formed.

A donor may be a stranger, so hivemind's download loop is replaced (:class:`StateSharing`) where it
trusted the donor:

* each donor's state is checked in full before it is accepted (:func:`state_problem`): metadata
  types and ranges, the number, dtype, shape and finiteness of every tensor, the sha256 the donor
  announced, and that it is the state asked for. A bad state is logged with the donor's peer ID and
  the next donor is tried in the same attempt;
* a donor that may send more bytes than the state can hold is cut off;
* a peer that nobody can dial serves no state, so it may push its state to the run's keeper instead
  (:meth:`StateSharing.push_state`, over a connection it opens itself): the keeper keeps the last state
  pushed, checked for form only, and takes it (:meth:`StateSharing.take_pushed_state`) only when it is
  the state its own plan asks for, through the same checks as a download;
* the caller learns who served the state and which donors failed and why (:class:`DonorFailure`):
  a donor that served a malformed state is skipped for the rest of the run, and donors that served
  a sound state other than the one asked for are evidence that nobody serves the state the swarm's
  records claim (:meth:`p2p_diloco.swarm.progress.SwarmProgress.set_aside`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import CompressionInfo, deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import as_aiter
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming
from hivemind.utils.timed_storage import ValueWithExpiration

import p2p_diloco.faults as faults
from p2p_diloco.hashing import tensors_sha256
from p2p_diloco.remote_input import Count, OuterStep, Sha256Hex, StrictModel, parse, tensor_problem, warn_once
from p2p_diloco.traffic import traffic_of

logger = logging.getLogger(__name__)

FRAMING_ALLOWANCE_BYTES = 1 << 20  # protobuf and serialization headers on top of the raw fp32 bytes


def donors_key(prefix: str) -> str:
    """The DHT key under which hivemind's averagers of `prefix` declare that they serve their state."""
    return f"{prefix}.all_averagers"


class StateMetadata(StrictModel):
    outer_step: OuterStep
    sha256: Sha256Hex
    inner_steps: Count


@dataclass
class GlobalState:
    outer_step: int
    sha256: str
    inner_steps: int
    tensors: list[torch.Tensor]  # θ_global then the outer momentum
    donor: str  # peer ID of the peer that served it


TRANSFER_FAILED, MALFORMED, OTHER_STATE = "transfer failed", "malformed", "other state"


class MalformedStateError(ValueError):
    """A donor's stream is not a state in any reading (too many bytes, metadata twice)."""


@dataclass(frozen=True)
class DonorFailure:
    # TRANSFER_FAILED (the stream broke, ended early or timed out), MALFORMED, or OTHER_STATE (sound, but not
    # the state asked for)
    kind: str
    detail: str
    outer_step: Optional[int] = None  # for OTHER_STATE: the step of the state the donor holds

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


@dataclass
class DownloadOutcome:
    state: Optional[GlobalState]  # None: no donor served a usable state
    failed_donors: dict[str, DonorFailure] = field(default_factory=dict)  # peer ID -> why its state was not used


@dataclass(frozen=True)
class StateExpectation:
    """What a downloaded state must be: its tensors' shapes (θ_global, then as many for the momentum),
    its outer step and its sha256."""

    param_shapes: tuple[tuple[int, ...], ...]
    outer_step: int
    sha256: str

    @property
    def max_bytes(self) -> int:
        return 2 * 4 * sum(int(torch.Size(s).numel()) for s in self.param_shapes) + FRAMING_ALLOWANCE_BYTES


def state_problem(metadata: Any, tensors: Sequence[Any], expected: StateExpectation) -> Optional[DonorFailure]:
    """None if a downloaded state may be used; else why not."""
    meta, problem = parse(StateMetadata, metadata)
    if meta is None:
        return DonorFailure(MALFORMED, f"metadata {problem}")
    shapes = expected.param_shapes
    if len(tensors) != 2 * len(shapes):
        return DonorFailure(MALFORMED, f"{len(tensors)} tensors where {2 * len(shapes)} were expected")
    for index, (tensor, shape) in enumerate(zip(tensors, (*shapes, *shapes))):
        kind = "parameter" if index < len(shapes) else "momentum"
        problem = tensor_problem(tensor, shape, f"{kind} tensor {index % len(shapes)}")
        if problem is not None:
            return DonorFailure(MALFORMED, problem)
    actual = tensors_sha256(tensors)
    if actual != meta.sha256:
        return DonorFailure(MALFORMED, "the tensors do not match the sha256 their sender announced")
    if (meta.outer_step, actual) != (expected.outer_step, expected.sha256):
        return DonorFailure(OTHER_STATE, f"its state is outer step {meta.outer_step} ({actual[:12]}), not the one "
                                         f"asked for: outer step {expected.outer_step} ({expected.sha256[:12]})",
                            meta.outer_step)
    return None


class StateSharing(DecentralizedAverager):
    """Serves this peer's global state to joiners and downloads, checked, the state of others.

    ``state_provider`` (called in the host process when a peer downloads our state) returns
    ``(metadata, tensors)``; it replaces hivemind's default of serving the averaged tensors. It is
    mixed into an averager with a group screen (``self.screen``,
    :class:`~p2p_diloco.sync.group_screen.GroupScreen`), which decides whom the state is refused to.
    """

    def __init__(self, *args, state_provider: Callable[[], tuple[dict, list[torch.Tensor]]],
                 takes_pushed_states: bool = False, **kwargs):
        self._state_provider = state_provider
        # the run's keeper takes states that unreachable peers push to it (:meth:`push_state`): nobody can dial
        # them to download one. The last one pushed, checked for form alone, waits in the averager process
        self.takes_pushed_states = takes_pushed_states
        self._pushed: Optional[tuple[str, Any, list[torch.Tensor]]] = None
        super().__init__(*args, **kwargs)

    def get_current_state(self):
        metadata, tensors = self._state_provider()
        return metadata, tensors, None

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """hivemind's, except that a peer this averager refuses to average with (its group screen: banned,
        or not listed in a private run's run.allowed_peers) gets nothing: an empty stream, which its
        download reads as a failed donor."""
        if self.screen.refuses(context.remote_id, "the global state"):
            return
        first = True
        async for message in super().rpc_download_state(request, context):
            traffic_of(self.dht).add(sent=message.ByteSize(), phase="state")
            yield message
            if first:
                first = False
                await asyncio.sleep(faults.serve_state_pause_s())  # 0 unless a fault test asks for a pause

    def download_state(
        self, expected: StateExpectation, exclude: set[str], timeout: float, should_stop: Callable[[], bool]
    ) -> Optional[DownloadOutcome]:
        """A checked state from the best donor not in `exclude`; None if the download did not end in time."""
        future = MPFuture()
        request = dict(future=future, expected=expected, exclude=set(exclude))
        self._outer_pipe.send(("_load_state_from_peers", [], request))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not should_stop():
            try:
                donor, metadata, tensors, failures = future.result(timeout=0.5)
            except concurrent.futures.TimeoutError:
                continue
            if donor is None:
                return DownloadOutcome(None, failures)
            state = GlobalState(metadata["outer_step"], metadata["sha256"], metadata["inner_steps"], list(tensors),
                                donor)
            return DownloadOutcome(state, failures)
        future.cancel()
        return None

    async def _load_state_from_peers(self, future: MPFuture, *, expected: StateExpectation, exclude: set[str]):
        """hivemind's download loop (averager process), with each donor's state checked before it is
        accepted, a bound on its size, and the donors that failed reported back."""
        failures: dict[str, DonorFailure] = {}
        try:
            chunk_timeout = self.next_chunk_timeout if self.next_chunk_timeout is not None else self.request_timeout
            for donor in self._donors_by_priority(exclude):
                try:
                    metadata, tensors = await self._download_from(donor, chunk_timeout, expected)
                except MalformedStateError as e:
                    failures[donor.to_base58()] = DonorFailure(MALFORMED, str(e))
                    warn_once(donor.to_base58(), "a downloaded state", str(e))
                    continue
                except Exception as e:  # a broken stream, a timeout, or bytes that do not decode
                    failures[donor.to_base58()] = DonorFailure(TRANSFER_FAILED, repr(e))
                    logger.info("state download from %s failed: %r; trying the next donor", donor, e)
                    continue
                problem = state_problem(metadata, tensors, expected)
                if problem is not None:
                    failures[donor.to_base58()] = problem
                    if problem.kind == MALFORMED:
                        warn_once(donor.to_base58(), "a downloaded state", problem.detail)
                    continue
                future.set_result((donor.to_base58(), metadata, tensors, failures))
                return
        finally:
            if not future.done():
                future.set_result((None, None, None, failures))

    def _donors_by_priority(self, exclude: set[str]) -> list[PeerID]:
        key = donors_key(self._matchmaking.group_key_manager.prefix)
        found = self.dht.get(key, latest=True)
        declared = found.value if found is not None and isinstance(found.value, dict) else {}
        priorities = {}
        for peer_bytes, info in declared.items():
            if not (isinstance(peer_bytes, bytes) and isinstance(info, ValueWithExpiration)
                    and isinstance(info.value, (int, float)) and not isinstance(info.value, bool)):
                continue
            peer = PeerID(peer_bytes)
            if peer != self.peer_id and peer.to_base58() not in exclude:
                priorities[peer] = (float(info.value), random.random())  # random: a tie breaker
        return sorted(priorities, key=priorities.get, reverse=True)

    async def _download_from(self, donor: PeerID, chunk_timeout: float, expected: StateExpectation):
        """The donor's (metadata, tensors). A stream that ends early raises: hivemind reads a cut
        connection as a normal end, so a donor that died mid-transfer looks like one that sent less."""
        stub = self.get_stub(self._p2p, donor, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        return await self._read_state(stream, chunk_timeout, expected.max_bytes, len(expected.param_shapes))

    async def _read_state(self, stream: AsyncIterator[averaging_pb2.DownloadData], chunk_timeout: float,
                          max_bytes: int, num_params: int) -> tuple[Any, list[torch.Tensor]]:
        """(metadata, tensors) of a state's stream, as hivemind's ``rpc_download_state`` writes it: each
        message within `chunk_timeout`, at most `max_bytes` in all (MalformedStateError past them)."""
        metadata, tensors, parts, received = None, [], [], 0
        while True:
            try:
                message = await asyncio.wait_for(stream.__anext__(), timeout=chunk_timeout)
            except StopAsyncIteration:
                break
            received += len(message.tensor_part.buffer) + len(message.metadata)
            traffic_of(self.dht).add(received=message.ByteSize(), phase="state")
            if received > max_bytes:
                raise MalformedStateError(f"the donor sent more than the {max_bytes} bytes a state can hold")
            if message.metadata:
                if metadata is not None:
                    raise MalformedStateError("the donor sent its metadata twice")
                metadata = self.serializer.loads(message.metadata)
            if message.tensor_part.dtype and parts:  # a dtype marks the first chunk of the next tensor
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
            parts.append(message.tensor_part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        if metadata is None:
            raise ValueError("the donor sent no state")
        if len(tensors) < 2 * num_params:
            raise ValueError(f"the stream ended after {len(tensors)} of {2 * num_params} tensors")
        return metadata, tensors

    # ----- states pushed by unreachable peers to the run's keeper --------------------------------------
    def push_state(self, keeper: str, timeout: float) -> Optional[str]:
        """Send this peer's state to the run's keeper `keeper` (base58), which cannot dial this peer to
        download it (main process). None once the keeper took it, else why not."""
        outcome = self._call("_push_state", wait_s=timeout + 5.0, keeper=keeper, timeout=timeout)
        return "no answer from the averager" if outcome is None else outcome or None

    async def _push_state(self, future: MPFuture, keeper: str, timeout: float) -> None:
        try:
            metadata, tensors, _ = await self._get_current_state_from_host_process()
            stub = self.get_stub(self._p2p, PeerID.from_base58(keeper), namespace=self.prefix)
            messages = state_messages(metadata, tensors, self.state_compression)
            traffic_of(self.dht).add(sent=sum(message.ByteSize() for message in messages), phase="state")
            reply = await asyncio.wait_for(stub.rpc_take_state(as_aiter(*messages)), timeout)
            future.set_result("" if reply.code == averaging_pb2.ACCEPTED else
                              f"the keeper answered {averaging_pb2.MessageCode.Name(reply.code)}")
        except Exception as e:
            future.set_result(f"the push failed: {e!r}")

    async def rpc_take_state(self, stream: AsyncIterator[averaging_pb2.DownloadData], context: P2PContext
                             ) -> averaging_pb2.AveragingData:
        """As the run's keeper: keep the state a peer pushed (its form checked: the state's size, tensors of
        this averager's shapes, the sha256 it announces) until :meth:`take_pushed_state` asks for it."""
        refused = averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
        if not self.takes_pushed_states or self.screen.refuses(context.remote_id, "a pushed state"):
            return refused
        shapes = tuple(tuple(t.shape) for t in self._averaged_tensors)
        expected = StateExpectation(shapes, outer_step=-1, sha256="")
        chunk_timeout = self.next_chunk_timeout if self.next_chunk_timeout is not None else self.request_timeout
        try:
            metadata, tensors = await self._read_state(stream, chunk_timeout, expected.max_bytes, len(shapes))
        except Exception as e:
            warn_once(context.remote_id.to_base58(), "a pushed state", repr(e))
            return refused
        problem = state_problem(metadata, tensors, expected)
        if problem is None or problem.kind != OTHER_STATE:  # sound, of another step than "-1": as it must be
            warn_once(context.remote_id.to_base58(), "a pushed state", str(problem))
            return refused
        self._pushed = (context.remote_id.to_base58(), metadata, tensors)
        return averaging_pb2.AveragingData(code=averaging_pb2.ACCEPTED)

    def take_pushed_state(self, expected: StateExpectation, timeout: float = 5.0) -> Optional[GlobalState]:
        """The state last pushed to this keeper, if it is the one `expected` names (main process)."""
        taken = self._call("_take_pushed_state", wait_s=timeout, expected=expected)
        if not taken:
            return None
        donor, metadata, tensors = taken
        return GlobalState(metadata["outer_step"], metadata["sha256"], metadata["inner_steps"], list(tensors), donor)

    async def _take_pushed_state(self, future: MPFuture, expected: StateExpectation) -> None:
        pushed = self._pushed
        if pushed is not None and state_problem(pushed[1], pushed[2], expected) is None:
            self._pushed = None
            future.set_result(pushed)
        else:
            future.set_result(None)


def state_messages(metadata: bytes, tensors: Sequence[torch.Tensor], compression) -> list[averaging_pb2.DownloadData]:
    """A state's stream as hivemind's ``rpc_download_state`` writes it: each tensor compressed and split for
    streaming, the serialized metadata in the first message."""
    messages = []
    for index, tensor in enumerate(tensors):
        info = CompressionInfo.from_tensor(tensor, key=index)
        for part in split_for_streaming(compression.compress(tensor, info, allow_inplace=False)):
            messages.append(averaging_pb2.DownloadData(tensor_part=part, metadata=metadata if not messages else b""))
    return messages


def download_global_state(
    sharing: StateSharing,
    expected: StateExpectation,
    distrusted_donors: set[str],
    timeout: float,
    should_stop: Callable[[], bool] = lambda: False,
    attempts: int = 3,
) -> tuple[Optional[GlobalState], dict[str, DonorFailure]]:
    """Download a checked state within `timeout`, trying every donor up to `attempts` times.

    Returns the state (or None) and every donor that failed with why. Donors that served a
    malformed state are added to `distrusted_donors` and not asked again.
    """
    deadline = time.monotonic() + timeout
    failed: dict[str, DonorFailure] = {}
    for attempt in range(attempts):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or should_stop():
            break
        outcome = sharing.download_state(expected, distrusted_donors, remaining, should_stop)
        if outcome is None:
            break
        failed.update(outcome.failed_donors)
        distrusted_donors.update(donor for donor, why in outcome.failed_donors.items() if why.kind == MALFORMED)
        if outcome.state is not None:
            return outcome.state, failed
        logger.info("state download attempt %d: no peer served a usable state", attempt + 1)
        if outcome.failed_donors and all(f.kind != TRANSFER_FAILED for f in outcome.failed_donors.values()):
            break  # every donor answered, none with this state: asking them again changes nothing
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    return None, failed


def nobody_serves(failed_donors: dict[str, DonorFailure], outer_step: int) -> bool:
    """Whether the donors' answers show that nobody serves the state asked for at `outer_step`: some
    served a sound state, none of them a later one (a later state means the swarm moved on meanwhile)."""
    answers = [f.outer_step for f in failed_donors.values() if f.kind == OTHER_STATE]
    return bool(answers) and max(answers) <= outer_step
