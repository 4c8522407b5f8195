"""The run's DHT records, their schemas, and the validators that keep strangers' records out.

A run keeps three keys on the DHT, each a dictionary with one subkey per peer:

* ``<run>_progress``: where each peer is (:mod:`p2p_diloco.swarm.progress`);
* ``<run>_rounds``: each peer's reports on its last averaging rounds (:mod:`p2p_diloco.sync.commit`);
* ``<run>_status``: what each peer tells people and joiners about itself (:mod:`p2p_diloco.swarm.status`).

Two keys are shared by all runs: ``p2p_diloco_assistance``, where unreachable peers ask reachable
nodes (bootstrap nodes, which know no run) to reduce for their run (:mod:`p2p_diloco.sync.assistant`),
and ``p2p_diloco_runs``, where each peer names its run (for ``p2p-diloco status``).

Every subkey is a peer's *owner marker* (``[owner:<its RSA public key>]``) and every value is signed
by that key. Each node of a run checks every record it is asked to store or receives in a reply
with two hivemind validators (``hivemind/dht/validation.py`` says when they run):

* :class:`LoggedSignatureValidator` (hivemind's ``RSASignatureValidator``): a record under a
  peer's marker must carry that peer's signature, so nobody can write another peer's record;
* :class:`LoggedSchemaValidator` (hivemind's ``SchemaValidator``): the subkey must be an owner
  marker (unsigned records are refused) and the value must match the schema below, with strict types.

A private run (``run.allowed_peers``) adds a third, :class:`RunMembers`: a record of the run's keys
(and an assistance request or run announcement naming the run) whose author is not listed is refused.

A refused record never reaches the application; it is logged once per author and kind. The author
of an accepted record is the peer whose key signed it (:func:`~p2p_diloco.swarm.identity.owner_peer_id`),
never a peer ID written inside the value.
"""

from __future__ import annotations

import logging
import threading
from typing import Dict, Iterable, Iterator, Literal, Optional, Type, Union

import pydantic.v1 as pydantic
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.remote_input import (
    MAX_TENSORS, Count, FiniteFloat, Model, OuterStep, Sha256Hex, StrictModel, Token, parse, warn_once,
)
from p2p_diloco.swarm.identity import Identity, owner_peer_id

logger = logging.getLogger(__name__)



PeerIdText = pydantic.constr(strict=True, regex=r"^[1-9A-HJ-NP-Za-km-z]{32,64}$")  # base58, as libp2p writes it
LeaderText = pydantic.constr(strict=True, regex=r"^([1-9A-HJ-NP-Za-km-z]{32,64})?$")  # a peer ID, or "" for none


class ProgressValue(StrictModel):
    """A peer's progress record (see :class:`p2p_diloco.protocol.view.PeerProgress`)."""

    outer_step: OuterStep
    sha256: Sha256Hex
    # committing: its group agreed on the round's mean; keeping: the run's keeper (train/keeper.py)
    phase: Literal["training", "ready", "committing", "loading", "keeping", "left"]
    samples: Count
    time: FiniteFloat
    fingerprint: Sha256Hex
    reachability: Literal["direct", "unreachable"]  # see p2p_diloco.swarm.reachability
    # ready: the leader it asks first in its round (p2p_diloco.protocol.membership); "" in every other record (a
    # field always present: hivemind's schema check refuses a record whose parsed form differs from it)
    leader: LeaderText


MAX_SHARDS = 2**20
MAX_SETTINGS = 128  # p2p_diloco.config.shared_settings has about 50
SettingName = pydantic.constr(strict=True, regex=r"^[a-z0-9_]{1,32}(\.[a-z0-9_]{1,48})?$")
SettingValue = Union[pydantic.StrictBool, pydantic.StrictInt, pydantic.StrictFloat,
                     pydantic.constr(strict=True, max_length=256)]
ShortText = pydantic.constr(strict=True, max_length=64)
NonNegative = pydantic.confloat(strict=True, ge=0, allow_inf_nan=False)
Fraction = pydantic.confloat(strict=True, ge=0, le=1, allow_inf_nan=False)


MAX_RANKS = 65536  # of one island peer (torchrun's ranks)


