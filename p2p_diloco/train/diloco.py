"""The DiLoCo loop of one peer (Douillard et al., arXiv 2311.08105, Algorithm 1), over a hivemind swarm,
with Streaming DiLoCo's fragments and overlap (arXiv 2501.18512) as options.

Each round, toward outer step t + 1:

1. read the swarm's progress and decide (:func:`~p2p_diloco.protocol.decide.next_move`): a peer that is
   behind or holds a θ_global the swarm does not agree on downloads the agreed state first, checked against
   its own before it replaces it (:mod:`~p2p_diloco.train.state_check`); one behind the run with nobody at
   its step waits for the run's state (:mod:`~p2p_diloco.train.catch_up`);
2. H/P inner AdamW steps (:class:`~p2p_diloco.train.inner.InnerTrainer`; P = ``outer.fragments``,
   1 by default), those run while the last round's sync was in flight included;
3. the pseudo-gradient of fragment t mod P (:mod:`p2p_diloco.train.fragments`; with P = 1, the
   whole model): Δ = θ_global − θ_local;
4. its sync (:class:`~p2p_diloco.train.round_sync.RoundSync`): wait (at most ``round_wait_timeout``)
   for the peers at step t, then the group's sample-weighted mean of what this peer sends, Δ plus,
   with error feedback, the residual it owes (:class:`~p2p_diloco.sync.outer_sync.OuterSync`), or that
   itself when no other peer is at this step. With ``outer.sync_delay`` τ = 0 the inner loop waits
   for it; with τ > 0 it runs in a background thread while the next inner steps run, until one ends
   with it done, τ at most (exactly τ with ``outer.fixed_sync_delay``);
5. outer Nesterov step on that fragment of θ_global, then θ_local ← α·θ_local + (1 − α)·θ_global
   on the fragment (α = ``outer.merge_alpha``), metrics, checkpoint.

A failed round applies nothing: θ_global stays, training goes on (so the fragment's next Δ holds
every inner step since its last applied outer step, and is weighted by all of their samples), and
the next round's plan brings the peer back in step with the swarm. Data flows one way: train
produces Δ, sync turns it into the group's mean, train applies it. With P = 1, τ = 0, α = 0 and the
fp32 codec this is DiLoCo's Algorithm 1 exactly.

This module is the driver: :meth:`DiLoCoPeer.run` reads the records, asks for the move and acts on it, and
:meth:`DiLoCoPeer._round` runs one outer step top to bottom. What a peer holds and shares with the run's keeper
(θ_global, its records, its averager) is :class:`~p2p_diloco.train.member.RunMember`; loading the run's state
:mod:`p2p_diloco.train.state_loading`; its checkpoint and the hand-over to the keeper
:mod:`p2p_diloco.train.checkpointing`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

import p2p_diloco.faults as faults
from p2p_diloco.protocol.decide import LOAD, WAIT
from p2p_diloco.protocol.update_rule import CLIPPED, VOID
from p2p_diloco.protocol.view import READY, TRAINING, PeerProgress
from p2p_diloco.swarm.status import EXCLUDED_AFTER_ROUNDS, choose_shard, read_status, settings_mismatch
from p2p_diloco.sync.outer_sync import GroupMean, PendingDelta
from p2p_diloco.train.checkpointing import KeeperHandOver
from p2p_diloco.train.data import DataError
from p2p_diloco.train.match_ahead import MatchLead
from p2p_diloco.train.member import RunMember
from p2p_diloco.train.round_sync import ROUND_STOPPED, RoundSync, SyncOutcome
from p2p_diloco.train.update_check import ROUND_CLIPPED, ROUND_REJECTED, checked_mean
from p2p_diloco.train.utilization import ComputeClock, RecentRate

logger = logging.getLogger(__name__)

ROUND_CHECK_PERIOD_S = 0.5  # how often the inner loop looks whether the swarm is ready to average


@dataclass
class AnnouncedRound:
    """A round this peer said it is ready for, whose sync runs while its Δ is not yet handed over."""

    samples: int  # the samples its Δ will hold, as announced (the weight the group counts)
    lead_steps: int  # inner steps it trains after announcing
    delta: PendingDelta
    sync: concurrent.futures.Future  # the round's SyncOutcome


class RunSettingsMismatch(RuntimeError):
    """The run's live peers all train with other settings: this peer can never average with them."""


