"""The records a peer read, and every predicate the round protocol asks of them, each defined once.

A record (:class:`PeerProgress`) says where its author's global state is (outer step t, its sha256) and
its :class:`~p2p_diloco.protocol.phases.Phase`. Records are read from an eventually consistent DHT: a
record may be seconds old, missed by one read, or already replaced by its author. The predicates here
are what every rule of the protocol asks of them, so that a rule never re-derives "on its way to t" or
"a peer I may average with" in a way of its own (two such definitions once disagreed about the keeper).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping, Optional

from p2p_diloco.protocol.phases import Phase

TRAINING, READY, COMMITTING, LOADING, KEEPING, LEFT = (p.value for p in Phase)
DIRECT, UNREACHABLE = "direct", "unreachable"  # whether others can dial a peer (p2p_diloco.swarm.reachability)

Records = Mapping[str, "PeerProgress"]  # peer ID -> its latest record read


@dataclass(frozen=True)
class PeerProgress:
    peer_id: str  # the peer whose key signed the record
    outer_step: int  # outer steps applied to this peer's global state
    sha256: str  # of that state (θ_global and the outer momentum)
    # TRAINING toward outer_step + 1, READY to average for it, COMMITTING the round's agreed mean (applying it:
    # it says TRAINING at outer_step + 1 next), LOADING the swarm's state at outer_step
    # (to train toward outer_step + 1 next; its sha256 is not yet that state's), KEEPING the run's state at
    # outer_step without training (the run's keeper: it serves that state, and nobody waits or averages with it),
    # or LEFT the swarm
    phase: str
    samples: int = 0  # samples in this peer's pseudo-gradient so far
    time: float = 0.0
    reachability: str = DIRECT  # DIRECT (others can dial it: it can reduce) or UNREACHABLE
    # READY: the leader it asks first (its membership plan's), once it planned its round; "" before
    # (p2p_diloco.protocol.membership: a peer that plans later asks the leader its groupmates already ask)
    leader: str = ""


@dataclass(frozen=True)
class RunHistory:
    """The latest outer step this peer has seen the run at, from the progress records it read on the DHT
    (those expired since included)."""

    outer_step: int
    peers: int  # how many peers' records are at that step (live, gone or expired)
    age_s: float  # seconds since the newest of them was written


def committing_toward(record: PeerProgress, outer_step: int) -> bool:
    """Whether `record`'s peer is committing the round that brings it to `outer_step`: its group agreed on the
    round's mean, and it applies it (the update check, its overlap steps) until it publishes `outer_step`. A
    phase of its own (COMMITTING at t − 1), never inferred from a stale READY."""
    return record.outer_step == outer_step - 1 and record.phase == COMMITTING


def on_its_way_to(record: PeerProgress, outer_step: int) -> bool:
    """Whether `record`'s peer's round toward `outer_step` runs (READY at t − 1: its all-reduce, reports and audit
    may still fail) or is committing (:func:`committing_toward`): either may bring it to `outer_step` any moment,
    so a peer there waits for it before it votes, averages or calls itself alone."""
    return committing_toward(record, outer_step) or (record.outer_step == outer_step - 1 and record.phase == READY)


def averages(record: PeerProgress) -> bool:
    """Whether `record`'s peer is one that averages: every peer but the run's keeper, which only keeps the state."""
    return record.phase != KEEPING


def averaging_peers(records: Records, peer_id: str) -> list[PeerProgress]:
    """The records of the other peers this one may average with, at whatever step: a keeper never averages."""
    return [r for pid, r in records.items() if pid != peer_id and averages(r)]


def keepers(records: Records, peer_id: str) -> list[PeerProgress]:
    """The records of the run's keepers other than this peer: they serve the state, and never average."""
    return [r for pid, r in records.items() if pid != peer_id and not averages(r)]


