"""The held-out loss of θ_global while a run trains: when to measure it, and how.

A training peer's model holds θ_local; θ_global, what the run agrees on, is kept apart, in fp32 on the
CPU (:class:`~p2p_diloco.train.outer.GlobalModel`). To measure θ_global on the device the model trains
on, without a second copy of the model there, :func:`evaluate_global` copies θ_global into the model's
parameters, evaluates (:func:`~p2p_diloco.train.model.evaluate_loss`) and puts θ_local back, bit for
bit. The run's keeper (``bootstrap --keep``) goes the same way: its model holds θ_global already, so
the copies change nothing there.

:class:`HeldoutEval` says when (``[eval] every`` outer steps; :class:`EvalSchedule`) and on what (the
first ``[eval] sequences`` of the run's held-out split, the same sequences on every peer, so that the
losses peers publish for one θ_global agree up to their device's rounding).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from p2p_diloco.train.model import evaluate_loss


class EvalSchedule:
    """Evaluate the first θ_global a peer holds in each span of `every` outer steps, [every·k, every·(k+1))
    for k >= 1.

    A peer that applies its outer steps one by one evaluates at every multiple of `every`; one that jumps
    (it loaded the run's state, or a keeper that reads the run every few seconds) evaluates the state it
    lands on, once per span. Nothing before outer step `every` is due (the initial model is the demo's
    to measure). `every` = 0: never due."""

    def __init__(self, every: int):
        self.every = every
        self._last_span: Optional[int] = None  # the span of the last evaluated outer step

    def due(self, outer_step: int) -> bool:
        """Whether θ_global at `outer_step` is to be evaluated (:meth:`done` records that it was)."""
        return 0 < self.every <= outer_step and outer_step // self.every != self._last_span

    def done(self, outer_step: int) -> None:
        self._last_span = outer_step // self.every


@torch.no_grad()
def evaluate_global(model: torch.nn.Module, model_params: Sequence[torch.Tensor],
                    global_params: Sequence[torch.Tensor], sequences: torch.Tensor, batch_size: int) -> Optional[float]:
    """The mean next-token loss of `model` with `global_params` (θ_global, any device and dtype) in place of
    its trainable parameters `model_params` (θ_local), over held-out `sequences`; θ_local is back in the
    model when it returns, whatever happened. None when there are no sequences."""
    if len(sequences) == 0:
        return None
    local = [p.detach().to("cpu", copy=True) for p in model_params]
    try:
        for param, value in zip(model_params, global_params):
            param.copy_(value)
        return evaluate_loss(model, sequences, batch_size)
    finally:
        for param, value in zip(model_params, local):
            param.copy_(value)


@dataclass(frozen=True)
class Evaluation:
    """One held-out loss of θ_global: at which outer step, over how many sequences, in how many seconds."""

    outer_step: int
    loss: float
    sequences: int
    seconds: float


class HeldoutEval:
    """A peer's (or keeper's) held-out evaluation of θ_global: `sequences` [n, seq_len], n > 0 (the first n
    of the run's held-out split; a peer without them has no HeldoutEval), every `every` outer steps
    (:class:`EvalSchedule`), in batches of `batch_size` (the peer's micro-batch: what fits its device)."""

    def __init__(self, sequences: torch.Tensor, every: int, batch_size: int):
        self.sequences = sequences
        self.schedule = EvalSchedule(every)
        self.batch_size = batch_size

    def maybe(self, outer_step: int, model: torch.nn.Module, model_params: Sequence[torch.Tensor],
              global_params: Sequence[torch.Tensor]) -> Optional[Evaluation]:
        """The evaluation of θ_global at `outer_step` if it is due, else None."""
        if not self.schedule.due(outer_step):
            return None
        started = time.monotonic()
        loss = evaluate_global(model, model_params, global_params, self.sequences, self.batch_size)
        self.schedule.done(outer_step)
        return Evaluation(outer_step, loss, len(self.sequences), time.monotonic() - started)
