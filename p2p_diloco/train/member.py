"""What a member of a run holds, whether it trains (:class:`~p2p_diloco.train.diloco.DiLoCoPeer`) or keeps the
run's state (:class:`~p2p_diloco.train.keeper.Keeper`): θ_global and what it lives in, its records on the DHT, the
averager that serves its state to joiners, the run's checkpoint store; its joining and its leaving.

Each piece of state has one owner: θ_global, its momentum and its hash :class:`~p2p_diloco.train.outer.GlobalModel`;
θ_local and what it holds beyond θ_global (unsynced samples, steps run ahead, the error-feedback residual)
:class:`~p2p_diloco.train.local_work.LocalWork`; which fragment syncs when :class:`~p2p_diloco.schedule.FragmentSchedule`;
what others and the user see :class:`~p2p_diloco.train.peer_view.PeerView`. Both roles load the run's state the same
way (:class:`~p2p_diloco.train.state_loading.StateLoading`) and checkpoint it the same way
(:class:`~p2p_diloco.train.checkpointing.Checkpointing`); a role says what differs: its phase between loads, and
the hooks it overrides.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Iterator, Optional, Protocol, Sequence

import torch

from p2p_diloco.config import Config, settings_fingerprint
from p2p_diloco.metrics import MetricsWriter
from p2p_diloco.protocol.view import LEFT, TRAINING
from p2p_diloco.schedule import FragmentSchedule
from p2p_diloco.swarm.liveness import answering
from p2p_diloco.swarm.node import RunNode
from p2p_diloco.swarm.progress import SwarmProgress
from p2p_diloco.swarm.records import RecordPublisher, assistance_key
from p2p_diloco.swarm.status import StatusPublisher
from p2p_diloco.sync.assistant import assistance_request
from p2p_diloco.sync.outer_sync import OuterSync
from p2p_diloco.sync.robust import aggregation_rule
from p2p_diloco.sync.state_store import StateStore, StoreWriter
from p2p_diloco.train.catch_up import CatchUpWait
from p2p_diloco.train.checkpointing import Checkpointing
from p2p_diloco.train.error_feedback import ErrorFeedback
from p2p_diloco.train.fragments import model_fragments
from p2p_diloco.train.heldout import HeldoutEval
from p2p_diloco.train.inner import InnerTrainer
from p2p_diloco.train.island import IslandLead, SoloIsland
from p2p_diloco.train.local_work import LocalWork
from p2p_diloco.train.outer import GlobalModel
from p2p_diloco.train.peer_view import PeerView
from p2p_diloco.train.state_loading import StateLoading

logger = logging.getLogger(__name__)


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


class InnerSteps(Protocol):
    """Where a member's inner steps come from: :class:`~p2p_diloco.train.inner.InnerTrainer` computes them (the
    CLI), :class:`~p2p_diloco.train.user_loop.UserLoop` waits for a user's loop to take them (the library)."""

    optimizer: torch.optim.Optimizer  # its state goes into the checkpoint
    device: torch.device
    micro_batch_size: int
    steps_done: int
    batches: Any  # the CLI's stream of batches, set when the peer joins

    @property
    def lr(self) -> float: ...

    def step(self) -> tuple[Optional[float], int]: ...  # one inner step: its loss (None: not told) and samples

    def fast_forward_schedule(self, steps: int) -> None: ...


