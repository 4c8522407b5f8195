"""What must hold in a run, checked after every event of the simulation.

* **one state per step**: no outer step has two states committed by honest peers, while one of the first
  state's committers is alive (a history whose every holder crashed is lost: a new one may start); a side
  of a partition that cannot see the run's history may fork it (a round whose group formed while the partition
  was on, even if it commits a moment after it healed): counted apart, the cost of availability, and so are
  the fork's later steps, until the two histories meet again once the partition heals (the larger group keeps
  its state: :func:`~p2p_diloco.protocol.trust.choose_target`);
* **never alone while the run is ahead**: no honest peer takes a step alone while the run's history (a state
  honest peers committed) is at a later step, unless every committer of that history crashed (counted apart);
* **only committed states are loaded**: no honest peer loads a state that honest peers did not commit;
* **live**: once faults stop, every live honest peer takes (or loads) an outer step within `liveness_bound_s`,
  unless every honest peer that committed the run's later steps crashed (:meth:`Invariants.history_lost`: the peer
  then waits for the run's state, bounded, as :mod:`p2p_diloco.train.catch_up` has it; counted apart);
* **no lost work**: no trained samples are lost except by a crash: a load keeps the inner steps a peer held
  (:func:`~p2p_diloco.protocol.plans.keeps_work`) unless they went into a round that lost a member (the crash's
  cost); a jump of two steps or more drops them by design (the peer missed rounds: its Δ is stale), counted apart;
* **no trap**: no honest peer has more than `max_void_streak` void rounds in a row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


ONE_STATE, ALONE_AHEAD, UNCOMMITTED_LOAD, LIVENESS, LOST_WORK, VOID_TRAP = (
    "one_state_per_step", "alone_while_ahead", "uncommitted_load", "liveness", "lost_work", "void_trap")
INVARIANTS = (ONE_STATE, ALONE_AHEAD, UNCOMMITTED_LOAD, LIVENESS, LOST_WORK, VOID_TRAP)


@dataclass(frozen=True)
class Violation:
    invariant: str
    at: float
    peer: str
    detail: str

    def __str__(self) -> str:
        return f"{self.at:.2f} s {self.peer}: {self.invariant}: {self.detail}"


@dataclass
class Invariants:
    swarm: Any  # the SimSwarm it watches (p2p_diloco.protocol.simulation.swarm)
    liveness_bound_s: float
    max_void_streak: int
    checked: tuple[str, ...] = INVARIANTS  # which ones count as violations (the others are counted only)
    violations: list[Violation] = field(default_factory=list)
    observed: dict[str, int] = field(default_factory=dict)  # every breach, checked or not
    _next_liveness_check: float = 0.0
    _stalled: set[str] = field(default_factory=set)
    forked_apart: set[str] = field(default_factory=set)  # states of a history forked in a partition, and their heirs
    formed_apart: set[str] = field(default_factory=set)  # states whose round's group formed while a partition was on

    def breach(self, invariant: str, peer: str, detail: str, of_partition: bool = False) -> None:
        if (self.swarm.dht.partition or of_partition) and invariant in (ONE_STATE, ALONE_AHEAD):
            invariant += " (partitioned)"  # a side that cannot see the run's history forks it: counted, not a bug
        self.observed[invariant] = self.observed.get(invariant, 0) + 1
        if invariant in self.checked:
            self.violations.append(Violation(invariant, self.swarm.loop.now, peer, detail))

    def on_commit(self, state: Any, honest_members: list[str], formed_apart: bool = False) -> None:
        """Check one state per step as `state` is committed by `honest_members`; `formed_apart`: its group formed while
        a partition was on (a minority side's round that commits a moment after the partition heals is its fork)."""
        if not honest_members:
            return
        # a state all of whose committers crashed is a history lost by crashes: a new one may start
        others = {sha for sha in self.swarm.committed_at.get(state.outer_step, set()) if sha != state.sha256
                  and any(self.swarm.alive(peer) for peer in self.swarm.states[sha].committed_by)}
        if state.parent in self.forked_apart:
            self.forked_apart.add(state.sha256)
        if formed_apart:
            self.formed_apart.add(state.sha256)
        if others:
            of_partition = bool(self.swarm.dht.partition) or bool(({state.sha256} | others)
                                                                  & (self.forked_apart | self.formed_apart))
            if of_partition:
                self.forked_apart.add(state.sha256)
            self.breach(ONE_STATE, honest_members[0], f"outer step {state.outer_step}: {state.sha256[:8]} beside "
                        f"{', '.join(sorted(s[:8] for s in others))}", of_partition)

    def on_alone(self, peer: Any) -> None:
        ahead = max(self.swarm.committed_at, default=0)
        if peer.honest and ahead > peer.outer_step:
            # as for one state per step, a history whose every committer crashed is lost: a new one may start
            lost = " (history lost)" if self.lost_above(peer.outer_step) else ""
            self.breach(ALONE_AHEAD + lost, peer.peer_id, f"stepped alone from {peer.outer_step}, the run is at "
                                                          f"{ahead}", peer.sha256 in self.forked_apart)

    def on_adopt(self, peer: Any, state: Any, loaded: bool, kept: bool = False) -> None:
        if not peer.honest:
            return
        if state.outer_step > 0 and not state.committed_by:
            self.breach(UNCOMMITTED_LOAD, peer.peer_id, f"adopted {state.sha256[:8]} at {state.outer_step}, which no "
                                                        f"honest peer committed")
        if loaded and not kept and peer.held_samples and not peer.work_sent:  # that one: lost to a crash
            # a jump of two steps or more: the peer missed rounds (frozen, cut off, or a joiner that trained from the
            # initial state before it read the run), and its Δ points where the run no longer is (keeps_work)
            stale = " (stale: a jump)" if state.outer_step > peer.outer_step + 1 else ""
            self.breach(LOST_WORK + stale, peer.peer_id, f"a load from outer step {peer.outer_step} to "
                                                         f"{state.outer_step} dropped {peer.held_samples} trained samples")

    def on_void(self, peer: Any) -> None:
        if peer.honest and peer.counts.void_streak == self.max_void_streak + 1:
            self.breach(VOID_TRAP, peer.peer_id, f"{peer.counts.void_streak} void rounds in a row")

    def after_event(self) -> None:
        now = self.swarm.loop.now
        if now < self._next_liveness_check:
            return
        self._next_liveness_check = now + 1.0
        quiet = self.swarm.faults.quiet_at
        if not math.isfinite(quiet) or now < quiet + self.liveness_bound_s:
            return
        for peer in self.swarm.live_honest():
            since = max(peer.last_progress, quiet, peer.joined_at)
            if now - since > self.liveness_bound_s and peer.peer_id not in self._stalled:
                self._stalled.add(peer.peer_id)
                self.breach(LIVENESS + (" (history lost)" if self.history_lost(peer) else ""), peer.peer_id,
                            f"no outer step for {now - since:.0f} s after faults stopped (at {peer.outer_step}; "
                            f"its last: {peer.events[-1:]})")

    def history_lost(self, peer: Any) -> bool:
        """Whether `peer` waits for a history of the run that honest peers committed and every one of them crashed
        since: no state is left to load, and the peer waits as :mod:`p2p_diloco.train.catch_up` has it (bounded by
        ``state_wait_timeout``, then exit 5 with what to do); counted apart. A wait on a claim that no honest peer
        committed (a liar's) is no such wait."""
        history = peer.ledger.history(peer.seen, self.swarm.loop.now)
        committed = self.swarm.committed_at
        if history is None or not peer.outer_step < history.outer_step <= max(committed, default=0):
            return False
        return self.lost_above(peer.outer_step)

    def lost_above(self, outer_step: int) -> bool:
        """Whether every honest peer that committed a state above `outer_step` has crashed."""
        return not any(self.swarm.alive(member) for step, shas in self.swarm.committed_at.items() if step > outer_step
                       for sha in shas for member in self.swarm.states[sha].committed_by)
