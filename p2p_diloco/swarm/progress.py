"""Swarm progress on the DHT: where every peer is, so peers agree on when and with whom to sync.

Each peer keeps one record under ``<run>_progress`` (subkey: its owner marker, the value signed by
its key; see :mod:`p2p_diloco.swarm.records`), refreshed whenever its phase changes and expiring
``progress_ttl`` seconds after the last refresh, so a crashed peer disappears by itself. A record
says which outer step the peer's global state is at, the sha256 of that state (θ_global and the
outer momentum), whether the peer is still training toward the next step or ready to average, and
the fingerprint of the run settings it trains with. Records of peers with another fingerprint are
not part of this run's plan: their states cannot be averaged with this peer's.

From these records a peer decides (:func:`p2p_diloco.protocol.plans.plan_round`):

* it is *behind* when any live peer holds a later outer step: it downloads the state first;
* it *diverged* when peers at its own step hold another state that more peers share (ties
  broken by the larger sha256): it downloads that state;
* otherwise it trains, then averages with the peers at its step that are ready within
  ``round_wait_timeout``, or applies its own pseudo-gradient when it is alone.

A record that claims a state nobody serves (a failed download found no donor of it), or one that this
peer does not trust enough to load (:mod:`p2p_diloco.train.state_check`), is set aside until its author
claims another step, until this peer loads that state (:meth:`SwarmProgress.served`), or for 30 s at most
(:class:`~p2p_diloco.protocol.ledger.TrustLedger`): a stranger's false claim cannot stall the run. A state that failed the state
check, and every record of an identity that served a malformed or refused state, are ignored for the
rest of the run (:meth:`SwarmProgress.refuse`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterator, Optional, Sequence

from hivemind import DHT
from hivemind.utils import get_dht_time

from p2p_diloco.polling import poll_intervals
from p2p_diloco.remote_input import warn_once
from p2p_diloco.protocol.ledger import STRUCK_IN_HISTORY_S, UNSERVED_STRIKES, Seen, TrustLedger, remember
from p2p_diloco.protocol.phases import check_transition
from p2p_diloco.protocol.view import (
    COMMITTING, DIRECT, KEEPING, LEFT, LOADING, READY, TRAINING, PeerProgress, RunHistory, averages, busy_toward,
    dialable,
)
from p2p_diloco.swarm.liveness import SilentPeers
from p2p_diloco.swarm.records import ProgressValue, RecordPublisher, progress_key, read_signed, signed_records

logger = logging.getLogger(__name__)

__all__ = ["TRAINING", "READY", "COMMITTING", "LOADING", "KEEPING", "LEFT", "PeerProgress", "RunHistory",
           "SwarmProgress", "read_progress"]


def parse_progress(subkey: object, value: object, fingerprint: str) -> Optional[PeerProgress]:
    """The record of the peer that signed it, or None (logged once) if it is not one of this run's."""
    parsed = read_signed(ProgressValue, subkey, value, "progress record")
    return None if parsed is None else _of_this_run(*parsed, fingerprint)


def _of_this_run(author: str, record: ProgressValue, fingerprint: str) -> Optional[PeerProgress]:
    if record.fingerprint != fingerprint:
        warn_once(author, "the progress of a peer with other run settings",
                  f"its settings fingerprint is {record.fingerprint[:12]}, this peer's {fingerprint[:12]}; "
                  f"the two cannot average together")
        return None
    return PeerProgress(author, record.outer_step, record.sha256, record.phase, record.samples, record.time,
                        record.reachability, record.leader)


def read_progress(dht: DHT, key: str, fingerprint: str) -> list[PeerProgress]:
    """The live progress records under `key` of the peers that train with `fingerprint` (LEFT omitted)."""
    return [record for record, _ in _read_expiring(dht, key, fingerprint) if record.phase != LEFT]


def _read_expiring(dht: DHT, key: str, fingerprint: str) -> Iterator[tuple[PeerProgress, float]]:
    """(record, its DHT expiration time) of each record under `key` of the peers that train with `fingerprint`."""
    for author, value, expiration in signed_records(dht, key, ProgressValue, "progress record"):
        record = _of_this_run(author, value, fingerprint)
        if record is not None:
            yield record, expiration


