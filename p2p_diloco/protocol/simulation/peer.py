"""One simulated peer: the loop of :class:`p2p_diloco.train.diloco.DiLoCoPeer`, deciding with the real core.

Each round, as a real peer runs it (``outer.sync_delay`` = 0, one fragment, DiLoCo's copy θ_local ← θ_global):

1. read the records and decide (:func:`~p2p_diloco.protocol.decide.next_move`, as the real peer does): a load
   the records trust is downloaded from a peer that holds the state, checked (one step ahead: a step from this
   peer's state, else :func:`~p2p_diloco.protocol.trust.unverified_step_trusted`);
2. behind the run with nobody to average with: wait for the run's state, never train;
3. inner steps, until H or until another peer is ready (:func:`~p2p_diloco.protocol.view.round_closing`), then
   ready; wait for the busy groupmates (:func:`~p2p_diloco.protocol.view.busy_toward`, bounded, silent peers
   dropped); skip, go alone or average (:func:`~p2p_diloco.protocol.plans.plan_averaging`) in the group the
   membership plan names (:func:`~p2p_diloco.protocol.membership.plan_membership`), retried once without the
   members that failed;
4. the update check (:func:`~p2p_diloco.protocol.update_rule.judge_update`) and the outer step.

Its pseudo-gradient is a small vector that grows with the inner steps it holds: each inner step adds the run's
direction and noise, so a peer with 2 inner steps sends mostly noise beside one with 25.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from p2p_diloco.protocol.decide import LOAD, WAIT, Move, next_move
from p2p_diloco.protocol.ledger import STRUCK_IN_HISTORY_S, Seen, TrustLedger, remember
from p2p_diloco.protocol.membership import plan_membership, quorum_of
from p2p_diloco.protocol.phases import check_transition
from p2p_diloco.protocol.plans import RoundPlan, keeps_work, plan_averaging, plan_round
from p2p_diloco.protocol.trust import is_verifiable, moved_past, unverified_step_trusted
from p2p_diloco.protocol.view import (
    COMMITTING, DIRECT, LEFT, LOADING, READY, TRAINING, PeerProgress, busy_toward, round_closing, went_on_without,
)

from p2p_diloco.protocol.simulation.schedule import HONEST, SCALER
from p2p_diloco.train.catch_up import POLL_S as CATCH_UP_POLL_S  # how often a peer behind the run tries again

CHECK_S = 0.5  # how often a training peer reads whether the round is closing (ROUND_CHECK_PERIOD_S)
WAIT_POLL_S = 0.5  # how often a ready peer reads whether its groupmates are (wait_for_groupmates)
SILENT_CHECK_S, SILENT_MISSES = 2.0, 2  # SilentPeers: a busy peer that does not answer twice, 2 s apart, is gone
ROUND_POLL_S = 0.2  # how often a matching member looks at its round
LEFT_BEHIND_POLL_S = 1.0  # outer_sync.LEFT_BEHIND_POLL_S


@dataclass
class PeerCounts:
    """What the report and the invariants need of a peer's run."""

    samples_trained: int = 0
    samples_counted: int = 0
    samples_dropped: int = 0  # by loads: the inner steps θ_local held went with it
    void_streak: int = 0
    longest_void_streak: int = 0


