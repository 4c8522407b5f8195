"""The global model θ_global and the outer optimizer that moves it (DiLoCo, arXiv 2311.08105, Alg. 1).

θ_global is kept in fp32 on the CPU, whatever device and precision the inner loop uses, so that the
outer step and its hash are the same on every peer. One outer step t does

    Δ_t      = θ_global − θ_local                       (pseudo-gradient, Alg. 1 line 10)
    Δ̄_t      = the group's sample-weighted mean of Δ_t   (line 11; done by p2p_diloco.sync)
    θ_global ← NesterovSGD(θ_global, Δ̄_t; outer lr, μ)    (line 12)
    θ_local  ← θ_global                                  (line 3 of the next round)

The outer optimizer is torch's SGD with Nesterov momentum, exactly the update the paper uses. The
global state is θ_global and that momentum: peers that hold the same θ_global but another momentum
would part ways at the next step, so the state's sha256 covers both.
"""

from __future__ import annotations

from typing import Sequence

import torch

from p2p_diloco.config import OuterConfig
from p2p_diloco.hashing import tensors_sha256


class GlobalModel:
    """θ_global, its outer optimizer state and the outer step counter, in one place."""

    def __init__(self, local_params: Sequence[torch.Tensor], cfg: OuterConfig):
        self.params = [p.detach().to("cpu", torch.float32, copy=True) for p in local_params]
        self.outer_step = 0
        # torch's SGD refuses nesterov=True without momentum; with momentum 0 both updates coincide
        self.optimizer = torch.optim.SGD(
            self.params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0
        )

    @torch.no_grad()
    def pseudo_gradient(self, local_params: Sequence[torch.Tensor], indices: Sequence[int]) -> list[torch.Tensor]:
        """Δ = θ_global − θ_local of the parameters at `indices` (a fragment), in fp32 on the CPU (Alg. 1 line 10)."""
        return [self.params[i] - local_params[i].detach().to("cpu", torch.float32) for i in indices]

    @torch.no_grad()
    def apply(self, mean_pseudo_gradient: Sequence[torch.Tensor], indices: Sequence[int]) -> None:
        """One outer Nesterov step with the group's mean pseudo-gradient of the parameters at `indices`
        (Alg. 1 line 12). The others keep their values and their momentum: torch's SGD skips a
        parameter without a gradient, so each Streaming DiLoCo fragment has its own outer state."""
        for i, delta in zip(indices, mean_pseudo_gradient):
            self.params[i].grad = delta.to(torch.float32).clone()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.outer_step += 1

    @torch.no_grad()
    def copy_to(self, local_params: Sequence[torch.Tensor]) -> None:
        """θ_local ← θ_global (cast to the local parameters' device and dtype)."""
        for p, g in zip(local_params, self.params):
            p.copy_(g)

    @torch.no_grad()
    def merge_into(self, local_params: Sequence[torch.Tensor], indices: Sequence[int], alpha: float) -> None:
        """θ_local ← α·θ_local + (1 − α)·θ_global at `indices` (the overlap merge of Streaming DiLoCo, arXiv 2501.18512);
        α = 0 copies θ_global, as DiLoCo does."""
        for i in indices:
            g = self.params[i].to(local_params[i].device, local_params[i].dtype)
            if alpha == 0:
                local_params[i].copy_(g)
            else:
                local_params[i].mul_(alpha).add_(g, alpha=1 - alpha)

    def momentum_buffers(self) -> list[torch.Tensor]:
        """The outer momentum, zeros before the first step, in parameter order."""
        buffers = []
        for p in self.params:
            buf = self.optimizer.state.get(p, {}).get("momentum_buffer")
            buffers.append(torch.zeros_like(p) if buf is None else buf)
        return buffers

    def state_tensors(self) -> list[torch.Tensor]:
        """Everything a joining peer needs: θ_global then the outer momentum."""
        return [*self.params, *self.momentum_buffers()]

    @torch.no_grad()
    def load_state_tensors(self, tensors: Sequence[torch.Tensor], outer_step: int) -> None:
        n = len(self.params)
        if len(tensors) != 2 * n:
            raise ValueError(f"global state has {len(tensors)} tensors, expected {2 * n}")
        for p, t in zip(self.params, tensors[:n]):
            if p.shape != t.shape:
                raise ValueError(f"global state tensor of shape {tuple(t.shape)} where {tuple(p.shape)} was expected")
            p.copy_(t)
        for p, t in zip(self.params, tensors[n:]):
            self.optimizer.state[p]["momentum_buffer"] = t.to(torch.float32).clone()
        self.outer_step = outer_step

    def sha256(self) -> str:
        """sha256 of the global state's fp32 bytes: θ_global then the outer momentum, in parameter order."""
        return tensors_sha256(self.state_tensors())
