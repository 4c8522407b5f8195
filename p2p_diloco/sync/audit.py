"""Reducers are checked: what travelled in a round is on record, and a second member recomputes each
reducer's result.

In the butterfly all-reduce each part has one author, its reducer, and every member copies the
bytes that reducer sends (:mod:`p2p_diloco.sync.exact_allreduce`). Agreement on the mean's sha256
(:mod:`p2p_diloco.sync.commit`) shows that everyone got the same bytes, not that they are right, and
when they are not the same it does not say whose fault that is. So:

* **What travelled is on record.** Every input of a reducer is bytes in the run's codec, its own
  parts included (they are encoded and decoded like everyone's). In each round every member keeps a
  :class:`RoundLedger` (in the averager process): the sha256 of the hash list of the chunks of the
  encoded parts it sent each reducer (:func:`~p2p_diloco.sync.spot_check.input_digest`) and of the
  averaged parts it got back from each, all parts in order (for itself, its own
  encoded parts and its own encoded results), and as a reducer the encoded parts each sender sent it,
  for the last :data:`KEPT_ROUNDS` rounds. The digests go into its signed round report (``inputs``,
  ``outputs``: :class:`~p2p_diloco.swarm.records.RoundReport`).
* **A reducer that sends different bytes to different members is pinned.** Its own report states
  the digest of what it sent (its ``outputs`` entry for itself). A member that got other bytes
  voids the round and bans it (:func:`~p2p_diloco.sync.commit.judge`): its own observation against
  the reducer's own signed word, so no groupmate can frame a reducer this way.
* **Each reducer's result is spot-checked.** Each reducer is audited by one other member
  (:func:`auditors`: a rotation of the sorted peer IDs by a seed every member computes from the
  round's tokens). As soon as its all-reduce is done, while the members exchange their reports, the
  auditor reveals its secret, whose commitment is its attempt token (:mod:`p2p_diloco.sync.spot_check`:
  the reducer cannot know it before it sent its result), and fetches from the reducer
  (:meth:`ReducerAudit.rpc_audit_inputs`, which answers its auditor in that round alone, after it
  checked the secret against the token) one chunk in 12 of its inputs, drawn from that secret: each
  sender's hash list and the sampled chunks of each
  sender's parts; it recomputes those chunks with the reducer's own function
  (:func:`~p2p_diloco.sync.spot_check.aggregate_in_chunks`, a fixed function of each chunk's decoded
  values) and compares them with the averaged bytes it received, whose digest is the reducer's
  signed statement. Once every report agrees, it checks each hash list against the digest its
  sender states and each chunk against its entry, and only then does the recomputation count
  (:func:`check_reducer`). Its verdict goes into its report; every member waits for every verdict
  before it applies the round, and anything but "ok" voids it. A wrong result gets the reducer
  banned by its auditor. The audit moves 1/12 of a reducer's inputs plus 32 bytes a chunk: at most
  8.7 % of a peer's all-reduce bytes with the 4-bit codecs (docs/benchmarks.md, "Bytes per phase").

What this does not stop:

* A hostile auditor can void rounds (a false verdict, or none): denial of service, never a wrong
  mean applied nor an honest reducer banned by an honest member (the auditor bans on its own list).
* A reducer that changes few of its chunks is caught with the probability that the sample holds
  one of them: ``1 − C(N − k, s) / C(N, s)`` for k changed of N chunks and s sampled, at least
  ``1 − (1 − k/N)^s`` (docs/security.md has the table), in each round anew. It is caught at once if
  it changes a value in every chunk (the garbage reducer of the hostile tests). The update check
  (:mod:`p2p_diloco.train.update_check`) bounds what it moves.
* A hostile reducer audited by a hostile member passes a wrong result on its parts. Robust
  aggregation does not bound it (the reducer is the one that aggregates); the check of the update
  before it is applied does (:mod:`p2p_diloco.train.update_check`). The seed is the
  sha256 of the gathered tokens, and a group's leader gathers its own token last: a hostile leader
  can pick among the n − 1 rotations, so with one colluding identity in the group it can be audited
  by it.
* With the two-byte floats (``fp16``, ``bf16``), whose conversion a CPU may flush to zero below their
  normal range, the auditor accepts bytes that decode within the codec's error bound of the
  recomputed result (:func:`off_values`): a hostile reducer can move each value of its parts by up to
  that bound. With ``none`` and the block codecs (``int8``, ``nf4``, ``fp4-bnb`` and the default
  ``fp4-e3m0``), whose encoding is IEEE arithmetic and table lookups alone, every value must be the
  auditor's own encoding (values below 2^-100 aside).
* When the bytes a reducer serves for a sender do not match that sender's digest, either may lie:
  the round is void and nobody is banned. A hostile reducer can thus void its rounds unpunished,
  never pass a wrong result.
* Assistants (:mod:`p2p_diloco.sync.assistant`) are not audited and audit nobody: they publish no
  round report to state their results in (they reduce for runs whose peers are all unreachable). A
  run that relies on assistants trusts the node that runs them (the bootstrap node); different
  bytes from an assistant to different peers still void the round, unpinned.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterable, Optional, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import anext

from p2p_diloco.remote_input import warn_once
from p2p_diloco.swarm.records import AUDIT_OK, INPUTS_DIFFER, UNAVAILABLE, WRONG_MEAN
from p2p_diloco.sync import spot_check
from p2p_diloco.sync.codecs import Codec
from p2p_diloco.sync.robust import AggregationRule, aggregate

logger = logging.getLogger(__name__)

KEPT_ROUNDS = 2  # a reducer keeps the inputs of its last rounds for their auditors


def auditors(tokens: dict[str, str], reducers: Iterable[str]) -> dict[str, str]:
    """reducer -> its auditor, among the members of `tokens` (peer ID -> the attempt token it gathered).

    Every member computes the same: with the members' peer IDs sorted and ``seed`` the sha256 of
    their sorted tokens, the auditor of member i is member (i + 1 + seed mod (n − 1)) mod n, never
    the reducer itself. Reducers that are not members (assistants) are not audited.
    """
    members = sorted(tokens)
    if len(members) < 2:
        return {}
    seed = int.from_bytes(hashlib.sha256(",".join(sorted(tokens.values())).encode()).digest(), "big")
    shift = 1 + seed % (len(members) - 1)
    return {reducer: members[(members.index(reducer) + shift) % len(members)]
            for reducer in sorted(set(reducers)) if reducer in tokens}


def digest(parts: Iterable[bytes]) -> str:
    """The sha256 of parts in order, as the round reports state it."""
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(part)
    return hasher.hexdigest()


@dataclass(frozen=True)
class RoundDigests:
    """What travelled in a round, for this peer's round report (peer IDs in base58)."""

    inputs: dict[str, str]  # reducer -> sha256 of the hash list of the chunks of the parts this peer sent it
    outputs: dict[str, str]  # reducer -> sha256 of the averaged parts this peer got from it
    auditors: dict[str, str]  # reducer -> its auditor
    tokens: dict[str, str]  # member (role "peer") -> its attempt token
    relayed: tuple[str, ...] = ()  # the reducers whose averaged parts came through a relay (sync/relay.py)


