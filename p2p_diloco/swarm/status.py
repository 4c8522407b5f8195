"""What each peer tells the world about itself, for people (``p2p-diloco status``) and for joiners.

Besides its progress record (which peers act on), every peer keeps a *status record* under
``<run>_status``: its outer step and phase, inner steps, samples per second, last loss, its latest
held-out loss of θ_global and the outer step it measured it at (:mod:`p2p_diloco.train.heldout`), whether
others can dial it, its version, device and uptime, the data shard it reads, and the run settings it
trains with (:func:`p2p_diloco.config.shared_settings`) with their fingerprint. Like every run
record it sits under the peer's owner subkey and carries its signature
(:mod:`p2p_diloco.swarm.records`, where its schema :class:`StatusValue` is).

Nothing a peer decides about averaging depends on a status record: a stranger's false status can
mislead a reader of the table, never make peers average across settings. Two decisions do read
them, both at start-up, and both only advise:

* a joiner that sees no live peer of its own settings, and the run's settled peers all on another
  fingerprint, stops, naming the settings that differ (:func:`settings_mismatch`): it could never
  average with them. One identity can forge such records; ``--ignore-other-settings`` trains anyway;
* a peer reading a sharded stream picks a data shard that no live peer of its settings reads
  (:func:`choose_shard`). A peer whose data is not sharded reads all of it and claims no shard.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

from hivemind import DHT
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.config import settings_differences, settings_fingerprint
from p2p_diloco.remote_input import parse
from p2p_diloco.swarm.records import RecordPublisher, StatusValue, read_signed, runs_key, signed_records, status_key

logger = logging.getLogger(__name__)

STARTING, TRAINING, SYNCING, LOADING, KEEPING, LEFT = "starting", "training", "syncing", "loading", "keeping", "left"
EXCLUDED_AFTER_ROUNDS = 3  # rounds in a row without an outer step after which a peer says it is excluded

@dataclass(frozen=True)
class PeerStatus:
    """An accepted status record and its author (the peer whose key signed it)."""

    peer_id: str
    record: StatusValue
    expires_at: float  # DHT time

    @property
    def settings_trusted(self) -> bool:
        """Whether the published settings are the ones its fingerprint was computed from."""
        return settings_fingerprint(self.record.settings) == self.record.fingerprint

    def as_dict(self) -> dict[str, Any]:
        """For ``status --json``: the record without the settings (they are the run's, once per run)."""
        record = self.record.dict(exclude={"settings"})
        return dict(peer_id=self.peer_id, **record)


def parse_status(subkey: object, value: object, expires_at: float = 0.0) -> Optional[PeerStatus]:
    """The record of the peer that signed it, or None (logged once per author) if it is malformed."""
    parsed = read_signed(StatusValue, subkey, value, "status record")
    return None if parsed is None else PeerStatus(*parsed, expires_at)


def read_status(dht: DHT, run_name: str) -> dict[str, PeerStatus]:
    """The run's live status records by peer ID, whatever their fingerprint (peers that left omitted)."""
    return {author: PeerStatus(author, record, expires_at)
            for author, record, expires_at in signed_records(dht, status_key(run_name), StatusValue, "status record")
            if record.phase != LEFT}


def settings_mismatch(statuses: dict[str, PeerStatus], peer_id: str, settings: dict[str, Any],
                      fingerprint: str, run_name: str, ttl: float, now: Optional[float] = None) -> Optional[str]:
    """None when this peer can train in the run; else one line saying why not.

    The run is the other live peers. When none of them shares this peer's fingerprint, this peer
    could never average with them: it is told which settings differ (from the most common other
    fingerprint's published settings, when they hash to that fingerprint). Only settled peers
    count: not those still starting, and not those whose record was not stored again in the last
    two thirds of `ttl` (this peer's ``swarm.progress_ttl``; DHT time `now`), which are gone.
    """
    others = [s for pid, s in statuses.items() if pid != peer_id]
    if any(s.record.fingerprint == fingerprint for s in others):
        return None
    stored_after = (get_dht_time() if now is None else now) + ttl / 3  # what expires after was stored recently
    others = [s for s in others if s.record.phase != STARTING and s.expires_at >= stored_after]
    if not others:
        return None
    counts = Counter(s.record.fingerprint for s in others)
    theirs, count = counts.most_common(1)[0]
    example = next(s for s in others if s.record.fingerprint == theirs and s.settings_trusted) if any(
        s.record.fingerprint == theirs and s.settings_trusted for s in others) else None
    differs = ("; ".join(settings_differences(settings, example.record.settings)) if example is not None
               else "its peers publish no settings that match their fingerprint")
    return (f"run {run_name!r} is trained with other settings ({count} of {len(others)} live peers on fingerprint "
            f"{theirs[:12]}, this peer {fingerprint[:12]}): {differs}. Join it with the run's own manifest "
            f"or config, or pick another run.name")


def choose_shard(statuses: dict[str, PeerStatus], peer_id: str, num_shards: int, fingerprint: str) -> int:
    """A data shard for a peer that has none yet: one no live peer of its settings (`fingerprint`)
    reads, if any is left; peers on other settings read other data, whatever they claim.

    Peers that start together see each other without a shard (phase ``starting``): they take the
    free shards in the order of their peer IDs, so they take different ones. A peer that sees no
    free shard shares one, chosen by its peer ID.
    """
    statuses = {pid: s for pid, s in statuses.items() if s.record.fingerprint == fingerprint}
    taken = {s.record.data_shard for pid, s in statuses.items() if pid != peer_id and s.record.data_shard is not None}
    free = [shard for shard in range(num_shards) if shard not in taken]
    if not free:
        return int.from_bytes(peer_id.encode()[-4:], "big") % num_shards
    choosing = sorted({peer_id} | {pid for pid, s in statuses.items() if s.record.data_shard is None})
    return free[choosing.index(peer_id) % len(free)]


def first_status(fingerprint: str, settings: dict[str, Any], reachability: str, device: str,
                 ranks: int = 1) -> dict[str, Any]:
    """A peer's first status record, less its time. Every field of :class:`StatusValue` is in it, defaults
    too: hivemind's schema check on every DHT node refuses a record that parsing would change, and a
    field filled in with its default is such a change (a missing ``stored_step`` made every status record
    malformed): the optional fields are filled in from the schema's own defaults."""
    from p2p_diloco.version import __version__

    defaults = {name: field.default for name, field in StatusValue.__fields__.items() if not field.required}
    return dict(defaults, outer_step=0, phase=STARTING, inner_steps=0, samples_per_s=0.0, loss=None,
                reachability=reachability, version=__version__, device=device[:64], uptime_s=0.0, data_shard=None,
                fingerprint=fingerprint, settings=settings, ranks=ranks)


class StatusPublisher:
    """Keeps this peer's status record, and its run's announcement, fresh on the DHT.

    :meth:`update` changes fields that move all the time (inner steps, throughput, loss): they are
    stored at the next refresh, every ``REFRESH_S`` seconds; it never waits for the DHT. :meth:`publish`
    stores at once, for a new phase or outer step. A loss (inner or held-out) or throughput that is not a
    finite number (a diverging run) is published as none. Neither raises into the training loop: the
    fields that never change are checked against the schema at start-up, and a published value that
    fails it is logged once and not stored.
    """

    REFRESH_S = 10.0

    def __init__(self, dht: DHT, run_name: str, record_subkey: bytes, ttl: float, *, fingerprint: str,
                 settings: dict[str, Any], reachability: str, device: str, ranks: int = 1):
        self.started = time.monotonic()
        self.fingerprint = fingerprint
        # replaced by each new value, never changed in place: the refresh thread may be storing it
        self._fields: dict[str, Any] = first_status(fingerprint, settings, reachability, device, ranks)
        StatusValue.parse_obj(self._value())  # a bug in the fields that never change shows at start-up
        self._warned = False
        self._status = RecordPublisher(dht, status_key(run_name), record_subkey, ttl, "status", self.REFRESH_S)
        self._announcement = RecordPublisher(dht, runs_key(), record_subkey, ttl, "run announcement")
        self._announcement.publish(dict(run=run_name, fingerprint=fingerprint, time=time.time()))

    def _value(self, **fields: Any) -> dict[str, Any]:
        """The record with `fields` changed; a loss or throughput that is not finite becomes None or 0."""
        value = dict(self._fields, **fields, uptime_s=time.monotonic() - self.started, time=time.time())
        for loss in ("loss", "eval_loss"):
            if not _finite(value[loss]):
                value[loss] = None
        if not _finite(value["samples_per_s"]):
            value["samples_per_s"] = 0.0
        return value

    @property
    def phase(self) -> str:
        """The phase of the record as this peer last set it (training, syncing, loading, ...)."""
        return self._fields["phase"]

    def update(self, **fields: Any) -> None:
        """Inner steps, throughput and loss (numbers: not checked again), for the next refresh."""
        value = self._value(**fields)
        self._fields = value
        self._status.update(value)

    def publish(self, wait: bool = False, **fields: Any) -> None:
        """The record with `fields` changed, stored at once, in the background (:meth:`RecordPublisher.publish`);
        with `wait`, and for the LEFT record, before this returns."""
        value = self._value(**fields)
        _, problem = parse(StatusValue, value)
        if problem is not None:
            if not self._warned:
                self._warned = True
                logger.warning("not publishing this peer's status record (%s): it does not match the schema", problem)
            return
        self._fields = value
        self._status.publish(value, keep_fresh=value["phase"] != LEFT, wait=wait)

    def close(self) -> None:
        self._status.close()
        self._announcement.close()


def _finite(number: Any) -> bool:
    return isinstance(number, (int, float)) and math.isfinite(number)
