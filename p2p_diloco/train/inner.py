"""The inner loop: local AdamW steps between outer steps (DiLoCo, arXiv 2311.08105, Alg. 1 lines 4-8).

Inner optimizer state never leaves the peer: the paper found that syncing it tripled the traffic for
no gain. The learning rate follows linear warmup then cosine decay to ``min_lr_ratio × lr`` over
``total_steps`` inner steps, counted across outer steps, and stays there (:func:`inner_lr_factor`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import PreTrainedModel

from p2p_diloco.config import InnerConfig


def make_inner_optimizer(params, cfg: InnerConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW, or bitsandbytes' 8-bit AdamW (its optimizer state in 8 bits, for large models on GPU)."""
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def inner_lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The inner lr after `step` scheduler steps, as a fraction of ``inner.lr``.

    Linear warmup from 0 over `warmup_steps`, then cosine decay to `min_lr_ratio` at `total_steps`
    (warmup then cosine decay, as for DiLoCo's inner AdamW, arXiv 2311.08105), then `min_lr_ratio` for
    ever: a swarm may train past `total_steps`. Up to `total_steps` this is exactly transformers'
    ``get_cosine_with_min_lr_schedule_with_warmup``, whose cosine climbs back to 1 after it.
    """
    if step < warmup_steps:
        return float(step) / float(max(1, warmup_steps))
    progress = min(1.0, float(step - warmup_steps) / float(max(1, total_steps - warmup_steps)))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cosine * (1 - min_lr_ratio) + min_lr_ratio


def make_inner_scheduler(optimizer: torch.optim.Optimizer, cfg: InnerConfig) -> LambdaLR:
    """:func:`inner_lr_factor` times each parameter group's initial lr, one step per inner step."""
    factor = functools.partial(
        inner_lr_factor, warmup_steps=cfg.warmup_steps, total_steps=cfg.total_steps, min_lr_ratio=cfg.min_lr_ratio
    )
    return LambdaLR(optimizer, factor)


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
        self.scheduler = make_inner_scheduler(self.optimizer, cfg)
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
        """Align the lr schedule with the swarm after loading state (a joiner starts mid-run).

        Jumps straight to step `steps` (never back), in O(1): a downloaded state is not trusted and
        may claim any number of inner steps.
        """
        steps = int(steps)
        if steps <= self.steps_done:
            return
        self.scheduler.last_epoch = steps - 1  # the scheduler's next step() computes the lr at `steps`
        with warnings.catch_warnings():  # stepping a schedule before the first optimizer step is intended here
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()
        self.steps_done = steps