def ready_at(records: Records, outer_step: int, sha256: Optional[str] = None) -> dict[str, PeerProgress]:
    """The peers ready to average toward `outer_step` + 1 (from the state `sha256`; None: any), and those whose
    round toward it is committing: a round's members are planned from them. A committing peer is not in a new
    round, but a late peer that plans it in finds no group beside it rather than form a second group at the step
    that just committed: in the simulation (4 peers, 60 seeds) leaving committing peers out raised the steps with
    two honest states from 35 to 63."""
    return {pid: r for pid, r in records.items()
            if r.outer_step == outer_step and r.phase in (READY, COMMITTING) and sha256 in (None, r.sha256)}


def busy_toward(records: Records, outer_step: int, peer_id: str, sha256: Optional[str] = None) -> dict[str, str]:
    """The peers (ID -> phase) still on their way to averaging toward `outer_step` + 1 with this peer, whose
    state is `sha256`: training from that state, loading the state at `outer_step`, or in the round that brings
    them there (:func:`on_its_way_to`). A peer ready at the step waits for them
    (:meth:`p2p_diloco.swarm.progress.SwarmProgress.wait_for_groupmates`).

    A peer training from another state at the step cannot be in this peer's round (its θ_global differs):
    it is not waited for. One identity whose record said "training" at the run's step held every round for
    ``round_wait_timeout``, and two honest peers whose waits ended apart never met again (the simulation's
    ``vote_tie_while_committing``). Once such a peer loads the agreed state it says "loading", and is
    waited for. `sha256` None: any state."""
    return {r.peer_id: r.phase for r in records.values()
            if (r.outer_step == outer_step and r.phase == LOADING)
            or (r.outer_step == outer_step and r.phase == TRAINING and sha256 in (None, r.sha256))
            or (on_its_way_to(r, outer_step) and r.peer_id != peer_id)}


def round_closing(records: Records, outer_step: int, peer_id: str) -> bool:
    """Whether another peer is ready at `outer_step` (or committing its round), or past it: the fastest peer ends
    the round for all."""
    return any(r.peer_id != peer_id and (r.outer_step > outer_step
                                         or (r.outer_step == outer_step and r.phase in (READY, COMMITTING)))
               for r in records.values())


def went_on_without(records: Records, outer_step: int, peer_id: str, among: Optional[Collection[str]] = None) -> bool:
    """Whether the peers at `outer_step` averaged without this one: of the other peers it planned its round with
    (`among`, the membership's members; None: every record), more are past the step than still ready or training
    at it. A liar's claim past the step changes nothing while as many honest peers are at it, and one committing
    at the step is no longer there to average with. Counted, not "any peer still at the step": three peers left
    behind by a group of 13 each saw the two others ready at the step, waited out every leader's window
    together, and committed a second state at a step the run had left 17 s before (the simulation, 16 peers,
    seed 39)."""
    others = [r for pid, r in records.items() if pid != peer_id and (among is None or pid in among)]
    past = sum(r.outer_step > outer_step for r in others)
    staying = sum(r.outer_step == outer_step and r.phase in (READY, TRAINING) for r in others)
    return past > staying


def dialable(records: Records) -> list[str]:
    """The peers of `records` that others can dial, sorted: the only ones whose silence says they are gone (one
    behind NAT may not answer a request at all)."""
    return sorted(peer for peer, r in records.items() if r.reachability == DIRECT)


def vouchers(records: Records, outer_step: int, sha256: str) -> set[str]:
    """The identities whose live records (not "loading": they hold no agreed state) claim this state."""
    return {peer for peer, r in records.items()
            if r.phase != LOADING and (r.outer_step, r.sha256) == (outer_step, sha256)}


def own_vouchers(records: Records, peer_id: str, outer_step: int, sha256: str) -> set[str]:
    """This peer, the records at its step with its state, and the peers whose round toward its step runs or
    commits (:func:`on_its_way_to`: a groupmate's record read while the round ran says READY at the step before).
    At step 0, this peer alone: every fresh peer holds the
    run's initial state (built from the seed), which says nothing about where the run is, so joiners that
    start together follow a peer that went ahead."""
    if outer_step == 0:
        return {peer_id}
    committing = {peer for peer, r in records.items() if on_its_way_to(r, outer_step)}
    return {peer_id} | vouchers(records, outer_step, sha256) | committing
