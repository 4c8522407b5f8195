"""Error feedback: each peer carries what the group did not count of its last send into its next.

With a lossy codec the group counts, of a peer's Δ + e, only what survives the codec: call it S. The
peer keeps the rest, e ← (Δ + e) − S, and its next pseudo-gradient holds it (error-feedback SGD:
Seide et al., "1-bit stochastic gradient descent", Interspeech 2014; Karimireddy et al., "Error
feedback fixes SignSGD", ICML 2019, Alg. 2; SparseLoCo, arXiv 2508.15706, keeps it per DiLoCo worker
the same way). Summed over the rounds the group agreed on, what was counted plus the residual still
held is every Δ: ``Σ_t S_t + e_T = Σ_t Δ_t``. Nothing the codec drops is lost, only delayed.

S is what really left, as the all-reduce reports it (:attr:`p2p_diloco.sync.outer_sync.GroupMean.sent`):
each part after the codec's round trip of the very bytes counted, on the runner's own part
boundaries, whether it went to another reducer or this peer reduced it itself (a reducer aggregates
its own parts decoded too, so that an auditor can recompute its result: :mod:`p2p_diloco.sync.audit`).
A residual computed by coding each tensor whole instead differs where hivemind cuts parts off the
codec's block grid: it fed back another error than the one made, and the accumulated error then
grows with the rounds (issue 18, ``tests/test_error_feedback.py``).

**The residual goes into θ_local**, not into the next send: once the round is applied, the peer's θ_local is
merged with θ_global − e instead of θ_global (:meth:`ErrorFeedback.take`,
:meth:`~p2p_diloco.train.outer.GlobalModel.merge_into`), so its next Δ = θ_global − θ_local holds e, as a
compensated send would, but its inner steps start from the point that holds it too. Added to the next send
instead, a value the codec did not send was one the inner steps never saw move: with a sparse codec
(:class:`~p2p_diloco.sync.codecs.SharedMaskCodec`, a value sent once in 8 rounds on average) its gradient
accumulated unchanged round after round and then moved it at once by all of them, through the outer momentum:
at equal tokens the demo model's held-out loss was 82.6 % above fp32 DiLoCo's with 1 value in 8, 22 % with the
residual in θ_local; with the dense fp4-e3m0 both are within noise of fp32 (docs/benchmarks.md). Keeping the
values not sent in the local model is what SPARTA does for the parameters it does not average.

The training loop owns this object; sync knows nothing of it::

    to_send = ef.compensate(indices, delta)           # before the round (e is zero unless a checkpoint saved one)
    result = sync.average(to_send, ...)               # an OuterSync made with record_sent=True
    ef.commit(indices, to_send, result.sent)          # only once the round is agreed
    owed = ef.take(indices)                           # e, into θ_local with the merge; zero here again
    ef.reset()                                        # when the peer loads a downloaded state

A round that applied nothing commits nothing: its Δ stays in θ_local and goes into the next one,
and e is still owed. A downloaded state already holds whatever of this peer's Δ + e reached the
group, so the residual is dropped with θ_local then (keeping it would count it twice).
"""

from __future__ import annotations

from typing import Sequence

import torch


class ErrorFeedback:
    """The residual e of each averaged tensor (zeros until a round is committed), float32 on the CPU."""

    def __init__(self, shapes: Sequence[torch.Size]):
        self.residual = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]

    @torch.no_grad()
    def compensate(self, indices: Sequence[int], delta: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Δ + e of the tensors at `indices`: what this peer sends this round."""
        return [d.to(torch.float32) + self.residual[i] for i, d in zip(indices, delta, strict=True)]

    @torch.no_grad()
    def commit(self, indices: Sequence[int], to_send: Sequence[torch.Tensor], sent: Sequence[torch.Tensor]) -> None:
        """After an agreed round: e ← (Δ + e) − S, with `to_send` what :meth:`compensate` gave and `sent`
        what the group counted of it (S)."""
        for i, x, s in zip(indices, to_send, sent, strict=True):
            if x.shape != self.residual[i].shape or s.shape != x.shape:
                raise ValueError(f"tensor {i}: shapes {tuple(x.shape)} and {tuple(s.shape)}, "
                                 f"expected {tuple(self.residual[i].shape)}")
            self.residual[i] = x - s

    def take(self, indices: Sequence[int]) -> list[torch.Tensor]:
        """The residual of the tensors at `indices`, handed over to θ_local (see the module's docstring), and
        zero here from now on."""
        owed = [self.residual[i] for i in indices]
        for i in indices:
            self.residual[i] = torch.zeros_like(self.residual[i])
        return owed

    def reset(self) -> None:
        """Drop every residual: the peer took a downloaded state, which counts whatever of it had reached the group."""
        for r in self.residual:
            r.zero_()

    def state_dict(self) -> dict:
        return {"residual": [r.clone() for r in self.residual]}

    def load_state_dict(self, state: dict) -> None:
        residual = state["residual"]
        shapes = [tuple(r.shape) for r in residual]
        if shapes != [tuple(r.shape) for r in self.residual]:
            raise ValueError(f"the saved residual has shapes {shapes}, this model "
                             f"{[tuple(r.shape) for r in self.residual]}")
        self.residual = [r.to(torch.float32).clone() for r in residual]
