"""What a peer knows of the run's records, and whose word it no longer takes: one owner for both.

:func:`remember` keeps each author's latest record read and when it expires on the DHT (a DHT read can miss
records: a record seen once stands until it expires or its author replaces it, :func:`merge_seen`).
:class:`TrustLedger` holds what this peer learnt not to take on trust:

* set-aside claims: a record that claims a state nobody served, or one this peer would not load on so few
  vouchers, until its author claims another step, this peer loads that state, or :data:`ASIDE_S` pass;
* unserved claims: an identity whose claims of a state were asked for and served by nobody
  :data:`UNSERVED_STRIKES` times in a row, with no state served by it since, is *struck* for
  :data:`STRIKE_S`: its claims above this peer's step count in no plan, and after `history_grace_s` (while it
  stays live) not in the run's history either (a liar that claims the run's next step at every step otherwise cost every
  peer a skipped round and a failed download at every step, :data:`ASIDE_S` or not). A claim nobody served
  once is no more than a strike: the peer asks again before it trains on;
* refused states: a state that failed the state check, for the rest of the run;
* distrusted peers: identities that served a malformed or refused state, or that this peer's averager banned
  (malformed group data or parts, a reducer's wrong or two-faced result), for the rest of the run;
* former groupmates: identities it averaged with, and the run's bootstrap nodes, whose word on a state counts
  first (:func:`~p2p_diloco.protocol.trust.choose_target`), unless it distrusts them since;
* silent peers: identities that did not answer on the network, until they write another record.

From both, :meth:`TrustLedger.split` gives the live records a plan counts and those it set aside, and
:meth:`TrustLedger.history` the latest step the run was seen at. Nothing here reads a clock: `now` is
passed in (DHT time for expirations, wall time for ages).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional

from p2p_diloco.protocol.view import LEFT, LOADING, PeerProgress, RunHistory

MAX_EXPIRED = 1024  # authors whose latest record a peer keeps, for the run's history, once it has expired
# how long a claim stays set aside while its author stays at its step: a donor frozen when a joiner asked is asked
# again (left aside, the joiner and its company started a second history beside it, for good: the simulation's
# seed 25), and a liar costs one failed download per ASIDE_S
ASIDE_S = 30.0
# unserved claims in a row after which an identity's claims above this peer's step count nowhere, and for how long
# (DHT time): an honest peer frozen or busy when asked twice is asked again after STRIKE_S, and at once when another
# identity claims the same state (a set-aside record still vouches for a state a live record claims too)
UNSERVED_STRIKES = 2
STRIKE_S = 300.0
# how long a live identity stays in the run's history once struck, at least (TrustLedger.history_grace_s: the
# records' TTL, so that a crashed peer's record has expired first, and stays in the history as a gone peer's): an
# honest peer frozen when asked is struck after two asks (seconds), and a lone peer beside it must not step alone
# meanwhile (a second history); a liar that claims the step after a lone peer's held it back for good (exit 5 after
# state_wait_timeout: the simulation, 3 peers, seed 166). A longer freeze costs a fork that the next vote merges.
STRUCK_IN_HISTORY_S = 60.0

Seen = dict[str, tuple[PeerProgress, float]]  # peer ID -> its latest record seen, and when that record expires


def merge_seen(seen: Seen, read: Iterable[tuple[PeerProgress, float]], now: float) -> Seen:
    """The records a peer knows after a DHT read: each author's latest (by the time it wrote in it) of
    those `read` now and those `seen` before, until the record's DHT expiration has passed.

    A DHT read can miss records: the nodes that hold some of them answer too late. With 24 peers on
    2 cores, 7 peers stopped waiting for the 14 others still training, whose records their reads did not
    return, and averaged as a group of 7 while the 14 formed their own. So a record seen once stands
    until it expires, as it does on the DHT, or until its author replaces it (a LEFT record included:
    the caller leaves those out)."""
    merged = {peer: (record, expiration) for peer, (record, expiration) in seen.items() if expiration > now}
    for record, expiration in read:
        held = merged.get(record.peer_id)
        if held is None or record.time >= held[0].time:
            merged[record.peer_id] = (record, expiration)
    return merged


def without_oldest_expired(seen: Seen, now: float) -> Seen:
    """`seen` with at most :data:`MAX_EXPIRED` of its expired records, the newest; every live one."""
    expired = sorted((record.time, peer) for peer, (record, expiration) in seen.items() if expiration <= now)
    dropped = {peer for _, peer in expired[:max(len(expired) - MAX_EXPIRED, 0)]}
    return {peer: held for peer, held in seen.items() if peer not in dropped} if dropped else seen


def remember(seen: Seen, read: Iterable[tuple[PeerProgress, float]], now: float) -> Seen:
    """What a peer knows after a read at `now` (DHT time): every author's latest record, expired ones too (the
    run's history: :meth:`TrustLedger.history`), at most :data:`MAX_EXPIRED` of those."""
    return without_oldest_expired(merge_seen(seen, read, now=-math.inf), now)