@dataclass
class RoundLedger:
    """What travelled in one all-reduce round, as this peer saw it (kept in the averager process).

    The runner (:class:`~p2p_diloco.sync.exact_allreduce.ExactAllReduceRunner`) records every part as
    it goes; parts of one stream go in order, so each reducer's digests are of all its parts in order.
    """

    peer_id: PeerID
    token: str  # this peer's attempt token: names the round
    tokens: dict[PeerID, str]  # each member of role "peer" -> its token (assistants are not in it)
    senders: list[PeerID]  # in sender order: the order of the reducer's aggregate
    weights: list[float]  # each sender's weight (the samples it gathered), in sender order
    part_numels: dict[PeerID, list[int]]  # reducer -> the values of each of its parts
    auditors: dict[PeerID, PeerID]  # reducer -> its auditor
    codec: Optional[Codec] = None  # the round's parts' (Codec.for_round); None: the averager's codec as it is
    secret: Optional[bytes] = None  # this peer's, whose commitment is its token: the seed of the sample it audits
    _sent: dict[PeerID, Any] = field(default_factory=dict)  # reducer -> sha256 of the parts sent it, so far
    _received: dict[PeerID, Any] = field(default_factory=dict)  # reducer -> sha256 of its averaged parts, so far
    kept_outputs: dict[PeerID, list[bytes]] = field(default_factory=dict)  # of the reducers this peer audits
    inputs: dict[PeerID, list[bytes]] = field(default_factory=dict)  # as a reducer: each sender's parts, in order
    relayed: set[PeerID] = field(default_factory=set)  # the reducers this peer reached through a relay
    # of the reducers this peer audits: the fetch of their inputs and the recomputation, begun as soon as
    # this peer's all-reduce is done (ReducerAudit.prepare_audits), awaited once the round's reports agree
    prepared: dict[PeerID, "asyncio.Task[FetchedInputs]"] = field(default_factory=dict)

    def sender_names(self) -> list[str]:
        """The senders' peer IDs in base58, in sender order: the keys of an audit's inputs and digests."""
        return [sender.to_base58() for sender in self.senders]

    @classmethod
    def for_round(cls, peer_id: PeerID, token: str, tokens: dict[PeerID, str], ordered_peer_ids: Sequence[PeerID],
                  senders: Sequence[PeerID], weights: dict[PeerID, float],
                  part_numels: dict[PeerID, list[int]], codec: Optional[Codec] = None) -> "RoundLedger":
        reducers = [p for p in ordered_peer_ids if part_numels.get(p)]
        by_name = {p.to_base58(): p for p in ordered_peer_ids}
        assigned = auditors({p.to_base58(): t for p, t in tokens.items()}, [r.to_base58() for r in reducers])
        return cls(peer_id, token, dict(tokens), list(senders),
                   [weights[s] for s in senders], dict(part_numels),
                   {by_name[r]: by_name[a] for r, a in assigned.items()}, codec)

    def sent_input(self, reducer: PeerID, data: bytes, numel: int, codec: Codec) -> None:
        """This peer sent `reducer` its next encoded part, of `numel` values in `codec` (the round's): its
        chunks' hashes go into the hash list whose sha256 the report states (:func:`spot_check.input_digest
        <p2p_diloco.sync.spot_check.input_digest>`)."""
        self._sent.setdefault(reducer, hashlib.sha256()).update(spot_check.chunk_hashes(codec, data, numel))

    def received_output(self, reducer: PeerID, data: bytes) -> None:
        """`reducer` sent this peer its next averaged part (this peer's own, for its own parts)."""
        self._received.setdefault(reducer, hashlib.sha256()).update(data)
        if self.auditors.get(reducer) == self.peer_id:
            self.kept_outputs.setdefault(reducer, []).append(bytes(data))

    def received_input(self, sender: PeerID, part_index: int, data: bytes) -> None:
        """As a reducer: `sender` sent its encoded part `part_index` (parts of one sender come in order)."""
        parts = self.inputs.setdefault(sender, [])
        if part_index == len(parts):
            parts.append(bytes(data))

    def digests(self) -> RoundDigests:
        return RoundDigests(
            inputs={r.to_base58(): h.hexdigest() for r, h in self._sent.items()},
            outputs={r.to_base58(): h.hexdigest() for r, h in self._received.items()},
            auditors={r.to_base58(): a.to_base58() for r, a in self.auditors.items()},
            tokens={p.to_base58(): t for p, t in self.tokens.items()},
            relayed=tuple(sorted(r.to_base58() for r in self.relayed)),
        )


