"""hivemind's butterfly all-reduce, changed so that every peer ends with bit-identical results.

In hivemind 1.1.12 the reducer of each part sends every sender the *difference* between the average
and that sender's own part, which the sender adds back: ``x + (avg − x)`` is rounded differently
on each peer, so replicas drift apart in the last bits (about 4e-7 measured) even without
compression. Here each reducer sends the averaged part itself, and every peer, the reducer
included, copies those exact bytes in: the result is identical on all peers by construction.

The change sits at narrow seams of hivemind's classes, and nothing else of its all-reduce protocol or
timeouts is touched (who forms a group with whom is :mod:`p2p_diloco.sync.membership`'s):

* :meth:`ExactAllReduceRunner._accumulate_parts_streaming`: the reducer replies with the average;
* :meth:`ExactAllReduceRunner._communicate_with_peer`: the local part keeps the average too;
* :meth:`ExactMeanAverager._run_allreduce_inplace_`: results are copied in, not added;
* :meth:`ExactAllReduceRunner._communicate_with_remote_reducer` and
  :meth:`ExactAllReduceRunner.rpc_aggregate_part`: the sender, not the reducer, closes each stream.
  In hivemind 1.1.12 the reducer's handler returns right after its last reply and the stream is
  closed under it; the sender may then lose the tail of that reply (measured: 393,208 of 524,312
  bytes of a last part arrived) and hivemind reads the cut as a normal end of stream. About one
  round in 14 of a 6-peer swarm on loopback was partial that way, with no fault at all;
* :meth:`ExactAllReduceRunner.rpc_relay_part`, and the sender named in a forwarded stream's first
  message: past ``swarm.relay_group_size`` members a part may reach its reducer through a relay
  (:mod:`p2p_diloco.sync.relay`), with the same result.

**Codecs.** Parts travel in the run's codec (:mod:`p2p_diloco.sync.codecs`, ``outer.codec``): each
sender encodes its parts, the reducer decodes them and sums in fp32, encodes each averaged part
once, and every peer, the reducer included, decodes those same bytes. Decoding is a pure function
of the bytes, so the result is identical on every peer with any codec. A reducer's own input parts
never travel, but they are encoded and decoded all the same: every input a reducer aggregates is
bytes in the codec that it can show an auditor.

**What travelled is on record.** The runner records in its :class:`~p2p_diloco.sync.audit.RoundLedger`
the digests of the parts it sends each reducer and gets back from each, and as a reducer the encoded
parts each sender sent it, so that a groupmate can audit it (:mod:`p2p_diloco.sync.audit`). Two
methods are the seams a hostile test peer patches: :meth:`ExactAllReduceRunner._encode_averaged`
(a reducer that returns a wrong result to everyone) and
:meth:`ExactAllReduceRunner._accumulate_parts_streaming` (different results to different senders).

**Parts on the codec's grid, and balanced.** hivemind cuts each tensor into parts of
``int(part_size_bytes / bytes_per_value)`` values (932,067 for the 4-bit codecs), and a part that
starts off the codec's block grid is coded in other blocks than the whole tensor. The runner passes
a part size rounded down to a multiple of :attr:`Codec.blocksize <p2p_diloco.sync.codecs.Codec.blocksize>`
(:func:`part_container_settings`), so every part starts on the grid, and small enough that each
reducer gets about eight parts (:func:`balanced_part_size_bytes`; at least four where a sparse codec's round
is small), so that the reducers' shares of encoded bytes are nearly equal. A codec whose coordinates depend on
the round (a shared mask: :meth:`Codec.for_round <p2p_diloco.sync.codecs.Codec.for_round>`) is bound to the
group's ID, which every member holds, before the runner codes a part.

**Reducers' results.** Each reducer's result is :func:`~p2p_diloco.sync.robust.aggregate` of the
senders' parts in sender order under the run's rule (``outer.aggregation``: a robust mean by default,
or DiLoCo's weighted mean), every operation rounded once in a fixed order
(:class:`SenderOrderReducer`): the same bits whichever sender arrives first and whatever kernel the
CPU picks. The senders' weights are the sample counts they gathered.

**What the group counted.** For error feedback (Seide et al. 2014; Karimireddy et al. 2019) a peer
must know what the group counted of its input: for each part, the decoded bytes of its encoding
(sent to another reducer, or aggregated by this peer itself). With ``record_sent`` the runner
writes these into shared-memory buffers (:attr:`ExactMeanAverager.sent`) as the parts go.

A round in which a reducer failed is partial: its parts keep each peer's own input (hivemind only
logs a warning and reports success). Here that raises :class:`PartialRoundError`, so the caller
knows the tensors it holds are not the group's mean.

Nothing a groupmate sends is used unchecked (:mod:`p2p_diloco.remote_input`): its gathered metadata
must match the schema before any tensor moves (:class:`~p2p_diloco.sync.group_screen.GroupScreen`);
each sender's weight in the mean is the sample count it gathered, not a number in its messages; and
every part received, as a reducer or from one, must be a finite fp32 tensor of the expected shape.
A reducer that received a bad part marks the round partial for itself, so its report voids the
round for the whole group (:mod:`p2p_diloco.sync.commit`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from typing import AsyncIterator, Optional, Sequence

import hivemind.averaging.averager
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import (
    DEFAULT_PART_SIZE_BYTES, AllreduceException, BannedException, TensorPartReducer,
)
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import achain, aenumerate, anext, as_aiter, attach_event_on_finished, azip

import p2p_diloco.faults as faults
from p2p_diloco.event_loop import keep_tasks_in
from p2p_diloco.sync.audit import ReducerAudit, RoundLedger
from p2p_diloco.sync.codecs import Codec, get_codec
from p2p_diloco.sync.group_screen import GroupMetadata, GroupScreen, MalformedGroupData
from p2p_diloco.sync.membership import PlannedMatchmaking
from p2p_diloco.sync.relay import RelayLayout, relay_group_size
from p2p_diloco.sync.robust import EXACT_MEAN, AggregationRule, aggregate
from p2p_diloco.sync.spot_check import aggregate_in_chunks
from p2p_diloco.traffic import TrafficCounters, traffic_of

logger = logging.getLogger(__name__)

CLOSE_WAIT_S = 10.0  # how long a reducer keeps a finished stream open for a sender that does not close it


class PartialRoundError(RuntimeError):
    """Some parts of the all-reduce were not averaged by their reducer: the result is not the mean."""


class CodecCompression(CompressionBase):
    """hivemind's hook for the bytes of a part that a sender sends: the run's codec. Only this
    project's peers read them, with :meth:`Codec.decode` (hivemind's own decoder is never used)."""

    def __init__(self, codec: Codec):
        self.codec = codec

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        part = tensor.detach().reshape(-1).to(torch.float32).contiguous()
        return runtime_pb2.Tensor(buffer=self.codec.encode(part), size=list(tensor.shape), dtype="float32")

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        raise NotImplementedError("parts are decoded by the runner, with the codec and the shape it expects")

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.codec.encoded_size(2**20) / (4 * 2**20)  # hivemind sizes the parts by it

    def __repr__(self):
        return f"CodecCompression({self.codec.name})"


PARTS_PER_REDUCER = 8  # parts each reducer gets at least, where they stay above MIN_PART_BYTES
MIN_PART_BYTES = 32 * 1024  # encoded: smaller parts cost more in per-message overhead than they balance
MIN_PARTS_PER_REDUCER = 4  # ... unless a reducer would get fewer parts than this (a sparse codec's small round)


def balanced_part_size_bytes(codec: Codec, total_values: int, reducers: int,
                             cap: float = DEFAULT_PART_SIZE_BYTES) -> float:
    """The encoded bytes per part for a round of `total_values` values among `reducers` reducers: hivemind's
    512 KiB, or less, so that each reducer gets about :data:`PARTS_PER_REDUCER` parts.

    hivemind gives each part whole to one reducer: with 512 KiB parts, 4M values in a 4-bit codec are 4.5 parts,
    and 3 reducers got 2, 2 and 1 (the busiest peer moved 10 % more than its share; docs/benchmarks.md). With
    8 parts or more each, the shares differ by at most 1/8 of a part's share. Smaller parts also pipeline the
    round finer: a sender encodes its next part while the last one travels, and a reducer sums each part as it
    completes. Every member computes the same size from the group's `total_values` and `reducers`."""
    encoded = codec.encoded_size(total_values)
    reducers = max(reducers, 1)
    # the floor still leaves each reducer MIN_PARTS_PER_REDUCER parts: a mask codec's whole round can be below
    # reducers × MIN_PART_BYTES (the demo model's 688,768 values in mask8-e3m0 are 48 KB: one of 3 reducers got none)
    floor = min(MIN_PART_BYTES, encoded / (reducers * MIN_PARTS_PER_REDUCER))
    return max(floor, min(cap, encoded / (reducers * PARTS_PER_REDUCER)))