class StatusValue(StrictModel):
    """A peer's status record, for people and joiners (see :mod:`p2p_diloco.swarm.status`); every field bounded."""

    outer_step: OuterStep
    phase: Literal["starting", "training", "syncing", "loading", "keeping", "left"]
    inner_steps: Count  # done since the run began (the lr schedule's position)
    samples_per_s: NonNegative  # inner-loop throughput over its last steps
    loss: Optional[FiniteFloat]  # mean inner loss of the current (or last) round
    reachability: Literal["direct", "unreachable"]  # see p2p_diloco.swarm.reachability
    version: ShortText
    device: ShortText
    uptime_s: NonNegative
    data_shard: Optional[pydantic.conint(strict=True, ge=0, lt=MAX_SHARDS)]  # of a sharded stream
    fingerprint: Sha256Hex
    settings: Dict[SettingName, SettingValue]  # p2p_diloco.config.shared_settings, hashing to the fingerprint
    time: FiniteFloat
    stored_step: Optional[OuterStep] = None  # the newest outer step it wrote to the run's checkpoint store
    ranks: pydantic.conint(strict=True, ge=1, le=MAX_RANKS) = 1  # the processes of an island peer (train/island.py)
    # its contribution and its last outer step, for the run's page (p2p_diloco/run_page): as it claims them
    samples: Count = 0  # in the outer steps it applied with its group, since this process started
    counted_samples: Optional[Count] = None  # of those, what its groups' rule counted (sync/robust.py fair_weights)
    rounds: Count = 0  # outer steps it applied with a group of two or more
    group_size: Count = 0  # of its last applied outer step (0: none yet)
    sync_bytes: Count = 0  # the bytes it sent and received since its outer step before, every phase (p2p_diloco.traffic)
    utilization: Optional[Fraction] = None  # inner-step time / wall time over that outer step
    rounds_not_applied: Count = 0  # in a row: from EXCLUDED_AFTER_ROUNDS on, it is excluded (swarm/status.py)
    # its latest held-out loss of θ_global (p2p_diloco.train.heldout; a cross-entropy: >= 0) ...
    eval_loss: Optional[NonNegative] = None
    eval_step: Optional[OuterStep] = None  # ... at this outer step

    @pydantic.validator("settings")
    def _bounded(cls, settings):
        if len(settings) > MAX_SETTINGS:
            raise ValueError(f"more than {MAX_SETTINGS} settings")
        return settings


MAX_GROUP_MEMBERS = 256  # a round report names each groupmate at most once in each map (~250 bytes each)
AUDIT_OK, WRONG_MEAN, INPUTS_DIFFER, UNAVAILABLE = "ok", "wrong mean", "inputs differ", "unavailable"
Verdict = Literal["ok", "wrong mean", "inputs differ", "unavailable"]  # of an audit (p2p_diloco.sync.audit)


class RoundReport(StrictModel):
    """A peer's report on one averaging round (see :mod:`p2p_diloco.sync.commit`).

    ``inputs`` and ``outputs`` are what travelled, as this peer saw it (:mod:`p2p_diloco.sync.audit`):
    for each reducer of the round (this peer included, if it reduced), the sha256 of the hash list of the
    chunks of the encoded parts this peer sent it (:mod:`p2p_diloco.sync.spot_check`), and of the averaged
    parts it got back from it, all parts in order. A reducer's
    own ``outputs`` entry is its signed statement of the averaged bytes it sent everyone. ``audits``
    holds this peer's verdict on each reducer it audited (published again once the audit is done).
    """

    outer_step: OuterStep
    token: Token
    complete: pydantic.StrictBool
    mean_sha256: Optional[Sha256Hex]
    inputs: Dict[PeerIdText, Sha256Hex] = {}
    outputs: Dict[PeerIdText, Sha256Hex] = {}
    audits: Dict[PeerIdText, Verdict] = {}

    @pydantic.validator("inputs", "outputs", "audits")
    def _bounded(cls, entries):
        if len(entries) > MAX_GROUP_MEMBERS:
            raise ValueError(f"more than {MAX_GROUP_MEMBERS} groupmates")
        return entries


class RoundReportsValue(StrictModel):
    """A peer's reports on its latest rounds, newest first (two: a slow groupmate may still read the older)."""

    reports: pydantic.conlist(RoundReport, min_items=1, max_items=2)