Served = tuple[bytes, list[bytes]]  # a sender's hash list, and its sampled chunks in sample order


@dataclass(frozen=True)
class FetchedInputs:
    """What a reducer served its auditor of its inputs, and the auditor's recomputation on them."""

    sample: list[int]  # the chunks checked (spot_check.reducer_chunks' numbering)
    served: dict[str, Served]  # sender (base58) -> its hash list and sampled chunks, as the reducer holds them
    recomputed: tuple[str, str]  # (verdict, detail) of :func:`recompute_sample` on these chunks


def served_inputs(codec: Codec, part_numels: Sequence[int], parts: Sequence[Sequence[bytes]],
                  sample: Sequence[int]) -> list[Served]:
    """What a reducer serves its auditor: for each sender's encoded parts in `parts` (in sender order), the
    hash list of its chunks (:func:`~p2p_diloco.sync.spot_check.hash_list`) and the bytes of the chunks of
    `sample`."""
    chunks = spot_check.reducer_chunks(codec, part_numels)
    served = []
    for sender_parts in parts:
        if len(sender_parts) != len(part_numels):  # a sender that failed mid-round: nothing to show of it
            served.append((b"", []))
            continue
        served.append((spot_check.hash_list(codec, sender_parts, part_numels),
                       [spot_check.chunk_bytes(codec, sender_parts[chunks[k][0]], part_numels[chunks[k][0]],
                                               *chunks[k][1:]) for k in sample]))
    return served


