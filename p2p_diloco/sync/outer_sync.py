"""Turns this peer's pseudo-gradient into the group's agreed mean (DiLoCo, arXiv 2311.08105, Alg. 1 l. 11).

The group's mean is weighted by the samples each peer processed since the last outer step, so a
peer that managed fewer inner steps counts for less. Averaging goes through hivemind's butterfly
all-reduce (:class:`~p2p_diloco.sync.exact_allreduce.ExactMeanAverager`), whose result is
bit-identical on every peer of the group. Only peers at the same outer step can meet: the step
number is part of the matchmaking key.

The same averager serves this peer's global state to joiners (``rpc_download_state``) and
downloads the state of others (see :mod:`p2p_diloco.sync.state_transfer`). Its DHT keys and its
network handlers are named after the run and the fingerprint of the run's settings
(:func:`averager_prefix`): peers that train with other settings never meet in a group and never
serve each other state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Optional, Sequence, Union

import torch
from hivemind import DHT
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.control import AveragingStage
from hivemind.averaging.matchmaking import MatchmakingException

from p2p_diloco.config import SwarmConfig
from p2p_diloco.hashing import tensors_sha256
from p2p_diloco.remote_input import parse
from p2p_diloco.swarm.liveness import answering
from p2p_diloco.swarm.node import SwarmDHT
from p2p_diloco.swarm.records import AUDIT_OK, RoundReport
from p2p_diloco.sync.audit import RoundDigests
from p2p_diloco.sync.commit import RoundReports, Void
from p2p_diloco.sync.exact_allreduce import ExactMeanAverager
from p2p_diloco.sync.group_screen import GroupMetadata
from p2p_diloco.protocol.membership import Membership
from p2p_diloco.sync.robust import EXACT_MEAN, AggregationRule, counted_claims
from p2p_diloco.sync.state_transfer import StateSharing, donors_key

logger = logging.getLogger(__name__)

STEP_KEY_BITS = 16  # the outer step modulo 2**16 goes into the group key


@dataclass
class GroupMean:
    """The outcome of one averaging round, as this peer saw it."""

    mean: list[torch.Tensor]  # the group's aggregate of the pseudo-gradients (fp32, CPU; outer.aggregation)
    group_size: int
    group_samples: int  # the groupmates' sample counts, each claim capped as the aggregation rule caps it
    tokens: dict[str, str]  # each groupmate's peer ID -> the attempt token it announced
    # the fragment's tensors as the group counted them in `mean` (this peer's input after the codec's
    # round trip, on the parts it reduced itself too), when asked for: what error feedback subtracts
    sent: Optional[list[torch.Tensor]] = None
    # the fragment's values the round's codec sent (bool, like `mean`), for a codec that sends a subset of them
    # (a shared mask): `mean` holds no value of the group elsewhere. None: every value was sent
    carried: Optional[list[torch.Tensor]] = None
    attempt: int = 1  # which attempt of the step's round this is (train/round_sync.py retries without failed members)
    # where the round's seconds went, by phase (:class:`RoundTimes`; round_sync adds the wait for groupmates)
    phases: dict[str, float] = field(default_factory=dict)
    update_scale: float = 1.0  # what the update check multiplied `mean` by (< 1: clipped; protocol/update_rule.py)
    # this peer's own claim as the rule counted it (sync/robust.py fair_weights); alone, all of its samples
    counted_samples: Optional[int] = None

    def __post_init__(self):
        if self.counted_samples is None and self.group_size == 1:
            self.counted_samples = self.group_samples

    @property
    def peer_ids(self) -> list[str]:
        return sorted(self.tokens)


def _refuse_abandoned(delta: "PendingDelta") -> None:
    """RoundFailed, before any tensor moved, if the inner loop abandoned `delta` (this peer is stopping)."""
    if delta.settled and delta.tensors is None:
        raise RoundFailed("this peer stopped before its pseudo-gradient was taken", tensors_touched=False)


LEFT_BEHIND_POLL_S = 1.0  # how often a peer still matching reads the run (WhileForming)
ROUND_POLL_S = 0.05  # how often a peer waiting for its round looks at it (cancels, and when its group formed)
ASSEMBLED = (AveragingStage.AWAITING_TRIGGER, AveragingStage.RUNNING_ALLREDUCE)  # its group is formed


class PendingDelta:
    """What this peer sends in a round (its fragment's Δ; with error feedback, plus the residual it owes),
    handed over by the inner loop once it is taken. A round matched ahead of its Δ
    (:mod:`p2p_diloco.train.match_ahead`) forms its group meanwhile, and its all-reduce begins once the Δ is
    here; a peer that stops before then abandons it. Made with `tensors`, it is here already."""

    def __init__(self, tensors: Optional[Sequence[torch.Tensor]] = None):
        self.tensors: Optional[list[torch.Tensor]] = None
        self._settled = threading.Event()
        if tensors is not None:
            self.hand_over(tensors)

    def hand_over(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        self._settled.set()

    def abandon(self) -> None:
        """The inner loop stopped before the Δ was taken: the round gets none."""
        self._settled.set()

    @property
    def settled(self) -> bool:
        """Handed over or abandoned."""
        return self._settled.is_set()

    def wait(self, timeout: float) -> bool:
        return self._settled.wait(timeout)


@dataclass
class RoundTimes:
    """When the phases of one attempt at a round ended (``time.monotonic()``), for the metrics' breakdown."""

    started: float  # the averager was asked for a group
    assembled: Optional[float] = None  # the group formed (first seen)
    handed_over: Optional[float] = None  # this peer's Δ was there and its all-reduce allowed to begin
    reduced: Optional[float] = None  # the all-reduce ended
    agreed: Optional[float] = None  # every groupmate's report agreed
    audited: Optional[float] = None  # every reducer passed its audit

    def look(self, control) -> None:
        """Note when the group of the averager's step `control` is first seen formed."""
        if self.assembled is None and control.stage in ASSEMBLED:
            self.assembled = time.monotonic()

    def phases(self) -> dict[str, float]:
        """Seconds per phase: `match` (asked → group formed), `late` (the group waited for this peer's Δ),
        `allreduce` (from when both were there), `commit` (the groupmates' reports), `audit` (this peer's
        audits and the other auditors' verdicts)."""
        assembled = self.assembled if self.assembled is not None else self.handed_over
        begun = max(assembled, self.handed_over)
        return {name: round(max(seconds, 0.0), 4) for name, seconds in dict(
            match=assembled - self.started, late=self.handed_over - assembled,
            allreduce=self.reduced - begun, commit=self.agreed - self.reduced, audit=self.audited - self.agreed).items()}


class RoundFailed(RuntimeError):
    """No group was formed, or the all-reduce broke off: this peer has no agreed mean for the step.

    `tensors_touched`: the group formed and tensors moved (an attempt worth making again among its members).
    `reported`: this peer had reported the round complete (:mod:`p2p_diloco.sync.commit`) when it failed, so a
    groupmate that saw every report may have committed a mean that holds this peer's Δ. A round that fails before
    that report cannot be committed by anyone: every member waits for every groupmate's complete report, and this
    peer reports it incomplete."""

    def __init__(self, message: str, tensors_touched: bool, reported: bool = False):
        super().__init__(message)
        self.tensors_touched = tensors_touched
        self.reported = reported


class NoGroup(RoundFailed):
    """No group formed around this peer: no leader took it in, or matchmaking gave up."""

    def __init__(self, message: str = "no group formed"):
        super().__init__(message, tensors_touched=False)


class LeftBehind(RoundFailed):
    """The peers this peer planned to average with averaged without it (they moved past the step while
    it was still matching): it stopped waiting for a group that had gone, before any tensor moved."""

    def __init__(self):
        super().__init__("the group averaged without this peer", tensors_touched=False)


@dataclass(frozen=True)
class WhileForming:
    """What this peer reads of the run while its round's group forms (asked once a second, until the all-reduce
    begins): whether its planned groupmates went on without it, and whom its group must hold more than half of
    (:func:`~p2p_diloco.protocol.membership.quorum_of`: its plan and every peer read ready at the step since)."""

    left_behind: bool = False
    quorum: frozenset[str] = frozenset()


def averager_prefix(run_name: str, fingerprint: str) -> str:
    return f"{run_name}_{fingerprint[:16]}_outer"


def group_bits(outer_step: int) -> str:
    """The averager's group key bits for a round toward `outer_step + 1`: peers at other steps never meet."""
    return format(outer_step % 2**STEP_KEY_BITS, f"0{STEP_KEY_BITS}b")


STATE_RPCS = frozenset({"rpc_download_state", "rpc_take_state"})  # the global state's handlers


class SwarmAverager(StateSharing, ExactMeanAverager):
    """The exact all-reduce of the pseudo-gradients and the checked transfer of the global state.

    The bootstrap node may run two of them for one run, on one p2p daemon and in one namespace: an
    assistant (:mod:`p2p_diloco.sync.assistant`: it reduces and holds no state) and the run's keeper (it
    holds the state and never averages). Each registers the handlers of its role alone, or the second
    to start would fail on a handler name that the first already holds."""

    def _serves(self, method_name: str) -> bool:
        if self.takes_pushed_states:  # the keeper's
            return method_name in STATE_RPCS
        if self.mode == AveragingMode.AUX:  # an assistant's
            return method_name not in STATE_RPCS
        return True

    async def add_p2p_handlers(self, p2p, wrapper=None, *, namespace: Optional[str] = None, balanced: bool = False):
        """hivemind's, for the handlers of this averager's role (:meth:`_serves`)."""
        self._collect_rpc_handlers()
        await asyncio.gather(*[
            p2p.add_protobuf_handler(self._get_handle_name(namespace, handler.method_name),
                                     getattr(self if wrapper is None else wrapper, handler.method_name),
                                     handler.request_type, stream_input=handler.stream_input,
                                     stream_output=handler.stream_output, balanced=balanced)
            for handler in self._rpc_handlers if self._serves(handler.method_name)])

    async def remove_p2p_handlers(self, p2p, *, namespace: Optional[str] = None) -> None:
        """hivemind's, for the handlers that :meth:`add_p2p_handlers` registered."""
        self._collect_rpc_handlers()
        await asyncio.gather(*[
            p2p.remove_protobuf_handler(self._get_handle_name(namespace, handler.method_name),
                                        stream_input=handler.stream_input, stream_output=handler.stream_output)
            for handler in self._rpc_handlers if self._serves(handler.method_name)])

    def run_in_background(self, await_ready: bool = True, timeout: Optional[float] = None) -> None:
        """hivemind's, without its side effects on the calling process: hivemind sets SIGINT to "ignore"
        there for good (Ctrl+C no longer stopped a peer), which fails outside the main thread."""
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the averager process inherits it: Ctrl+C is its parent's
            try:
                self.start()
            finally:
                signal.signal(signal.SIGINT, previous)
        else:  # only the main thread may set handlers: the averager process inherits the parent's
            self.start()
        if await_ready:
            self.wait_until_ready(timeout)


def averager_timeouts(settings) -> dict:
    """The averager settings every member of a run's groups shares, from its swarm timeouts: a
    :class:`~p2p_diloco.config.SwarmConfig`, or an assistance request, which carries them."""
    return dict(
        min_matchmaking_time=settings.matchmaking_time,
        request_timeout=settings.request_timeout,
        allreduce_timeout=settings.allreduce_timeout,
        next_chunk_timeout=settings.next_chunk_timeout,
        # hivemind requires reducer_timeout > sender_timeout (a reducer may wait on senders)
        reducer_timeout=2 * settings.next_chunk_timeout,
        min_group_size=2,
        shutdown_timeout=5,
    )


def round_timeout(settings) -> float:
    """How long a member gives matchmaking and the all-reduce of one round (the same for every member
    of a run's groups; `settings` as for :func:`averager_timeouts`)."""
    return 2 * settings.matchmaking_time + 2 * settings.request_timeout + settings.allreduce_timeout


class OuterSync:
    """One averager per peer, sized like the model's trainable parameters; the parts of the
    pseudo-gradient travel in `codec` (:mod:`p2p_diloco.sync.codecs`), and the parts this peer reduces
    are aggregated by `aggregation` (:mod:`p2p_diloco.sync.robust`).

    `fragments` lists the tensor indices of each Streaming DiLoCo fragment (default: one of all); a
    round averages one of them, named in the gathered metadata, and the averager moves only its
    tensors. With `record_sent` the averager keeps, in shared memory, what the group counted of this
    peer's input (one more float32 copy of the tensors: 4 bytes per parameter), and every mean
    :meth:`average` returns carries it as ``sent``: what error feedback, which the training loop owns,
    needs to know what the codec dropped.

    A peer that nobody can dial (`client_mode`) averages as hivemind's client: it sends its parts to
    reducers that it dials, reduces none, never leads a group and serves no state.
    """

    def __init__(
        self,
        dht: DHT,
        run_name: str,
        fingerprint: str,
        record_subkey: bytes,
        shapes: Sequence[torch.Size],
        cfg: SwarmConfig,
        state_provider: Callable[[], tuple[dict, list[torch.Tensor]]],
        client_mode: bool = False,
        codec: str = "none",
        aggregation: AggregationRule = EXACT_MEAN,
        fragments: Optional[list[list[int]]] = None,
        record_sent: bool = False,
        takes_pushed_states: bool = False,
    ):
        self.cfg = cfg
        self.client_mode = client_mode
        self.peer_id = dht.peer_id.to_base58()
        self.reports = RoundReports(dht, run_name, ttl=cfg.progress_ttl, record_subkey=record_subkey,
                                    answering=functools.partial(answering, dht))
        buffers = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]
        prefix = averager_prefix(run_name, fingerprint)
        if isinstance(dht, SwarmDHT):
            dht.count_keys({donors_key(prefix): "state"})
        self.averager = SwarmAverager(
            buffers,
            dht,
            start=True,
            prefix=prefix,
            client_mode=client_mode,
            allow_state_sharing=not client_mode,
            declare_state_period=min(30.0, cfg.progress_ttl / 2),
            state_provider=state_provider,
            codec=codec,
            aggregation=aggregation,
            fragments=fragments,  # kept by the averager alone: its process reads them too
            record_sent=record_sent,
            takes_pushed_states=takes_pushed_states,  # the run's keeper (sync/state_transfer.py)
            **averager_timeouts(cfg),
        )

    def average(
        self,
        pseudo_gradient: Union[Sequence[torch.Tensor], PendingDelta],
        samples: int,
        outer_step: int,
        global_sha256: str,
        fragment: int = 0,
        stop: Optional[threading.Event] = None,
        membership: Optional[Membership] = None,
        watch: Callable[[], WhileForming] = WhileForming,
    ) -> GroupMean:
        """Average `fragment` of the pseudo-gradient (its tensors, in order; with error feedback, already
        compensated) with the peers at this outer step that hold the same θ_global (`global_sha256`): the
        group of `membership`'s leader (:mod:`p2p_diloco.sync.membership`), or without one, the group that
        hivemind's matchmaking forms.

        Returns only a mean that every groupmate holds too (see p2p_diloco.sync.commit) and whose every
        reducer passed its audit (p2p_diloco.sync.audit); raises RoundFailed otherwise, and then this peer
        must apply nothing: :class:`LeftBehind` when `watch` (asked once a second until the all-reduce begins)
        says the group went on without this peer; the peers it reads ready at the step meanwhile widen the quorum
        this peer's group needs if this peer leads it (:class:`WhileForming`). A reducer that this peer's own observation convicts (it sent this peer other
        averaged bytes than it states it sent everyone, or this peer's audit found its result wrong) is
        banned from this peer's groups. With `record_sent` the result's ``sent`` holds what the group
        counted of `pseudo_gradient`: the codec's round trip of each of its parts.

        `pseudo_gradient` may be a :class:`PendingDelta` that the inner loop has not handed over yet: the
        group is formed meanwhile, and the all-reduce begins once it is there (`samples` then counts what
        it will hold). The result's ``phases`` say where the round's seconds went.
        """
        stop = stop or threading.Event()
        delta = pseudo_gradient if isinstance(pseudo_gradient, PendingDelta) else PendingDelta(pseudo_gradient)
        _refuse_abandoned(delta)
        token = self.averager.new_token()  # names this attempt in the group's round reports; commits to a secret
        times = RoundTimes(started=time.monotonic())
        try:
            result = self._all_reduce(delta, samples, outer_step, global_sha256, fragment, token, stop,
                                     membership, watch, times)
            times.reduced = time.monotonic()
            digests = self.averager.round_digests(token, timeout=self.cfg.commit_timeout)
            if digests is None:
                raise RoundFailed("the averager holds no record of what travelled in the round", tensors_touched=True)
        except RoundFailed:
            self.reports.publish(outer_step, token, complete=False, mean_sha256=None)
            raise
        mean_sha256 = tensors_sha256(result.mean)
        report = dict(complete=True, mean_sha256=mean_sha256, inputs=digests.inputs, outputs=digests.outputs)
        self.reports.publish(outer_step, token, **report)
        groupmates = {pid: tok for pid, tok in result.tokens.items() if pid != self.peer_id}
        dialable = membership.dialable if membership is not None else ()  # whose silence says they are gone
        void, reports = self.reports.agree(outer_step, groupmates, mean_sha256, self.cfg.commit_timeout, stop,
                                           received=digests.outputs, relayed=digests.relayed, dialable=dialable)
        if void is not None and void.culprit is not None:
            self.averager.ban(void.culprit, "different averaged parts to different peers", void.reason)
        times.agreed = time.monotonic()
        void = void or self._audit(outer_step, token, digests, reports, report, stop, dialable)
        if void is not None:
            raise RoundFailed(f"round void: {void}", tensors_touched=True, reported=True)
        times.audited = time.monotonic()
        result.phases = times.phases()
        return result

    def _audit(self, outer_step: int, token: str, digests: RoundDigests, reports: dict[str, RoundReport],
               report: dict, stop: threading.Event, dialable: Collection[str] = ()) -> Optional[Void]:
        """Audit the reducers this peer audits, publish the verdicts, and wait for every other auditor's:
        None if every reducer of the round passed (see p2p_diloco.sync.audit), else why the round is void.

        The audit is bounded by ``commit_timeout``, and the wait for the other auditors by twice that
        (their audit and their report)."""
        timeout = self.cfg.commit_timeout
        mine = sorted(reducer for reducer, auditor in digests.auditors.items() if auditor == self.peer_id)
        verdicts = {}
        for reducer in mine:
            stated = {sender: (digests.inputs if sender == self.peer_id else reports[sender].inputs).get(reducer)
                      for sender in digests.tokens}
            verdicts[reducer], detail = self.averager.audit(token, reducer, stated, timeout, stop)
            if verdicts[reducer] != AUDIT_OK:
                logger.warning("audit of reducer %s: %s (%s)", reducer, verdicts[reducer], detail)
        if verdicts:
            self.reports.publish(outer_step, token, **report, audits=verdicts)
        failed = next((reducer for reducer in mine if verdicts[reducer] != AUDIT_OK), None)
        if failed is not None:
            return Void(f"this peer's audit of reducer {failed[-8:]} found: {verdicts[failed]}")
        others = {reducer: auditor for reducer, auditor in digests.auditors.items() if auditor != self.peer_id}
        return self.reports.audited(outer_step, digests.tokens, others, 2 * timeout, stop, dialable) if others else None

    def _all_reduce(
        self, delta: PendingDelta, samples: int, outer_step: int, global_sha256: str, fragment: int, token: str,
        stop: threading.Event, membership: Optional[Membership], watch: Callable[[], WhileForming], times: RoundTimes,
    ) -> GroupMean:
        self.averager.set_group_bits(group_bits(outer_step))
        indices = self.averager.fragments[fragment]
        ahead = not delta.settled  # matched ahead of the Δ: the all-reduce waits for its hand-over
        if not ahead:
            _refuse_abandoned(delta)  # the inner loop may have abandoned it since average() looked (a stop)
            self._load(indices, delta, times)
        timeout = round_timeout(self.cfg)
        if membership is not None:
            self.averager.plan_members(token, membership.members)
        control = self.averager.step(
            gather=dict(samples=samples, outer_step=outer_step, global_sha256=global_sha256, token=token, role="peer",
                        fragment=fragment, relay_group=self.cfg.relay_group_size,
                        **(membership.as_gathered() if membership else {})),
            weight=float(samples),
            timeout=timeout,
            allow_retries=False,  # a retry after a broken all-reduce would average half-averaged values
            require_trigger=ahead,
            wait=False,
        )
        deadline = time.monotonic() + timeout + self.cfg.allreduce_timeout
        if ahead:
            self._hand_over(control, delta, indices, stop, times, deadline)
        gathered = self._wait(control, stop.is_set, self._watching(token, membership, watch), deadline, times)
        if gathered is None:
            raise NoGroup()
        metadata = {}
        for peer, meta in gathered.items():  # checked in the averager process already: this cannot fail there
            metadata[peer.to_base58()], problem = parse(GroupMetadata, meta)
            if problem is not None:
                raise RoundFailed(f"groupmate {peer} gathered malformed metadata: {problem}", tensors_touched=True)
        starts = {(meta.outer_step, meta.global_sha256) for meta in metadata.values()}
        if starts != {(outer_step, global_sha256)}:
            raise RoundFailed("groupmates started from different global states", tensors_touched=True)
        with self.averager.get_tensors() as buffers:  # the averager writes `sent` under the same lock
            mean = [buffers[i].clone() for i in indices]
            sent = None if self.averager.sent is None else [self.averager.sent[i].clone() for i in indices]
            carried = None if self.averager.carried is None else [self.averager.carried[i].clone() for i in indices]
        peers = {peer_id: meta for peer_id, meta in metadata.items() if meta.role == "peer"}  # assistants hold no mean
        # as the rule counts them: a robust rule bounds each claim (a lie buys no more here than in the mean)
        counted = dict(zip(peers, counted_claims([m.samples for m in peers.values()], self.averager.aggregation)))
        return GroupMean(
            mean=mean,
            group_size=len(peers),
            group_samples=round(sum(counted.values())),
            tokens={peer_id: meta.token for peer_id, meta in peers.items()},
            sent=sent,
            carried=carried,
            counted_samples=round(counted[self.peer_id]) if self.peer_id in counted else None,
        )

    def _load(self, indices: Sequence[int], delta: PendingDelta, times: RoundTimes) -> None:
        """Put the handed-over Δ into the averager's tensors of the fragment (`indices`)."""
        with self.averager.get_tensors() as buffers:
            for i, tensor in zip(indices, delta.tensors):
                buffers[i].copy_(tensor)
        times.handed_over = time.monotonic()

    def _hand_over(self, control, delta: PendingDelta, indices: Sequence[int], stop: threading.Event,
                   times: RoundTimes, deadline: float) -> None:
        """While the group forms, wait for the inner loop to hand the Δ over, then let the all-reduce begin.
        A peer that stops first, or whose Δ does not come by `deadline`, leaves the round before any tensor
        moves (its groupmates see a member fail, as when a peer leaves mid-round)."""
        while not delta.wait(ROUND_POLL_S):
            times.look(control)
            if stop.is_set() or time.monotonic() > deadline:
                break
        if delta.tensors is None:
            control.cancel()
            raise RoundFailed("cancelled: this peer is stopping" if stop.is_set()
                              else "this peer stopped before its pseudo-gradient was taken" if delta.settled
                              else "this peer's pseudo-gradient did not come in time", tensors_touched=False)
        self._load(indices, delta, times)
        control.allow_allreduce()

    def _watching(self, token: str, membership: Optional[Membership],
                  watch: Callable[[], WhileForming]) -> Callable[[], bool]:
        """`watch` as the wait asks it: whether this peer was left behind, after handing the averager the peers
        its group must hold more than half of, when more are ready than its plan named (as the round's leader it
        then runs only with a majority of them: :class:`~p2p_diloco.sync.membership.PlannedMatchmaking`)."""
        quorum = frozenset(membership.members) if membership is not None else frozenset()

        def left_behind() -> bool:
            nonlocal quorum
            seen = watch()
            if membership is not None and not seen.quorum <= quorum:
                quorum |= seen.quorum
                self.averager.plan_members(token, sorted(quorum))
            return seen.left_behind

        return left_behind

    def _wait(self, control, should_stop: Callable[[], bool], left_behind: Callable[[], bool], deadline: float,
              times: RoundTimes):
        """Wait for the round, polling `should_stop` so that Ctrl+C cancels it within a second, and until its
        group has formed, `left_behind` once a second; `times` gets the moment the group was seen formed.

        Not after the group formed: hivemind looks at a cancel only once its matchmaking returns, so a cancel just
        after a group was matched did not stop its all-reduce, and this peer's parts went into a round it had
        given up on (under a busy core, "Can't set_result to a future that is CANCELLED"); its averager, still in
        that round, then queued its next matchmaking behind it ("Another look_for_group is already in progress"),
        and a late joiner missed round after round (tests/test_library.py, 2 runs of 28 beside a busy core)."""
        next_look = time.monotonic()
        while True:
            times.look(control)
            if should_stop() and control.cancel():
                raise RoundFailed("cancelled: this peer is stopping", tensors_touched=control.began_allreduce)
            if control.stage not in ASSEMBLED and not control.began_allreduce and time.monotonic() >= next_look:
                next_look = time.monotonic() + LEFT_BEHIND_POLL_S
                if left_behind() and control.cancel():  # cancel() refuses once the all-reduce has begun
                    raise LeftBehind()
            if time.monotonic() > deadline and control.cancel():  # the averager never answered: do not hang
                raise RoundFailed("the averager did not finish the round in time", tensors_touched=True)
            try:
                gathered = control.result(timeout=ROUND_POLL_S)
            except concurrent.futures.TimeoutError:
                continue
            except MatchmakingException as e:  # hivemind wraps a broken all-reduce (PartialRoundError too) in this
                raise RoundFailed(f"all-reduce failed: {e}", tensors_touched=True) from e
            except concurrent.futures.CancelledError as e:
                raise RoundFailed("cancelled", tensors_touched=control.began_allreduce) from e
            except Exception as e:  # hivemind raises a handful of types for a round that never formed
                raise NoGroup(f"no group formed: {e!r}") from e
            times.assembled = times.assembled or time.monotonic()
            return gathered

    def set_state_priority(self, priority: float) -> None:
        """Joiners download from the peer with the highest priority first (a client serves no state)."""
        if not self.client_mode:
            self.averager.state_sharing_priority = priority

    def share_state(self, allowed: bool) -> None:
        """Serve this peer's state to joiners, or stop (while it replaces its state); a client never does."""
        self.averager.allow_state_sharing = allowed and not self.client_mode

    def shutdown(self) -> None:
        if self.averager.is_alive():
            self.averager.shutdown()
