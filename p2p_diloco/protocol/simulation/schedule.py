"""A seed's schedule: who joins when, how fast each trains, who crashes, freezes or lies, and the partitions.

Every draw comes from ``random.Random(seed)``, so a seed is its schedule, and :func:`describe` prints it.
Faults (read and store delays, missed reads, crashes, freezes, partitions) happen before `quiet_at` only; the
run then goes on until `end`, and every live honest peer must step in that time (the liveness invariant).

Arrivals are drawn as volunteers arrive: together, 1 or 2 s apart, or minutes apart, with a start-up of a
few seconds each. :data:`SCENARIOS` are the races CI found before, each a fixed schedule.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from p2p_diloco.protocol.simulation.dht import Faults

HONEST, LIAR, SCALER = "honest", "liar", "scaler"  # a peer that follows the protocol; signs lies only; sends K·Δ

ARRIVALS = ("together", "1 s apart", "2 s apart", "minutes apart")


@dataclass(frozen=True)
class PeerPlan:
    peer_id: str
    join_at: float
    step_s: float = 0.05
    kind: str = HONEST
    scale: float = 1.0
    leave_at: float = math.inf
    warm_up_s: float = 0.0  # the first inner step's extra seconds (a fresh process: allocations, first kernels)
    serves: bool = True  # False: nobody can download its state (unreachable, and the run has no keeper)


@dataclass
class Schedule:
    peers: list[PeerPlan]
    faults: Faults = field(default_factory=Faults)
    crashes: list[tuple[str, float]] = field(default_factory=list)
    freezes: list[tuple[str, float, float]] = field(default_factory=list)
    partitions: list[tuple[float, float, dict[str, int]]] = field(default_factory=list)
    end: float = 200.0
    lie_jump: int = 1  # how far ahead of the run a liar claims to be (0: another state at the run's step)
    arrival: str = ""


def random_schedule(seed: int, peers: int, quiet_at: float = 90.0, settle_s: float = 150.0,
                    arrival: Optional[str] = None) -> Schedule:
    """The schedule of `seed` for a run of `peers` honest peers (and maybe a liar or a scaler); `arrival` (one
    of :data:`ARRIVALS`) fixes how they arrive, else the seed draws it."""
    rng = random.Random(seed)
    drawn = rng.choice(ARRIVALS)
    arrival = arrival or drawn
    gap = {"together": 0.0, "1 s apart": 1.0, "2 s apart": 2.0, "minutes apart": 45.0}[arrival]
    plans = []
    for i in range(peers):
        startup = rng.uniform(0.5, 3.0)  # the DHT node's start and the first reads
        join = i * gap + startup if arrival != "minutes apart" or i < 2 else rng.uniform(20.0, quiet_at)
        step_s = 0.05 * (rng.choice((1, 1, 1, 2, 6)))  # now and then a slow volunteer
        plans.append(PeerPlan(f"p{i}", join, step_s, warm_up_s=rng.uniform(0, 1.5)))
    schedule = Schedule(plans, Faults(rng.uniform(0, 0.5), rng.uniform(0, 1.0), rng.choice((0, 0.02, 0.1)), quiet_at),
                        arrival=arrival, end=quiet_at + settle_s)
    if rng.random() < 0.3:
        schedule.peers.append(PeerPlan(f"p{peers}", rng.uniform(0, 30), kind=LIAR))
        schedule.lie_jump = rng.choice((0, 1, 1, 3))
    elif rng.random() < 0.15 and peers >= 3:
        # a hostile volunteer joins a run an honest peer started (a first peer alone is trusted on first use)
        schedule.peers.append(PeerPlan(f"p{peers}", rng.uniform(10, 30), kind=SCALER, scale=rng.choice((3.0, 100.0))))
    honest = [p.peer_id for p in plans]
    for _ in range(rng.choice((0, 0, 1, 2))):
        if len(honest) > 2:
            schedule.crashes.append((rng.choice(honest), rng.uniform(5, quiet_at)))
    for _ in range(rng.choice((0, 0, 1))):
        schedule.freezes.append((rng.choice(honest), rng.uniform(5, quiet_at - 20), rng.uniform(2, 20)))
    if rng.random() < 0.15 and len(honest) >= 4:
        side = {peer: int(rng.random() < 0.5) for peer in honest}
        schedule.partitions.append((rng.uniform(10, quiet_at - 30), rng.uniform(5, 25), side))
    return schedule


def describe(schedule: Schedule) -> list[str]:
    """The schedule, a line each, for a failing seed's report."""
    lines = [f"arrivals {schedule.arrival or 'fixed'}; faults until {schedule.faults.quiet_at:g} s: store delay "
             f"≤ {schedule.faults.store_delay_s:.2f} s, read delay ≤ {schedule.faults.read_delay_s:.2f} s, "
             f"missed reads {schedule.faults.miss:.0%}; end {schedule.end:g} s"]
    lines += [f"{p.peer_id} {p.kind}{f' ×{p.scale:g}' if p.kind == SCALER else ''}"
              f"{f' (claims +{schedule.lie_jump})' if p.kind == LIAR else ''} joins at {p.join_at:.2f} s, "
              f"{p.step_s:.2f} s per inner step" + (f", leaves at {p.leave_at:.1f} s" if math.isfinite(p.leave_at) else "")
              for p in schedule.peers]
    lines += [f"{peer} crashes at {at:.2f} s" for peer, at in schedule.crashes]
    lines += [f"{peer} freezes at {at:.2f} s for {s:.1f} s" for peer, at, s in schedule.freezes]
    lines += [f"partition at {at:.2f} s for {s:.1f} s: {sorted(p for p, v in side.items() if v)} apart"
              for at, s, side in schedule.partitions]
    return lines


