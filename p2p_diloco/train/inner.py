"""The inner loop: local AdamW steps between outer steps (DiLoCo, arXiv 2311.08105, Alg. 1 lines 4-8).

Inner optimizer state never leaves the peer: the paper found that syncing it tripled the traffic for
no gain. The learning rate follows linear warmup then cosine decay to ``min_lr_ratio × lr`` over
``total_steps`` inner steps, counted across outer steps, and stays there (:func:`inner_lr_factor`).

How a peer computes its steps is its own choice (``[compute]``, :class:`~p2p_diloco.config.ComputeConfig`):
bf16 autocast (:func:`autocast_dtype`), fused AdamW on CUDA (:func:`make_inner_optimizer`), gradient
checkpointing and ``torch.compile`` (:func:`prepare_for_compute`), and micro-batches that fit its
memory (:mod:`p2p_diloco.train.memory`).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
import warnings
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import PreTrainedModel

from p2p_diloco.config import ComputeConfig, ConfigError, InnerConfig
from p2p_diloco.train.memory import MemoryFitError, largest_divisor, memory_remedies

logger = logging.getLogger(__name__)


def autocast_dtype(precision: str, device: torch.device) -> Optional[torch.dtype]:
    """The dtype the forward pass autocasts to, None for plain fp32.

    ``auto``: bf16 on a CUDA device that supports it natively (Ampere and later), fp32 elsewhere: on a
    CPU, bf16 autocast is often slower than fp32. ``bf16``: bf16 autocast on any device, CPU included
    (asked for explicitly, e.g. to save memory). ``fp32``: none. The weights, their gradients and the
    optimizer state stay fp32 in every case.
    """
    if precision == "bf16":
        return torch.bfloat16
    if precision == "auto" and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8:
        return torch.bfloat16
    return None


def uses_fused_adamw(cfg: InnerConfig, device: torch.device) -> bool:
    """torch's fused AdamW (one kernel for every parameter) for ``adamw`` on CUDA: the same update, faster."""
    return cfg.optimizer == "adamw" and device.type == "cuda"


def make_inner_optimizer(params, cfg: InnerConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW (fused on CUDA), or bitsandbytes' 8-bit AdamW (its optimizer state in 8 bits, for large models on GPU)."""
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs, fused=True if uses_fused_adamw(cfg, device) else None)


def describe_compute(cfg: InnerConfig, compute: ComputeConfig, device: torch.device) -> str:
    """``"bf16 autocast, fused AdamW, gradient checkpointing, compiled"``: how the inner steps compute."""
    parts = ["bf16 autocast" if autocast_dtype(compute.precision, device) else "fp32",
             "fused AdamW" if uses_fused_adamw(cfg, device) else
             "8-bit AdamW" if cfg.optimizer == "adamw8bit" else "AdamW"]
    if compute.gradient_checkpointing:
        parts.append("gradient checkpointing")
    if compute.compile:
        parts.append("compiled")
    return ", ".join(parts)