class RunMember(StateLoading, Checkpointing):
    """A member of the run: a model, its inner trainer, θ_global, and its link to the swarm (see the module).

    `data` opens this member's stream of training batches (a shard no other live peer reads, when the
    data is sharded); the stream's state goes into the checkpoint, so a restarted peer goes on with
    the data it had not seen. None: the inner steps come from `inner` (a user's loop reads its own data).
    `inner` is where its inner steps come from (:class:`InnerSteps`; default: an
    :class:`~p2p_diloco.train.inner.InnerTrainer` on `data`), and `fragments` the parameter indices of
    each Streaming DiLoCo fragment (default: the model's transformer blocks, :func:`model_fragments`). `node` is its DHT node, with the identity that signs its records and how
    others reach it; `settings` the run settings it trains with (:func:`p2p_diloco.config.shared_settings`),
    whose fingerprint decides which peers it averages with. `display` shows the inner steps' progress
    (:class:`p2p_diloco.train.display.InnerProgress`), if given. `micro_batch_size` is the one chosen for
    its memory (:func:`p2p_diloco.train.memory.choose_micro_batch`; default: ``compute.micro_batch_size``,
    else the whole batch). `trusted_peers` are identities whose word on a state counts first, as a former
    groupmate's does (the run's bootstrap nodes: its keepers). It evaluates θ_global on the `heldout` sequences
    every ``eval.every`` outer steps (:mod:`p2p_diloco.train.heldout`).
    """

    # its record's phase while it holds a state and loads none: TRAINING toward the next outer step, or a keeper's
    # KEEPING (train/keeper.py), which nobody waits for or averages with
    idle_phase = TRAINING
    takes_pushed_states = False  # whether its averager takes a state an unreachable peer pushes (a keeper's does)

    def __init__(
        self,
        cfg: Config,
        model: torch.nn.Module,
        data: Optional[PeerData],
        node: RunNode,
        settings: dict[str, Any],
        metrics: Optional[MetricsWriter] = None,
        stop_event: Optional[threading.Event] = None,
        display: Any = None,
        micro_batch_size: Optional[int] = None,
        trusted_peers: Sequence[str] = (),
        island: Optional[IslandLead] = None,
        heldout: Optional[torch.Tensor] = None,
        inner: Optional[InnerSteps] = None,
        fragments: Optional[list[list[int]]] = None,
    ):
        self.cfg = cfg
        self.model = model
        # a peer of several ranks (train/island.py) is rank 0 of its island; a single process, an island of one
        self.island = island or SoloIsland(model)
        self.local_params = self.island.params
        self.data = data
        self.data_shard: Optional[int] = None  # chosen when the peer joins (from its checkpoint, or free)
        self._saved_data_state: Optional[dict] = None  # the stream's state in a restored checkpoint
        self.inner = inner or InnerTrainer(model, cfg.inner, iter(()), cfg.compute,  # batches from _open_data
                                           micro_batch_size, self.island.island, self.island.forward_model)
        self.global_model = GlobalModel(self.local_params, cfg.outer)
        self.schedule = FragmentSchedule(fragments or model_fragments(model, cfg.outer), cfg.inner.steps_per_outer,
                                         cfg.outer.sync_delay, cfg.outer.fixed_sync_delay)
        error_feedback = cfg.outer.error_feedback and cfg.outer.codec != "none"
        self.local = LocalWork(self.local_params, len(self.schedule.fragments),
                               ErrorFeedback([p.shape for p in self.local_params]) if error_feedback else None)
        self.peer_id = node.dht.peer_id.to_base58()
        self.reachability = node.reachability
        self.metrics = metrics or MetricsWriter(None, self.peer_id)
        self.stop_event = stop_event or threading.Event()
        self.stream: Optional[BatchStream] = None
        self._state_lock = threading.Lock()  # guards θ_global while a joiner downloads it
        self.checkpoint_dir = cfg.swarm.checkpoint_dir or None
        self.last_group_size = 1
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
        # a sample of the CLI's runs is a sequence of data.seq_len tokens; a library peer's samples are its own
        self.view = PeerView(status, display, tokens_per_sample=cfg.data.seq_len if data is not None else 1,
                             idle_phase=self.idle_phase)
        self.progress = SwarmProgress(node.dht, cfg.run.name, cfg.swarm.progress_ttl, node.identity.record_subkey,
                                      fingerprint, node.reachability.mode,
                                      answering=functools.partial(answering, node.dht))
        # the run's bootstrap nodes (its keepers): their word on a state counts first, as a former groupmate's does
        self.progress.ledger.averaged_with(trusted_peers)
        self.assistance = None if node.reachability.can_reduce else self._ask_for_assistance(node, fingerprint)
        self.sync = OuterSync(node.dht, cfg.run.name, fingerprint, node.identity.record_subkey,
                              [p.shape for p in self.local_params], cfg.swarm, state_provider=self._serve_state,
                              client_mode=not node.reachability.can_reduce, codec=cfg.outer.codec,
                              fragments=self.schedule.fragments, record_sent=error_feedback,
                              aggregation=aggregation_rule(cfg.outer), takes_pushed_states=self.takes_pushed_states)
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
        publisher.publish(assistance_request(self.cfg, fingerprint, [p.shape for p in self.local_params],
                                             self.schedule.fragments, time.time()))
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
        """The sha256 of this member's global state (:meth:`GlobalModel.sha256`)."""
        return self.global_model.sha256()

    def _after_state_change(self) -> None:
        # joiners download from the most advanced peer, and among those from the largest group's
        self.sync.set_state_priority(self.global_model.outer_step * 1000.0 + min(self.last_group_size, 999))

    # ----- joining and leaving ----------------------------------------------------------------------
    def _stopping(self) -> bool:
        return self.stop_event.is_set()

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

    def _shard_claim(self) -> Optional[int]:
        """The data shard its status record names: none when the data is not sharded (it reads all of it), or
        is the user's own (a library peer's loop reads its data)."""
        return self.data_shard if self.data is not None and self.data.num_shards > 1 else None

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

    def _leave(self) -> None:
        """Tell the swarm this member is gone, then stop the averager (the caller stops the DHT)."""
        self.stop_event.set()  # whatever ended the loop (a signal, an exception), a sync in flight stops too
        try:
            self._before_leaving()
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
        self._stop_workers()
        self.sync.shutdown()

    def _before_leaving(self) -> None:
        """What this member does before its last record, while the run still counts it: nothing here (a peer
        hands its state over to the run's keeper, :meth:`~p2p_diloco.train.diloco.DiLoCoPeer._before_leaving`)."""

    def _stop_workers(self) -> None:
        """Stop the threads of this member's own work, before its averager stops: none here (a peer's syncs,
        reads of the records and pushes to the keeper)."""


def describe_device(device: torch.device) -> str:
    """``"cpu"``, or ``"cuda:0 NVIDIA H100 80GB HBM3"``: what a status table shows of a peer's device (of an
    island's rank 0)."""
    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)}"
    return str(device)
