"""Swarm progress on the DHT: where every peer is, so peers agree on when and with whom to sync.

Each peer keeps one record under ``<run>_progress`` (subkey: its peer ID), refreshed whenever its
phase changes and expiring ``progress_ttl`` seconds after the last refresh, so a crashed peer
disappears by itself. A record says which outer step the peer's θ_global is at, the sha256 of that
θ_global, and whether the peer is still training toward the next step or ready to average.

From these records a peer decides (see :func:`plan_round`):

* it is *behind* when any live peer holds a later outer step: it downloads the state first;
* it *diverged* when peers at its own step hold another θ_global that more peers share (ties
  broken by the larger sha256): it downloads that state;
* otherwise it trains, then averages with the peers at its step that are ready within
  ``round_wait_timeout``, or applies its own pseudo-gradient when it is alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Optional

from hivemind import DHT
from hivemind.utils.timed_storage import get_dht_time

logger = logging.getLogger(__name__)

TRAINING, READY, LOADING, LEFT = "training", "ready", "loading", "left"


@dataclass(frozen=True)
class PeerProgress:
    peer_id: str
    outer_step: int  # outer steps applied to this peer's θ_global
    sha256: str  # of that θ_global
    # TRAINING toward outer_step + 1, READY to average for it, LOADING the swarm's state at outer_step
    # (to train toward outer_step + 1 next; its sha256 is not yet that state's), or LEFT the swarm
    phase: str
    samples: int = 0  # samples processed since the last outer step
    time: float = 0.0


class SwarmProgress:
    """Reads and writes the run's progress records on the DHT.

    A background thread re-publishes this peer's latest record every ttl/3 seconds, so a record
    outlives long inner phases, and vanishes within `ttl` of the peer crashing or freezing.
    """

    def __init__(self, dht: DHT, run_name: str, ttl: float):
        self.dht = dht
        self.key = f"{run_name}_progress"
        self.ttl = ttl
        self.peer_id = dht.peer_id.to_base58()
        self._latest: Optional[PeerProgress] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._refresh_periodically, name="progress-heartbeat", daemon=True)
        self._heartbeat.start()

    def publish(self, outer_step: int, sha256: str, phase: str, samples: int = 0) -> None:
        record = PeerProgress(self.peer_id, outer_step, sha256, phase, samples, time.time())
        with self._lock:
            self._latest = record
            self._store(record)

    def _store(self, record: PeerProgress) -> None:
        # hivemind keeps whichever value of a subkey expires last, so every record (a LEFT one too)
        # must expire later than the one it replaces: all use the same ttl from "now"
        try:
            ok = self.dht.store(
                self.key, value=asdict(record), subkey=self.peer_id, expiration_time=get_dht_time() + self.ttl
            )
        except Exception as e:  # the DHT process is gone (shutting down): nothing left to tell
            logger.debug("could not store the progress record: %r", e)
            return
        if not ok and record.phase != LEFT:
            logger.warning("could not store this peer's progress record on the DHT")

    def _refresh_periodically(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            with self._lock:
                if self._latest is not None and self._latest.phase != LEFT:
                    self._store(self._latest)

    def close(self) -> None:
        self._stop.set()
        self._heartbeat.join(timeout=5)

    def fetch(self) -> dict[str, PeerProgress]:
        """Live records of every peer, this one included (peers that left are omitted)."""
        found = self.dht.get(self.key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        records = {}
        for subkey, item in found.value.items():
            try:
                record = PeerProgress(**item.value)
            except (TypeError, AttributeError):
                logger.debug("ignoring a malformed progress record under %r", subkey)
                continue
            if record.phase != LEFT:
                records[record.peer_id] = record
        return records

    def wait_for_peers(self, count: int, timeout: float, stop: threading.Event, poll: float = 0.5) -> int:
        """Wait until `count` live peers (this one included) have records, `timeout` s, or `stop`.

        For peers that are started together (``peer --wait-for-peers``), so that none of them takes
        its first outer steps alone. Returns how many peers were seen last.
        """
        deadline = time.monotonic() + timeout
        while True:
            seen = len(self.fetch())
            if seen >= count:
                return seen
            if time.monotonic() >= deadline:
                logger.warning("starting with %d of the %d peers waited for (start_wait_timeout %.0f s)",
                               seen, count, timeout)
                return seen
            if stop.wait(poll):
                return seen

    def wait_for_groupmates(
        self, outer_step: int, timeout: float, stop: threading.Event, poll: float = 0.5
    ) -> dict[str, PeerProgress]:
        """Wait until no live peer is still training (or loading the state) toward `outer_step + 1`,
        `timeout` s, or `stop`.

        Returns the records seen last. Peers still training after the timeout are left behind:
        they catch up by downloading the state afterwards. Waiting for a loading peer keeps a swarm
        whose rounds are shorter than a state download from running away from every joiner.
        """
        deadline = time.monotonic() + timeout
        announced: set[str] = set()
        while True:
            records = self.fetch()
            busy = {r.peer_id: r.phase for r in records.values()
                    if r.outer_step == outer_step and r.phase in (TRAINING, LOADING)}
            if not busy:
                return records
            if set(busy) - announced:
                logger.info("outer step %d: waiting up to %.0f s for groupmates: %s",
                            outer_step + 1, max(deadline - time.monotonic(), 0), describe_peers(busy))
                announced |= set(busy)
            if time.monotonic() >= deadline:
                logger.warning("outer step %d: going ahead without groupmates not ready after %.0f s: %s",
                               outer_step + 1, timeout, describe_peers(busy))
                return records
            if stop.wait(poll):
                return records


def describe_peers(phases: dict[str, str]) -> str:
    """``"ab12cd34 (training), ef56ab78 (loading)"``: short peer IDs with their phases, for logs."""
    return ", ".join(f"{peer_id[-8:]} ({phase})" for peer_id, phase in sorted(phases.items()))


@dataclass(frozen=True)
class RoundPlan:
    """What this peer does next, derived from the progress records alone."""

    action: str  # "train", or "load" (download a newer or the agreed state first)
    reason: str
    target_step: int
    target_sha256: Optional[str] = None


def agreed_sha256(records: dict[str, PeerProgress], outer_step: int) -> Optional[str]:
    """The θ_global most peers at `outer_step` hold (ties: the larger sha256), or None."""
    counts = Counter(r.sha256 for r in records.values() if r.outer_step == outer_step)
    if not counts:
        return None
    return max(counts, key=lambda sha: (counts[sha], sha))


def plan_round(records: dict[str, PeerProgress], my_step: int, my_sha256: str) -> RoundPlan:
    records = {pid: r for pid, r in records.items() if r.phase != LOADING}  # they hold no agreed state yet
    others = {pid: r for pid, r in records.items() if r.sha256 != my_sha256 or r.outer_step != my_step}
    frontier = max((r.outer_step for r in others.values()), default=my_step)
    if frontier > my_step:
        return RoundPlan("load", f"the swarm is at outer step {frontier}, this peer at {my_step}", frontier,
                         agreed_sha256(records, frontier))
    agreed = agreed_sha256(records, my_step)
    if agreed is not None and agreed != my_sha256:
        return RoundPlan("load", f"peers at outer step {my_step} agree on another global model", my_step, agreed)
    return RoundPlan("train", "in step with the swarm", my_step)