class DiLoCoPeer(RunMember, KeeperHandOver):
    """One training peer: the driver of its outer steps (see the module), a :class:`~p2p_diloco.train.member.RunMember`
    constructed with the same arguments."""

    override_hint = "--ignore-other-settings"  # how its user trains on other settings anyway (the library: a keyword)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sync_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="outer-sync")
        # the inner loop's reads of the run's records (is the round closing?): a DHT read takes tens of
        # milliseconds on 2 loaded cores, every ROUND_CHECK_PERIOD_S, and the inner loop never waits for one
        self._round_reads = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="round-reads")
        self.clock = ComputeClock()  # inner seconds against wall seconds, per outer_step record
        self.samples_per_s = RecentRate()  # of the last inner steps, for the status record
        self.rounds_not_applied = 0  # in a row: the peer says it is excluded after EXCLUDED_AFTER_ROUNDS
        self._push_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="state-push")
        self._push: Optional[concurrent.futures.Future] = None
        # how many inner steps before its Δ is taken the peer says it is ready (train/match_ahead.py)
        self.match_lead = MatchLead(self.cfg.swarm.match_ahead, max_s=self.cfg.swarm.next_chunk_timeout / 2)
        self._announced: Optional[AnnouncedRound] = None  # the round whose sync began, until its Δ is handed over
        self._records_read: Optional[concurrent.futures.Future] = None  # during an applied round's sync (_round)
        self._step_samples = 0  # samples of the last inner step (every batch is whole: each step counts as many)
        self.round_sync = RoundSync(self.progress, self.sync, self.peer_id, self.reachability.mode,
                                    self.cfg.swarm.round_wait_timeout, self.stop_event, self.cfg.swarm.round_attempts)

    # ----- the loop -------------------------------------------------------------------------------
    def run(self, max_outer_steps: Optional[int] = None, wait_for_peers: int = 1,
            ignore_other_settings: bool = False) -> None:
        """Train until stopped, or until θ_global reaches outer step `max_outer_steps`.

        With `wait_for_peers` > 1, the first round waits (at most ``swarm.start_wait_timeout``) until
        that many peers, this one included, are in the swarm. A peer that finds the run's live peers
        all on other settings raises RunSettingsMismatch, or with `ignore_other_settings` says so and
        trains (:meth:`_check_settings`).
        """
        try:
            self._join()
            if wait_for_peers > 1:
                logger.info("waiting for %d peers before training", wait_for_peers)
                self.progress.wait_for_peers(wait_for_peers, self.cfg.swarm.start_wait_timeout, self.stop_event)
            statuses = read_status(self.progress.dht, self.cfg.run.name)
            self._check_settings(statuses, ignore_other_settings)
            self._open_data(statuses)
            self.clock.reset()  # start-up is not part of any outer step
            while not self._stopping():
                if max_outer_steps is not None and self.global_model.outer_step >= max_outer_steps:
                    break
                records, read_now = self._records_for_plan()
                move = self._next_move(records)
                if move.action == WAIT and not read_now:
                    # a wait is decided on a read now: in the records read while the sync ran, the groupmates may
                    # still train at the step before, and with the run's history ahead (a liar's claim of step
                    # 1,000,000 in CI) the peer sat out the catch-up poll, 5 s, at many of its steps
                    records = self.progress.fetch()
                    move = self._next_move(records)
                if move.action == LOAD:
                    if self._load_from_peers(move.load, records):
                        continue
                    move = self._next_move(records, may_load=False)
                if move.action == WAIT:
                    self._wait_for_state(move)
                    continue
                self.catch_up.reset()  # it has company at its step, or the run is not ahead
                self._round()
        finally:
            self._leave()

    def _check_settings(self, statuses: dict, ignore_other_settings: bool) -> None:
        """Stop when the run's live peers all train with other settings (:func:`settings_mismatch`): this
        peer could never average with them. The status records say so, and one identity can forge
        them: the check only advises, `ignore_other_settings` overrides it."""
        if any(peer_id != self.peer_id for peer_id in self.progress.fetch()):
            return  # another live peer of this peer's settings: progress records count no others
        mismatch = settings_mismatch(statuses, self.peer_id, self.settings, self.fingerprint, self.cfg.run.name,
                                     self.cfg.swarm.progress_ttl)
        if mismatch is None:
            return
        if not ignore_other_settings:
            raise RunSettingsMismatch(f"{mismatch} ({self.override_hint} trains anyway)")
        logger.warning("training anyway (--ignore-other-settings): %s", mismatch)

    def _open_data(self, statuses: dict) -> None:
        """This peer's data stream: where its checkpoint left it, or a shard that no live peer reads (none for
        a library peer: its loop reads its own data)."""
        if self.data is None:
            self.view.training(data_shard=None)
            self.metrics.write("join", outer_step=self.global_model.outer_step, global_sha256=self.sha256,
                               from_checkpoint=self.restored)
            return
        if self.data_shard is None:
            self.data_shard = choose_shard(statuses, self.peer_id, self.data.num_shards, self.fingerprint)
        state = self._saved_data_state
        try:
            stream = self.data.open(self.data_shard, state)
        except DataError as e:
            if state is None:
                raise
            logger.warning("cannot resume the data stream of the checkpoint (%s): reading shard %d from its start",
                           e, self.data_shard)
            state, stream = None, self.data.open(self.data_shard, None)
        stream = self.island.open_stream(stream, self.data_shard, state)  # an island's ranks each read their part
        self.inner.batches = stream
        self.stream = stream
        if self.data.num_shards > 1:
            logger.info("reading data shard %d of %d from batch %d", self.data_shard, self.data.num_shards,
                        stream.position)
        self.view.training(data_shard=self._shard_claim())
        self.metrics.write("join", outer_step=self.global_model.outer_step, global_sha256=self.sha256,
                           from_checkpoint=self.restored, data_shard=self.data_shard, data_position=stream.position)

    def _round(self) -> None:
        """Inner steps until this outer step's fragment is due, then its sync (:meth:`_sync`), then the outer
        step if the sync ended with the group's mean. The sync starts when the peer says it is ready, up to
        :class:`~p2p_diloco.train.match_ahead.MatchLead` inner steps before its Δ is taken."""
        step = self.global_model.outer_step
        fragment = self.schedule.fragment_at(step)
        self.progress.publish(step, self.sha256, TRAINING, self.local.contribution.samples(fragment))
        try:
            trained = self._train_round(step, fragment)
        except BaseException:
            self._abandon_round()
            raise
        if not trained:  # stopping
            self._abandon_round()
            return
        if self._announced is None:
            self._announce(step, fragment, 0)
        announced, self._announced = self._announced, None
        samples = self.local.contribution.samples(fragment)
        if samples != announced.samples:  # its batches are whole: each inner step counts the same samples
            logger.warning("outer step %d: %d samples in the pseudo-gradient, %d announced", step + 1, samples,
                           announced.samples)
        self.view.syncing()
        indices = self.schedule.fragments[fragment]
        self.island.pull()
        to_send = self.local.to_send(indices, self.global_model.pseudo_gradient(self.local_params, indices))
        announced.delta.hand_over(to_send)
        records_read = self._round_reads.submit(self.progress.fetch)  # for the next plan, while the sync runs
        outcome, steps_while_syncing = self._sync(announced.sync)
        for reason in outcome.failed_attempts:  # the round was tried again without the members that failed
            self.metrics.write("attempt_failed", outer_step=step, reason=reason)
        if outcome.result is not None:
            self.match_lead.record(outcome.result.phases.get("match", 0.0))
            outcome = self._checked(outcome, step, indices)
        if outcome.result is not None:
            self._apply(outcome.result, fragment, samples, steps_while_syncing, to_send, announced.lead_steps)
            self._records_read = records_read
        else:
            self._not_applied(step, outcome)
        self.view.training(outer_step=self.global_model.outer_step)

    def _records_for_plan(self) -> tuple[dict[str, PeerProgress], bool]:
        """The run's records for the next round's plan, and whether they were read now. After an applied round,
        those read while its sync ran (:meth:`_round`): a DHT read takes 30-100 ms on 2 loaded cores, up to
        0.8 s, and the inner loop would stand still for it. In them the group's records, this peer's own
        included, may still say ready or committing at the step before: on their way here, as they are, so the plan
        does not vote at this step (``plan_round``), and a peer far ahead was read all the same. After anything
        else (a failed or skipped round, a load, the start), a read now: where this peer stands in the run is
        the question then."""
        read, self._records_read = self._records_read, None
        if read is None:
            return self.progress.fetch(), True
        return read.result(), False  # bounded by the DHT's timeouts

    def _abandon_round(self) -> None:
        """The inner loop ends before the Δ of a round whose sync began: that sync ends now, with nothing
        applied (bounded: the stop event, set by then, or the abandoned Δ ends its waits)."""
        announced, self._announced = self._announced, None
        if announced is not None:
            announced.delta.abandon()
            if self._stopping():
                announced.sync.result()

    def _announce(self, step: int, fragment: int, steps_left: int) -> None:
        """Say this peer is ready to average for `step` and start the round's sync: its Δ will be taken
        after `steps_left` more inner steps (each counting as many samples as the last one did)."""
        samples = self.local.contribution.samples(fragment) + steps_left * self._step_samples
        self.progress.publish(step, self.sha256, READY, samples)
        delta = PendingDelta()
        sync = self._sync_thread.submit(self.round_sync, step, fragment, delta, samples, self.sha256)
        self._announced = AnnouncedRound(samples, steps_left, delta, sync)

    def _sync(self, in_flight: concurrent.futures.Future) -> tuple[SyncOutcome, int]:
        """The outcome of the sync in flight: waited for at once (τ = 0), or after the inner steps that run
        beside it (Streaming DiLoCo's overlap, arXiv 2501.18512 §2.2: τ of them, or until one ends with the
        sync done, :meth:`FragmentSchedule.overlaps`), with how many of those ended before it did."""
        if not self.schedule.sync_delay:
            return in_flight.result(), 0  # bounded: every wait inside the sync has its timeout
        steps_while_syncing = 0
        while self.schedule.overlaps(self.local.steps_ahead, in_flight.done()) and self._train_steps(1):
            self.local.steps_ahead += 1
            steps_while_syncing += not in_flight.done()  # this step ended before the sync did
        return in_flight.result(), steps_while_syncing

    def _train_round(self, step: int, fragment: int) -> bool:
        """The inner steps of outer step `step` (those run during the last sync count); False if stopping.

        The peer says it is ready (:meth:`_announce`) its :class:`MatchLead` of inner steps before the last,
        so that its group forms while it trains them. The fastest peer at this step decides when the round
        ends: once one is ready, the others announce too and stop after their own lead. Slower peers then
        contribute the inner steps they managed, weighted by their samples, so a slow volunteer never makes
        the others wait for its full H/P steps.
        """
        steps_this_round, self.local.steps_ahead = self.local.steps_ahead, 0
        self.view.round_started(step, self.schedule.steps_per_sync, steps_this_round)
        next_check = time.monotonic() + ROUND_CHECK_PERIOD_S
        closing: Optional[concurrent.futures.Future] = None  # a read of whether others are ready, in flight
        end = self.schedule.steps_per_sync
        while steps_this_round < end:
            if self._stopping():
                return False
            if self._announced is None:  # until it has said it is ready: when to say it, and whether others did
                lead = self.match_lead.steps(self.samples_per_s.step_s(), self.schedule.steps_per_sync)
                if closing is not None and closing.done():
                    if closing.result():
                        logger.info("outer step %d: others are ready; contributing %d inner steps", step + 1,
                                    steps_this_round + min(lead, end - steps_this_round))
                        end = min(end, steps_this_round + lead)
                        if steps_this_round >= end:
                            break
                    closing = None
                if closing is None and steps_this_round and time.monotonic() >= next_check:
                    next_check = time.monotonic() + ROUND_CHECK_PERIOD_S
                    closing = self._round_reads.submit(self.round_sync.round_is_closing, step)
                if end - steps_this_round <= lead:
                    self._announce(step, fragment, end - steps_this_round)
            self._train_steps(1)
            steps_this_round += 1
        return True

    def _train_steps(self, count: int) -> int:
        """Up to `count` inner steps (fewer if the peer is stopping); returns how many ran."""
        for done in range(count):
            if self._stopping():
                return done
            with self.clock.inner_step(), self.island.guard():
                self.island.before_step()
                loss, n = self.inner.step()
                faults.after_inner_step()
            self.local.contribution.add(loss, n)
            self._step_samples = n
            self.samples_per_s.add(n, self.clock.last_step_s)
            self.view.inner_step(loss, n, inner_steps=self.inner.steps_done, samples_per_s=self.samples_per_s.rate(),
                                 loss=self.local.contribution.recent_loss())
        return count

    def _checked(self, outcome: SyncOutcome, step: int, indices: list[int]) -> SyncOutcome:
        """The outcome with the group's mean as the update check leaves it (p2p_diloco.protocol.update_rule):
        as it is, clipped to the run's limit, or a void round if it is not finite. Every peer of the group
        decides the same, and a clipped mean is the same bytes on each."""
        verdict, mean = checked_mean(outcome.result.mean, [self.global_model.momentum_buffer[i] for i in indices],
                                     [self.global_model.params[i] for i in indices], self.cfg.outer.max_update_growth)
        if verdict.action == VOID:
            return SyncOutcome(event=ROUND_REJECTED, reason=verdict.reason)
        if verdict.action == CLIPPED:
            logger.warning("outer step %d: %s", step + 1, verdict.reason)
            self.metrics.write(ROUND_CLIPPED, outer_step=step, scale=verdict.scale, reason=verdict.reason)
        outcome.result.mean = mean
        outcome.result.update_scale = verdict.scale
        return outcome

    def _not_applied(self, step: int, outcome: SyncOutcome) -> None:
        """A round that ends without an outer step: say why; after a few in a row, say the peer is excluded.

        The inner steps stay in θ_local: the next pseudo-gradient holds them too. A round this peer left
        because it is stopping is only written to the metrics.
        """
        event, reason = outcome.event, outcome.reason
        if outcome.delta_may_be_committed:  # a state loaded next may hold its Δ (protocol.plans.keeps_work)
            self.local.sent_in_failed_round(self.schedule.fragment_at(step))
        self.metrics.write(event, outer_step=step, reason=reason)
        if event == ROUND_STOPPED:
            return
        logger.warning("outer step %d: %s; applying nothing this round", step + 1, reason)
        # a round the averager banned someone in (malformed group data or parts, a wrong or two-faced reducer) is
        # void: from now on that identity's records count in no plan either (one trust ledger, protocol/ledger.py)
        self.progress.refuse(peers=self.sync.averager.banned_peers() or ())
        self.rounds_not_applied += 1
        self.view.not_applied(self.rounds_not_applied)
        if self.rounds_not_applied == EXCLUDED_AFTER_ROUNDS:
            logger.warning("excluded from the swarm's outer steps for %d rounds in a row (last: %s); this peer "
                           "keeps its inner steps and keeps trying", self.rounds_not_applied, reason)
            self.metrics.write("excluded", outer_step=step, rounds=self.rounds_not_applied, reason=reason,
                               reachability=self.reachability.mode)

    def _apply(self, result: GroupMean, fragment: int, samples: int, steps_while_syncing: int,
               to_send: list[torch.Tensor], lead_steps: int) -> None:
        """The outer step on this fragment of θ_global, merged into θ_local; `samples` were in the peer's Δ,
        `to_send` is what it sent (Δ plus the residual it owed), and `lead_steps` ran after it said it was
        ready."""
        mean_loss = self.local.contribution.synced(fragment, samples)
        self.progress.ledger.averaged_with(result.tokens)
        indices = self.schedule.fragments[fragment]
        self.local.sent(indices, to_send, result.sent, fragment)
        self.island.pull()  # the inner steps run while the sync was in flight
        with self._state_lock:
            self.global_model.apply(result.mean, indices, result.carried)
            self.global_model.merge_into(self.local_params, indices, self.cfg.outer.merge_alpha,
                                         owed=self.local.owed(indices))
            self.island.changed(self.inner.steps_done, indices)
            self.last_group_size = result.group_size
            self._after_state_change()
        step = self.global_model.outer_step
        self.progress.publish(step, self.sha256, TRAINING)
        traffic = self.sync.averager.traffic
        lap = self.clock.lap()
        self.view.applied(samples, result.group_size, traffic.sent + traffic.received, lap["compute_utilization"],
                          counted_samples=result.counted_samples)
        # the checkpoint before the record: a peer killed between the two (an island whose rank died, mid-save)
        # never has a record of a step that its checkpoint lacks
        self._save_checkpoint()
        self.metrics.write(
            "outer_step",
            outer_step=step,
            group_size=result.group_size,
            group_samples=result.group_samples,
            attempt=result.attempt,
            update_scale=result.update_scale,  # < 1: the update check clipped the mean
            samples=samples,
            loss=mean_loss,
            fragment=fragment,
            steps_while_syncing=steps_while_syncing,
            overlap_steps=self.local.steps_ahead,  # τ of this round: the inner steps after the Δ, before the merge
            lead_steps=lead_steps,
            sync_phases=result.phases,
            global_sha256=self.sha256,
            bytes_sent=traffic.sent,
            bytes_received=traffic.received,
            bytes_by_phase=traffic.by_phase(),  # the same bytes by phase (p2p_diloco.traffic.PHASES)
            codec=self.cfg.outer.codec,
            inner_steps=self.inner.steps_done,
            lr=self.inner.lr,
            **lap,
        )
        logger.info(
            "outer step %d: group of %d, %d samples, loss %.4f, global %s",
            step, result.group_size, result.group_samples, mean_loss, self.sha256[:12],
        )
        self._store_step()
        self._push_to_keeper(first_only=True)
        self._evaluate_global()

    def _after_state_change(self) -> None:
        super()._after_state_change()
        self.rounds_not_applied = 0  # a new state, applied or loaded, ends a streak of rounds that applied nothing

    def _before_leaving(self) -> None:
        self._hand_over_to_keeper()

    def _stop_workers(self) -> None:
        self._sync_thread.shutdown(wait=True)
        self._round_reads.shutdown(wait=True)  # a read of the records: bounded by the DHT's timeouts
        self._push_thread.shutdown(wait=True)  # each push is bounded by state_download_timeout
