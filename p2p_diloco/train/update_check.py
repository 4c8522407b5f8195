"""An outer update that cannot be right is not applied: the group's mean checked against the run's history.

Robust aggregation (:mod:`p2p_diloco.sync.robust`) bounds what a minority of senders can do to the
mean; it does not bound a reducer that returns garbage, or a group whose majority is hostile. The last
line of defence is here, before the outer step (DiLoCo, arXiv 2311.08105, Alg. 1 line 12): the norm of
the group's mean g on a fragment is compared with the fragment's outer momentum b, a decaying sum of
every update the run accepted (``b ← μ·b + g``; :mod:`p2p_diloco.train.outer`):

    ‖g‖ ≤ max_update_growth × ‖b‖        (once the fragment has taken an outer step)
    ‖g‖ ≤ ‖θ_global‖ of the fragment     (its first outer step, b = 0)

Honest pseudo-gradients change slowly from one outer step to the next, and ‖b‖ is about the last
accepted ‖g‖ or more when successive updates agree, but less when they partly cancel (b ← μ·b + g
can shrink), and a round's Δ holds more inner steps after a round that failed: a tiny 2-peer test
run had an honest round at 4.2 × ‖b‖. The default growth of 16 leaves honest runs that margin and
more, and still refuses an update a hundred times the run's recent ones (the scaled and garbage
updates that ended the run in issue 19); smaller shifts are the robust aggregation's to bound.
A refused round is not dropped: its Δ stays in θ_local and goes into the next round, which a
bound far above the honest spread lets through. Every peer that
holds θ_global holds the same b (both are the global state, and a joiner downloads both), the group's
mean is the same bytes on every groupmate, and the norms are computed in a fixed order
(:mod:`p2p_diloco.fixed_order`): every peer of the group decides the same, so a refused round is void
on all of them and nobody diverges. A run that trips the check on honest updates (the log says the
norms) can raise ``outer.max_update_growth``; 0 turns the check off.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from p2p_diloco.fixed_order import sum_of_squares

ROUND_REJECTED = "round_rejected"  # the metrics event of a round whose mean failed the check


def tensors_norm(tensors: Sequence[torch.Tensor]) -> float:
    """The Euclidean norm of the tensors taken together, the same bits on every CPU."""
    return math.sqrt(sum(sum_of_squares(t) for t in tensors))  # a chunk at a time: no float64 copy of a tensor


def update_rejection(mean: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor],
                     params: Sequence[torch.Tensor], max_growth: float) -> Optional[str]:
    """Why the group's mean `mean` of a fragment must not be applied, or None if it may; `momentum` and
    `params` are that fragment's outer momentum and θ_global, `max_growth` is ``outer.max_update_growth``."""
    if max_growth == 0:
        return None
    update = tensors_norm(mean)
    history = tensors_norm(momentum)
    if history > 0:
        limit, basis = max_growth * history, f"{max_growth:g} × the outer momentum's norm {history:.4g}"
    else:
        limit, basis = tensors_norm(params), "the norm of θ_global (the fragment's first outer step)"
    if update <= limit:  # False for a NaN too
        return None
    return f"the group's mean has norm {update:.4g}, above {limit:.4g} = {basis}: it cannot be an honest update"