class RunRecords(pydantic.BaseModel):
    """The schema of a run's DHT keys, as hivemind's SchemaValidator takes it (prefix: the run name)."""

    progress: Dict[BytesWithPublicKey, ProgressValue]
    rounds: Dict[BytesWithPublicKey, RoundReportsValue]
    status: Dict[BytesWithPublicKey, StatusValue]

    class Config:
        extra = pydantic.Extra.forbid


RunName = pydantic.constr(strict=True, regex=r"^[A-Za-z0-9_-]{1,64}$")  # as p2p_diloco.config checks run.name
Shape = pydantic.conlist(pydantic.conint(strict=True, ge=1, le=2**31), max_items=8)
Seconds = pydantic.confloat(strict=True, gt=0, le=86400, allow_inf_nan=False)


class AssistanceRequest(StrictModel):
    """An unreachable peer's request that a reachable node reduce for its run (:mod:`p2p_diloco.sync.assistant`):
    what an assistant must know to join the run's groups."""

    run: RunName
    fingerprint: Sha256Hex
    shapes: pydantic.conlist(Shape, min_items=1, max_items=MAX_TENSORS)  # of the averaged tensors
    matchmaking_time: Seconds
    request_timeout: Seconds
    allreduce_timeout: Seconds
    next_chunk_timeout: Seconds
    codec: pydantic.constr(strict=True, regex=r"^[a-z0-9-]{1,16}$")  # of the parts (p2p_diloco.sync.codecs)
    # how the run's reducers aggregate the parts (outer.aggregation and its parameters: p2p_diloco.sync.robust)
    aggregation: pydantic.constr(strict=True, regex=r"^[a-z-]{1,16}$")
    clip_factor: FiniteFloat
    clip_iterations: pydantic.conint(strict=True, ge=1, le=100)
    trim_fraction: FiniteFloat
    # required, not defaulted: hivemind's schema check refuses a record whose parsed value differs from the value
    # stored, and a default the request left out is such a difference (every request was refused, and no assistant
    # ever reduced for a run nobody can dial)
    claim_cap: FiniteFloat
    norm_clip: FiniteFloat
    drop_opposed: pydantic.StrictBool
    # indices into `shapes` of each Streaming DiLoCo fragment (p2p_diloco.train.fragments); None: one of all
    fragments: Optional[pydantic.conlist(pydantic.conlist(pydantic.conint(strict=True, ge=0, lt=MAX_TENSORS),
                                                           min_items=1, max_items=MAX_TENSORS),
                                         min_items=1, max_items=MAX_TENSORS)] = None
    time: FiniteFloat

    @property
    def fragment_indices(self) -> list[list[int]]:
        return self.fragments or [list(range(len(self.shapes)))]

    @pydantic.validator("fragments")
    def _a_partition_of_the_shapes(cls, fragments, values):
        shapes = values.get("shapes")
        if fragments is not None and shapes is not None:
            if sorted(i for fragment in fragments for i in fragment) != list(range(len(shapes))):
                raise ValueError("the fragments must hold each averaged tensor exactly once")
        return fragments


class RunAnnouncement(StrictModel):
    """A peer says which run it trains in, so that ``p2p-diloco status`` finds the runs of a swarm."""

    run: RunName
    fingerprint: Sha256Hex
    time: FiniteFloat


class SharedRecords(pydantic.BaseModel):
    """DHT keys shared by every run, so that a node that knows no run finds them (prefix: ``p2p_diloco``)."""

    assistance: Dict[BytesWithPublicKey, AssistanceRequest]
    runs: Dict[BytesWithPublicKey, RunAnnouncement]

    class Config:
        extra = pydantic.Extra.forbid


SHARED_PREFIX = "p2p_diloco"


def assistance_key() -> str:
    return f"{SHARED_PREFIX}_assistance"


def runs_key() -> str:
    return f"{SHARED_PREFIX}_runs"


def progress_key(run_name: str) -> str:
    return f"{run_name}_progress"


def status_key(run_name: str) -> str:
    return f"{run_name}_status"


def rounds_key(run_name: str) -> str:
    return f"{run_name}_rounds"


def key_phases(run_name: Optional[str] = None) -> dict[str, str]:
    """The traffic phase (:mod:`p2p_diloco.traffic`) of the DHT requests about each key that every node shares
    and, with `run_name`, each of that run's (:mod:`p2p_diloco.swarm.dht_traffic`)."""
    phases = {assistance_key(): "records", runs_key(): "records"}
    if run_name is not None:
        phases.update({progress_key(run_name): "records", status_key(run_name): "records",
                       rounds_key(run_name): "commit"})
    return phases