def check_reducer(codec: Codec, rule: AggregationRule, part_numels: Sequence[int], senders: Sequence[str],
                  weights: Sequence[float], sample: Sequence[int], served: dict[str, Served],
                  input_digests: dict[str, Optional[str]], outputs: Sequence[bytes]) -> tuple[str, str]:
    """(verdict, detail) on a reducer's results `outputs` (its averaged parts, as sent) on the chunks of
    `sample`, from what it served of each sender's inputs (`served`: sender -> hash list and sampled
    chunks) and the digests the senders state of them (`input_digests`).

    Verdicts: "inputs differ" (what it served of a sender is not what that sender states it sent, or does
    not decode: the reducer or the sender lies), "wrong mean" (a sampled chunk of a result is not the
    recomputed one), "ok". The inputs are judged first (:func:`judge_served`): a result recomputed from
    inputs nobody stated convicts nobody.
    """
    return (judge_served(senders, len(spot_check.reducer_chunks(codec, part_numels)), sample, served, input_digests)
            or recompute_sample(codec, rule, part_numels, senders, weights, sample, served, outputs))


def judge_served(senders: Sequence[str], chunks: int, sample: Sequence[int], served: dict[str, Served],
                 input_digests: dict[str, Optional[str]]) -> Optional[tuple[str, str]]:
    """("inputs differ", detail) if what a reducer served of a sender is not bound to the digest that sender
    states (`input_digests`): its hash list (of `chunks` entries) hashes to another digest, or a sampled
    chunk to another entry of the list. None if every sender's is."""
    for sender in senders:
        hashes, sampled = served.get(sender, (b"", []))
        wrong = (len(hashes) != spot_check.HASH_BYTES * chunks or len(sampled) != len(sample)
                 or spot_check.input_digest(hashes) != input_digests.get(sender)
                 or any(hashlib.sha256(chunk).digest() != hashes[spot_check.HASH_BYTES * k:spot_check.HASH_BYTES * (k + 1)]
                        for k, chunk in zip(sample, sampled)))
        if wrong:
            return INPUTS_DIFFER, f"the chunks it holds from {sender[-8:]} are not those that sender states it sent"
    return None


