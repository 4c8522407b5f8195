"""What must hold in a run, checked after every event of the simulation.

* **one state per step**: no outer step has two states committed by honest peers, while one of the first
  state's committers is alive (a history whose every holder crashed is lost: a new one may start); a side
  of a partition that cannot see the run's history may fork it: counted apart, the cost of availability;
* **never alone while the run is ahead**: no honest peer takes a step alone while the run's history (a state
  honest peers committed) is at a later step;
* **only committed states are loaded**: no honest peer loads a state that honest peers did not commit;
* **live**: once faults stop, every live honest peer takes (or loads) an outer step within `liveness_bound_s`;
* **no lost work**: no trained samples are lost except by a crash: a load keeps the inner steps a peer held
  (:func:`~p2p_diloco.protocol.plans.keeps_work`) unless they went into a round that lost a member (the crash's
  cost) or a group that went on while the peer matched (counted: hivemind may have run that group with them);
* **no trap**: no honest peer has more than `max_void_streak` void rounds in a row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from p2p_diloco.protocol.simulation.peer import LOST_MEMBER

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

    def breach(self, invariant: str, peer: str, detail: str) -> None:
        if self.swarm.dht.partition and invariant in (ONE_STATE, ALONE_AHEAD):
            invariant += " (partitioned)"  # a side that cannot see the run's history forks it: counted, not a bug
        self.observed[invariant] = self.observed.get(invariant, 0) + 1
        if invariant in self.checked:
            self.violations.append(Violation(invariant, self.swarm.loop.now, peer, detail))

    def on_commit(self, state: Any, honest_members: list[str]) -> None:
        if not honest_members:
            return
        # a state all of whose committers crashed is a history lost by crashes: a new one may start
        others = {sha for sha in self.swarm.committed_at.get(state.outer_step, set()) if sha != state.sha256
                  and any(self.swarm.alive(peer) for peer in self.swarm.states[sha].committed_by)}
        if others:
            self.breach(ONE_STATE, honest_members[0], f"outer step {state.outer_step}: {state.sha256[:8]} beside "
                        f"{', '.join(sorted(s[:8] for s in others))}")

    def on_alone(self, peer: Any) -> None:
        ahead = max(self.swarm.committed_at, default=0)
        if peer.honest and ahead > peer.outer_step:
            self.breach(ALONE_AHEAD, peer.peer_id, f"stepped alone from {peer.outer_step}, the run is at {ahead}")

    def on_adopt(self, peer: Any, state: Any, loaded: bool, kept: bool = False) -> None:
        if not peer.honest:
            return
        if state.outer_step > 0 and not state.committed_by:
            self.breach(UNCOMMITTED_LOAD, peer.peer_id, f"adopted {state.sha256[:8]} at {state.outer_step}, which no "
                                                        f"honest peer committed")
        if loaded and not kept and peer.held_samples and peer.work_sent != LOST_MEMBER:  # that one: lost to a crash
            self.breach(LOST_WORK, peer.peer_id, f"a load to outer step {state.outer_step} dropped "
                                                 f"{peer.held_samples} trained samples")

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
                self.breach(LIVENESS, peer.peer_id, f"no outer step for {now - since:.0f} s after faults stopped "
                                                    f"(at {peer.outer_step}; its last: {peer.events[-1:]})")