def read_signed(model: Type[Model], subkey: object, value: object, what: str) -> Optional[tuple[str, Model]]:
    """(author, record) of a record signed under its author's subkey that matches `model`'s schema; None,
    logged once per author, if it has no owner's key or is malformed (`what` names it in the log)."""
    author = owner_peer_id(subkey) if isinstance(subkey, bytes) else None
    if author is None:
        warn_once(repr(subkey)[:40], f"a {what} without an owner's key")
        return None
    record, problem = parse(model, value)
    if record is None:
        warn_once(author, f"a malformed {what}", problem)
        return None
    return author, record


def signed_records(dht, key: str, model: Type[Model], what: str) -> Iterator[tuple[str, Model, float]]:
    """(author, record, expiration time) of each well-formed signed record under `key` (:func:`read_signed`),
    read from the nodes that hold the key (the latest of every subkey)."""
    found = dht.get(key, latest=True)
    if found is None or not isinstance(found.value, dict):
        return
    for subkey, item in found.value.items():
        parsed = read_signed(model, subkey, getattr(item, "value", None), what)
        if parsed is not None:
            yield parsed[0], parsed[1], getattr(item, "expiration_time", 0.0)


def _author(record: DHTRecord) -> str:
    return owner_peer_id(record.subkey) or "(unsigned)"


class LoggedSignatureValidator(RSASignatureValidator):
    """hivemind's signature check, which logs (once per owner) a record that fails it."""

    def validate(self, record: DHTRecord) -> bool:
        if super().validate(record):
            return True
        warn_once(_author(record), "a DHT record under this peer's key that it did not sign",
                  "somebody else tried to write it")
        return False


class LoggedSchemaValidator(SchemaValidator):
    """hivemind's schema check, which logs (once per author and key) a record that fails it."""

    def __init__(self, schema, prefix: str):
        super().__init__(schema, allow_extra_keys=True, prefix=prefix)
        self._key_names = {DHTID.generate(source=f"{prefix}_{name}").to_bytes(): f"{prefix}_{name}"
                           for name in schema.__fields__}

    def validate(self, record: DHTRecord) -> bool:
        if super().validate(record):
            return True
        key = self._key_names.get(record.key, "a run key")
        warn_once(_author(record), f"a malformed {key} record", "it does not match the record schema")
        return False

    def merge_with(self, other: RecordValidatorBase) -> bool:
        merged = super().merge_with(other)
        if merged and isinstance(other, LoggedSchemaValidator):
            self._key_names.update(other._key_names)
        return merged


class RunMembers(RecordValidatorBase):
    """A private run's allow-list: refuses the records of the run that an identity not listed wrote.

    The run's records are those of its own keys (progress, rounds, status) and those of the keys all
    runs share (assistance requests, run announcements) that name the run. It runs after the signature
    check (a forged record is refused there, as a forgery) and before the schema check, and logs once
    per identity. A node that refuses a record refuses to store it and ignores it in a reply, so no
    part of the peer ever reads it.
    """

    def __init__(self, run_name: str, peer_ids: Iterable[str]):
        self.run_name = run_name
        self.peer_ids = frozenset(peer_ids)
        self._run_keys = {DHTID.generate(source=name).to_bytes(): name
                          for name in (progress_key(run_name), rounds_key(run_name), status_key(run_name))}
        self._shared_keys = {DHTID.generate(source=name).to_bytes(): name for name in (assistance_key(), runs_key())}

    @property
    def priority(self) -> int:
        return 5  # validated in decreasing priority: after the signature (10), before the schema (0)

    def _names_the_run(self, record: DHTRecord) -> bool:
        if record.key in self._run_keys:
            return True
        if record.key not in self._shared_keys:
            return False
        try:
            value = MSGPackSerializer.loads(record.value)
        except Exception:  # not msgpack: the schema check refuses it
            return False
        return isinstance(value, dict) and value.get("run") == self.run_name

    def validate(self, record: DHTRecord) -> bool:
        if not self._names_the_run(record):
            return True
        author = owner_peer_id(record.subkey)
        if author in self.peer_ids:
            return True
        warn_once(author or "(unsigned)", f"records of private run {self.run_name!r}",
                  "this identity is not in run.allowed_peers")
        return False


