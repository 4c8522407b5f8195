"""The global model θ_global and the outer optimizer that moves it (DiLoCo, arXiv 2311.08105, Alg. 1).

θ_global is kept in fp32 on the CPU, whatever device and precision the inner loop uses, so that the
outer step and its hash are the same on every peer. One outer step t does

    Δ_t      = θ_global − θ_local                       (pseudo-gradient, Alg. 1 line 10)
    Δ̄_t      = the group's sample-weighted mean of Δ_t   (line 11; done by p2p_diloco.sync)
    θ_global ← NesterovSGD(θ_global, Δ̄_t; outer lr, μ)    (line 12)
    θ_local  ← θ_global                                  (line 3 of the next round)

The outer optimizer is SGD with Nesterov momentum, the update the paper uses (Alg. 1 line 12), in
the form torch documents for ``torch.optim.SGD(nesterov=True)`` (after Sutskever et al. 2013, "On
the importance of initialization and momentum in deep learning", ICML). With momentum μ, outer
learning rate η and the mean pseudo-gradient g = Δ̄_t (:func:`nesterov_step_`):

    b ← b·μ + g           (the momentum buffer, zeros before the first step)
    d ← g + b·μ
    θ_global ← θ_global − d·η

It is written out by hand, one multiply or add per operation, rather than run by torch's SGD:
θ_global must be the same bits on every peer, and torch's SGD computes ``param.add_(d, alpha=-η)``
and ``g.add(b, alpha=μ)``, which ATen's AVX2 and AVX-512 kernels round once (a fused multiply-add)
and its default kernel (a CPU without AVX2) twice. An elementwise multiply, add or subtract of two
float32 tensors is rounded once, to nearest, by every kernel (IEEE 754), so each line above gives
the same bits on every CPU; μ and η are rounded to float32 first, as torch rounds a Python scalar
that multiplies a float32 tensor. The global state is θ_global and the momentum: peers that hold
the same θ_global but another momentum would part ways at the next step, so the state's sha256
covers both.

θ_local moves to and from the CPU one fragment at a time, with the same values as copying each
parameter (:mod:`p2p_diloco.train.transfer`): on CUDA as one flat page-locked buffer, one copy each
way (:class:`~p2p_diloco.train.transfer.FlatTransfer`); on a CPU directly, without a buffer or, for
fp32 parameters, any copy (:class:`~p2p_diloco.train.transfer.DirectTransfer`).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from p2p_diloco.config import OuterConfig
from p2p_diloco.hashing import tensors_sha256
from p2p_diloco.train.transfer import Transfer, transfer_for

TransferFactory = Callable[[Sequence[torch.Tensor]], Transfer]  # a fragment's parameters -> its transfer


class GlobalModel:
    """θ_global, its outer optimizer state, the outer step counter and the state's sha256, in one place.

    θ_global and its momentum change only through :meth:`apply` and :meth:`load_state_tensors`, which is
    what lets :meth:`sha256` hash the state once per change.

    `transfer_factory` makes each fragment's transfer (default :func:`~p2p_diloco.train.transfer.transfer_for`:
    flat on CUDA, direct elsewhere); the tests pass FlatTransfer to check it on a CPU."""

    def __init__(self, local_params: Sequence[torch.Tensor], cfg: OuterConfig,
                 transfer_factory: TransferFactory = transfer_for):
        self.params = [p.detach().to("cpu", torch.float32, copy=True) for p in local_params]
        self.outer_step = 0
        self._transfer_factory = transfer_factory
        self._transfers: dict[tuple, Transfer] = {}  # (fragment's indices, device) -> its transfer (host buffer)
        self.lr = cfg.lr
        self.momentum = cfg.momentum
        self.momentum_buffer = [torch.zeros_like(p) for p in self.params]  # b of each parameter
        self._sha256: Optional[str] = None  # of the state as it is now; None after a change

    @torch.no_grad()
    def pseudo_gradient(self, local_params: Sequence[torch.Tensor], indices: Sequence[int]) -> list[torch.Tensor]:
        """Δ = θ_global − θ_local of the parameters at `indices` (a fragment), in fp32 on the CPU (Alg. 1 line 10)."""
        local_fp32 = self._transfer(local_params, indices).gather([local_params[i] for i in indices])
        return [self.params[i] - local for i, local in zip(indices, local_fp32)]

    @torch.no_grad()
    def apply(self, mean_pseudo_gradient: Sequence[torch.Tensor], indices: Sequence[int],
              carried: Optional[Sequence[torch.Tensor]] = None) -> None:
        """One outer Nesterov step (:func:`nesterov_step_`, Alg. 1 line 12) with the group's mean
        pseudo-gradient of the parameters at `indices`. The others keep their values and their
        momentum, so each Streaming DiLoCo fragment has its own outer state.

        `carried` (bool, one per tensor of the mean; :attr:`p2p_diloco.sync.outer_sync.GroupMean.carried`): the
        values the round's codec sent, where a codec sends a subset (a shared mask). Only those step; every other
        value keeps its value and its momentum, as the moments of a value absent from a sparse gradient stay put
        in torch's ``SparseAdam`` (a "lazy" update). Stepped with a mean of 0 instead, the momentum of a value
        not sent went on moving it for rounds with no new word from the group, while the next word, which
        answers that motion, came only when the mask drew the value again (8 rounds on average for mask8):
        at equal tokens the demo model's held-out loss was 22 % above fp32 DiLoCo's with 1 value in 8 over 14
        rounds and 75 % over 34, and θ_global ended above its initial loss in a 240 s run over 20 Mbit/s links;
        with this rule 11 % over 14 rounds and 5 % over 34 (docs/benchmarks.md).
        The choice is `torch.where` of two IEEE results, the same bits on every CPU."""
        carried = [None] * len(indices) if carried is None else carried
        for i, delta, sent in zip(indices, mean_pseudo_gradient, carried, strict=True):
            param, buffer = self.params[i], self.momentum_buffer[i]
            if sent is None:
                nesterov_step_(param, buffer, delta.to(torch.float32), self.lr, self.momentum)
                continue
            new_param, new_buffer = param.clone(), buffer.clone()
            nesterov_step_(new_param, new_buffer, delta.to(torch.float32), self.lr, self.momentum)
            param.copy_(torch.where(sent, new_param, param))
            buffer.copy_(torch.where(sent, new_buffer, buffer))
        self.outer_step += 1
        self._sha256 = None

    @torch.no_grad()
    def copy_to(self, local_params: Sequence[torch.Tensor],
                fragments: Optional[Sequence[Sequence[int]]] = None) -> None:
        """θ_local ← θ_global (cast to the local parameters' device and dtype), fragment by fragment.

        `fragments`: the index lists of the fragments the outer steps use (default: one fragment of
        all the parameters). Each goes through its fragment's own transfer, the one its outer steps reuse, so
        loading a state makes no whole-model host buffer beside theirs (torch's pinned-memory cache
        would keep one page-locked for the rest of the run).
        """
        fragments = [list(range(len(self.params)))] if fragments is None else fragments
        if sorted(i for indices in fragments for i in indices) != list(range(len(self.params))):
            raise ValueError(f"fragments that do not cover each of the {len(self.params)} parameters once")
        for indices in fragments:
            self.merge_into(local_params, indices, alpha=0.0)

    @torch.no_grad()
    def merge_into(self, local_params: Sequence[torch.Tensor], indices: Sequence[int], alpha: float,
                   owed: Optional[Sequence[torch.Tensor]] = None) -> None:
        """θ_local ← α·θ_local + (1 − α)·(θ_global − e) at `indices` (the overlap merge of Streaming DiLoCo, arXiv
        2501.18512), with e what the group did not count of this peer's send (`owed`, error feedback's residual:
        :mod:`p2p_diloco.train.error_feedback`; None: zero); α = 0 and no residual copy θ_global, as DiLoCo does."""
        target = [self.params[i] for i in indices]
        if owed is not None:
            target = [param - residual for param, residual in zip(target, owed, strict=True)]
        self._transfer(local_params, indices).scatter(target, [local_params[i] for i in indices], alpha)

    @torch.no_grad()
    def rebase(self, local_params: Sequence[torch.Tensor], indices: Sequence[int],
               pseudo_gradient: Sequence[torch.Tensor]) -> None:
        """θ_local ← θ_global − Δ at `indices`: the pseudo-gradient Δ (:meth:`pseudo_gradient`, taken against
        the state this peer held before) moved onto this θ_global, a state it loaded
        (:func:`p2p_diloco.protocol.plans.keeps_work`): the merge with α = 0 and Δ as the residual."""
        self.merge_into(local_params, indices, 0.0, owed=pseudo_gradient)

    @staticmethod
    def _transfer_key(local_params: Sequence[torch.Tensor], indices: Sequence[int]) -> tuple:
        return tuple(indices), local_params[indices[0]].device

    def _transfer(self, local_params: Sequence[torch.Tensor], indices: Sequence[int]) -> Transfer:
        """The fragment's transfer, made at its first use and reused by every later one."""
        key = self._transfer_key(local_params, indices)
        if key not in self._transfers:
            self._transfers[key] = self._transfer_factory([local_params[i] for i in indices])
        return self._transfers[key]

    def momentum_buffers(self) -> list[torch.Tensor]:
        """The outer momentum, zeros before the first step, in parameter order."""
        return list(self.momentum_buffer)

    def state_tensors(self) -> list[torch.Tensor]:
        """Everything a joining peer needs: θ_global then the outer momentum."""
        return [*self.params, *self.momentum_buffers()]

    @torch.no_grad()
    def load_state_tensors(self, tensors: Sequence[torch.Tensor], outer_step: int) -> None:
        """θ_global then the momentum, as :meth:`state_tensors` gives them; ValueError, and nothing changed,
        unless every shape matches."""
        targets = self.state_tensors()
        if len(tensors) != len(targets):
            raise ValueError(f"global state has {len(tensors)} tensors, expected {len(targets)}")
        for target, t in zip(targets, tensors):
            if target.shape != t.shape:
                raise ValueError(f"global state tensor of shape {tuple(t.shape)} where {tuple(target.shape)} "
                                 "was expected")
        for target, t in zip(targets, tensors):
            target.copy_(t)
        self.outer_step = outer_step
        self._sha256 = None

    def sha256(self) -> str:
        """sha256 of the global state's fp32 bytes: θ_global then the outer momentum, in parameter order
        (hashed at the first call after a change)."""
        if self._sha256 is None:
            self._sha256 = tensors_sha256(self.state_tensors())
        return self._sha256


@torch.no_grad()
def nesterov_step_(param: torch.Tensor, momentum_buffer: torch.Tensor, grad: torch.Tensor,
                   lr: float, momentum: float) -> None:
    """One SGD step with Nesterov momentum on fp32 CPU tensors, in place, each operation rounded once:

        b ← b·μ + g,   d ← g + b·μ,   θ ← θ − d·η

    (torch's documented Nesterov SGD without dampening or weight decay; Sutskever et al. 2013). With
    μ = 0 it is plain SGD, θ ← θ − g·η, and b stays zero. No operation takes ``alpha``: ATen fuses
    ``a + alpha·b`` into one FMA on some CPUs and not on others (see the module docstring).
    """
    if momentum == 0:
        param.sub_(torch.mul(grad, lr))
        return
    momentum_buffer.mul_(momentum).add_(grad)
    step = torch.mul(momentum_buffer, momentum).add_(grad)
    param.sub_(step.mul_(lr))