class SwarmProgress:
    """Reads the run's progress records on the DHT, and keeps this peer's own fresh (:class:`RecordPublisher`)."""

    def __init__(self, dht: DHT, run_name: str, ttl: float, record_subkey: bytes, fingerprint: str,
                 reachability: str = DIRECT, answering: Optional[Callable[[list[str]], set[str]]] = None):
        self.dht = dht
        # which of some peers answer on the network now (p2p_diloco.swarm.liveness); None: never ask
        self.answering = answering
        self.key = progress_key(run_name)
        self.fingerprint = fingerprint
        self.reachability = reachability
        self.peer_id = dht.peer_id.to_base58()
        # set-aside claims, refused states, distrusted peers; a struck identity's claims leave the run's history
        # once a crashed peer's record would have expired
        self.ledger = TrustLedger(self.peer_id, history_grace_s=max(ttl, STRUCK_IN_HISTORY_S))
        # each author's latest record read (merge_seen), and when it expires on the DHT: the live ones are the
        # run's peers (fetch), and every one, expired ones too (at most MAX_EXPIRED of those), its history
        self._seen: Seen = {}
        self._merging = threading.Lock()
        self._publishing = threading.RLock()  # the training loop publishes, and the round's sync says COMMITTING
        # the live records that the last fetch left out because they were set aside (set_aside): no plan
        # targets their claims, but they are peers of the run, and the state check counts them as dissent
        self.set_aside_records: dict[str, PeerProgress] = {}
        self._own: Optional[PeerProgress] = None  # the record this peer published last
        self._publisher = RecordPublisher(dht, self.key, record_subkey, ttl, "progress")

    def publish(self, outer_step: int, sha256: str, phase: str, samples: int = 0, leader: str = "") -> None:
        """This peer's record, stored in the background (a LEFT record, its last word, before this returns);
        :meth:`fetch` holds it from now on, whether or not the DHT does yet. `leader`: READY only, the leader it
        asks first (:meth:`asking`)."""
        with self._publishing:
            check_transition(None if self._own is None else self._own.phase, phase)  # a bug if not: raises
            value = dict(outer_step=outer_step, sha256=sha256, phase=phase, samples=samples, time=time.time(),
                         fingerprint=self.fingerprint, reachability=self.reachability, leader=leader)
            self._own = PeerProgress(self.peer_id, outer_step, sha256, phase, samples, value["time"],
                                     self.reachability, leader)
            self._publisher.publish(value, keep_fresh=phase != LEFT)

    def committing(self, outer_step: int, sha256: str, samples: int) -> None:
        """Say this peer's group agreed on the mean of its round at `outer_step` (the commit window, a phase of
        its own: it applies the mean and says TRAINING at `outer_step` + 1 next). Called from the round's sync
        thread: nothing if this peer has said its last word (LEFT) meanwhile."""
        with self._publishing:
            if self._own is not None and self._own.phase == LEFT:
                return
            self.publish(outer_step, sha256, COMMITTING, samples)

    def asking(self, outer_step: int, sha256: str, leader: str) -> None:
        """Say which leader this peer, ready at `outer_step` with the state `sha256`, asks first in its round (its
        membership plan's, :func:`~p2p_diloco.protocol.membership.plan_membership`): a peer that plans later asks
        the same one, and the step forms one group. Called from the round's sync thread: nothing unless its
        record still says READY at that step and state."""
        with self._publishing:
            own = self._own
            if own is None or (own.phase, own.outer_step, own.sha256) != (READY, outer_step, sha256):
                return
            if own.leader != leader:
                self.publish(outer_step, sha256, READY, own.samples, leader)

    def close(self) -> None:
        self._publisher.close()

    def fetch(self) -> dict[str, PeerProgress]:
        """Live records of this run's peers, this one included (peers that left are omitted, and so are
        claims of a state that nobody served). A record read before stands until it expires, though this
        read missed it (:func:`~p2p_diloco.protocol.ledger.merge_seen`). This peer's own is the one it published last, which its
        background store may not have put on the DHT yet: the training loop never waits for a store."""
        read = list(_read_expiring(self.dht, self.key, self.fingerprint))
        with self._merging:  # the training loop, its sync and its reads in the background all fetch
            now = get_dht_time()
            own = [] if self._own is None else [(self._own, now + self._publisher.ttl)]
            self._seen = remember(self._seen, read + own, now)
            records, set_aside = self.ledger.split(self._seen, now)
            self.set_aside_records = set_aside
            return records

    def history(self) -> Optional[RunHistory]:
        """The latest outer step at which this peer has seen the run, from every record it read (:meth:`fetch`),
        of peers live, gone (LEFT) or whose record has expired since; this one's own and the loading ones left
        out (a loading peer holds no state of that step yet), and so are records of distrusted peers or
        refused states; None if there is none (:mod:`p2p_diloco.train.catch_up`).

        A record counts after it expired: a peer left behind by a run whose peers then all left (an
        unreachable run with no keeper serves nobody its state) must not forget that the run went on
        when their records expire, and take the run's next steps alone from its stale state, a second
        history (seen in CI: a peer whose round failed waited at outer step 1 while the two others took
        steps 2-4 and left; 12 s after, it took 2-4 alone)."""
        return self.ledger.history(self._seen, time.time())

    def drop_silent(self, records: dict[str, PeerProgress], peers: Sequence[str]) -> list[str]:
        """Those of `peers` that others can dial and that do not answer on the network twice in a row
        (:class:`~p2p_diloco.swarm.liveness.SilentPeers`' rule; a peer behind NAT may not answer, and is never
        asked); their records count in no plan until they write another
        (:meth:`~p2p_diloco.protocol.ledger.TrustLedger.found_silent`). None when this peer cannot ask."""
        asked = dialable({peer: records[peer] for peer in peers if peer in records})
        silent = SilentPeers(self.answering).confirm(asked)
        self.ledger.found_silent(records, silent)
        return silent

    def set_aside(self, claims: dict[str, tuple[int, str]], why: Optional[str] = None) -> None:
        """Ignore these peers' records while they claim the same outer step, for a while
        (:class:`~p2p_diloco.protocol.ledger.TrustLedger`): nobody served their state (`why` None: a strike against
        each, as the ledger counts them), or `why` this peer would not load it."""
        unserved = why is None
        why = f"no peer served that state {UNSERVED_STRIKES} times in a row" if unserved else why
        for peer_id in self.ledger.set_aside(claims, get_dht_time(), unserved=unserved):
            logger.warning("setting aside the record of peer %s: it claims outer step %d (%s) but %s",
                           peer_id, claims[peer_id][0], claims[peer_id][1][:12], why)

    def served(self, outer_step: int, sha256: str, donor: Optional[str] = None) -> None:
        """This peer holds the state (`outer_step`, `sha256`) now, checked: the records set aside for claiming it
        count again. Only a keeper serves an unreachable peer's state (once that peer pushed it), so a joiner
        may set such records aside for a moment, then load their state from the keeper; left aside, they
        would hide its groupmates, and it would step alone: a second history of the run."""
        self.ledger.served(outer_step, sha256, donor)

    def refuse(self, sha256: Optional[str] = None, peers: Sequence[str] = ()) -> None:
        """Ignore for the rest of the run every record that claims the state `sha256` (it failed the state
        check) and every record of `peers` (they served a malformed or refused state)."""
        self.ledger.refuse(sha256, peers)

    def wait_for_peers(self, count: int, timeout: float, stop: threading.Event, poll: float = 0.5) -> int:
        """Wait until `count` live peers (this one included) have records, `timeout` s, or `stop`.

        For peers that are started together (``peer --wait-for-peers``), so that none of them takes
        its first outer steps alone. Returns how many peers were seen last.
        """
        deadline = time.monotonic() + timeout
        while True:
            seen = sum(averages(record) for record in self.fetch().values())  # a keeper trains nothing
            if seen >= count:
                return seen
            if time.monotonic() >= deadline:
                logger.warning("starting with %d of the %d peers waited for (start_wait_timeout %.0f s)",
                               seen, count, timeout)
                return seen
            if stop.wait(poll):
                return seen

    def wait_for_groupmates(
        self, outer_step: int, timeout: float, stop: threading.Event, poll: float = 0.5, first_poll: float = 0.05,
        sha256: Optional[str] = None,
    ) -> dict[str, PeerProgress]:
        """Wait until no live peer is still on its way to averaging toward `outer_step + 1` with this one, whose
        state is `sha256` (:func:`~p2p_diloco.protocol.view.busy_toward`): training from that state or loading
        the state at `outer_step`, or still committing the round that brings it there (its record says ready
        at `outer_step - 1`). At most `timeout` s, or until `stop`.

        Returns the records seen last. Peers still busy after the timeout are left behind: they catch
        up by downloading the state afterwards. Waiting for a loading peer keeps a swarm whose rounds
        are shorter than a state download from running away from every joiner; waiting for a
        committing one keeps a peer that committed first from averaging alone while its groupmates
        still read the round's reports.
        """
        deadline = time.monotonic() + timeout
        intervals = poll_intervals(first_poll, poll)  # the last groupmates are often a moment away
        announced: set[str] = set()
        silent = SilentPeers(self.answering)
        while True:
            records = {peer: r for peer, r in self.fetch().items() if peer not in silent.gone}
            busy = busy_toward(records, outer_step, self.peer_id, sha256)
            for peer in silent.check(dialable({p: records[p] for p in busy})):
                logger.warning("outer step %d: not waiting for %s any more: its record says %s, but it does not "
                               "answer on the network (it left or crashed)", outer_step + 1, peer[-8:], busy[peer])
                self.ledger.found_silent(records, [peer])
                del busy[peer], records[peer]
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
            if stop.wait(next(intervals)):
                return records


def describe_peers(phases: dict[str, str]) -> str:
    """``"ab12cd34 (training), ef56ab78 (loading)"``: short peer IDs with their phases, for logs."""
    return ", ".join(f"{peer_id[-8:]} ({phase})" for peer_id, phase in sorted(phases.items()))