def recompute_sample(codec: Codec, rule: AggregationRule, part_numels: Sequence[int], senders: Sequence[str],
                     weights: Sequence[float], sample: Sequence[int], served: dict[str, Served],
                     outputs: Sequence[bytes]) -> tuple[str, str]:
    """(verdict, detail) on the chunks `sample` of a reducer's results `outputs`, recomputed from the
    senders' chunks in `served` as the reducer computes them: the senders' decoded chunks in sender
    order, :func:`~p2p_diloco.sync.robust.aggregate` under `rule` with the senders' `weights` (a chunk's
    result is the reducer's: :func:`~p2p_diloco.sync.spot_check.aggregate_in_chunks`). "inputs differ"
    if a chunk does not decode, "wrong mean" if a result is not the recomputed one (where the auditor's
    own encoding of a result differs from the reducer's bytes, :func:`off_values` says which values are
    wrong), else "ok". Whether the chunks are the senders' is :func:`judge_served`'s question."""
    if len(outputs) != len(part_numels):  # this peer's own record of the round is short: nobody to blame
        return UNAVAILABLE, f"this peer kept {len(outputs)} of the reducer's {len(part_numels)} averaged parts"
    chunks = spot_check.reducer_chunks(codec, part_numels)
    for position, k in enumerate(sample):
        index, start, stop = chunks[k]
        try:
            values = [codec.decode(served[sender][1][position], stop - start) for sender in senders]
        except (ValueError, IndexError, KeyError) as e:
            return INPUTS_DIFFER, f"chunk {k} of a sender does not decode: {e}"
        result = aggregate(values, list(weights), rule)
        try:
            averaged = spot_check.chunk_bytes(codec, outputs[index], part_numels[index], start, stop)
            if codec.encode(result) == averaged:
                continue
            sent = codec.decode(averaged, stop - start)
        except ValueError as e:
            return WRONG_MEAN, f"averaged part {index} does not decode: {e}"
        off = int(off_values(codec, sent, result).sum())
        if off:
            return WRONG_MEAN, (f"averaged part {index}, values {start}-{stop}: {off} of {stop - start} are not the "
                                f"{rule.name} of the inputs")
    return AUDIT_OK, ""


def _retrieved(task: asyncio.Task) -> None:
    """Mark a finished task's exception as seen (asyncio logs those that nobody retrieved)."""
    if not task.cancelled():
        task.exception()


NEGLIGIBLE = 2.0**-100  # far below any pseudo-gradient value a run applies; above float32's subnormals