def prepare_for_compute(model: PreTrainedModel, compute: ComputeConfig) -> None:
    """Gradient checkpointing (transformers', non-reentrant) and ``torch.compile`` as `compute` asks, in
    place: the model keeps its parameter objects, which the optimizer and the outer step hold."""
    if compute.gradient_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ConfigError(f"config: compute.gradient_checkpointing = true, but {type(model).__name__} does not "
                              "support gradient checkpointing; turn it off")
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})  # transformers 5 renamed gradient_checkpointing_enable
    if compute.compile:
        model.compile()


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
    """Runs inner steps on one model: micro-batches with gradient accumulation, clipping, bf16 autocast.

    A data-stream batch holds ``cfg.batch_size`` sequences and a step takes ``cfg.grad_accumulation``
    batches. Each batch is split into micro-batches of `micro_batch_size` sequences (it must divide the
    batch size; default: ``compute.micro_batch_size``, else the whole batch), whose gradients add up to
    the gradient of the mean loss over every sequence of the step. A micro-batch that runs out of CUDA
    memory halves the micro-batch and redoes the step on the same batches (:meth:`step`).

    In an island (`island`, :class:`~p2p_diloco.train.island.Island`) the forward passes go through
    `forward_model`, the model as DDP wraps it or FSDP2 shards it.
    """

    def __init__(self, model: PreTrainedModel, cfg: InnerConfig, batches: Iterator[torch.Tensor],
                 compute: ComputeConfig | None = None, micro_batch_size: int | None = None,
                 island=None, forward_model: Optional[torch.nn.Module] = None):
        self.model = model
        self.island = island
        self.forward_model = forward_model or model
        self.cfg = cfg
        self.compute = compute or ComputeConfig()
        self.micro_batch_size = micro_batch_size or self.compute.micro_batch_size or cfg.batch_size
        if cfg.batch_size % self.micro_batch_size != 0:
            raise ConfigError(f"config: inner.batch_size = {cfg.batch_size} must be a multiple of the micro-batch "
                              f"size {self.micro_batch_size} (each batch is split into micro-batches)")
        self.batches = batches
        self.device = next(model.parameters()).device
        self.autocast_dtype = autocast_dtype(self.compute.precision, self.device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_inner_optimizer(self.params, cfg, self.device)
        self.scheduler = make_inner_scheduler(self.optimizer, cfg)
        self.steps_done = 0

    @property
    def lr(self) -> float:
        """The inner learning rate of the last step (of the first parameter group)."""
        return self.scheduler.get_last_lr()[0]

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def forward_backward(self, micro_batch: torch.Tensor, weight: float) -> torch.Tensor:
        """The loss of one micro-batch times `weight`, its gradient added to the parameters' (this is where
        CUDA runs out of memory). Returns the weighted loss, detached: no sync with the device."""
        with self._autocast():
            loss = self.forward_model(input_ids=micro_batch, labels=micro_batch).loss * weight
        loss.backward()
        return loss.detach()

    def _accumulate(self, batches: list[torch.Tensor]) -> torch.Tensor:
        """Gradients of the step's mean loss, micro-batch by micro-batch; returns that mean loss.

        A micro-batch's loss is the mean over its sequences (all of one length), so weighting it by its
        share of the step's sequences makes the sum the mean over every sequence of the step.
        """
        samples = sum(len(batch) for batch in batches)
        total = torch.zeros((), device=self.device)
        micro_batches = [micro_batch for batch in batches for micro_batch in batch.split(self.micro_batch_size)]
        for i, micro_batch in enumerate(micro_batches):
            with self._accumulating(last=i == len(micro_batches) - 1):
                total += self.forward_backward(micro_batch, len(micro_batch) / samples)
        return total

    def _accumulating(self, last: bool):
        """In an island, the ranks average their gradients in the step's last backward pass only."""
        if self.island is None:
            return contextlib.nullcontext()
        return self.island.accumulating(self.forward_model, last)

    def _halve_micro_batch(self) -> None:
        """After an out-of-memory error in a forward/backward pass: the next divisor of the batch size <= half
        the micro-batch, or at 1 a one-line MemoryFitError. The gradients of the failed attempt are dropped
        and the cache freed."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            gc.collect()  # what the failed attempt's graph still holds through reference cycles
            torch.cuda.empty_cache()
        failed = self.micro_batch_size
        if failed == 1:
            raise MemoryFitError(
                f"out of memory on {self.device} with one sequence per forward/backward pass: "
                + memory_remedies(self.cfg.optimizer, self.compute.gradient_checkpointing))
        self.micro_batch_size = largest_divisor(self.cfg.batch_size, failed // 2)
        logger.warning("out of memory on %s at micro-batch %d: redoing the step at micro-batch %d x %d per batch "
                       "of %d", self.device, failed, self.micro_batch_size,
                       self.cfg.batch_size // self.micro_batch_size, self.cfg.batch_size)

    def step(self) -> tuple[float, int]:
        """One optimizer step over `grad_accumulation` batches; returns (mean loss, samples), over every
        rank in an island.

        The batches are taken from the stream first, so a step redone after running out of memory
        uses the same ones and the stream advances once.
        """
        self.model.train()
        batches = [next(self.batches).to(self.device, non_blocking=True) for _ in range(self.cfg.grad_accumulation)]
        while True:
            try:
                loss = self._accumulate(batches)
                break
            except torch.cuda.OutOfMemoryError:  # torch.OutOfMemoryError since torch 2.5
                pass  # handled outside the except clause, so that its traceback (and the tensors it holds) is freed
            self._halve_micro_batch()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        samples = sum(len(batch) for batch in batches)
        if self.island is not None:
            self.island.check_replicas(self.params, self.steps_done)
            return self.island.sum_over_ranks(loss, samples)
        return loss.item(), samples

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