@dataclass
class SimPeer:
    peer_id: str
    swarm: Any  # the SimSwarm it runs in (p2p_diloco.protocol.simulation.swarm)
    kind: str = HONEST
    step_s: float = 0.05  # seconds per inner step
    scale: float = 1.0  # what a SCALER multiplies its pseudo-gradient by
    warm_up_s: float = 0.0  # its first inner step's extra seconds
    serves: bool = True  # whether others can download its state
    outer_step: int = 0
    sha256: str = ""
    delta: Optional[torch.Tensor] = None  # θ_global − θ_local
    held_steps: int = 0
    inner_steps: int = 0  # of its inner learning rate's schedule
    seen: Seen = field(default_factory=dict)
    own: Optional[PeerProgress] = None
    set_aside_records: dict[str, PeerProgress] = field(default_factory=dict)
    counts: PeerCounts = field(default_factory=PeerCounts)
    last_progress: float = 0.0  # when it last took or loaded an outer step (or joined)
    joined_at: float = 0.0
    leave_at: float = math.inf
    left: bool = False
    attempts_at: tuple[int, int] = (-1, 0)
    # its held Δ went into a round that lost a member (the real peer's RoundFailed.reported, taken whenever a member
    # is lost: the simulation does not say whether the loss came before the reports): a state may hold it, and
    # keeps_work drops it on a load. A peer left behind while it matched keeps its work: it reports that round
    # incomplete, so no groupmate commits it
    work_sent: bool = False
    events: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.ledger = TrustLedger(self.peer_id, history_grace_s=max(self.swarm.settings.ttl, STRUCK_IN_HISTORY_S))
        self.rng = torch.Generator().manual_seed(self.swarm.seed * 1_000_003 + int(self.peer_id[1:]))

    # ----- records ------------------------------------------------------------------------------
    @property
    def now(self) -> float:
        return self.swarm.loop.now

    @property
    def honest(self) -> bool:
        return self.kind == HONEST

    def log(self, what: str) -> None:
        self.events.append(f"{self.now:8.2f} {self.peer_id} step {self.outer_step}: {what}")

    def publish(self, outer_step: int, sha256: str, phase: str, samples: int = 0, leader: str = "") -> None:
        check_transition(None if self.own is None else self.own.phase, phase)
        self.own = PeerProgress(self.peer_id, outer_step, sha256, phase, samples, self.now, DIRECT, leader)
        self.swarm.dht.store(self.own, self.now)

    def fetch(self) -> dict[str, PeerProgress]:
        read = self.swarm.dht.read(self.peer_id, self.now) + [(self.own, math.inf)]
        self.seen = remember(self.seen, read, self.now)
        records, self.set_aside_records = self.ledger.split(self.seen, self.now)
        return records

    @property
    def held_samples(self) -> int:
        return self.held_steps * self.swarm.settings.samples_per_step

    # ----- the loop -----------------------------------------------------------------------------
    def run(self):
        self.sha256 = self.swarm.initial.sha256
        self.delta = torch.zeros_like(self.swarm.initial.params)
        self.joined_at = self.last_progress = self.now
        self.publish(0, self.sha256, TRAINING)
        self.log("joined")
        while self.now < self.leave_at:
            records = self.fetch()
            move = self.next_move(records)
            if move.action == LOAD:
                loaded = yield from self.load(move.load, records)
                if loaded:
                    continue
                move = self.next_move(records, may_load=False)
            if move.action == WAIT:
                self.log(f"waiting for the run's state: {move.reason}")
                yield CATCH_UP_POLL_S
                continue
            yield from self.round()
        self.publish(self.outer_step, self.sha256, LEFT)
        self.swarm.dht.gone(self.peer_id, self.now)
        self.left = True
        self.log("left")

    def next_move(self, records: dict[str, PeerProgress], may_load: bool = True) -> Move:
        """The move before its next round (:func:`~p2p_diloco.protocol.decide.next_move`), from `records` and what
        its ledger holds now; a jump it declines has its claims set aside."""
        move = next_move(records, self.set_aside_records, self.peer_id, self.outer_step, self.sha256,
                         self.ledger.history(self.seen, self.now), self.ledger.trusted_word(),
                         may_load)
        if move.declined is not None:
            self.log(f"not loading outer step {move.declined.target_step}: {move.vouch_counts}")
            self.ledger.set_aside(dict(move.declined.claims or {}), self.now)
        return move

    # ----- loading ------------------------------------------------------------------------------
    def load(self, plan: RoundPlan, records: dict[str, PeerProgress]):
        """Download the state `plan` targets (one :func:`next_move` trusts) and adopt it, if it passes the check."""
        target, claims = (plan.target_step, plan.target_sha256), dict(plan.claims or {})
        self.publish(target[0], self.sha256, LOADING)
        yield self.swarm.settings.download_s
        state, donor = self.swarm.serve(target, self)
        if state is None:
            self.publish(self.outer_step, self.sha256, TRAINING)
            # a claimant past the target moved on meanwhile: not a claim nobody serves (state_transfer.nobody_serves)
            moved_on = any(self.swarm.peers[peer].outer_step > target[0] for peer in claims if peer in self.swarm.peers
                           and self.swarm.peers[peer].kind == HONEST)
            self.ledger.set_aside(claims, self.now, unserved=not moved_on)
            self.log(f"nobody served outer step {target[0]}")
            return False
        forked = is_verifiable(self.outer_step, state.outer_step) and state.parent != self.sha256
        if forked and not unverified_step_trusted(records, self.peer_id, self.outer_step, self.sha256, target):
            self.ledger.refuse(state.sha256, [donor])
            self.publish(self.outer_step, self.sha256, TRAINING)
            self.log(f"refused outer step {state.outer_step}: not a step from its state")
            return False
        self.adopt(state, f"loaded from {donor}", donor)
        return True

    def adopt(self, state: Any, how: str, donor: Optional[str] = None) -> None:
        """Take `state` (a SimState of the run's registry) as its own: loaded, or the round it averaged in."""
        loaded = how.startswith("loaded")
        kept = loaded and keeps_work(self.outer_step, state.outer_step, self.work_sent)
        self.swarm.invariants.on_adopt(self, state, loaded, kept)
        if loaded and not kept:
            self.counts.samples_dropped += self.held_samples
        if loaded:
            self.inner_steps = max(self.inner_steps, state.outer_step * self.swarm.settings.inner_steps)
        self.outer_step, self.sha256 = state.outer_step, state.sha256
        if not kept:  # its Δ moves onto the loaded state as it is (rebased), or goes with the old one
            self.delta = torch.zeros_like(self.delta)
            self.held_steps = 0
        self.work_sent = False
        self.last_progress = self.now
        self.ledger.served(state.outer_step, state.sha256, donor)
        self.publish(self.outer_step, self.sha256, TRAINING)
        if loaded:
            kept_steps = f", keeping {self.held_steps} inner steps" if kept and self.held_steps else ""
            self.log(f"{how}: now at {state.sha256[:8]}{kept_steps}")

    # ----- a round ------------------------------------------------------------------------------
    def train(self, steps: int) -> None:
        """`steps` inner steps: each moves θ_local along the run's direction and noise, scaled by the inner
        learning rate's linear warmup (a fresh peer's first steps move it little; a peer that loaded the run's
        state fast-forwards its schedule, as InnerTrainer.fast_forward_schedule does)."""
        settings = self.swarm.settings
        factors = [min(1.0, (self.inner_steps + i + 1) / settings.warmup_steps) for i in range(steps)]
        noise = torch.randn(self.delta.shape, generator=self.rng) / math.sqrt(self.delta.numel())
        spread = math.sqrt(sum(f * f for f in factors))
        self.delta += settings.step_size * (sum(factors) * self.swarm.direction + spread * settings.noise * noise)
        self.inner_steps += steps
        self.held_steps += steps
        self.counts.samples_trained += steps * settings.samples_per_step

    def round(self):
        settings = self.swarm.settings
        step, sha = self.outer_step, self.sha256
        self.publish(step, sha, TRAINING, self.held_samples)
        done, end = 0, settings.inner_steps
        while done < end and self.now < self.leave_at:
            chunk = min(end - done, max(1, int(CHECK_S / self.step_s)))
            warm_up, self.warm_up_s = self.warm_up_s, 0.0
            if warm_up:
                chunk = min(chunk, max(1, int((CHECK_S - warm_up) / self.step_s)))
            yield chunk * self.step_s + warm_up
            self.train(chunk)
            done += chunk
            if end == settings.inner_steps and round_closing(self.fetch(), step, self.peer_id):
                end = min(end, done + settings.lead_steps)
        if done < end:
            return  # leaving
        self.publish(step, sha, READY, self.held_samples)
        outcome = yield from self.sync(step, sha)
        self.log(f"{outcome} (held {self.held_steps} inner steps)" if self.outer_step == step else
                 f"{outcome}: now at {self.sha256[:8]}")

    def sync(self, step: int, sha: str):
        settings = self.swarm.settings
        records = yield from self.wait_for_groupmates(step, sha)
        if moved_past(records, self.peer_id, step, sha):
            return "skipped: the swarm moved past the step"
        vote = plan_round(records, step, sha)
        if vote.action == LOAD and vote.target_step == step:  # RoundSync's rule: the vote at this step only
            return f"skipped: {vote.reason}"
        plan = plan_averaging(records, step, self.peer_id, DIRECT, self.ledger.history(self.seen, self.now))
        if plan.action == "skip":
            return f"skipped: {plan.reason}"
        if plan.action == "alone":
            sent = self.sent()
            yield from self.committing(step, sha)
            return self.apply(self.swarm.commit_alone(self, sent), "alone")
        membership = None
        for attempt in range(1, settings.attempts + 1):
            membership = plan_membership(records, step, sha, self.peer_id, DIRECT, self.next_attempt(step),
                                         among=None if membership is None else membership.members)
            if membership is not None and self.own.leader != membership.leaders[0]:  # SwarmProgress.asking
                self.publish(step, sha, READY, self.held_samples, membership.leaders[0])
            outcome = yield from self.average(step, sha, membership)
            if outcome is None and membership is not None:  # RoundSync probes the members of a round that never formed
                self.ledger.found_silent(records, [m for m in membership.members if not self.swarm.answers(m)])
            if outcome == "left behind":
                return "skipped: its group averaged without it"
            if outcome is None:
                return "failed: no leader took it in"
            if outcome.mean is not None:
                yield from self.committing(step, sha)
                return self.apply(self.swarm.commit(outcome, step, sha), f"averaged in {len(outcome.members)}")
            self.work_sent = True  # its Δ travelled in a round that failed: a state may hold it
            if attempt == settings.attempts:
                return f"failed: members lost: {outcome.failed}"
            records = {p: r for p, r in self.fetch().items() if p not in outcome.failed or self.swarm.answers(p)}
            if moved_past(records, self.peer_id, step, sha):
                return "skipped: attempt failed while the swarm moved on"
        return "failed: no attempt left"

    def committing(self, step: int, sha: str):
        """The commit window: the group agreed on the mean; the peer says COMMITTING while it runs the update
        check and its overlap steps (``commit_s``), then applies the mean."""
        self.publish(step, sha, COMMITTING, self.held_samples)
        yield self.swarm.settings.commit_s

    def wait_for_groupmates(self, step: int, sha: str):
        deadline = self.now + self.swarm.settings.round_wait_timeout
        gone: set[str] = set()
        misses: dict[str, int] = {}
        next_check = self.now + SILENT_CHECK_S
        while True:
            records = {p: r for p, r in self.fetch().items() if p not in gone}
            busy = busy_toward(records, step, self.peer_id, sha)
            if self.now >= next_check:
                next_check = self.now + SILENT_CHECK_S
                for peer in busy:
                    misses[peer] = 0 if self.swarm.answers(peer) else misses.get(peer, 0) + 1
                    if misses[peer] >= SILENT_MISSES:
                        gone.add(peer)
                        self.ledger.found_silent(records, [peer])
                busy = {p: phase for p, phase in busy.items() if p not in gone}
                records = {p: r for p, r in records.items() if p not in gone}
            if not busy or self.now >= deadline:
                return records
            yield WAIT_POLL_S

    def average(self, step: int, sha: str, membership):
        settings, averager = self.swarm.settings, self.swarm.averager
        if membership is None:
            return None
        planned = frozenset(membership.members)
        for leader in membership.leaders:
            joined = averager.join(self.peer_id, step, sha, leader, planned, self.sent(), float(self.held_samples),
                                   self.now)
            if joined is None:
                yield averager.window_s if not self.swarm.present(leader, self.peer_id) else ROUND_POLL_S
                continue
            next_look = asked_at = self.now
            while True:  # noqa: the loop ends with the round's outcome, a disbanded group, or left behind
                if averager.leader_absent(joined, asked_at, self.now):
                    joined.parts.pop(self.peer_id, None)
                    break  # its leader never came to lead: ask the next one
                averager.tick(joined, self.now, settings.round_duration(len(joined.parts)))
                outcome = averager.outcome(joined, self.now)
                if outcome is not None and not outcome.formed:
                    break  # nobody joined this leader: ask the next one
                if outcome is not None and self.now >= outcome.known_at:
                    return outcome
                if joined.started is None and self.now >= next_look:
                    next_look = self.now + LEFT_BEHIND_POLL_S
                    records = self.fetch()
                    if joined.leader == self.peer_id:  # the leader's quorum counts whom it reads ready meanwhile
                        joined.planned = quorum_of(joined.planned, records, step, sha)
                    if went_on_without(records, step, self.peer_id, planned):
                        joined.parts.pop(self.peer_id, None)
                        return "left behind"
                yield ROUND_POLL_S
        return None

    def next_attempt(self, step: int) -> int:
        at, made = self.attempts_at
        self.attempts_at = (step, made + 1 if at == step else 1)
        return self.attempts_at[1]

    def sent(self) -> torch.Tensor:
        return self.delta * self.scale if self.kind == SCALER else self.delta.clone()

    # ----- outcomes -----------------------------------------------------------------------------
    def apply(self, committed, how: str) -> str:
        verdict, state, members = committed
        if state is None:
            self.counts.void_streak += 1
            self.counts.longest_void_streak = max(self.counts.longest_void_streak, self.counts.void_streak)
            self.swarm.invariants.on_void(self)
            return f"void: {verdict.reason}"
        self.counts.void_streak = 0
        self.counts.samples_counted += self.held_samples
        self.ledger.averaged_with(members)
        self.adopt(state, how)
        return how

