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

Each piece of state has one owner: θ_global, its momentum and its hash :class:`~p2p_diloco.train.outer.GlobalModel`;
θ_local and what it holds beyond θ_global (unsynced samples, steps run ahead, the error-feedback
residual) :class:`~p2p_diloco.train.local_work.LocalWork`; which fragment syncs when
:class:`~p2p_diloco.schedule.FragmentSchedule`; what others and the user see
:class:`~p2p_diloco.train.peer_view.PeerView`. This class runs the loop over them.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Protocol, Sequence

import torch

from p2p_diloco import faults
from p2p_diloco.config import Config, settings_fingerprint
from p2p_diloco.metrics import MetricsWriter
from p2p_diloco.schedule import FragmentSchedule
from p2p_diloco.swarm.liveness import answering
from p2p_diloco.swarm.node import RunNode
from p2p_diloco.swarm.reachability import DIRECT
from p2p_diloco.protocol.decide import LOAD, WAIT, Move, next_move
from p2p_diloco.protocol.plans import RoundPlan
from p2p_diloco.protocol.trust import is_verifiable, unverified_step_trusted
from p2p_diloco.protocol.update_rule import CLIPPED, VOID
from p2p_diloco.protocol.view import (
    KEEPING, LEFT, LOADING, READY, TRAINING, PeerProgress, averages, keepers,
)
from p2p_diloco.swarm.progress import SwarmProgress
from p2p_diloco.swarm.records import RecordPublisher, assistance_key
from p2p_diloco.swarm.status import EXCLUDED_AFTER_ROUNDS, StatusPublisher, choose_shard, read_status, settings_mismatch
from p2p_diloco.sync.outer_sync import GroupMean, OuterSync, PendingDelta
from p2p_diloco.sync.robust import aggregation_rule
from p2p_diloco.sync.state_store import StateStore, StoreError, StoreWriter
from p2p_diloco.sync.state_transfer import GlobalState, StateExpectation, download_global_state, nobody_serves
from p2p_diloco.train.catch_up import POLL_S, CatchUpWait
from p2p_diloco.train.checkpoint import check_checkpoint_settings, load_checkpoint, save_checkpoint
from p2p_diloco.train.data import DataError, checkpointed_stream_state, order_seed
from p2p_diloco.train.error_feedback import ErrorFeedback
from p2p_diloco.train.fragments import model_fragments
from p2p_diloco.train.inner import InnerTrainer
from p2p_diloco.train.island import IslandLead, SoloIsland
from p2p_diloco.train.local_work import LocalWork
from p2p_diloco.train.match_ahead import MatchLead
from p2p_diloco.train.heldout import HeldoutEval
from p2p_diloco.train.outer import GlobalModel
from p2p_diloco.train.peer_view import PeerView
from p2p_diloco.train.round_sync import ROUND_STOPPED, RoundSync, SyncOutcome
from p2p_diloco.train.state_check import STATE_REFUSED, step_problem
from p2p_diloco.train.update_check import ROUND_CLIPPED, ROUND_REJECTED, checked_mean
from p2p_diloco.train.utilization import ComputeClock, RecentRate

logger = logging.getLogger(__name__)

KEEP_POLL_S = 2.0  # how often the keeper reads the run's records
HANDOVER_S = 3 * KEEP_POLL_S  # how long a leaving peer waits for a keeper that lacks its state
HANDOVER_POLL_S = 0.5

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


class BatchStream(Protocol):
    """A peer's endless batches; ``state_dict()`` resumes it after the last batch taken (a checkpoint keeps it)."""

    position: int  # batches taken so far

    def __next__(self) -> torch.Tensor: ...

    def __iter__(self) -> Iterator[torch.Tensor]: ...

    def state_dict(self) -> dict: ...


class PeerData(Protocol):
    """Where a peer's batches come from: one of `num_shards` disjoint shards (1: every peer reads all
    the data, each in its own order), from the start or from a stream's saved `state`."""

    num_shards: int

    def open(self, shard: int, state: Optional[dict]) -> BatchStream: ...