def off_values(codec: Codec, sent: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """Which values of a reducer's decoded part `sent` are not the codec's image of the recomputed `result`.

    With a codec whose encoding is reproducible (``Codec.reproducible_encode``: ``none`` and the block
    codecs ``int8``, ``nf4``, ``fp4-bnb``, ``fp4-e3m0``) every value must be the decoded value of the
    auditor's own encoding, except values both below :data:`NEGLIGIBLE` (a CPU that flushes subnormals
    codes those differently). With the two-byte floats, whose encoding is not claimed reproducible, a
    value must be within the codec's error bound of the result."""
    if codec.reproducible_encode:
        expected = codec.decode(codec.encode(result), result.numel())
        return (sent != expected) & ~((sent.abs() <= NEGLIGIBLE) & (expected.abs() <= NEGLIGIBLE))
    return (sent - result).abs().gt(codec.error_bound(result))


class ReducerAudit(DecentralizedAverager):
    """The averager's side of the checks on reducers (see the module's docstring).

    The ledgers of the last :data:`KEPT_ROUNDS` rounds live in the averager process, keyed by this
    peer's attempt token; the host process reaches them through hivemind's control pipe
    (:meth:`round_digests`, :meth:`audit`, :meth:`ban`), as :mod:`p2p_diloco.sync.state_transfer` does.
    It is mixed into an averager with a codec (``self.codec``), an aggregation rule
    (``self.aggregation``) and a group screen (``self.screen``).
    """

    def __init__(self, *args, **kwargs):
        self._ledgers: OrderedDict[str, RoundLedger] = OrderedDict()  # the averager process's own copy is used
        self._secrets: OrderedDict[str, bytes] = OrderedDict()  # token -> this peer's secret of that attempt
        super().__init__(*args, **kwargs)

    def new_token(self, timeout: float = 5.0) -> str:
        """A token for this peer's next attempt at a round (host process): the commitment to a secret the
        averager keeps (:func:`~p2p_diloco.sync.spot_check.token_of`), revealed to the reducer this peer
        audits in that round once it holds its results."""
        secret = secrets.token_bytes(spot_check.SECRET_BYTES)
        token = spot_check.token_of(secret)
        self._call("_keep_secret", wait_s=timeout, token=token, secret=secret)
        return token

    async def _keep_secret(self, future: MPFuture, token: str, secret: bytes) -> None:
        self._secrets[token] = secret
        while len(self._secrets) > 4 * KEPT_ROUNDS:  # attempts that never reached an all-reduce leave theirs
            self._secrets.popitem(last=False)
        future.set_result(True)

    def keep_ledger(self, ledger: RoundLedger) -> None:
        """Keep `ledger` (averager process), and only the last :data:`KEPT_ROUNDS`, with this peer's secret."""
        ledger.secret = self._secrets.get(ledger.token)
        self._ledgers[ledger.token] = ledger
        while len(self._ledgers) > KEPT_ROUNDS:
            _, dropped = self._ledgers.popitem(last=False)
            for task in dropped.prepared.values():
                task.cancel()

    def prepare_audits(self, ledger: RoundLedger) -> None:
        """Begin this peer's audits of `ledger`'s round (averager process), once its all-reduce is done:
        fetch each audited reducer's inputs and recompute its results, while the members exchange their
        reports (:mod:`p2p_diloco.sync.commit`). The verdict waits for those reports (:meth:`audit`): the
        senders' digests judge the inputs first. Every input is there by then: this peer holds all of
        the reducer's averaged parts, and a reducer answers a part only once every sender's is in."""
        for reducer, auditor in ledger.auditors.items():
            if auditor == self.peer_id and reducer not in ledger.prepared:
                task = ledger.prepared[reducer] = asyncio.ensure_future(self._fetch_and_recompute(ledger, reducer))
                task.add_done_callback(_retrieved)  # a round void before its audit never asks for the verdict

    def _call(self, method: str, wait_s: float, stop: Optional[threading.Event] = None, **kwargs):
        """Run coroutine `method` in the averager process; its result, or None if none came within
        `wait_s`, `stop` was set meanwhile (polled twice a second), or the averager process is gone."""
        future = MPFuture()
        try:
            self._outer_pipe.send((method, [], dict(future=future, **kwargs)))
        except (OSError, ValueError) as e:  # the pipe is closed: the averager has shut down
            logger.debug("the averager did not take %s: %r", method, e)
            return None
        deadline = time.monotonic() + wait_s
        while not (stop is not None and stop.is_set()) and time.monotonic() < deadline:
            try:
                return future.result(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                continue
        future.cancel()
        return None

    def round_digests(self, token: str, timeout: float) -> Optional[RoundDigests]:
        """What travelled in this peer's round `token` (None if the averager holds no such round)."""
        return self._call("_round_digests", wait_s=timeout, token=token)

    async def _round_digests(self, future: MPFuture, token: str) -> None:
        ledger = self._ledgers.get(token)
        future.set_result(None if ledger is None else ledger.digests())

    def ban(self, peer_id: str, what: str, problem: str, timeout: float = 5.0) -> None:
        """Ban `peer_id` (base58) from this peer's groups: the ban list lives in the averager process."""
        self._call("_ban", wait_s=timeout, peer_id=peer_id, what=what, problem=problem)

    async def _ban(self, future: MPFuture, peer_id: str, what: str, problem: str) -> None:
        self.screen.ban(PeerID.from_base58(peer_id), what, problem)
        future.set_result(True)

    def banned_peers(self, timeout: float = 5.0) -> Optional[list[str]]:
        """The peers (base58) this averager refuses to average with, sorted (None if it did not answer)."""
        return self._call("_banned_peers", wait_s=timeout)

    async def _banned_peers(self, future: MPFuture) -> None:
        future.set_result(sorted(peer_id.to_base58() for peer_id in self.screen.banned))

    def audit(self, token: str, reducer: str, input_digests: dict[str, Optional[str]],
              timeout: float, stop: Optional[threading.Event] = None) -> tuple[str, str]:
        """(verdict, detail) of this peer's audit of `reducer` (base58) in its round `token`, given what
        each sender states it sent the reducer (sender -> sha256); a reducer found wrong is banned here.
        The fetch and the recomputation are bounded by `timeout`; past it, or once `stop` is set, the
        verdict is "unavailable"."""
        outcome = self._call("_audit", wait_s=timeout + 5.0, stop=stop, token=token, reducer=reducer,
                             input_digests=input_digests, timeout=timeout)
        return outcome if outcome is not None else (UNAVAILABLE, f"no verdict from the averager in {timeout:.0f} s")

    async def _audit(self, future: MPFuture, token: str, reducer: str, input_digests: dict[str, Optional[str]],
                     timeout: float) -> None:
        try:
            ledger = self._ledgers.get(token)
            reducer_id = PeerID.from_base58(reducer)
            if ledger is None or ledger.auditors.get(reducer_id) != self.peer_id:
                future.set_result((UNAVAILABLE, "this peer does not audit that reducer in that round"))
                return
            self.prepare_audits(ledger)  # begun at the all-reduce's end, unless that ended some other way
            prepared = ledger.prepared[reducer_id]
            try:
                fetched = await asyncio.wait_for(prepared, timeout)
            except Exception as e:  # a broken stream, a timeout, a refusal
                future.set_result((UNAVAILABLE, f"could not fetch the reducer's inputs: {e!r}"))
                return
            chunks = len(spot_check.reducer_chunks(self._round_codec(ledger), ledger.part_numels[reducer_id]))
            verdict = (judge_served(ledger.sender_names(), chunks, fetched.sample, fetched.served, input_digests)
                       or fetched.recomputed)
            if verdict[0] == WRONG_MEAN:
                self.screen.ban(reducer_id, "a wrong all-reduce result", verdict[1])
            future.set_result(verdict)
        except BaseException as e:
            if not future.done():
                future.set_result((UNAVAILABLE, f"the audit failed: {e!r}"))
            if not isinstance(e, Exception):
                raise

    def _round_codec(self, ledger: RoundLedger) -> Codec:
        return ledger.codec or self.codec

    async def _fetch_and_recompute(self, ledger: RoundLedger, reducer: PeerID) -> FetchedInputs:
        """`reducer`'s sampled inputs in `ledger`'s round (:meth:`_fetch_inputs`) and its results recomputed on
        them. The sample is drawn from this peer's secret, revealed now: it holds every averaged part of the
        reducer."""
        if ledger.secret is None:
            raise ValueError("this peer holds no secret for its round: it took its token elsewhere")
        senders, codec = ledger.sender_names(), self._round_codec(ledger)
        part_numels = ledger.part_numels[reducer]
        chunks = spot_check.reducer_chunks(codec, part_numels)
        sample = spot_check.spot_sample(spot_check.sample_seed(ledger.secret), reducer.to_base58(), len(chunks))
        began = time.monotonic()
        served = dict(zip(senders, await self._fetch_inputs(ledger, reducer, sample)))
        fetched = time.monotonic()
        recomputed = await asyncio.get_event_loop().run_in_executor(
            None, recompute_sample, codec, self.aggregation, part_numels, senders, ledger.weights, sample, served,
            ledger.kept_outputs.get(reducer, []))
        logger.info("audit of reducer %s: %d of its %d chunks (%.2f MB of its inputs) fetched in %.2f s, "
                    "recomputed in %.2f s", reducer.to_base58()[-8:], len(sample), len(chunks),
                    sum(len(h) + sum(map(len, c)) for h, c in served.values()) / 1e6,
                    fetched - began, time.monotonic() - fetched)
        return FetchedInputs(sample, served, recomputed)

    async def _fetch_inputs(self, ledger: RoundLedger, reducer: PeerID, sample: list[int]) -> list[Served]:
        """What `reducer` holds from each sender of `ledger`'s round, in sender order: the hash list of its
        chunks and the chunks of `sample`. Each message is bounded by what it must hold (a hash list of one
        entry per chunk; a chunk of its size in the codec): a longer one ends the fetch."""
        codec = self._round_codec(ledger)
        chunks = spot_check.reducer_chunks(codec, ledger.part_numels[reducer])
        sizes = [codec.encoded_size(chunks[k][2] - chunks[k][1]) for k in sample]
        chunk_timeout = self.next_chunk_timeout if self.next_chunk_timeout is not None else self.request_timeout
        stub = self.get_stub(self._p2p, reducer, namespace=self.prefix)
        request = averaging_pb2.DownloadData(metadata=audit_request(ledger.tokens[reducer], ledger.secret))
        self.traffic.add(sent=request.ByteSize(), phase="audit")
        stream = await asyncio.wait_for(stub.rpc_audit_inputs(request), self.request_timeout)
        inputs = []
        try:
            for _ in ledger.senders:
                message = await asyncio.wait_for(anext(stream), chunk_timeout)
                self.traffic.add(received=message.ByteSize(), phase="audit")
                if len(message.metadata) != spot_check.HASH_BYTES * len(chunks):
                    raise ValueError(f"the reducer sent a hash list of {len(message.metadata)} bytes, "
                                     f"{spot_check.HASH_BYTES * len(chunks)} expected")
                hashes, sampled = message.metadata, []
                for size in sizes:
                    message = await asyncio.wait_for(anext(stream), chunk_timeout)
                    self.traffic.add(received=message.ByteSize(), phase="audit")
                    if len(message.tensor_part.buffer) > size:
                        raise ValueError(f"the reducer sent a chunk of {len(message.tensor_part.buffer)} bytes, "
                                         f"at most {size} expected")
                    sampled.append(message.tensor_part.buffer)
                inputs.append((hashes, sampled))
        finally:
            await stream.aclose()  # this end closes the stream: the reducer's handler may now return
        return inputs

    def served_inputs(self, ledger: RoundLedger, sample: list[int]) -> list[Served]:
        """What this peer, as a reducer of `ledger`'s round, serves its auditor (:func:`served_inputs`): the
        seam a hostile test peer patches."""
        return served_inputs(self._round_codec(ledger), ledger.part_numels[self.peer_id],
                             [ledger.inputs.get(sender, ()) for sender in ledger.senders], sample)

    async def rpc_audit_inputs(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """What this peer received as a reducer in its round named by the request (:func:`audit_request`):
        sender by sender in sender order, the hash list of its chunks (``metadata``), then the chunks of the
        sample that the auditor's secret draws, in order. Only to this peer's auditor in that round (a
        groupmate, by the rule every member computes), and only if the secret is the one its token commits
        to: the others' pseudo-gradients go to nobody else, and to it only that sample; nothing for a round
        this peer no longer keeps.

        Like the all-reduce's handler (:meth:`ExactAllReduceRunner.rpc_aggregate_part
        <p2p_diloco.sync.exact_allreduce.ExactAllReduceRunner.rpc_aggregate_part>`), it keeps the stream
        open once it has sent everything, until the auditor closes it (at most ``next_chunk_timeout``):
        a stream closed by this end may lose its last bytes in transit."""
        self.traffic.add(received=request.ByteSize(), phase="audit")
        token, secret = read_audit_request(request.metadata)
        ledger = self._ledgers.get(token)
        if ledger is None:  # an old round, or a made-up token: its auditor's verdict is "unavailable"
            return
        if ledger.auditors.get(self.peer_id) != context.remote_id:
            warn_once(context.remote_id.to_base58(), "a request for the inputs of a round it does not audit")
            return
        if secret is None or spot_check.token_of(secret) != ledger.tokens.get(context.remote_id):
            warn_once(context.remote_id.to_base58(), "an audit request whose secret is not its token's")
            return
        chunks = len(spot_check.reducer_chunks(self._round_codec(ledger), ledger.part_numels[self.peer_id]))
        sample = spot_check.spot_sample(spot_check.sample_seed(secret), self.peer_id.to_base58(), chunks)
        for hashes, sampled in self.served_inputs(ledger, sample):
            for message in (averaging_pb2.DownloadData(metadata=hashes),
                            *(averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(buffer=c)) for c in sampled)):
                self.traffic.add(sent=message.ByteSize(), phase="audit")
                yield message
        await asyncio.sleep(self.next_chunk_timeout if self.next_chunk_timeout is not None else self.request_timeout)


def audit_request(token: str, secret: bytes) -> bytes:
    """The ``metadata`` of an auditor's request: the reducer's attempt token and the auditor's secret."""
    return f"{token}:{secret.hex()}".encode()


def read_audit_request(metadata: bytes) -> tuple[str, Optional[bytes]]:
    """(token, secret) of a request; None for the secret if malformed."""
    token, _, secret = metadata.decode("ascii", errors="replace").partition(":")
    try:
        revealed = bytes.fromhex(secret)
    except ValueError:
        return token, None
    return token, revealed if len(revealed) == spot_check.SECRET_BYTES else None