def node_validators(identity: Identity) -> list[RecordValidatorBase]:
    """What every node checks, whatever run it serves (a bootstrap node knows no run)."""
    return [LoggedSignatureValidator(identity.private_key), LoggedSchemaValidator(SharedRecords, prefix=SHARED_PREFIX)]


def run_validators(identity: Identity, run_name: str, allowed_peers: Iterable[str] = ()) -> list[RecordValidatorBase]:
    """What a peer of run `run_name` checks: signatures and the schema of the run's records, and in a
    private run (`allowed_peers`, the listed peer IDs) that their authors are listed."""
    validators = [*node_validators(identity), LoggedSchemaValidator(RunRecords, prefix=run_name)]
    allowed_peers = frozenset(allowed_peers)
    return [*validators, RunMembers(run_name, allowed_peers)] if allowed_peers else validators


class RecordPublisher:
    """Keeps one record of this node fresh on the DHT under its signed subkey.

    A background thread stores the latest value again every `refresh_s` (at most ttl/3) seconds, so
    that the record outlives long phases of the node and vanishes within `ttl` of the node crashing
    or freezing.
    hivemind keeps whichever value of a subkey expires last, so every value (a final one too)
    expires `ttl` after it was stored.

    A store blocks for as long as the DHT takes (seconds, on a slow network; tens of milliseconds on
    2 loaded cores), and a training peer publishes several records per round. Neither :meth:`update`
    nor :meth:`publish` waits for one: each replaces the value the background thread stores, at its
    next refresh (update) or at once (publish: the thread is woken). Only a last word (a record that
    must be on the DHT before the node goes) is stored in the caller's thread. A lock orders the stores
    themselves, and the thread reads the value only once it holds it, so that no store puts back a value
    older than one stored before it: after a last word, nothing is refreshed until the next update or
    publish.
    """

    def __init__(self, dht, key: str, subkey: bytes, ttl: float, what: str, refresh_s: Optional[float] = None):
        self.dht, self.key, self.subkey, self.ttl, self.what = dht, key, subkey, ttl, what
        self.refresh_s = min(refresh_s or ttl / 3, ttl / 3)
        self._value: Optional[dict] = None  # what the next refresh stores; None: nothing (a last word)
        self._store_lock = threading.Lock()  # held while storing; update() and publish() never take it
        self._stop = threading.Event()
        self._due = threading.Event()  # set by publish(): store the value now, not at the next refresh
        self._heartbeat = threading.Thread(target=self._refresh_periodically, name=f"{what}-heartbeat", daemon=True)
        self._heartbeat.start()

    def publish(self, value: dict, keep_fresh: bool = True, wait: bool = False) -> None:
        """Store `value` at once, in the background, and refresh it until the next publish or update. With
        `wait`, and always for a last word (`keep_fresh` False, never refreshed), it is stored in this thread,
        after any store in progress, before this returns. A value published and replaced before the
        background thread got to it is never stored: the newer one says more."""
        if keep_fresh and not wait:
            self._value = value
            self._due.set()
            return
        with self._store_lock:
            self._value = value if keep_fresh else None
            self._store(value, complain=keep_fresh)

    def update(self, value: dict) -> None:
        """Store `value` at the next refresh (within `refresh_s`), not now: for values that change often.

        Never waits for a store in progress. Binding an attribute is atomic in CPython, so the refresh
        thread reads either the old value or this one, whole; the caller must not change `value` after.
        """
        self._value = value

    def _store(self, value: dict, complain: bool = True) -> None:
        try:
            ok = self.dht.store(self.key, value=value, subkey=self.subkey, expiration_time=get_dht_time() + self.ttl)
        except Exception as e:  # the DHT process is gone (shutting down): nothing left to tell
            logger.debug("could not store the %s record: %r", self.what, e)
            return
        if not ok and complain:
            logger.warning("could not store this node's %s record on the DHT", self.what)

    def _refresh_periodically(self) -> None:
        while True:
            self._due.wait(self.refresh_s)
            self._due.clear()  # before the value is read: a publish from now on wakes the thread again
            if self._stop.is_set():
                return
            with self._store_lock:  # read under the lock: a last word that went before is not undone
                value = self._value
                if value is not None:
                    self._store(value)

    def close(self) -> None:
        self._stop.set()
        self._due.set()
        self._heartbeat.join(timeout=5)
