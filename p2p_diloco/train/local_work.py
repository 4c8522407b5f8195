"""What a peer holds beyond θ_global: its work not yet in the swarm's model, kept by one owner.

DiLoCo's θ_local (arXiv 2311.08105, Alg. 1) differs from θ_global by the inner steps not yet synced.
Around it a peer keeps more state that only makes sense together with θ_local:

* per fragment, the samples of the inner steps not yet in that fragment's θ_global (the peer's
  weight in the group's mean, DiLoCo's sample-weighted average; Streaming DiLoCo, arXiv 2501.18512,
  syncs one fragment at a time, so each has its own count);
* the inner steps already run toward the next round while the last round's sync was in flight
  (Streaming DiLoCo's overlap τ);
* the error-feedback residual (:mod:`p2p_diloco.train.error_feedback`): what the codec dropped from
  this peer's last sends, owed to the next.

They change together and move together. A downloaded state either replaces all of them at once
(:meth:`LocalWork.replace_with`: the state may hold some of this peer's work already, and keeping any
of it would count it twice) or takes all of them over (:meth:`LocalWork.rebase`: none of the work
was sent in a round that moved tensors and failed, and the state is at most one outer step ahead,
:func:`p2p_diloco.protocol.plans.keeps_work`); a checkpoint keeps all of them
(:meth:`LocalWork.state_dict`) with the data stream's position taken at the same moment, so a
restarted peer neither skips a batch it had read nor counts one twice.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from p2p_diloco.train.error_feedback import ErrorFeedback


class Contribution:
    """Per fragment, the samples of the inner steps not yet synced; and the loss of the inner steps since
    the last outer_step record."""

    def __init__(self, num_fragments: int):
        self.total_samples = 0  # of every inner step since θ_local was last set from θ_global
        self._synced = [0] * num_fragments  # total_samples already in each fragment's θ_global
        self.loss_sum = 0.0
        self.steps = 0
        self.last_mean_loss: Optional[float] = None

    def add(self, loss: Optional[float], samples: int) -> None:
        """An inner step over `samples`, with its `loss` (None: a library loop that did not say it; the mean
        loss counts only the steps that did)."""
        self.total_samples += samples
        if loss is not None:
            self.loss_sum += loss
            self.steps += 1

    def recent_loss(self) -> Optional[float]:
        """The mean loss of the inner steps since the last outer_step record, or of those before it."""
        return self.loss_sum / self.steps if self.steps else self.last_mean_loss

    def samples(self, fragment: int) -> int:
        return self.total_samples - self._synced[fragment]

    def synced(self, fragment: int, samples: int) -> float:
        """`samples` of `fragment` are in θ_global now; returns the mean loss since the last call."""
        self._synced[fragment] += samples
        mean_loss = self.loss_sum / max(self.steps, 1)
        self.loss_sum, self.steps = 0.0, 0
        self.last_mean_loss = mean_loss
        return mean_loss

    def state_dict(self) -> dict:
        return dict(total_samples=self.total_samples, synced=list(self._synced), loss_sum=self.loss_sum,
                    steps=self.steps, last_mean_loss=self.last_mean_loss)

    def load_state_dict(self, state: dict) -> None:
        if len(state["synced"]) != len(self._synced):
            raise ValueError(f"a contribution of {len(state['synced'])} fragments where {len(self._synced)} "
                             "were expected")
        self.total_samples = int(state["total_samples"])
        self._synced = [int(s) for s in state["synced"]]
        self.loss_sum, self.steps = float(state["loss_sum"]), int(state["steps"])
        self.last_mean_loss = state["last_mean_loss"]


class LocalWork:
    """θ_local (the model's trainable parameters, trained in place by the inner loop), the contribution
    of its inner steps, the steps run ahead into the next round and the error-feedback residual."""

    def __init__(self, params: Sequence[torch.Tensor], num_fragments: int,
                 error_feedback: Optional[ErrorFeedback] = None):
        self.params = list(params)
        self.num_fragments = num_fragments
        self.contribution = Contribution(num_fragments)
        self.steps_ahead = 0  # inner steps of the next round, run while the last round's sync was in flight
        self.error_feedback = error_feedback
        # fragments whose Δ went into a round that moved tensors and then failed: another member may have
        # committed it, so a state loaded next may hold that work (keeps_work)
        self.sent_unsettled: set[int] = set()

    def to_send(self, indices: Sequence[int], pseudo_gradient: list[torch.Tensor]) -> list[torch.Tensor]:
        """What this peer sends for the fragment at `indices`: Δ, plus the residual it owes with error feedback."""
        if self.error_feedback is None:
            return pseudo_gradient
        return self.error_feedback.compensate(indices, pseudo_gradient)

    def sent(self, indices: Sequence[int], to_send: Sequence[torch.Tensor],
             counted: Optional[Sequence[torch.Tensor]], fragment: Optional[int] = None) -> None:
        """The round that sent `to_send` for the fragment at `indices` (number `fragment`) is applied, and the group
        counted this peer's part as `counted` (None: exactly as sent, e.g. a peer alone): keep what it did not
        count."""
        self.sent_unsettled.discard(fragment)
        if self.error_feedback is not None:
            self.error_feedback.commit(indices, to_send, to_send if counted is None else counted)

    def owed(self, indices: Sequence[int]) -> Optional[list[torch.Tensor]]:
        """What the group did not count of this peer's last send of the fragment at `indices`, to merge into θ_local
        with the outer step (:meth:`~p2p_diloco.train.error_feedback.ErrorFeedback.take`); None without error
        feedback."""
        return None if self.error_feedback is None else self.error_feedback.take(indices)

    def sent_in_failed_round(self, fragment: int) -> None:
        """This peer's Δ of `fragment` went into a round that failed after this peer reported it complete: a groupmate
        may have committed it, and a state loaded next may hold it (`RoundFailed.reported`)."""
        self.sent_unsettled.add(fragment)

    @torch.no_grad()
    def replace_with(self, global_model, fragments: Sequence[Sequence[int]]) -> None:
        """θ_local ← θ_global (a downloaded state), and forget every count and residual of the old θ_local."""
        global_model.copy_to(self.params, fragments)
        self.contribution = Contribution(self.num_fragments)
        self.steps_ahead = 0
        self.sent_unsettled = set()
        if self.error_feedback is not None:
            self.error_feedback.reset()

    def pseudo_gradients(self, global_model, fragments: Sequence[Sequence[int]]) -> list[list[torch.Tensor]]:
        """Δ = θ_global − θ_local of each fragment (fp32, on the CPU), to keep across a load (:meth:`rebase`)."""
        return [global_model.pseudo_gradient(self.params, indices) for indices in fragments]

    def rebase(self, global_model, fragments: Sequence[Sequence[int]],
               pseudo_gradients: Sequence[Sequence[torch.Tensor]]) -> None:
        """θ_local ← θ_global − Δ for a downloaded θ_global, each fragment's Δ taken before the load
        (:meth:`pseudo_gradients`): this peer's unsynced inner steps, their counts, the steps run ahead and the
        residual it owes all carry over to the loaded state (:func:`p2p_diloco.protocol.plans.keeps_work`)."""
        for indices, delta in zip(fragments, pseudo_gradients):
            global_model.rebase(self.params, indices, delta)

    def state_dict(self) -> dict:
        """θ_local in its own dtype, on the CPU, and the rest; for a checkpoint taken between inner steps."""
        return dict(
            params=[p.detach().to("cpu", copy=True) for p in self.params],
            contribution=self.contribution.state_dict(),
            steps_ahead=self.steps_ahead,
            error_feedback=None if self.error_feedback is None else self.error_feedback.state_dict(),
            sent_unsettled=sorted(self.sent_unsettled),
        )

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved (shapes checked first: nothing changes on a mismatch)."""
        saved = state["params"]
        if len(saved) != len(self.params) or any(s.shape != p.shape for s, p in zip(saved, self.params)):
            raise ValueError("the saved θ_local does not have this model's parameters")
        contribution = Contribution(self.num_fragments)
        contribution.load_state_dict(state["contribution"])
        for p, s in zip(self.params, saved):
            p.copy_(s)
        self.contribution = contribution
        self.steps_ahead = int(state["steps_ahead"])
        self.sent_unsettled = {int(f) for f in state.get("sent_unsettled", ())}
        if self.error_feedback is not None:
            if state.get("error_feedback") is not None:
                self.error_feedback.load_state_dict(state["error_feedback"])
            else:  # saved without error feedback: nothing is owed
                self.error_feedback.reset()