@dataclass
class TrustLedger:
    """Whose records and which states this peer (`peer_id`) no longer takes on trust (see the module)."""

    peer_id: str
    # peer ID -> the claim set aside (outer step, sha256) and until when (DHT time)
    unverified: dict[str, tuple[int, str, float]] = field(default_factory=dict)
    refused_states: set[str] = field(default_factory=set)  # sha256 of states that failed the state check
    distrusted: set[str] = field(default_factory=set)  # served a malformed or refused state, or banned
    groupmates: set[str] = field(default_factory=set)  # averaged with this peer, or the run's bootstrap nodes
    # peer ID -> its claims in a row that nobody served, and until when the last of them counts (DHT time)
    unserved: dict[str, tuple[int, float]] = field(default_factory=dict)
    unserved_claims: dict[str, tuple[int, str]] = field(default_factory=dict)  # peer ID -> its last claim unserved
    struck_since: dict[str, float] = field(default_factory=dict)  # peer ID -> when it was struck last (DHT time)
    # peer ID -> the time in the record it had when it did not answer on the network: not counted until it writes
    # another (a crashed peer's last record stands until it expires, progress_ttl)
    silent: dict[str, float] = field(default_factory=dict)
    history_grace_s: float = STRUCK_IN_HISTORY_S  # at least the records' TTL (swarm.progress_ttl)

    def counts(self, record: PeerProgress) -> bool:
        """Whether `record` is one this peer takes into account at all (its own always is)."""
        return record.peer_id == self.peer_id or (record.peer_id not in self.distrusted
                                                  and record.sha256 not in self.refused_states)

    def struck(self, peer: str, now: float) -> bool:
        """Whether `peer`'s claims above this peer's step count nowhere now (see the module)."""
        count, until = self.unserved.get(peer, (0, 0.0))
        return count >= UNSERVED_STRIKES and now < until

    def struck_live(self, record: PeerProgress, expiration: float, now: float) -> bool:
        """Whether `record`'s author is live (its record neither expired nor LEFT) and has been struck for
        `history_grace_s` or more at `now`: the run's history no longer counts its claims."""
        return (expiration > now and record.phase != LEFT and self.struck(record.peer_id, now)
                and now - self.struck_since.get(record.peer_id, now) >= self.history_grace_s)

    def split(self, seen: Seen, now: float) -> tuple[dict[str, PeerProgress], dict[str, PeerProgress]]:
        """The live records (expiring after `now`, not LEFT) that a plan counts, and the live ones set aside.

        A set-aside author stays aside while its record claims the step it was set aside at, whatever state it
        names there: a liar that names a new state every few seconds otherwise counted again at once, and one
        identity claiming step 1 beside a run at step 0 stalled it for good (the simulation's seed 37). It
        counts again once it claims another step (an honest peer's next step), or after :data:`ASIDE_S`."""
        records, set_aside = {}, {}
        own = seen.get(self.peer_id)
        own_step = own[0].outer_step if own is not None else math.inf
        for record, expiration in seen.values():
            if expiration <= now or record.phase == LEFT or not self.counts(record):
                continue
            if record.peer_id in self.silent:
                if self.silent[record.peer_id] == record.time:
                    continue
                del self.silent[record.peer_id]  # it wrote since: it is back
            if record.outer_step > own_step and self.struck(record.peer_id, now):
                set_aside[record.peer_id] = record
                continue
            aside = self.unverified.get(record.peer_id)
            if aside is not None and aside[0] == record.outer_step and now < aside[2]:
                set_aside[record.peer_id] = record
                continue
            self.unverified.pop(record.peer_id, None)  # it moved on, or was aside long enough: it counts again
            records[record.peer_id] = record
        return records, set_aside

    def history(self, seen: Seen, wall_now: float) -> Optional[RunHistory]:
        """The latest outer step at which this peer has seen the run, from every record it read, of peers live,
        gone (LEFT) or whose record has expired since; this one's own and the loading ones left out (a loading
        peer holds no state of that step yet), and those it no longer trusts. A struck identity still counts here
        for `history_grace_s` while it is live (left out at once, a peer alone stepped alone beside an
        honest peer struck for a freeze), and for good once it is gone: a run whose peers all left waits for
        them or its checkpoint store (:mod:`p2p_diloco.train.catch_up`); None if there is none."""
        held = [record for record, expiration in seen.values()
                if record.peer_id != self.peer_id and record.phase != LOADING and self.counts(record)
                and not self.struck_live(record, expiration, wall_now)]
        if not held:
            return None
        step = max(record.outer_step for record in held)
        at_step = [record for record in held if record.outer_step == step]
        return RunHistory(step, len(at_step), max(0.0, wall_now - max(record.time for record in at_step)))

    def set_aside(self, claims: dict[str, tuple[int, str]], now: float, unserved: bool = False) -> list[str]:
        """Set these peers' claims (outer step, sha256) aside from `now` (DHT time); the peers set aside.
        `unserved`: nobody served the state they claim, a strike against each of them, and no more until they are
        struck: the claim still counts, and the peer asks again before it trains on (a donor frozen or busy when
        first asked; set aside at once, a joiner and its company averaged a second history from step 0 while
        the run's one peer was frozen for 8 s: the simulation, 4 peers, seed 25)."""
        aside = [peer for peer in claims if peer != self.peer_id]
        if not unserved:
            self.unverified.update((peer, (*claims[peer], now + ASIDE_S)) for peer in aside)
            return aside
        for peer in aside:
            was_struck = self.struck(peer, now)
            self.unserved[peer] = (self.unserved.get(peer, (0, 0.0))[0] + 1, now + STRIKE_S)
            self.unserved_claims[peer] = claims[peer]
            if not was_struck and self.struck(peer, now):
                self.struck_since[peer] = now
        return [peer for peer in aside if self.struck(peer, now)]

    def found_silent(self, records: dict[str, PeerProgress], peers: Iterable[str]) -> None:
        """`peers` did not answer on the network (they crashed or left without a word): their records in
        `records` count in no plan until they write another. A crashed member's last record said READY until it
        expired, and every round planned with it failed to form, 60 s of them (the simulation, 3 peers,
        seed 156)."""
        self.silent.update((peer, records[peer].time) for peer in peers if peer in records and peer != self.peer_id)

    def served(self, outer_step: int, sha256: str, donor: Optional[str] = None) -> None:
        """This peer holds the state (`outer_step`, `sha256`) now, checked, served by `donor`: the claims of it
        count again, and the unserved claims of the donor and of those claimants (they told the truth) are
        forgiven."""
        truthful = {peer for peer, claim in [*self.unverified.items(), *self.unserved_claims.items()]
                    if claim[:2] == (outer_step, sha256)}
        self.unverified = {peer: claim for peer, claim in self.unverified.items() if peer not in truthful}
        for peer in truthful | {donor}:
            self.unserved.pop(peer, None)
            self.unserved_claims.pop(peer, None)
            self.struck_since.pop(peer, None)

    def refuse(self, sha256: Optional[str] = None, peers: Iterable[str] = ()) -> None:
        """Refuse the state `sha256` and distrust `peers` for the rest of the run."""
        if sha256 is not None:
            self.refused_states.add(sha256)
        self.distrusted.update(peer for peer in peers if peer != self.peer_id)

    def averaged_with(self, peers: Iterable[str]) -> None:
        """This peer averaged with `peers`: their word on a state counts first from now on."""
        self.groupmates.update(peer for peer in peers if peer != self.peer_id)

    def trusted_word(self) -> frozenset[str]:
        """The identities whose word on a state counts first: former groupmates not distrusted since."""
        return frozenset(self.groupmates - self.distrusted)
