"""How a member of the run (a peer or the keeper, :mod:`p2p_diloco.train.member`) brings its state to the run's.

Before each round the member asks :func:`p2p_diloco.protocol.decide.next_move` what to do (:meth:`StateLoading._next_move`),
and acts on a load or a wait here:

* a load from peers (:meth:`StateLoading._load_from_peers`): the state the move targets is downloaded from a peer that
  serves it (:mod:`p2p_diloco.sync.state_transfer`), checked against this member's own before it replaces it (one step
  ahead: an outer step from its state, :mod:`p2p_diloco.train.state_check`; else on the records' word), and adopted;
  a state that fails is refused for the rest of the run, and so is its donor;
* a load from the run's checkpoint store (:mod:`p2p_diloco.sync.state_store`), when no peer serves the run's state;
* a wait for the run's state (:meth:`StateLoading._wait_for_state`), bounded (:mod:`p2p_diloco.train.catch_up`).

A member that adopts a state keeps its unsynced inner steps, rebased onto it, when it missed one round or lost a vote
at its step (:func:`p2p_diloco.protocol.plans.keeps_work`), else drops them with its old state (the metrics say how
many samples either way), and checkpoints the new one at once.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from p2p_diloco.protocol.decide import Move, next_move
from p2p_diloco.protocol.plans import RoundPlan, keeps_work
from p2p_diloco.protocol.trust import is_verifiable, unverified_step_trusted
from p2p_diloco.protocol.view import LOADING, PeerProgress, averages
from p2p_diloco.sync.codecs import get_codec
from p2p_diloco.sync.state_store import StoreError
from p2p_diloco.sync.state_transfer import GlobalState, StateExpectation, download_global_state, nobody_serves
from p2p_diloco.train.catch_up import POLL_S
from p2p_diloco.train.state_check import STATE_REFUSED, step_problem

logger = logging.getLogger(__name__)


class StateLoading:
    """Loading the run's state, for :class:`~p2p_diloco.train.member.RunMember`, whose θ_global, records, averager,
    store and catch-up wait it uses (see the module)."""

    def _next_move(self, records: dict[str, PeerProgress], may_load: bool = True) -> Move:
        """This peer's move before its next round (:func:`p2p_diloco.protocol.decide.next_move`) from `records` and
        what its ledger holds now; a jump it declines is said, and its claims set aside."""
        move = next_move(records, self.progress.set_aside_records, self.peer_id, self.global_model.outer_step,
                         self.sha256, self.progress.history(), self.progress.ledger.trusted_word(),
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

    def _load_from_peers(self, plan: RoundPlan, records: dict[str, PeerProgress]) -> bool:
        """Download the state `plan` targets (one the records trust: :meth:`_next_move`), check it
        (p2p_diloco.train.state_check) and adopt it; False, and this peer stays at its own state, when it is not
        downloaded or fails the check."""
        logger.info("loading global state from peers: %s", plan.reason)
        self._say_loading(plan)
        self.view.loading()
        self.sync.share_state(False)  # nobody should copy a state we are replacing
        expected = StateExpectation(tuple(tuple(p.shape) for p in self.local_params), plan.target_step,
                                    plan.target_sha256)
        pushed = self._pushed_state(expected)  # nobody can download from an unreachable peer
        distrusted = set(self.progress.ledger.distrusted)  # the download adds the donors of malformed states
        try:
            state, failed_donors = (pushed, {}) if pushed is not None else download_global_state(
                self.sync.averager, expected, distrusted, self.cfg.swarm.state_download_timeout,
                should_stop=self._stopping,
            )
        finally:
            self.sync.share_state(True)
        self.progress.refuse(peers=sorted(distrusted))  # not asked again, nor do their records count in any plan
        failures = {peer: str(why) for peer, why in failed_donors.items()}
        if state is None:
            self._load_failed()
            if nobody_serves(failed_donors, plan.target_step):
                self.progress.set_aside(plan.claims or {})
            logger.warning("could not download the global state of outer step %d (this peer is at %d)",
                           plan.target_step, self.global_model.outer_step)
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

    def _say_loading(self, plan: RoundPlan) -> None:
        """Its record says it loads the state at `plan`'s step: the peers at that step wait for this one."""
        self.progress.publish(plan.target_step, self.sha256, LOADING)

    def _pushed_state(self, expected: StateExpectation) -> Optional[GlobalState]:
        """The state `expected`, if an unreachable peer pushed it to this member: only a keeper takes those
        (:meth:`p2p_diloco.train.keeper.Keeper._pushed_state`)."""
        return None

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
                               self.cfg.outer.max_update_growth,
                               sparse=not get_codec(self.cfg.outer.codec).sends_every_value)
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
        self.progress.refuse(state.sha256, [state.donor])
        logger.warning("refusing the state at outer step %d (%s) from peer %s: %s; training on from outer step %d",
                       state.outer_step, state.sha256[:12], state.donor, problem, self.global_model.outer_step)
        self.metrics.write(STATE_REFUSED, outer_step=self.global_model.outer_step, target_step=state.outer_step,
                           target_sha256=state.sha256, donor=state.donor, claimed_by=sorted(plan.claims or {}),
                           reason=problem, failed_donors=failures)

    def _load_failed(self) -> None:
        """Back to this peer's own state after a load that failed: its record says so. Left "loading" at the
        target's step, it kept peers at that step waiting for it, and hid it from peers at its own step: three
        newcomers whose download failed each waited for company the others' records denied (seen in CI)."""
        self.progress.publish(self.global_model.outer_step, self.sha256, self.idle_phase)
        self.view.training()

    def _adopt(self, tensors: list[torch.Tensor], outer_step: int, inner_steps: int, reason: str, source: str,
               **details) -> None:
        """Replace this peer's state with a checked one (θ_global and momentum at `outer_step`) that came from
        `source` ("peer", "keeper" or "store"). θ_local's unsynced inner steps move onto it, rebased, when
        :func:`~p2p_diloco.protocol.plans.keeps_work` says so (a round missed, a vote lost); else they go with the
        old state."""
        fragments = self.schedule.fragments
        held = max(self.local.contribution.samples(f) for f in range(len(fragments)))
        keep = held > 0 and keeps_work(self.global_model.outer_step, outer_step, bool(self.local.sent_unsettled))
        with self._state_lock:
            deltas = self.local.pseudo_gradients(self.global_model, fragments) if keep else None
            self.global_model.load_state_tensors(tensors, outer_step)
            if keep:
                self.local.rebase(self.global_model, fragments, deltas)
            else:
                self.local.replace_with(self.global_model, fragments)
            self.inner.fast_forward_schedule(inner_steps)
            self.island.changed(self.inner.steps_done)
            self._after_state_change()
        self.progress.served(outer_step, self.sha256, details.get("donor"))
        self.progress.publish(self.global_model.outer_step, self.sha256, self.idle_phase)
        self.view.training(outer_step=self.global_model.outer_step, inner_steps=self.inner.steps_done)
        self.metrics.write("state_loaded", outer_step=outer_step, global_sha256=self.sha256, reason=reason,
                           source=source, samples_dropped=0 if keep else held, samples_kept=held if keep else 0,
                           **details)
        logger.info("loaded global state at outer step %d (%s) from %s %s%s", outer_step, self.sha256[:12], source,
                    details.get("donor", ""), f"; keeping the {held} samples of its unsynced inner steps" if keep
                    else "")
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
