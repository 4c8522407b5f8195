"""Where a member's state outlives its process: its checkpoint, the run's checkpoint store, and the run's keeper.

:class:`Checkpointing` (a peer and the keeper, :mod:`p2p_diloco.train.member`) saves the member's whole state at
outer-step boundaries (:mod:`p2p_diloco.train.checkpoint`: θ_global and the momentum, θ_local with its unsynced
samples and residual, the inner optimizer, the data position), restores it at the start, and writes θ_global to the
run's checkpoint store every ``swarm.checkpoint_every`` outer steps. :class:`KeeperHandOver` (a peer only) hands
the state to the run's keeper where the keeper cannot get it alone: an unreachable peer pushes it (nobody can dial
it to download it), and a leaving peer waits a moment for a keeper that is behind it.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from typing import Optional

import torch

from p2p_diloco.protocol.view import averages, keepers
from p2p_diloco.swarm.reachability import DIRECT
from p2p_diloco.train.checkpoint import check_checkpoint_settings, load_checkpoint, save_checkpoint
from p2p_diloco.train.data import checkpointed_stream_state, order_seed

logger = logging.getLogger(__name__)

KEEP_POLL_S = 2.0  # how often the keeper reads the run's records (train/keeper.py)
HANDOVER_S = 3 * KEEP_POLL_S  # how long a leaving peer waits for a keeper that lacks its state
HANDOVER_POLL_S = 0.5


class Checkpointing:
    """A member's checkpoint and its writes to the run's checkpoint store, for
    :class:`~p2p_diloco.train.member.RunMember` (see the module)."""

    def _save_checkpoint(self) -> None:
        """This member's whole state to ``swarm.checkpoint_dir``, if it has one, taken under the state's lock."""
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
        """This member's state from its checkpoint, if it has one (CheckpointMismatch if it was trained with
        other run settings); its data stream is opened later, where the checkpoint left it."""
        if not self.checkpoint_dir:
            return False
        state = load_checkpoint(self.checkpoint_dir)
        if state is None:
            return False
        check_checkpoint_settings(self.checkpoint_dir, self.fingerprint, state)
        with self._state_lock:
            self.island.load_optimizer(self.inner.optimizer, state["inner_optimizer"], int(state["inner_steps"]))
        self._adopt_saved(state)
        self.data_shard = state.get("data_shard")
        self._saved_data_state = checkpointed_stream_state(state, order_seed(self.cfg.run.seed, self.peer_id))
        if self.data_shard is not None and (self.data is None or not 0 <= self.data_shard < self.data.num_shards):
            logger.warning("the checkpoint's data shard %d is not one of the %d shards of this config: reading "
                           "another shard from its start", self.data_shard, self.data.num_shards)
            self.data_shard, self._saved_data_state = None, None
        return True

    def _adopt_saved(self, state: dict) -> None:
        """θ_global and its outer step, θ_local with what it holds, and the count of inner steps of a saved state
        (this member's checkpoint, or a library peer's ``DiLoCo.state_dict()``), under the state's lock; ValueError,
        before anything changes, if θ_global's shapes are not this model's."""
        with self._state_lock:
            self.global_model.load_state_tensors(state["global_state"], int(state["outer_step"]))
            if state.get("local") is not None:
                self.local.load_state_dict(state["local"])
            else:  # a checkpoint of an earlier version kept no θ_local: its data position is a round ahead
                self.local.replace_with(self.global_model, self.schedule.fragments)
            self.inner.fast_forward_schedule(int(state.get("inner_steps", 0)))

    def _state_snapshot(self) -> list[torch.Tensor]:
        """A copy of θ_global and the outer momentum, taken under the state's lock."""
        with self._state_lock:
            return [t.clone() for t in self.global_model.state_tensors()]

    def _store_step(self) -> None:
        """Write this member's state to the run's checkpoint store, if the store is due one at its outer step
        (``swarm.checkpoint_every``: :class:`~p2p_diloco.sync.state_store.StoreWriter`, in the background)."""
        if self.store_writer is not None:
            self.store_writer.after_step(self.global_model.outer_step, self.sha256, self.inner.steps_done,
                                         self._state_snapshot)

    def _stored(self, outer_step: int) -> None:
        """The state of `outer_step` is in the run's checkpoint store: the status record says so."""
        self.view.status.update(stored_step=outer_step)


class KeeperHandOver:
    """A peer's hand-over of its state to the run's keeper, for :class:`~p2p_diloco.train.diloco.DiLoCoPeer`
    (see the module); the peer makes `_push` and `_push_thread`."""

    _push: Optional[concurrent.futures.Future]  # the push in flight, if any
    _push_thread: concurrent.futures.ThreadPoolExecutor

    def _push_to_keeper(self, first_only: bool) -> None:
        """An unreachable peer pushes its state to a keeper of the run that is behind it: the keeper cannot
        dial it to download the state, and in a run whose peers are all unreachable nobody else serves it.
        Only the first (by peer ID) of the unreachable peers at this step and state pushes (`first_only`),
        in a thread of its own; a leaving peer pushes whatever its rank."""
        if self.reachability.can_reduce or (self._push is not None and not self._push.done()):
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