def _staggered(gap: float) -> Callable[[], Schedule]:
    """3 peers `gap` seconds apart, each with a second of warm-up before its first inner step."""
    def scenario() -> Schedule:
        return Schedule([PeerPlan(f"p{i}", 1.0 + i * gap, warm_up_s=1.0) for i in range(3)],
                        Faults(0.2, 0.5, 0.0, 60.0), end=200.0)
    return scenario


def _stall_at_step_2() -> Schedule:
    """The demo run's stall (issue 42): a newcomer reads the first peer ready when it has trained 2 inner steps of
    its learning rate's warm-up; the first round's robust mean is almost nothing, and the next honest means are
    far above 16 × that momentum."""
    return Schedule([PeerPlan("p0", 1.0), PeerPlan("p1", 1.95, warm_up_s=0.4), PeerPlan("p2", 3.95, warm_up_s=0.4)],
                    Faults(0.05, 0.1, 0.0, 60.0), end=200.0)


def _commit_tie() -> Schedule:
    """Two honest peers right after their step read each other at the step before, and a stranger's claim of
    another state at the new step: the vote must wait for them (34125a4)."""
    s = Schedule([PeerPlan("p0", 1.0), PeerPlan("p1", 1.0), PeerPlan("p2", 5.0, kind=LIAR)],
                 Faults(0.5, 1.0, 0.0, 60.0), end=200.0)
    s.lie_jump = 0
    return s


def _keeper_joiner() -> Schedule:
    """A joiner arrives while the run steps: it must never step alone from the state it loaded (b7789b7)."""
    return Schedule([PeerPlan("p0", 1.0), PeerPlan("p1", 1.2), PeerPlan("p2", 30.0)], Faults(0.3, 0.8, 0.05, 60.0),
                    end=200.0)


def _left_behind() -> Schedule:
    """A peer frozen mid-run falls behind a run whose state nobody can serve it (unreachable peers, no keeper);
    the others go on and leave; it must never take their steps alone, before or after their records expire
    (6a4ac64)."""
    return Schedule([PeerPlan("p0", 1.0), PeerPlan("p1", 1.0, leave_at=50.0, serves=False),
                     PeerPlan("p2", 1.0, leave_at=50.0, serves=False)],
                    Faults(0.2, 0.5, 0.0, 60.0), freezes=[("p0", 20.0, 15.0)], end=200.0)


def _slow_peer() -> Schedule:
    """A slow peer (6× the others' step time) contributes what it managed each round (e589aab)."""
    return Schedule([PeerPlan("p0", 1.0), PeerPlan("p1", 1.0), PeerPlan("p2", 1.0, step_s=0.3)],
                    Faults(0.3, 0.8, 0.05, 60.0), end=200.0)


def _kill_mid_round() -> Schedule:
    """A member crashes mid-round: the survivors try again without it (c2e7d41)."""
    return Schedule([PeerPlan(f"p{i}", 1.0) for i in range(4)], Faults(0.2, 0.5, 0.0, 60.0),
                    crashes=[("p3", 12.4)], end=200.0)


