"""The update check on tensors: a round's mean measured against the run's history, and clipped or void.

The decision is :mod:`p2p_diloco.protocol.update_rule`'s (the limit, and why a mean above it is clipped, not
void); this module measures the norms, the same bits on every CPU (:mod:`p2p_diloco.fixed_order`), and scales
the mean. Robust aggregation (:mod:`p2p_diloco.sync.robust`) bounds what a minority of senders can do to the
mean, and the audits (:mod:`p2p_diloco.sync.audit`) what a reducer can; this bounds the rest (a reducer audited
by an accomplice, a group whose majority is hostile), before the outer step (DiLoCo, arXiv 2311.08105, Alg. 1
line 12). A run whose honest updates are clipped often (the log says the norms) can raise
``outer.max_update_growth``; 0 turns the check off.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from p2p_diloco.fixed_order import as_float32, sum_of_squares
from p2p_diloco.protocol.update_rule import VOID, UpdateVerdict, exceeds_limit, judge_update, update_limit

ROUND_REJECTED = "round_rejected"  # the metrics event of a round whose mean was void (not finite)
ROUND_CLIPPED = "round_clipped"  # the metrics event of a round whose mean was clipped to the limit


def tensors_norm(tensors: Sequence[torch.Tensor]) -> float:
    """The Euclidean norm of the tensors taken together, the same bits on every CPU."""
    return math.sqrt(sum(sum_of_squares(t) for t in tensors))  # a chunk at a time: no float64 copy of a tensor


def _norms(update: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor],
           params: Sequence[torch.Tensor]) -> tuple[float, float, float]:
    """‖update‖, ‖momentum‖ and ‖params‖ as the limit needs them: θ_global's norm bounds only a fragment's first
    outer step (‖b‖ not > 0: update_limit's test), so it is not computed otherwise (0.0 in its place)."""
    history = tensors_norm(momentum)
    return tensors_norm(update), history, 0.0 if history > 0 else tensors_norm(params)


def checked_mean(mean: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                 max_growth: float) -> tuple[UpdateVerdict, list[torch.Tensor]]:
    """The verdict on the group's mean `mean` of a fragment (:func:`~p2p_diloco.protocol.update_rule.judge_update`),
    and the mean to apply: as it is, or scaled by the verdict's factor (rounded to float32: the same bytes on
    every peer). `momentum` and `params` are that fragment's outer momentum and θ_global."""
    if max_growth == 0:
        return judge_update(0.0, 0.0, 0.0, 0.0), list(mean)
    verdict = judge_update(*_norms(mean, momentum, params), max_growth)
    if verdict.action == VOID or verdict.scale == 1.0:
        return verdict, list(mean)
    scale = as_float32(verdict.scale)
    return verdict, [m * scale for m in mean]


def update_rejection(update: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor],
                     params: Sequence[torch.Tensor], max_growth: float) -> Optional[str]:
    """Why `update` of a fragment cannot be one a round applied (its norm is above the limit, or not finite), or
    None if it can; `momentum` and `params` are that fragment's outer momentum and θ_global before it, and
    `max_growth` is ``outer.max_update_growth``. For the state check of a downloaded step
    (:mod:`p2p_diloco.train.state_check`)."""
    if max_growth == 0:
        return None
    norm, history, params_norm = _norms(update, momentum, params)
    if not exceeds_limit(norm, history, params_norm, max_growth):
        return None
    limit, basis = update_limit(history, params_norm, max_growth)
    return f"the update has norm {norm:.4g}, above {limit:.4g} = {basis}: no round applies that"
