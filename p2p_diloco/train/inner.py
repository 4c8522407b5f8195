"""The inner loop: local AdamW steps between outer steps (DiLoCo, arXiv 2311.08105, Alg. 1 lines 4-8).

Inner optimizer state never leaves the peer: the paper found that syncing it tripled the traffic for
no gain. The learning rate follows linear warmup then cosine decay to ``min_lr_ratio × lr`` over
``total_steps`` inner steps, counted across outer steps.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Iterator

import torch
from transformers import PreTrainedModel, get_cosine_with_min_lr_schedule_with_warmup

from p2p_diloco.config import InnerConfig


def make_inner_optimizer(params, cfg: InnerConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW, or bitsandbytes' 8-bit AdamW (its optimizer state in 8 bits, for large models on GPU)."""
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


@dataclass
class InnerPhaseResult:
    """What one run of inner steps produced: how much data it used and how well it fit."""

    steps: int
    samples: int
    mean_loss: float


class InnerTrainer:
    """Runs inner steps on one model: gradient accumulation, clipping, bf16 autocast on CUDA."""

    def __init__(self, model: PreTrainedModel, cfg: InnerConfig, batches: Iterator[torch.Tensor]):
        self.model = model
        self.cfg = cfg
        self.batches = batches
        self.device = next(model.parameters()).device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_inner_optimizer(self.params, cfg, self.device)
        self.scheduler = get_cosine_with_min_lr_schedule_with_warmup(
            self.optimizer, cfg.warmup_steps, cfg.total_steps, min_lr_rate=cfg.min_lr_ratio
        )
        self.steps_done = 0

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step(self) -> tuple[float, int]:
        """One optimizer step over `grad_accumulation` micro-batches; returns (loss, samples)."""
        self.model.train()
        total_loss, samples = 0.0, 0
        for _ in range(self.cfg.grad_accumulation):
            batch = next(self.batches).to(self.device, non_blocking=True)
            with self._autocast():
                loss = self.model(input_ids=batch, labels=batch).loss / self.cfg.grad_accumulation
            loss.backward()
            total_loss += loss.item()
            samples += len(batch)
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        return total_loss, samples

    def run(self, num_steps: int) -> InnerPhaseResult:
        losses, samples = [], 0
        for _ in range(num_steps):
            loss, n = self.step()
            losses.append(loss)
            samples += n
        return InnerPhaseResult(num_steps, samples, sum(losses) / max(len(losses), 1))

    def fast_forward_schedule(self, steps: int) -> None:
        """Align the lr schedule with the swarm after loading state (a joiner starts mid-run)."""
        with warnings.catch_warnings():  # stepping a schedule before the first optimizer step is intended here
            warnings.simplefilter("ignore", UserWarning)
            while self.steps_done < steps:
                self.scheduler.step()
                self.steps_done += 1