def part_container_settings(codec: Codec, part_size_bytes: float = DEFAULT_PART_SIZE_BYTES) -> dict:
    """What the runner passes hivemind's TensorPartContainer: the codec, and a part size in bytes such
    that every part of every tensor starts on the codec's block grid (see the module's docstring).

    hivemind cuts ``int(part_size_bytes / bytes_per_value)`` values per part; the size is rounded down
    to a multiple of ``codec.blocksize`` (at least one block), and half a value is added so that
    hivemind's float division lands inside that count whatever its rounding.
    """
    compression = CodecCompression(codec)
    bytes_per_value = 4 * compression.estimate_compression_ratio(None)  # hivemind's: float32 parts
    values = max(int(part_size_bytes / bytes_per_value) // codec.blocksize, 1) * codec.blocksize
    return dict(compression=compression, part_size_bytes=(values + 0.5) * bytes_per_value)


class SenderOrderReducer(TensorPartReducer):
    """hivemind's reducer of the parts this peer averages, with a result that is a fixed function of the
    senders' parts: :func:`~p2p_diloco.sync.robust.aggregate` under the run's `rule`, in sender order, of
    each chunk of the parts that `codec` cuts (:func:`~p2p_diloco.sync.spot_check.aggregate_in_chunks`:
    an auditor recomputes a sample of chunks; no codec: whole parts).

    hivemind adds each part into a running sum as it arrives (``accumulator.add_(part, alpha=w)``), so
    its result depends on which sender came first and on the CPU's kernel, and every peer copies the
    bytes of whichever it got. Here each sender's part is kept until every sender still in the round
    has sent it (one part per sender at a time; hivemind kept one sum), then reduced at once. The
    order of parts, the waiting, the bans and the end of the round are hivemind's. This is the one
    place where the senders' parts meet.
    """

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, rule: AggregationRule = EXACT_MEAN,
                 codec: Optional[Codec] = None):
        self.rule = rule
        self.codec = codec
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self):
        super().reset_accumulators()
        self.accumulator = None  # hivemind's running sum (a zero tensor), unused: the parts are kept
        self.parts_by_sender: dict[int, tuple[torch.Tensor, float]] = {}

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        """hivemind's, except that the part is kept, not added into a running sum, and that each sender
        awaits the part's result shielded. The senders share that future, and hivemind's plain await
        let the cancel of one sender's handler (its stream closed: a groupmate that died or gave up)
        cancel the future itself, and with it every other sender's result, this peer's own included:
        its own parts then never completed, and the round hung until ``allreduce_timeout`` (a survivor
        of a groupmate SIGKILLed mid-round, in 1 run of 3 of ``benchmarks/scale.py --peers 3
        --kill-mid-round 3`` with two busy loops beside it, 1 of 16 without)."""
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:  # the parts before this one are not reduced yet
            finished = asyncio.create_task(self.finished.wait())
            await asyncio.wait({self.current_part_future, finished}, return_when=asyncio.FIRST_COMPLETED)
            finished.cancel()
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {type(self).__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        current_part_future = self.current_part_future
        self.parts_by_sender[sender_index] = (tensor_part, weight)
        self.current_part_accumulated_from += 1
        self.check_current_part_finished()
        return await asyncio.shield(current_part_future)

    def check_current_part_finished(self):
        """Once every sender still in the round has sent the current part, aggregate it in a worker
        thread (a robust rule takes tens of milliseconds per part: the event loop keeps serving the
        streams meanwhile) and move on to the next part at once."""
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            senders = sorted(self.parts_by_sender)
            parts = [self.parts_by_sender[s][0] for s in senders]
            claims = [self.parts_by_sender[s][1] for s in senders]
            future = self.current_part_future
            if self.current_part_index >= self.num_parts - 1:  # hivemind's reset finalizes: it cancels the
                self.current_part_future = asyncio.Future()   # current future, which must outlive the work
            self.reset_accumulators()
            if not senders:  # every sender of the part failed: nobody waits for its result
                future.set_result(None)
                return
            work = asyncio.get_event_loop().run_in_executor(None, self.aggregate, parts, claims)
            work.add_done_callback(functools.partial(_pass_on, future))


    def aggregate(self, parts: list[torch.Tensor], claims: list[float]) -> torch.Tensor:
        if self.codec is None:
            return aggregate(parts, claims, self.rule)
        return aggregate_in_chunks(parts, claims, self.rule, self.codec)


def _pass_on(future: asyncio.Future, work: asyncio.Future) -> None:
    """Give `future` the outcome of `work`, unless the round was torn down meanwhile."""
    if future.done():
        return
    if work.cancelled():
        future.cancel()
    elif work.exception() is not None:
        future.set_exception(work.exception())
    else:
        future.set_result(work.result())


async def addressed_to(reducer: PeerID, messages: AsyncIterator[averaging_pb2.AveragingData]
                       ) -> AsyncIterator[averaging_pb2.AveragingData]:
    """A sender's stream of parts for `reducer`, as it goes to a relay: the first message names the reducer."""
    first = True
    async for message in messages:
        if first:
            message.peer_id = reducer.to_bytes()
            first = False
        yield message


def relayed_sender(message: averaging_pb2.AveragingData, default: Optional[PeerID]) -> Optional[PeerID]:
    """The peer a stream's first message names (its ``peer_id``): `default` if it names none, None if malformed."""
    if not message.peer_id:
        return default
    try:
        return PeerID(message.peer_id)
    except Exception:
        return None


def decode_part(codec: Codec, data: bytes, shape: torch.Size, what: str) -> tuple[Optional[torch.Tensor], Optional[str]]:
    """(the part, None), or (None, why it is malformed): a stranger's bytes in the run's codec."""
    try:  # decode checks the length for `shape` and that every value is finite
        return codec.decode(data, shape.numel()).reshape(shape), None
    except ValueError as e:
        return None, f"{what}: {e}"


class ExactAllReduceRunner(AllReduceRunner):
    """Butterfly all-reduce whose output is the averaged tensor itself, identical on every peer.

    ``sender_weights`` maps each sender to its weight in the mean (the samples it gathered), `rule` is how
    the reducer aggregates the senders' parts (:mod:`p2p_diloco.sync.robust`). If `sent`
    is given (tensors shaped like `tensors`), the runner writes into it what the group counts of each
    value of this peer's input: the decoded bytes of each part's encoding, whether it is sent to another
    reducer or reduced here; once the round has completed, every value is written. `carried` (bool tensors
    shaped like `tensors`, for a codec that sends a subset of the values) is written the same way, part by
    part: True where the round's codec sent the value (:meth:`Codec.carried`). :attr:`ledger`, when
    the averager sets it before any part moves, records what travels (:mod:`p2p_diloco.sync.audit`).
    """

    def __init__(self, *, traffic: "TrafficCounters", sender_weights: dict[PeerID, float], screen: GroupScreen,
                 codec: Codec, rule: AggregationRule = EXACT_MEAN, sent: Optional[Sequence[torch.Tensor]] = None,
                 carried: Optional[Sequence[torch.Tensor]] = None, relay_group: int = 0, fault_pause_s: float = 0.0,
                 fault_send_pause_s: float = 0.0, **kwargs):
        kwargs.pop("compression", None)  # hivemind's averager passes its own; the run's codec replaces it
        reducers = sum(fraction > 0 for fraction in kwargs["peer_fractions"])
        part_size_bytes = balanced_part_size_bytes(codec, sum(t.numel() for t in kwargs["tensors"]), reducers,
                                                   kwargs.pop("part_size_bytes", DEFAULT_PART_SIZE_BYTES))
        super().__init__(**part_container_settings(codec, part_size_bytes), **kwargs)
        replaced = self.tensor_part_reducer  # hivemind's, built above and never used: see SenderOrderReducer
        replaced.finished.set()  # (its finalize would warn that it received nothing)
        self.tensor_part_reducer = SenderOrderReducer(replaced.part_shapes, replaced.num_senders, rule, codec)
        self.codec = codec
        self.sent = sent
        self.carried = carried
        self._averaged_bytes: dict[int, bytes] = {}  # part index -> the averaged part this reducer sends
        self.ledger: Optional[RoundLedger] = None  # what travelled, for the round report and the audit
        self.fault_send_pause_s = fault_send_pause_s
        self.sender_weights = sender_weights
        self.screen = screen  # a groupmate that sends a malformed part is banned there
        self.bad_input: Optional[str] = None  # set when a sender's part was malformed: the round is void
        self.fault_pause_s = fault_pause_s
        # a failed reducer's parts then keep the local input (not a zero delta): see PartialRoundError
        self.tensor_part_container.return_deltas = False
        self.traffic = traffic
        # who forwards whose parts to whom (sync/relay.py); a member others can dial is one that reduces
        self.layout = RelayLayout(tuple(self.ordered_peer_ids), tuple(f > 0 for f in self.peer_fractions), relay_group)
        self.relayed_senders: set[PeerID] = set()  # as a reducer: the senders whose parts came through a relay

    def progress(self) -> str:
        """Where the round stands, in one line for a log: the averaged parts this peer holds from each
        reducer, and as a reducer the part it is at and the parts each sender has sent it."""
        container, reducer = self.tensor_part_container, self.tensor_part_reducer
        short = [peer.to_base58()[-8:] for peer in self.ordered_peer_ids]
        held = ", ".join(f"{name} {container._outputs_registered_by_peer[i]}/{container.num_parts_by_peer[i]}"
                         for i, name in enumerate(short))
        senders = [peer.to_base58()[-8:] for peer in self.sender_peer_ids]
        sent = ", ".join(f"{name} {reducer.num_parts_received[i]}"
                         f"{' (failed)' if reducer.sender_failed_after[i] != float('inf') else ''}"
                         for i, name in enumerate(senders))
        return (f"averaged parts held, by reducer: {held}; as a reducer, at part {reducer.current_part_index + 1} "
                f"of {reducer.num_parts}, parts received by sender: {sent}")

    async def _encode_averaged(self, part_index: int, averaged_part: torch.Tensor) -> bytes:
        """The bytes of an averaged part, encoded once: every sender, and this peer, gets the same."""
        if part_index not in self._averaged_bytes:
            loop = asyncio.get_event_loop()
            encoded = await loop.run_in_executor(None, self.codec.encode, averaged_part.reshape(-1))
            self._averaged_bytes.setdefault(part_index, encoded)
        return self._averaged_bytes[part_index]

    def _record_part(self, info: CompressionInfo, counted: Optional[torch.Tensor], numel: int) -> None:
        """Write what the group counts of the part `info` of this peer's input (`numel` values) into ``self.sent``
        (`counted`, when recorded) and which of its values the codec sent into ``self.carried``."""
        start = info.part_index * info.part_size  # hivemind cuts every tensor into parts of part_size values
        if self.sent is not None:
            self.sent[info.key].view(-1)[start:start + numel].copy_(counted.reshape(-1))
        if self.carried is not None:
            self.carried[info.key].view(-1)[start:start + numel].copy_(self.codec.carried(numel))

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        first = True
        loop = asyncio.get_event_loop()
        parts = list(self.tensor_part_container._input_parts_by_peer[peer_index])  # (part, info), in order
        async for part_index, message in aenumerate(super()._generate_input_for_peer(peer_index)):
            part, info = parts[part_index]
            counted = None
            if self.sent is not None:  # the reducer counts these very bytes, decoded
                counted = await loop.run_in_executor(None, self.codec.decode, message.tensor_part.buffer, part.numel())
            self._record_part(info, counted, part.numel())  # in the event loop: never after the round is torn down
            if self.ledger is not None:
                self.ledger.sent_input(self.ordered_peer_ids[peer_index], message.tensor_part.buffer,
                                       parts[part_index][0].numel(), self.codec)
            self.traffic.add(sent=len(message.tensor_part.buffer))
            yield message
            if first and self.fault_send_pause_s:
                logger.warning("fault injection: pausing mid all-reduce (sending) for %.1f s", self.fault_send_pause_s)
                await asyncio.sleep(self.fault_send_pause_s)
            first = False

    async def _communicate_with_peer(self, peer_id: PeerID):
        if peer_id != self.peer_id:
            return await self._communicate_with_remote_reducer(peer_id)
        peer_index = self.ordered_peer_ids.index(peer_id)
        try:
            await self._reduce_own_parts(peer_index)
        except BaseException as e:  # as for a remote reducer: its parts keep this peer's input, and the round
            if isinstance(e, Exception):  # is partial at once, not when allreduce_timeout cancels it
                logger.warning("this peer's reduction of its own parts failed: %r", e)
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise

    async def _reduce_own_parts(self, peer_index: int) -> None:
        """This peer's input parts that it reduces itself: sent to its own reducer, and its results kept."""
        peer_id = self.peer_id
        sender_index = self.sender_peer_ids.index(peer_id)
        loop = asyncio.get_event_loop()
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            # like every sender's part, through the codec: the reducer aggregates bytes it can show an auditor
            own = await loop.run_in_executor(None, self.codec.encode, tensor_part.reshape(-1).contiguous())
            counted = (await loop.run_in_executor(None, self.codec.decode, own, tensor_part.numel())
                       ).reshape(tensor_part.shape)
            self._record_part(self.tensor_part_container._input_parts_by_peer[peer_index][part_index][1], counted,
                              tensor_part.numel())
            if self.ledger is not None:
                self.ledger.sent_input(peer_id, own, tensor_part.numel(), self.codec)
                self.ledger.received_input(peer_id, part_index, own)
            averaged_part = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, counted, weight=self.sender_weights[peer_id]
            )
            encoded = await self._encode_averaged(part_index, averaged_part)
            if self.ledger is not None:
                self.ledger.received_output(peer_id, encoded)
            decoded = self.codec.decode(encoded, averaged_part.numel()).reshape(averaged_part.shape)
            self.tensor_part_container.register_processed_part(peer_index, part_index, decoded)

    async def _communicate_with_remote_reducer(self, peer_id: PeerID):
        """hivemind's sender loop, except that this sender closes the stream once it holds every part.

        A stream closed by the reducer first may lose its last bytes in transit (see
        :meth:`rpc_aggregate_part`), and hivemind reads that as a normal end of stream ("peer X sent
        3 parts, but we expected 5"): the round is then partial although the reducer sent everything.
        """
        peer_index = self.ordered_peer_ids.index(peer_id)
        num_parts = self.tensor_part_container.num_parts_by_peer[peer_index]
        loop = asyncio.get_event_loop()
        stream = None
        relay = self.layout.relay(self.peer_id, peer_id)
        if relay is not None and self.ledger is not None:
            self.ledger.relayed.add(peer_id)
        try:
            done_sending = asyncio.Event()
            inputs_aiter = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            if relay is None:
                stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs_aiter)
            else:  # the relay learns the reducer from the first message (sync/relay.py)
                stream = await self._get_peer_stub(relay).rpc_relay_part(addressed_to(peer_id, inputs_aiter))
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()
            part_index = 0
            while part_index < num_parts:
                try:
                    msg = await asyncio.wait_for(anext(stream), self.reducer_timeout)
                except StopAsyncIteration:
                    break
                if msg.code != averaging_pb2.AVERAGED_PART:
                    raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(msg.code)}")
                self.traffic.add(received=len(msg.tensor_part.buffer))
                expected = self.tensor_part_container._input_parts_by_peer[peer_index][part_index][0].shape
                averaged_part, problem = await loop.run_in_executor(
                    None, decode_part, self.codec, msg.tensor_part.buffer, expected, f"averaged part {part_index}")
                if problem is not None:
                    if relay is None:  # through a relay, the relay may have sent it as well
                        self.screen.ban(peer_id, "a malformed averaged part", problem)
                    raise AllreduceException(f"{peer_id} sent a malformed averaged part: {problem}")
                if self.ledger is not None:
                    self.ledger.received_output(peer_id, msg.tensor_part.buffer)
                self.tensor_part_container.register_processed_part(peer_index, part_index, averaged_part)
                part_index += 1
            if part_index != num_parts:
                raise AllreduceException(f"peer {peer_id} sent {part_index} parts, but we expected {num_parts}")
        except BaseException as e:
            if isinstance(e, Exception):
                logger.debug(f"Caught {e!r} when communicating to {peer_id}", exc_info=True)
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise
        finally:
            if stream is not None:
                try:
                    await stream.aclose()  # closes our end: the reducer's rpc_aggregate_part may now return
                except Exception as e:  # the stream is broken already; the round's outcome stands
                    logger.debug(f"closing the stream to {peer_id} failed: {e!r}")

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's reducer, except that it keeps the stream open until the sender has closed it.

        When a handler returns, the stream is closed at once, and the bytes that the sender has not
        read yet can be lost (the sender saw "partial 393208 of 524312 bytes" of the last part, then
        end of stream). The sender closes its end as soon as it holds every averaged part
        (:meth:`_communicate_with_remote_reducer`), and hivemind's p2p layer then cancels this
        handler; the wait below is only a bound for a sender that never closes.
        """
        try:
            first = await asyncio.wait_for(anext(stream), self.sender_timeout)
        except StopAsyncIteration:
            return
        sender = relayed_sender(first, context.remote_id)
        if sender != context.remote_id:  # forwarded by a relay: only the relay the group's layout names
            if sender is None or sender not in self.sender_peer_ids or self.layout.relay(sender, self.peer_id) != context.remote_id:
                yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
                return
            self.relayed_senders.add(sender)
            context = dataclasses.replace(context, remote_id=sender)  # hivemind's reducer knows senders by it
        async for message in super().rpc_aggregate_part(achain(as_aiter(first), stream), context):
            yield message
        await asyncio.sleep(self.sender_timeout if self.sender_timeout is not None else CLOSE_WAIT_S)

    async def rpc_relay_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """As a relay (:mod:`p2p_diloco.sync.relay`): forward a groupmate's parts to the reducer its first
        message names, untouched, and the reducer's averaged parts back, if the group's layout makes this
        peer that pair's relay. Each wait is bounded like the sender's and the reducer's own; the sender
        closes the stream once it holds every averaged part, which closes the stream to the reducer."""
        first = await asyncio.wait_for(anext(stream), self.sender_timeout)
        sender = context.remote_id
        reducer = relayed_sender(first, None)
        members = self.ordered_peer_ids
        if sender not in members or reducer not in members or self.layout.relay(sender, reducer) != self.peer_id:
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        first.peer_id = sender.to_bytes()  # the reducer checks that this peer relays that sender's parts

        async def inputs() -> AsyncIterator[averaging_pb2.AveragingData]:
            async for message in achain(as_aiter(first), stream):
                self.traffic.add(sent=len(message.tensor_part.buffer), received=len(message.tensor_part.buffer))
                yield message

        upstream = await self._get_peer_stub(reducer).rpc_aggregate_part(inputs())
        try:
            while True:
                try:
                    message = await asyncio.wait_for(anext(upstream), self.reducer_timeout)
                except StopAsyncIteration:
                    break
                self.traffic.add(sent=len(message.tensor_part.buffer), received=len(message.tensor_part.buffer))
                yield message
        finally:
            await upstream.aclose()

    async def _accumulate_parts_streaming(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Reduce a sender's parts as they arrive and reply to each with the averaged part."""
        parts_reduced = 0
        loop = asyncio.get_event_loop()
        sender = self.sender_peer_ids[sender_index]
        try:
            async for msg in stream:
                self.traffic.add(received=len(msg.tensor_part.buffer))
                if parts_reduced >= self.tensor_part_reducer.num_parts:
                    tensor_part, problem = None, "more parts than it was given to send"
                else:
                    tensor_part, problem = await loop.run_in_executor(
                        None, decode_part, self.codec, msg.tensor_part.buffer,
                        self.tensor_part_reducer.part_shapes[parts_reduced], f"part {parts_reduced}")
                if problem is not None:
                    if sender not in self.relayed_senders:  # through a relay, the relay may have sent it as well
                        self.screen.ban(sender, "a malformed all-reduce part", problem)
                    self.bad_input = f"{sender} sent a malformed part: {problem}"
                    break
                if self.ledger is not None:
                    self.ledger.received_input(sender, parts_reduced, msg.tensor_part.buffer)
                try:
                    averaged_part = await self.tensor_part_reducer.accumulate_part(
                        sender_index, parts_reduced, tensor_part, weight=self.sender_weights[sender]
                    )
                except BannedException:
                    break  # the sender was banned meanwhile: its remaining parts are not needed
                parts_reduced += 1
                if parts_reduced == 1 and self.fault_pause_s:
                    logger.warning("fault injection: pausing mid all-reduce for %.1f s", self.fault_pause_s)
                    await asyncio.sleep(self.fault_pause_s)
                encoded = await self._encode_averaged(parts_reduced - 1, averaged_part)
                self.traffic.add(sent=len(encoded))
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART,
                                                  tensor_part=runtime_pb2.Tensor(buffer=encoded, dtype="float32"))
        finally:
            if parts_reduced != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])