def _liar_far_ahead() -> Schedule:
    """A liar claims a step far ahead of 2 honest peers: set aside, never loaded, never a stall (e3eea37)."""
    s = Schedule([PeerPlan("p0", 1.0), PeerPlan("p1", 1.0), PeerPlan("p2", 3.0, kind=LIAR)],
                 Faults(0.3, 0.8, 0.05, 60.0), end=200.0)
    s.lie_jump = 5
    return s


def _liar_following_the_run() -> Schedule:
    """A liar joins a running run of 4 and keeps claiming the step after the run's, of a state nobody serves
    (the many-peer campaign's 256 peers: every peer skipped each round and asked for that state, 18 % of the
    work counted; struck after two unserved asks since issue 42's fourth part)."""
    s = Schedule([PeerPlan(f"p{i}", 1.0) for i in range(4)] + [PeerPlan("p4", 12.0, kind=LIAR)],
                 Faults(0.2, 0.5, 0.0, 60.0), end=200.0)
    s.lie_jump = 1
    return s


def _failed_download_newcomers() -> Schedule:
    """Newcomers to a run whose only peer crashed right after a step (5ea32d3): none may stall the others."""
    return Schedule([PeerPlan("p0", 1.0), PeerPlan("p1", 8.0), PeerPlan("p2", 8.5), PeerPlan("p3", 9.0)],
                    Faults(0.3, 0.8, 0.0, 60.0), crashes=[("p0", 7.0)], end=200.0)


def _one_peer_and_a_liar_at_its_step() -> Schedule:
    """A run of one peer, a liar claiming another state at its step, and joiners a minute apart: one voucher
    against one dissent, a joiner trusted neither and waited, and the next joiner averaged with it from step 0, a
    second history (the simulation, 4 peers, seed 9: issue 42's fifth part tries the tie by download)."""
    s = Schedule([PeerPlan("p0", 1.0), PeerPlan("p1", 40.0), PeerPlan("p2", 55.0), PeerPlan("p3", 5.0, kind=LIAR)],
                 Faults(0.3, 0.8, 0.02, 60.0), end=200.0)
    s.lie_jump = 0
    return s


def _joiners_beside_a_frozen_peer() -> Schedule:
    """Two joiners ask the run's one peer for its state while it is frozen: set aside at the first unserved ask,
    its claim left them averaging together from step 0 while the run was at step 20 (the simulation, 4 peers,
    seed 25: an unserved ask is a strike now, and a failed load of a vouched-for state is asked for again)."""
    return Schedule([PeerPlan("p0", 1.0), PeerPlan("p1", 36.0), PeerPlan("p2", 38.0)],
                    Faults(0.2, 0.5, 0.0, 60.0), freezes=[("p0", 35.0, 9.0)], end=200.0)


def _liar_three_steps_ahead_of_sixteen() -> Schedule:
    """16 peers and a liar claiming three steps past the run: its fresh claim at every step made every peer skip
    the round (the run had "moved past" the step), and 16 peers forked at a step (the simulation, 16 peers, seed
    28: the run moves past a step only by a state the peer would load)."""
    s = Schedule([PeerPlan(f"p{i}", 1.0 + 0.1 * i) for i in range(16)] + [PeerPlan("p16", 20.0, kind=LIAR)],
                 Faults(0.2, 0.5, 0.02, 60.0), end=200.0)
    s.lie_jump = 3
    return s


SCENARIOS: dict[str, Callable[[], Schedule]] = {
    "stall_at_step_2": _stall_at_step_2,
    "arrivals_2s_apart": _staggered(2.0),  # issue 42: 3 peers 2 s apart, without --wait-for-peers
    "arrivals_1s_apart": _staggered(1.0),
    "arrivals_together": _staggered(0.0),
    "vote_tie_while_committing": _commit_tie,
    "joiner_while_the_run_steps": _keeper_joiner,
    "left_behind_after_the_run_left": _left_behind,
    "slow_peer": _slow_peer,
    "kill_mid_round": _kill_mid_round,
    "liar_far_ahead": _liar_far_ahead,
    "liar_following_the_run": _liar_following_the_run,
    "newcomers_after_the_last_peer_crashed": _failed_download_newcomers,
    "one_peer_and_a_liar_at_its_step": _one_peer_and_a_liar_at_its_step,
    "joiners_beside_a_frozen_peer": _joiners_beside_a_frozen_peer,
    "liar_three_steps_ahead_of_sixteen": _liar_three_steps_ahead_of_sixteen,
}

__all__ = ["Schedule", "PeerPlan", "random_schedule", "describe", "SCENARIOS", "replace"]
