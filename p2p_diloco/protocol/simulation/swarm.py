"""One simulated run: the peers, the DHT, the averager, the states the run committed, and the report.

The states are kept in a registry, as the run's peers hold them: θ_global and the outer momentum (small
float32 vectors), the step, the parent state and the honest peers that committed it. A round's outcome is
committed once for its group (every member computes the same: the same mean, the same state), through the
real update check (:func:`p2p_diloco.protocol.update_rule.judge_update`) and the real Nesterov step
(:func:`p2p_diloco.train.outer.nesterov_step_`). ``update_check="void"`` replays the rule before issue 42,
which voided a round above the limit instead of clipping it.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
from dataclasses import dataclass, field
from typing import Optional

import torch

from p2p_diloco.fixed_order import as_float32, norm
from p2p_diloco.protocol.simulation.averager import RoundOutcome, SimAverager
from p2p_diloco.protocol.simulation.dht import Faults, SimDHT
from p2p_diloco.protocol.simulation.invariants import INVARIANTS, Invariants
from p2p_diloco.protocol.simulation.loop import Loop, Task
from p2p_diloco.protocol.simulation.peer import SimPeer
from p2p_diloco.protocol.simulation.schedule import LIAR, Schedule
from p2p_diloco.protocol.update_rule import APPLY, VOID, UpdateVerdict, exceeds_limit, judge_update
from p2p_diloco.protocol.view import DIRECT, TRAINING, PeerProgress
from p2p_diloco.sync.relay import RelayLayout
from p2p_diloco.sync.robust import AggregationRule
from p2p_diloco.train.outer import nesterov_step_


@dataclass(frozen=True)
class SimSettings:
    """The run's settings as the simulation needs them (defaults: the demo run's, peers/demo.toml)."""

    inner_steps: int = 25  # inner.steps_per_outer
    lead_steps: int = 1  # inner steps a peer trains after it reads that another is ready
    samples_per_step: int = 16
    round_wait_timeout: float = 30.0
    attempts: int = 2  # swarm.round_attempts
    window_s: float = 6.0  # 3 × swarm.matchmaking_time
    # a member lost mid-round: its missing parts, or (lost after the all-reduce) its silence on the network, two
    # ALIVE checks 2 s apart (swarm.liveness.SilentPeers), where the wait for its report took commit_timeout
    failure_detection_s: float = 4.0
    download_s: float = 1.0
    commit_s: float = 0.5  # from the group's agreement to the state at t + 1: the update check, the overlap steps
    ttl: float = 60.0  # swarm.progress_ttl
    update_check: str = "clip"  # or "void": the rule before issue 42
    max_growth: float = 16.0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    dims: int = 32  # of the simulated pseudo-gradients
    step_size: float = 0.02  # an inner step's move along the run's direction
    noise: float = 6.0  # its noise, against 1 of direction: a few inner steps are mostly noise
    warmup_steps: int = 20  # inner.warmup_steps
    rule: AggregationRule = AggregationRule()
    # a liar can hold a lone peer for a declined claim's ASIDE_S (30 s), two asks and the ledger's history_grace_s (60 s)
    liveness_bound_s: float = 120.0
    max_void_streak: int = 3

    relay_group_size: int = 32  # swarm.relay_group_size: a round of more members travels through relays

    def round_duration(self, members: int) -> float:
        """The all-reduce, the reports and the audit of a round of `members`: 0.3 s of payload, and 20 ms for each
        peer a member talks to; a group larger than ``relay_group_size`` is laid out as the real round lays it out
        (:class:`p2p_diloco.sync.relay.RelayLayout`), so a member talks to its group and its column only, and the
        relayed share of the payload crosses two links."""
        talks_to, relayed = relay_cost(members, self.relay_group_size)
        return 0.3 * (1.0 + relayed) + 0.02 * talks_to


@functools.lru_cache(maxsize=4096)
def relay_cost(members: int, group_size: int) -> tuple[int, float]:
    """For a round of `members` laid out in groups of `group_size` (:class:`~p2p_diloco.sync.relay.RelayLayout`):
    how many peers a member talks to (``members`` in a flat round, as this model always counted it; G − 1 + k − 1
    through relays, k the layout's groups) and the share of the payload that is relayed."""
    layout = RelayLayout(tuple(range(members)), (True,) * members, group_size)
    if layout.flat:
        return members, 0.0
    direct = group_size + layout.groups - 1  # its own group and its own column, itself once
    return direct - 1, max(0.0, 1.0 - direct / members)


@dataclass
class SimState:
    outer_step: int
    sha256: str
    params: torch.Tensor
    momentum: torch.Tensor
    parent: Optional[str]
    committed_by: set[str] = field(default_factory=set)  # honest peers


def state_sha256(parent: str, outer_step: int, members, serial: int) -> str:
    return hashlib.sha256(f"{parent}|{outer_step}|{','.join(members)}|{serial}".encode()).hexdigest()


class SimSwarm:
    def __init__(self, seed: int, schedule: Schedule, settings: SimSettings = SimSettings(),
                 checked: tuple[str, ...] = INVARIANTS):
        self.seed = seed
        self.schedule = schedule
        self.settings = settings
        self.faults: Faults = schedule.faults
        self.rng = random.Random(seed)
        self.invariants = Invariants(self, settings.liveness_bound_s, settings.max_void_streak, checked)
        self.loop = Loop(self.invariants.after_event)
        self.dht = SimDHT(self.rng, self.faults, settings.ttl)
        self.averager = SimAverager(settings.rule, settings.window_s, settings.failure_detection_s, self.present,
                                    lambda: bool(self.dht.partition))
        generator = torch.Generator().manual_seed(seed)
        direction = torch.randn(settings.dims, generator=generator)
        self.direction = direction / direction.norm()
        params = torch.randn(settings.dims, generator=generator) * (20.0 / math.sqrt(settings.dims))
        self.initial = SimState(0, hashlib.sha256(b"initial").hexdigest(), params, torch.zeros(settings.dims), None)
        self.states: dict[str, SimState] = {self.initial.sha256: self.initial}
        self.committed_at: dict[int, set[str]] = {}  # outer step -> states honest peers committed there
        self._serial = 0
        self._join_at = {plan.peer_id: plan.join_at for plan in schedule.peers}
        self.peers: dict[str, SimPeer] = {}
        self.tasks: dict[str, Task] = {}
        for plan in schedule.peers:
            peer = SimPeer(plan.peer_id, self, plan.kind, plan.step_s, plan.scale, plan.warm_up_s,
                           leave_at=plan.leave_at, serves=plan.serves)
            self.peers[plan.peer_id] = peer
            process = lie(self, peer) if plan.kind == LIAR else peer.run()
            self.tasks[plan.peer_id] = Task(self.loop, process, plan.join_at)
        for peer_id, at in schedule.crashes:
            self.loop.at(at, lambda p=peer_id: self.crash(p))
        for peer_id, at, seconds in schedule.freezes:
            self.loop.at(at, lambda p=peer_id, s=seconds: self.tasks[p].freeze(self.loop.now + s))
        for at, seconds, sides in schedule.partitions:
            self.loop.at(at, lambda s=sides: self.dht.partition.update(s))
            self.loop.at(at + seconds, self.dht.partition.clear)

    # ----- the network ----------------------------------------------------------------------------
    def alive(self, peer_id: str) -> bool:
        task = self.tasks.get(peer_id)
        return (task is not None and not task.crashed and not task.done
                and self.loop.now >= self._join_at[peer_id])

    def answers(self, peer_id: str) -> bool:
        """Whether `peer_id` answers on the network (alive and not frozen)."""
        return self.alive(peer_id) and self.tasks[peer_id].frozen_until <= self.loop.now

    def present(self, peer_id: str, other: str) -> bool:
        """Whether `peer_id` answers `other`: alive, not frozen, on the same side of a partition."""
        return self.answers(peer_id) and self.dht.partition.get(peer_id, 0) == self.dht.partition.get(other, 0)

    def crash(self, peer_id: str) -> None:
        self.tasks[peer_id].crash()
        self.dht.gone(peer_id, self.loop.now)
        self.peers[peer_id].log("crashed")

    def live_honest(self) -> list[SimPeer]:
        return [p for p in self.peers.values() if p.honest and self.alive(p.peer_id) and not p.left
                and p.leave_at > self.loop.now]

    def serve(self, target: tuple[int, str], asker: SimPeer) -> tuple[Optional[SimState], Optional[str]]:
        """The state `target` and a donor that serves it to `asker`, or (None, None)."""
        for peer_id in sorted(self.peers):
            peer = self.peers[peer_id]
            if (peer.kind != LIAR and peer.serves and peer_id != asker.peer_id and (peer.outer_step, peer.sha256) == target
                    and self.present(peer_id, asker.peer_id) and target[1] in self.states):
                return self.states[target[1]], peer_id
        return None, None

    # ----- committing -----------------------------------------------------------------------------
    def _verdict(self, mean: torch.Tensor, parent: SimState) -> UpdateVerdict:
        settings = self.settings
        update, history, params = norm(mean), norm(parent.momentum), norm(parent.params)
        if settings.update_check == "void":
            return UpdateVerdict(VOID, 0.0, "above the limit") if exceeds_limit(
                update, history, params, settings.max_growth) else UpdateVerdict(APPLY)
        return judge_update(update, history, params, settings.max_growth)

    def _commit(self, mean: torch.Tensor, step: int, sha: str, members: tuple[str, ...], formed_apart: bool = False):
        parent = self.states[sha]
        verdict = self._verdict(mean, parent)
        if verdict.action == VOID:
            return verdict, None, members
        params, momentum = parent.params.clone(), parent.momentum.clone()
        nesterov_step_(params, momentum, mean * as_float32(verdict.scale), self.settings.outer_lr,
                       self.settings.outer_momentum)
        self._serial += 1
        state = SimState(step + 1, state_sha256(sha, step + 1, members, self._serial), params, momentum, sha)
        honest = [m for m in members if self.peers[m].honest]
        self.invariants.on_commit(state, honest, formed_apart)
        state.committed_by.update(honest)
        self.states[state.sha256] = state
        if honest:
            self.committed_at.setdefault(step + 1, set()).add(state.sha256)
        return verdict, state, members

    def commit(self, outcome: RoundOutcome, step: int, sha: str):
        """What the members of a round that ended with a mean apply: computed once for all of them."""
        if outcome.applied is None:  # kept on the outcome: an id() of a freed outcome is reused, and replays differed
            outcome.applied = self._commit(outcome.mean, step, sha, outcome.members, outcome.formed_apart)
        return outcome.applied

    def commit_alone(self, peer: SimPeer, sent: torch.Tensor):
        self.invariants.on_alone(peer)
        return self._commit(sent, peer.outer_step, peer.sha256, (peer.peer_id,))

    # ----- the run --------------------------------------------------------------------------------
    def run(self) -> "SimReport":
        self.loop.run(self.schedule.end)
        return SimReport.of(self)


def lie(swarm: SimSwarm, liar: SimPeer):
    """A hostile identity that signs records only: every 2 s a claim `jump` steps past the run's latest step,
    of a state nobody serves (jump 0: another state at the run's step, for the vote)."""
    rng = random.Random(swarm.seed * 7919 + int(liar.peer_id[1:]))
    jump = swarm.schedule.lie_jump
    while True:
        read = swarm.dht.read(liar.peer_id, swarm.loop.now)
        latest = max((r.outer_step for r, _ in read if r.peer_id != liar.peer_id), default=0)
        fake = hashlib.sha256(f"lie {rng.random()}".encode()).hexdigest()
        swarm.dht.store(PeerProgress(liar.peer_id, latest + jump, fake, TRAINING, 0, swarm.loop.now, DIRECT),
                        swarm.loop.now)
        yield 2.0


@dataclass
class SimReport:
    seed: int
    violations: list
    observed: dict[str, int]
    rounds: int  # distinct states committed
    honest_steps: int  # the latest step an honest peer committed
    counted_share: float  # of the samples honest peers trained, the share a group counted
    dropped_share: float  # the share loads dropped
    messages_per_peer: float  # DHT stores and reads per peer
    longest_void_streak: int
    events: int
    transcript: list[str]

    @classmethod
    def of(cls, swarm: SimSwarm) -> "SimReport":
        honest = [p for p in swarm.peers.values() if p.honest]
        trained = sum(p.counts.samples_trained for p in honest) or 1
        transcript = sorted((line for p in swarm.peers.values() for line in p.events), key=lambda l: float(l.split()[0]))
        return cls(swarm.seed, list(swarm.invariants.violations), dict(swarm.invariants.observed),
                   len(swarm.states) - 1, max(swarm.committed_at, default=0),
                   sum(p.counts.samples_counted for p in honest) / trained,
                   sum(p.counts.samples_dropped for p in honest) / trained,
                   (swarm.dht.stores + swarm.dht.reads) / max(len(swarm.peers), 1),
                   max((p.counts.longest_void_streak for p in honest), default=0), swarm.loop.events, transcript)