class ExactMeanAverager(ReducerAudit, DecentralizedAverager):
    """A DecentralizedAverager whose ``step()`` leaves the same bytes on every peer of the group: the
    `aggregation` of the members' inputs, weighted by the samples each gathered, among groupmates whose
    metadata passed the screen. What travelled in its last rounds is kept for the audit of reducers
    (:class:`~p2p_diloco.sync.audit.ReducerAudit`).

    With `record_sent`, :attr:`sent` holds one shared-memory tensor per averaged tensor (made before the
    averager process forks: one more float32 copy of the tensors, 4 bytes per value): after a round
    that completed, the fragment's entries hold what the group counted of this peer's input
    (see :class:`ExactAllReduceRunner`). Read them under :meth:`get_tensors`, like the tensors. With a codec
    that sends a subset of the values, :attr:`carried` holds one shared bool tensor per averaged tensor (1 byte per
    value; None for a dense codec): after a round that completed, True where the round's codec sent the value.
    """

    matchmaking = PlannedMatchmaking  # hivemind's Matchmaking in the averager's process (see _run_internal)

    def __init__(self, tensors: Sequence[torch.Tensor], *args, codec: str = "none",
                 aggregation: AggregationRule = EXACT_MEAN, fragments: Optional[list[list[int]]] = None,
                 record_sent: bool = False, **kwargs):
        # a round averages one fragment of the tensors (Streaming DiLoCo): the one its members gathered
        self.fragments = fragments or [list(range(len(tensors)))]
        self.codec = get_codec(codec)  # of the pseudo-gradient parts (outer.codec); the state travels in fp32
        self.aggregation = aggregation  # how this peer reduces the parts it reduces (outer.aggregation)
        # one round trip before the averager process forks: it then holds bitsandbytes already, whose import
        # on first use took ~10 s on a loaded machine, inside the first round (longer than next_chunk_timeout)
        self.codec.decode(self.codec.encode(torch.ones(256)), 256)
        dht = args[0] if args else kwargs.get("dht")  # hivemind's second argument
        self.traffic = traffic_of(dht)  # created before the averager process forks, so both see it
        # used in the averager process; a private run's members known before any handler is registered
        self.screen = GroupScreen(members=getattr(dht, "members", None))
        self.rounds_started = 0  # counted in the averager process
        self.sent = [torch.zeros_like(t, dtype=torch.float32).share_memory_() for t in tensors] if record_sent else None
        self.carried = None if self.codec.sends_every_value else [
            torch.zeros_like(t, dtype=torch.bool).share_memory_() for t in tensors]
        super().__init__(tensors, *args, **kwargs)

    def plan_members(self, token: str, members: Sequence[str], timeout: float = 5.0) -> None:
        """The members (base58) that the membership plan of this peer's round `token` names: as that round's
        leader, it starts once they have joined (:class:`~p2p_diloco.sync.membership.PlannedMatchmaking`)."""
        self._call("_plan_members", wait_s=timeout, token=token, members=list(members))

    async def _plan_members(self, future, token: str, members: list[str]) -> None:
        self._matchmaking.planned_members = (token, frozenset(members))
        future.set_result(True)

    async def rpc_relay_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A groupmate's parts to forward to another (:meth:`ExactAllReduceRunner.rpc_relay_part`), found by
        group as hivemind's ``rpc_aggregate_part`` finds a reducer's."""
        request = await asyncio.wait_for(anext(stream), self._allreduce_timeout or CLOSE_WAIT_S)
        if request.group_id not in self._running_groups:  # the leader's reply may reach this peer after the sender
            await asyncio.wait_for(self._pending_groups_registered.wait(), self._allreduce_timeout or CLOSE_WAIT_S)
        future = self._running_groups.get(request.group_id)
        if future is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        runner = await future
        async for message in runner.rpc_relay_part(achain(as_aiter(request), stream), context):
            yield message

    def _run_internal(self):
        # This runs in the averager's own process, where hivemind builds its Matchmaking by name: the name
        # is bound to our subclass there, so groups follow the round's membership plan (sync/membership.py)
        # and banned peers stay out of them (sync/group_screen.py).
        hivemind.averaging.averager.Matchmaking = functools.partial(self.matchmaking, screen=self.screen)
        keep_tasks_in(hivemind.averaging.averager)  # a request's task is not collected mid-call (event_loop.py)
        super()._run_internal()

    async def _shutdown(self, timeout: Optional[float]) -> None:
        """hivemind's, except that each running group's all-reduce is cancelled through its runner: hivemind
        1.1.12 calls ``finalize`` on the future that holds the runner, which raised an AttributeError at
        every stop mid-round (the round is void anyway: its groupmates see this peer fail)."""
        if not self.client_mode:
            await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
        for future in self._running_groups.values():
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().finalize(cancel=True)
            else:
                future.cancel()

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: Optional[bytes] = None, **kwargs
    ):
        group_id = group_info.group_id if group_id is None else group_id
        assert group_id in self._running_groups, f"group {group_id} was not registered"
        try:
            metadata = self.screen.check_group(group_info)
        except Exception as e:  # no tensor moves in this group; senders that reach us get the error at once
            self._running_groups[group_id].set_exception(e)
            raise
        fragment = metadata[self.peer_id].fragment
        if {meta.fragment for meta in metadata.values()} != {fragment} or fragment >= len(self.fragments):
            error = MalformedGroupData(f"groupmates gathered fragments {sorted({m.fragment for m in metadata.values()})}, "
                                       f"this peer fragment {fragment} of {len(self.fragments)}")
            self._running_groups[group_id].set_exception(error)
            raise error
        tensors = [tensors[i] for i in self.fragments[fragment]]
        self.rounds_started += 1
        runner = ExactAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            modes=averaging_modes(group_info.peer_ids, metadata, kwargs["peer_fractions"]),
            traffic=self.traffic,
            sender_weights={peer_id: float(meta.samples) for peer_id, meta in metadata.items()},
            screen=self.screen,
            codec=self.codec.for_round(group_id),  # a shared mask is the round's: every member holds its group ID
            rule=self.aggregation,
            sent=None if self.sent is None else [self.sent[i] for i in self.fragments[fragment]],
            carried=None if self.carried is None else [self.carried[i] for i in self.fragments[fragment]],
            relay_group=relay_group_size(meta.relay_group for meta in metadata.values() if meta.role == "peer"),
            fault_pause_s=faults.allreduce_pause_s(self.rounds_started),
            fault_send_pause_s=faults.allreduce_pause_s(self.rounds_started, role="sender"),
            **kwargs,
        )
        runner.ledger = round_ledger(runner, metadata)
        self.keep_ledger(runner.ledger)
        layout = runner.layout
        logger.info("all-reduce started: group of %d (%s)%s", len(group_info.peer_ids),
                    ", ".join(peer.to_base58()[-8:] for peer in group_info.peer_ids),
                    "" if layout.flat else f", in {layout.groups} groups of at most {layout.group_size} through relays")
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("auxiliary peers should not receive averaged tensors")
            return
        try:
            async for tensor, averaged in azip(as_aiter(*tensors), runner):
                tensor.copy_(averaged)
        except BaseException:  # the round's timeout (a cancel) included: say where each party stood
            logger.warning("all-reduce ended unfinished: %s", runner.progress())
            raise
        if runner.bad_input is not None:
            raise PartialRoundError(f"a groupmate's input was malformed ({runner.bad_input})")
        failed = runner.tensor_part_container.failed_size
        if failed:
            raise PartialRoundError(
                f"{failed} of {runner.tensor_part_container.total_size} values were not averaged "
                f"(a reducer failed); this peer's result differs from the group's"
            )
        self.prepare_audits(runner.ledger)  # while the members exchange their reports


def averaging_modes(peer_ids: Sequence[PeerID], metadata: dict[PeerID, GroupMetadata],
                    peer_fractions: Sequence[float]) -> tuple[AveragingMode, ...]:
    """Each member's part in the all-reduce: an assistant reduces and sends nothing (hivemind's AUX), a
    member with no share of the parts only sends (CLIENT), any other both (NODE).

    hivemind 1.1.12 reads every member's mode from the gathered data and then drops it: its
    ``_aggregate_with_group`` passes the runner no ``modes``, and the runner derives them from the
    shares alone, so an auxiliary member became a sender of its zero tensors with weight 0. Under a
    robust rule those zeros counted as a sender's part: they lowered the median norm (in a round of
    three peers, a part above twice the smallest one was clipped) and moved the coordinate median, and
    in a round of one peer and an assistant the median of the claims [0, w] capped both at 0 and the
    reduction divided by zero (the round failed, and that peer fell behind a run nobody could serve it
    the state of)."""
    return tuple(
        AveragingMode.AUX if metadata[peer_id].role == "assistant"
        else AveragingMode.CLIENT if fraction == 0 else AveragingMode.NODE
        for peer_id, fraction in zip(peer_ids, peer_fractions))


def round_ledger(runner: ExactAllReduceRunner, metadata: dict[PeerID, GroupMetadata]) -> RoundLedger:
    """An empty record of what will travel in `runner`'s round, before any part moves: the members'
    tokens and weights from their gathered `metadata`, each reducer's parts as this peer cuts them."""
    container = runner.tensor_part_container
    return RoundLedger.for_round(
        runner.peer_id, metadata[runner.peer_id].token,
        {peer_id: meta.token for peer_id, meta in metadata.items() if meta.role == "peer"},
        runner.ordered_peer_ids, runner.sender_peer_ids, runner.sender_weights,
        {peer_id: [part.numel() for part, _ in container._input_parts_by_peer[index]]
         for index, peer_id in enumerate(runner.ordered_peer_ids)},
        codec=runner.codec,
    )