class DiLoCoPeer:
    """One training peer: a model, its inner trainer, θ_global, and its link to the swarm.

    `data` opens this peer's stream of training batches (a shard no other live peer reads, when the
    data is sharded); the stream's state goes into the checkpoint, so a restarted peer goes on with
    the data it had not seen. `node` is its DHT node, with the identity that signs its records and how
    others reach it; `settings` the run settings it trains with (:func:`p2p_diloco.config.shared_settings`),
    whose fingerprint decides which peers it averages with. `display` shows the inner steps' progress
    (:class:`p2p_diloco.train.display.InnerProgress`), if given. `micro_batch_size` is the one chosen for
    its memory (:func:`p2p_diloco.train.memory.choose_micro_batch`; default: ``compute.micro_batch_size``,
    else the whole batch). It evaluates θ_global on the `heldout` sequences every ``eval.every`` outer steps
    (:mod:`p2p_diloco.train.heldout`).
    """

    def __init__(
        self,
        cfg: Config,
        model: torch.nn.Module,
        data: PeerData,
        node: RunNode,
        settings: dict[str, Any],
        metrics: Optional[MetricsWriter] = None,
        stop_event: Optional[threading.Event] = None,
        display: Any = None,
        micro_batch_size: Optional[int] = None,
        keeper: bool = False,
        trusted_peers: Sequence[str] = (),
        island: Optional[IslandLead] = None,
        heldout: Optional[torch.Tensor] = None,
    ):
        self.cfg = cfg
        # the run's keeper (:meth:`keep`) follows the run's state and serves it, and never trains
        self.keeper = keeper
        self.idle_phase = KEEPING if keeper else TRAINING
        self.model = model
        # a peer of several ranks (train/island.py) is rank 0 of its island; a single process, an island of one
        self.island = island or SoloIsland(model)
        self.local_params = self.island.params
        self.data = data
        self.data_shard: Optional[int] = None  # chosen when the peer joins (from its checkpoint, or free)
        self._saved_data_state: Optional[dict] = None  # the stream's state in a restored checkpoint
        self.inner = InnerTrainer(model, cfg.inner, iter(()), cfg.compute,  # batches from _open_data
                                  micro_batch_size, self.island.island, self.island.forward_model)
        self.global_model = GlobalModel(self.local_params, cfg.outer)
        self.schedule = FragmentSchedule(model_fragments(model, cfg.outer), cfg.inner.steps_per_outer,
                                         cfg.outer.sync_delay, cfg.outer.fixed_sync_delay)
        error_feedback = cfg.outer.error_feedback and cfg.outer.codec != "none"
        self.local = LocalWork(self.local_params, len(self.schedule.fragments),
                               ErrorFeedback([p.shape for p in self.local_params]) if error_feedback else None)
        self._sync_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="outer-sync")
        # the inner loop's reads of the run's records (is the round closing?): a DHT read takes tens of
        # milliseconds on 2 loaded cores, every ROUND_CHECK_PERIOD_S, and the inner loop never waits for one
        self._round_reads = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="round-reads")
        self.clock = ComputeClock()  # inner seconds against wall seconds, per outer_step record
        self.samples_per_s = RecentRate()  # of the last inner steps, for the status record
        self.peer_id = node.dht.peer_id.to_base58()
        self.reachability = node.reachability
        self.rounds_not_applied = 0  # in a row: the peer says it is excluded after EXCLUDED_AFTER_ROUNDS
        self.metrics = metrics or MetricsWriter(None, self.peer_id)
        self.stop_event = stop_event or threading.Event()
        self.stream: Optional[BatchStream] = None
        self._state_lock = threading.Lock()  # guards θ_global while a joiner downloads it
        self.checkpoint_dir = cfg.swarm.checkpoint_dir or None
        self.last_group_size = 1
        self.distrusted_donors: set[str] = set()  # peers that served a malformed or refused state
        # identities this peer has averaged with, and the run's bootstrap nodes (its keepers): their word on a
        # state counts first (train/state_check.py)
        self.groupmates: set[str] = set(trusted_peers)
        self.settings = settings
        self.fingerprint = fingerprint = settings_fingerprint(settings)
        # the run's checkpoint store, if it has one (StoreError before anything starts if fsspec cannot open it):
        # written every checkpoint_every outer steps, read when no peer serves the run's state (sync/state_store.py)
        self.store = StateStore(cfg.swarm.checkpoint_store, cfg.run.name, fingerprint) if cfg.swarm.checkpoint_store else None
        self.store_writer = StoreWriter(self.store, cfg.swarm.checkpoint_every, self._stored) \
            if self.store and cfg.swarm.checkpoint_every else None
        self.catch_up = CatchUpWait(cfg.run.name, cfg.swarm.state_wait_timeout)
        status = StatusPublisher(node.dht, cfg.run.name, node.identity.record_subkey, cfg.swarm.progress_ttl,
                                 fingerprint=fingerprint, settings=settings, reachability=node.reachability.mode,
                                 device=describe_device(self.inner.device), ranks=self.island.world_size)
        self.view = PeerView(status, display, tokens_per_sample=cfg.data.seq_len, keeper=keeper)
        self.progress = SwarmProgress(node.dht, cfg.run.name, cfg.swarm.progress_ttl, node.identity.record_subkey,
                                      fingerprint, node.reachability.mode,
                                      answering=functools.partial(answering, node.dht))
        self.assistance = None if node.reachability.can_reduce else self._ask_for_assistance(node, fingerprint)
        self.sync = OuterSync(node.dht, cfg.run.name, fingerprint, node.identity.record_subkey,
                              [p.shape for p in self.local_params], cfg.swarm, state_provider=self._serve_state,
                              client_mode=not node.reachability.can_reduce, codec=cfg.outer.codec,
                              fragments=self.schedule.fragments, record_sent=error_feedback,
                              aggregation=aggregation_rule(cfg.outer), takes_pushed_states=keeper)
        self._push_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="state-push")
        self._push: Optional[concurrent.futures.Future] = None
        # how many inner steps before its Δ is taken the peer says it is ready (train/match_ahead.py)
        self.match_lead = MatchLead(cfg.swarm.match_ahead, max_s=cfg.swarm.next_chunk_timeout / 2)
        self._announced: Optional[AnnouncedRound] = None  # the round whose sync began, until its Δ is handed over
        self._records_read: Optional[concurrent.futures.Future] = None  # during an applied round's sync (_round)
        self._step_samples = 0  # samples of the last inner step (every batch is whole: each step counts as many)
        self.round_sync = RoundSync(self.progress, self.sync, self.peer_id, node.reachability.mode,
                                    cfg.swarm.round_wait_timeout, self.stop_event, cfg.swarm.round_attempts)
        self.heldout = self._heldout_eval(heldout)

    def _heldout_eval(self, heldout: Optional[torch.Tensor]) -> Optional[HeldoutEval]:
        """θ_global's held-out evaluation on `heldout` [n, seq_len] every ``eval.every`` outer steps, on the
        model's device in its micro-batches; none without sequences, or on a sharded island, whose rank 0
        holds only a shard of the model on its device."""
        if heldout is None or not len(heldout) or not self.cfg.eval.every:
            return None
        if self.island.island is not None and self.island.island.shard:
            logger.info("not evaluating θ_global on held-out text (eval.every): the model is sharded over this "
                        "island's ranks")
            return None
        return HeldoutEval(heldout, self.cfg.eval.every, self.inner.micro_batch_size)

    def _ask_for_assistance(self, node: RunNode, fingerprint: str) -> RecordPublisher:
        """An unreachable peer asks reachable nodes to reduce for its run (see p2p_diloco.sync.assistant)."""
        swarm = self.cfg.swarm
        publisher = RecordPublisher(node.dht, assistance_key(), node.identity.record_subkey, swarm.progress_ttl,
                                    "assistance request")
        publisher.publish(dict(run=self.cfg.run.name, fingerprint=fingerprint, time=time.time(),
                               shapes=[list(p.shape) for p in self.local_params],
                               matchmaking_time=swarm.matchmaking_time, request_timeout=swarm.request_timeout,
                               allreduce_timeout=swarm.allreduce_timeout, next_chunk_timeout=swarm.next_chunk_timeout,
                               codec=self.cfg.outer.codec, fragments=self.schedule.fragments,
                               aggregation=self.cfg.outer.aggregation, clip_factor=self.cfg.outer.clip_factor,
                               clip_iterations=self.cfg.outer.clip_iterations,
                               trim_fraction=self.cfg.outer.trim_fraction))
        return publisher

    # ----- state shared with joiners -------------------------------------------------------------
    def _serve_state(self) -> tuple[dict, list[torch.Tensor]]:
        """Called by hivemind in a background thread when another peer downloads our state."""
        with self._state_lock:
            metadata = dict(
                outer_step=self.global_model.outer_step, sha256=self.sha256, inner_steps=self.inner.steps_done
            )
            return metadata, [t.clone() for t in self.global_model.state_tensors()]

    @property
    def sha256(self) -> str:
        """The sha256 of this peer's global state (:meth:`GlobalModel.sha256`)."""
        return self.global_model.sha256()

    def _after_state_change(self) -> None:
        # joiners download from the most advanced peer, and among those from the largest group's
        self.sync.set_state_priority(self.global_model.outer_step * 1000.0 + min(self.last_group_size, 999))

    # ----- the loop -------------------------------------------------------------------------------
    def _stopping(self) -> bool:
        return self.stop_event.is_set()

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
                records = self._records_for_plan()
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

    def keep(self) -> None:
        """Keep the run's state until stopped, as its keeper: follow the run step by step (each state it loads
        is one the run's records vouch for, checked as any peer checks it: train/state_check.py), serve it to
        joiners like any donor, and write it to the checkpoint store every ``swarm.checkpoint_every`` outer
        steps. Its progress record says KEEPING: it vouches for the state it holds, nobody waits for it or
        averages with it, and it never trains."""
        try:
            self._join()
            while not self._stopping():
                records = self.progress.fetch()
                move = self._next_move(records)  # only a load concerns a keeper: it never trains
                if move.action == LOAD and self._load_from_peers(move.load, records):
                    if self.store_writer is not None:
                        self.store_writer.after_step(self.global_model.outer_step, self.sha256,
                                                     self.inner.steps_done, self._state_snapshot)
                    self._evaluate_global()
                self.stop_event.wait(KEEP_POLL_S)
        finally:
            self._leave()

    def _evaluate_global(self) -> None:
        """θ_global's held-out loss when it is due (p2p_diloco.train.heldout): an ``eval`` metrics record, and
        the status record's latest, for `status` and the run's page."""
        evaluation = None if self.heldout is None else self.heldout.maybe(
            self.global_model.outer_step, self.model, self.local_params, self.global_model.params)
        if evaluation is None:
            return
        self.metrics.write("eval", outer_step=evaluation.outer_step, eval_loss=evaluation.loss,
                           sequences=evaluation.sequences, seconds=evaluation.seconds)
        self.view.evaluated(evaluation.outer_step, evaluation.loss)  # after the record: never ahead of it
        logger.info("outer step %d: held-out loss of θ_global %.4f (%d sequences, %.2f s)", evaluation.outer_step,
                    evaluation.loss, evaluation.sequences, evaluation.seconds)

    def _join(self) -> None:
        self.restored = self._restore_checkpoint()
        if self.store is not None and not self.progress.fetch().keys() - {self.peer_id}:
            self._load_from_store("no live peer of the run is in the swarm")  # the run's state, if it has one
        self._after_state_change()
        self.view.joined(outer_step=self.global_model.outer_step, inner_steps=self.inner.steps_done,
                         data_shard=self._shard_claim())
        self.progress.publish(self.global_model.outer_step, self.sha256, self.idle_phase)
        logger.info("joined at outer step %d (%s)", self.global_model.outer_step,
                    "checkpoint" if self.restored else "fresh")

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
            raise RunSettingsMismatch(f"{mismatch} (--ignore-other-settings trains anyway)")
        logger.warning("training anyway (--ignore-other-settings): %s", mismatch)

    def _shard_claim(self) -> Optional[int]:
        """The data shard its status record names: none when the data is not sharded (it reads all of it)."""
        return self.data_shard if self.data.num_shards > 1 else None

    def _open_data(self, statuses: dict) -> None:
        """This peer's data stream: where its checkpoint left it, or a shard that no live peer reads."""
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

    def _records_for_plan(self) -> dict[str, PeerProgress]:
        """The run's records for the next round's plan. After an applied round, those read while its sync ran
        (:meth:`_round`): a DHT read takes 30-100 ms on 2 loaded cores, up to 0.8 s, and the inner loop would
        stand still for it. In them the group's records, this peer's own included, may still say ready at the
        step before: committing their way here, as they are, so the plan does not vote at this step
        (``plan_round``), and a peer far ahead was read all the same. After anything else (a failed or skipped
        round, a load, the start), a read now: where this peer stands in the run is the question then."""
        read, self._records_read = self._records_read, None
        return self.progress.fetch() if read is None else read.result()  # bounded by the DHT's timeouts

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
        self.metrics.write(event, outer_step=step, reason=reason)
        if event == ROUND_STOPPED:
            return
        logger.warning("outer step %d: %s; applying nothing this round", step + 1, reason)
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
        self.rounds_not_applied = 0
        self.groupmates.update(peer for peer in result.tokens if peer != self.peer_id)
        indices = self.schedule.fragments[fragment]
        self.local.sent(indices, to_send, result.sent)
        self.island.pull()  # the inner steps run while the sync was in flight
        with self._state_lock:
            self.global_model.apply(result.mean, indices)
            self.global_model.merge_into(self.local_params, indices, self.cfg.outer.merge_alpha)
            self.island.changed(self.inner.steps_done, indices)
            self.last_group_size = result.group_size
            self._after_state_change()
        step = self.global_model.outer_step
        self.progress.publish(step, self.sha256, TRAINING)
        traffic = self.sync.averager.traffic
        lap = self.clock.lap()
        self.view.applied(samples, result.group_size, traffic.sent + traffic.received, lap["compute_utilization"])
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
            codec=self.cfg.outer.codec,
            inner_steps=self.inner.steps_done,
            lr=self.inner.scheduler.get_last_lr()[0],
            **lap,
        )
        logger.info(
            "outer step %d: group of %d, %d samples, loss %.4f, global %s",
            step, result.group_size, result.group_samples, mean_loss, self.sha256[:12],
        )
        if self.store_writer is not None:
            self.store_writer.after_step(step, self.sha256, self.inner.steps_done, self._state_snapshot)
        self._push_to_keeper(first_only=True)
        self._evaluate_global()

    # ----- catching up ----------------------------------------------------------------------------
    def _next_move(self, records: dict[str, PeerProgress], may_load: bool = True) -> Move:
        """This peer's move before its next round (:func:`p2p_diloco.protocol.decide.next_move`) from `records` and
        what its ledger holds now; a jump it declines is said, and its claims set aside."""
        move = next_move(records, self.progress.set_aside_records, self.peer_id, self.global_model.outer_step,
                         self.sha256, self.progress.history(), frozenset(self.groupmates - self.distrusted_donors),
                         may_load)
        if move.declined is not None:
            self._decline_jump(move.declined, move.vouch_counts)
        return move

    def _decline_jump(self, plan: RoundPlan, counts: str) -> None:
        """A jump to `plan`'s state that the records do not trust enough (`counts`, the vouchers counted): said,
        written to the metrics, and its claims set aside until their authors move on."""
        step = self.global_model.outer_step
        logger.warning("not loading outer step %d (%s): a jump of %d outer steps is taken only on at least as many "
                       "vouchers as this peer's own state has, and more than the other claims above it; %s; "
                       "training on from outer step %d, and trying again when its claimants move on", plan.target_step,
                       plan.target_sha256[:12], plan.target_step - step, counts, step)
        self.metrics.write(STATE_REFUSED, outer_step=step, target_step=plan.target_step,
                           target_sha256=plan.target_sha256, claimed_by=sorted(plan.claims or {}),
                           reason=f"unverified jump: {counts}")
        self.progress.set_aside(plan.claims or {}, "this peer does not take that jump on so few vouchers")

    def _step_refusal(self, state: GlobalState, records: dict[str, PeerProgress]) -> Optional[str]:
        """Why a downloaded state one step ahead must not replace this peer's, or None if it may: it is
        an outer step from this peer's state (:func:`p2p_diloco.train.state_check.step_problem`), or, when
        it is not, enough identities vouch for it that this peer is the one that forked."""
        step = self.global_model.outer_step
        if not is_verifiable(step, state.outer_step):
            return None
        model = self.global_model
        problem = step_problem(model.params, model.momentum_buffer, state.tensors, self.schedule.fragments,
                               self.schedule.fragment_at(step), model.lr, model.momentum,
                               self.cfg.outer.max_update_growth)
        if problem is None:
            return None
        if unverified_step_trusted(records, self.peer_id, step, self.sha256, (state.outer_step, state.sha256)):
            logger.warning("the state at outer step %d (%s) is not an outer step from this peer's state (%s), but "
                           "at least as many identities vouch for it as for this peer's: this peer forked, and loads "
                           "it",
                           state.outer_step, state.sha256[:12], problem)
            return None
        return problem

    def _refuse_state(self, state: GlobalState, plan: RoundPlan, problem: str, failures: dict[str, str]) -> None:
        """A downloaded state that failed the state check: refused like a malformed one (its donor is not
        asked again), and no plan targets it again."""
        self.distrusted_donors.add(state.donor)
        self.progress.refuse(state.sha256, [state.donor])
        logger.warning("refusing the state at outer step %d (%s) from peer %s: %s; training on from outer step %d",
                       state.outer_step, state.sha256[:12], state.donor, problem, self.global_model.outer_step)
        self.metrics.write(STATE_REFUSED, outer_step=self.global_model.outer_step, target_step=state.outer_step,
                           target_sha256=state.sha256, donor=state.donor, claimed_by=sorted(plan.claims or {}),
                           reason=problem, failed_donors=failures)

    def _load_from_peers(self, plan: RoundPlan, records: dict[str, PeerProgress]) -> bool:
        """Download the state `plan` targets (one the records trust: :meth:`_next_move`), check it
        (p2p_diloco.train.state_check) and adopt it; False, and this peer stays at its own state, when it is not
        downloaded or fails the check."""
        logger.info("loading global state from peers: %s", plan.reason)
        if self.keeper:  # nobody waits for a keeper: it keeps the state it has until the new one is checked
            self.progress.publish(self.global_model.outer_step, self.sha256, KEEPING)
        else:
            self.progress.publish(plan.target_step, self.sha256, LOADING)  # peers at that step wait for this one
        self.view.loading()
        self.sync.share_state(False)  # nobody should copy a state we are replacing
        expected = StateExpectation(tuple(tuple(p.shape) for p in self.local_params), plan.target_step,
                                    plan.target_sha256)
        # a keeper first takes the state if an unreachable peer pushed it: nobody can download from those
        pushed = self.sync.averager.take_pushed_state(expected) if self.keeper else None
        try:
            state, failed_donors = (pushed, {}) if pushed is not None else download_global_state(
                self.sync.averager, expected, self.distrusted_donors, self.cfg.swarm.state_download_timeout,
                should_stop=self._stopping,
            )
        finally:
            self.sync.share_state(True)
        self.progress.refuse(peers=sorted(self.distrusted_donors))  # nor do their records count in any plan
        failures = {peer: str(why) for peer, why in failed_donors.items()}
        if state is None:
            self._load_failed()
            if nobody_serves(failed_donors, plan.target_step):
                self.progress.set_aside(plan.claims or {})
            logger.warning("could not download the global state; training on from outer step %d",
                           self.global_model.outer_step)
            self.metrics.write("state_load_failed", outer_step=plan.target_step, reason=plan.reason,
                               failed_donors=failures)
            return False
        problem = self._step_refusal(state, records)
        if problem is not None:
            self._load_failed()
            self._refuse_state(state, plan, problem, failures)
            return False
        donor_record = records.get(state.donor)
        source = "keeper" if donor_record is not None and not averages(donor_record) else "peer"
        self._adopt(state.tensors, state.outer_step, state.inner_steps, plan.reason, source=source, donor=state.donor,
                    failed_donors=failures)
        return True

    def _load_failed(self) -> None:
        """Back to this peer's own state after a load that failed: its record says so. Left "loading" at the
        target's step, it kept peers at that step waiting for it, and hid it from peers at its own step: three
        newcomers whose download failed each waited for company the others' records denied (seen in CI)."""
        self.progress.publish(self.global_model.outer_step, self.sha256, self.idle_phase)
        self.view.training()

    def _adopt(self, tensors: list[torch.Tensor], outer_step: int, inner_steps: int, reason: str, source: str,
               **details) -> None:
        """Replace this peer's state with a checked one (θ_global and momentum at `outer_step`) that came from
        `source` ("peer", "keeper" or "store"); θ_local and its unsynced inner steps go with the old state."""
        contribution = self.local.contribution  # its unsynced inner steps are dropped with θ_local
        samples_dropped = max(contribution.samples(f) for f in range(len(self.schedule.fragments)))
        with self._state_lock:
            self.global_model.load_state_tensors(tensors, outer_step)
            self.local.replace_with(self.global_model, self.schedule.fragments)
            self.inner.fast_forward_schedule(inner_steps)
            self.island.changed(self.inner.steps_done)
            self.rounds_not_applied = 0
            self._after_state_change()
        self.progress.served(outer_step, self.sha256)
        self.progress.publish(self.global_model.outer_step, self.sha256, self.idle_phase)
        self.view.training(outer_step=self.global_model.outer_step, inner_steps=self.inner.steps_done)
        self.metrics.write("state_loaded", outer_step=outer_step, global_sha256=self.sha256, reason=reason,
                           source=source, samples_dropped=samples_dropped, **details)
        logger.info("loaded global state at outer step %d (%s) from %s %s", outer_step, self.sha256[:12], source,
                    details.get("donor", ""))
        self._save_checkpoint()

    def _load_from_store(self, reason: str) -> bool:
        """Adopt the newest whole state in the run's checkpoint store above this peer's outer step, if any."""
        step = self.global_model.outer_step
        try:
            stored = self.store.newest([tuple(p.shape) for p in self.local_params], above_step=step)
        except StoreError as e:
            logger.warning("%s", e)
            return False
        if stored is None:
            return False
        self._adopt(stored.tensors, stored.outer_step, stored.inner_steps, f"{reason}: the checkpoint store's newest",
                    source="store", donor=stored.source)
        return True

    def _wait_for_state(self, move: Move) -> None:
        """One wait of a peer behind the run with nobody at its step (`move`): it must not train
        (:mod:`p2p_diloco.train.catch_up`); it tries the checkpoint store, if the run has one, and the peers again
        at the next move. Raises NoStateSource once that has lasted ``swarm.state_wait_timeout``."""
        if self.store is not None and self._load_from_store(move.reason):
            self.catch_up.reset()
            return
        self.catch_up.wait(self.global_model.outer_step, move.history, self.cfg.swarm.checkpoint_store)
        self.stop_event.wait(POLL_S)

    # ----- checkpoints ----------------------------------------------------------------------------
    def _stored(self, outer_step: int) -> None:
        """The state of `outer_step` is in the run's checkpoint store: the status record says so."""
        self.view.status.update(stored_step=outer_step)

    def _state_snapshot(self) -> list[torch.Tensor]:
        """A copy of θ_global and the outer momentum, taken under the state's lock."""
        with self._state_lock:
            return [t.clone() for t in self.global_model.state_tensors()]

    def _save_checkpoint(self) -> None:
        if not self.checkpoint_dir:
            return
        self.island.pull()
        with self._state_lock:
            state = dict(
                outer_step=self.global_model.outer_step,
                sha256=self.sha256,
                fingerprint=self.fingerprint,  # the run settings it was trained with (export checks them)
                inner_steps=self.inner.steps_done,
                data_shard=self.data_shard,
                data_state=self.stream.state_dict() if self.stream is not None else None,
                global_state=[t.clone() for t in self.global_model.state_tensors()],
                inner_optimizer=self.island.optimizer_state(self.inner.optimizer),
                # θ_local, its unsynced samples, the steps run ahead and the residual, taken with the data
                # position above: a restart neither skips a batch it read nor counts one twice
                local=self.local.state_dict(),
            )
        save_checkpoint(self.checkpoint_dir, state)

    def _restore_checkpoint(self) -> bool:
        if not self.checkpoint_dir:
            return False
        state = load_checkpoint(self.checkpoint_dir)
        if state is None:
            return False
        check_checkpoint_settings(self.checkpoint_dir, self.fingerprint, state)
        with self._state_lock:
            self.global_model.load_state_tensors(state["global_state"], state["outer_step"])
            if state.get("local") is not None:
                self.local.load_state_dict(state["local"])
            else:  # a checkpoint of an earlier version kept no θ_local: its data position is a round ahead
                self.local.replace_with(self.global_model, self.schedule.fragments)
            self.island.load_optimizer(self.inner.optimizer, state["inner_optimizer"], int(state["inner_steps"]))
            self.inner.fast_forward_schedule(state["inner_steps"])
        self.data_shard = state.get("data_shard")
        self._saved_data_state = checkpointed_stream_state(state, order_seed(self.cfg.run.seed, self.peer_id))
        if self.data_shard is not None and not 0 <= self.data_shard < self.data.num_shards:
            logger.warning("the checkpoint's data shard %d is not one of the %d shards of this config: reading "
                           "another shard from its start", self.data_shard, self.data.num_shards)
            self.data_shard, self._saved_data_state = None, None
        return True

    def _push_to_keeper(self, first_only: bool) -> None:
        """An unreachable peer pushes its state to a keeper of the run that is behind it: the keeper cannot
        dial it to download the state, and in a run whose peers are all unreachable nobody else serves it.
        Only the first (by peer ID) of the unreachable peers at this step and state pushes (`first_only`),
        in a thread of its own; a leaving peer pushes whatever its rank."""
        if self.reachability.can_reduce or self.keeper or (self._push is not None and not self._push.done()):
            return
        step, sha = self.global_model.outer_step, self.sha256
        records = self.progress.fetch()
        behind = sorted(r.peer_id for r in keepers(records, self.peer_id)
                        if r.outer_step < step and r.reachability == DIRECT)
        holders = sorted(pid for pid, r in records.items()
                         if r.outer_step == step and r.sha256 == sha and averages(r))
        if not behind or (first_only and holders and holders[0] != self.peer_id):
            return

        def push() -> None:
            for keeper in behind:
                problem = self.sync.averager.push_state(keeper, self.cfg.swarm.state_download_timeout)
                logger.info("pushed outer step %d to the run's keeper %s%s", step, keeper[-8:],
                            f": {problem}" if problem else "")

        self._push = self._push_thread.submit(push)

    def _hand_over_to_keeper(self) -> None:
        """Before this peer leaves, a keeper of the run that is behind its state gets up to
        :data:`HANDOVER_S` to download it: the last peers of a run may leave right after a step, before the
        keeper has read it (it reads every KEEP_POLL_S), and that step would be lost with them."""
        if self.keeper:
            return
        step, deadline = self.global_model.outer_step, time.monotonic() + HANDOVER_S
        self._push_to_keeper(first_only=False)  # an unreachable peer: the keeper cannot download from it
        for poll in itertools.count():
            found = keepers(self.progress.fetch(), self.peer_id)
            if not found or any(r.outer_step >= step for r in found):
                return
            if time.monotonic() >= deadline:
                logger.warning("leaving before the run's keeper has this peer's outer step %d", step)
                return
            if not poll:
                logger.info("leaving once the run's keeper has this peer's outer step %d (at most %.0f s)", step,
                            HANDOVER_S)
            time.sleep(HANDOVER_POLL_S)

    def _leave(self) -> None:
        """Tell the swarm this peer is gone, then stop the averager (the caller stops the DHT)."""
        self.stop_event.set()  # whatever ended the loop (a signal, an exception), a sync in flight stops too
        try:
            self._hand_over_to_keeper()
            self.progress.publish(self.global_model.outer_step, self.sha256, LEFT)
            self.view.left()
        except Exception as e:  # leaving must not fail because the DHT is already unreachable
            logger.debug("could not publish the leave record: %s", e)
        self.view.close()
        self.progress.close()
        if self.assistance is not None:
            self.assistance.close()
        self.metrics.write("exit", outer_step=self.global_model.outer_step, global_sha256=self.sha256)
        if self.store_writer is not None:
            self.store_writer.close(timeout=self.cfg.swarm.state_download_timeout)
        self._sync_thread.shutdown(wait=True)
        self._round_reads.shutdown(wait=True)  # a read of the records: bounded by the DHT's timeouts
        self._push_thread.shutdown(wait=True)  # each push is bounded by state_download_timeout
        self.sync.shutdown()


def describe_device(device: torch.device) -> str:
    """``"cpu"``, or ``"cuda:0 NVIDIA H100 80GB HBM3"``: what a status table shows of a peer's device (of an
    island's rank 0)."""
    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)}"
    return str(device)
