"""Whether a round's mean is applied as it is, clipped, or void: the update check's decision, on norms.

The group's mean g of a fragment is compared with the fragment's outer momentum b, a decaying sum of every
update the run applied (``b ← μ·b + g``; DiLoCo, arXiv 2311.08105, Alg. 1 line 12, with Nesterov momentum):

    limit = max_update_growth × ‖b‖        (once the fragment has taken an outer step)
    limit = ‖θ_global‖ of the fragment     (its first outer step, b = 0)

* ‖g‖ ≤ limit: applied as it is;
* ‖g‖ > limit: **clipped**, g scaled to just under the limit (``CLIP_MARGIN``), and applied: an outer-gradient
  clip, as gradient clipping bounds a step by a norm;
* ‖g‖ not finite: void (a NaN or an infinity is never a step).

No applied update is ever above the limit, which is what the check is for: a garbage reducer that an
accomplice audited, or a hostile majority of a group, moves θ_global by at most max_update_growth × the
run's recent updates per round, as before. What changed (issue 42) is what happens above the limit. A void
round applies nothing, so the next round's Δ holds more inner steps and is larger: when ‖b‖ was made small
by one honest but lopsided round (a newcomer's 2 inner steps beside a peer's 10, whose median claim and
median norm shrank the mean to almost nothing: ‖b‖ = 0.073), the next honest mean (6.2) was above
16 × ‖b‖, every round after it larger still, and the run voided 63 rounds in a row without end. A clipped
round cannot start such a trap: it grows ‖b‖ to at least (max_update_growth − μ) × ‖b‖, so within
log_(growth − μ)(‖g‖ / ‖b‖) rounds the limit is above the honest updates again (two rounds for the 85× of
that run), and every round applies the group's direction meanwhile.

Every groupmate holds the same b and θ_global (the global state) and the same mean (its bytes agree), and
the norms come in a fixed order (:mod:`p2p_diloco.fixed_order`): every peer of the group decides the same,
and a clipped mean is the same bytes on each. A joiner that verifies the step (its state check,
:mod:`p2p_diloco.train.state_check`) finds the implied update under the same limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

APPLY, CLIPPED, VOID = "apply", "clipped", "void"
CLIP_MARGIN = 1.0 - 2.0 ** -10  # a clipped mean's norm is this × the limit: float32 rounding keeps it under


@dataclass(frozen=True)
class UpdateVerdict:
    """What becomes of a round's mean: APPLY it, apply it CLIPPED (multiplied by `scale`), or VOID the round."""

    action: str
    scale: float = 1.0  # the factor the mean is multiplied by before it is applied
    reason: str = ""


def update_limit(momentum_norm: float, params_norm: float, max_growth: float) -> tuple[float, str]:
    """The largest norm an update of a fragment may have, and what it is (for the log)."""
    if momentum_norm > 0:
        return max_growth * momentum_norm, f"{max_growth:g} × the outer momentum's norm {momentum_norm:.4g}"
    return params_norm, "the norm of θ_global (the fragment's first outer step)"


def judge_update(update_norm: float, momentum_norm: float, params_norm: float, max_growth: float) -> UpdateVerdict:
    """The verdict on a round's mean of norm `update_norm`, for a fragment whose outer momentum and θ_global
    have the norms `momentum_norm` and `params_norm`; `max_growth` is ``outer.max_update_growth`` (0: off)."""
    if max_growth == 0:
        return UpdateVerdict(APPLY)
    if not math.isfinite(update_norm):
        return UpdateVerdict(VOID, 0.0, f"the group's mean has norm {update_norm}: it cannot be an update")
    limit, basis = update_limit(momentum_norm, params_norm, max_growth)
    if update_norm <= limit:
        return UpdateVerdict(APPLY)
    return UpdateVerdict(CLIPPED, limit * CLIP_MARGIN / update_norm,
                         f"the group's mean has norm {update_norm:.4g}, above {limit:.4g} = {basis}: clipped to it")


def exceeds_limit(update_norm: float, momentum_norm: float, params_norm: float, max_growth: float) -> bool:
    """Whether an update of norm `update_norm` is one no round applies (above the limit, or not finite)."""
    if max_growth == 0:
        return False
    return not update_norm <= update_limit(momentum_norm, params_norm, max_growth)[0]
