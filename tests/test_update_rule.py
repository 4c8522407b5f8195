"""The update check's decision (p2p_diloco/protocol/update_rule.py): applied, clipped to the limit, or void."""

import math

import pytest
import torch

from p2p_diloco.protocol.update_rule import APPLY, CLIP_MARGIN, CLIPPED, VOID, exceeds_limit, judge_update
from p2p_diloco.train.outer import nesterov_step_
from p2p_diloco.train.update_check import checked_mean, tensors_norm

GROWTH, MU = 16.0, 0.9  # outer.max_update_growth and outer.momentum, the shipped defaults


def test_an_update_within_the_limit_is_applied_as_it_is():
    assert judge_update(1.0, momentum_norm=0.1, params_norm=50.0, max_growth=GROWTH).action == APPLY
    assert judge_update(1.6, momentum_norm=0.1, params_norm=50.0, max_growth=GROWTH).action == APPLY  # at the limit


def test_an_update_above_the_limit_is_clipped_to_just_under_it():
    verdict = judge_update(100.0, momentum_norm=0.1, params_norm=50.0, max_growth=GROWTH)
    assert verdict.action == CLIPPED and "clipped" in verdict.reason
    assert 100.0 * verdict.scale == pytest.approx(GROWTH * 0.1 * CLIP_MARGIN)
    first = judge_update(100.0, momentum_norm=0.0, params_norm=50.0, max_growth=GROWTH)  # b = 0: ‖θ‖ bounds it
    assert first.action == CLIPPED and "first outer step" in first.reason and 100.0 * first.scale < 50.0


@pytest.mark.parametrize("norm", [math.nan, math.inf])
def test_a_mean_that_is_not_finite_is_void(norm):
    assert judge_update(norm, 0.1, 50.0, GROWTH).action == VOID
    assert exceeds_limit(norm, 0.1, 50.0, GROWTH)


def test_the_check_off_applies_anything():
    assert judge_update(1e9, 0.1, 50.0, max_growth=0.0).action == APPLY
    assert not exceeds_limit(1e9, 0.1, 50.0, 0.0)


def test_the_clipped_mean_is_the_same_bytes_every_time_and_under_the_limit():
    torch.manual_seed(0)
    mean, momentum, params = [torch.randn(1000) * 10], [torch.randn(1000) * 0.01], [torch.randn(1000)]
    verdict, clipped = checked_mean(mean, momentum, params, GROWTH)
    again = checked_mean([m.clone() for m in mean], momentum, params, GROWTH)[1]
    assert verdict.action == CLIPPED and torch.equal(clipped[0], again[0])
    assert tensors_norm(clipped) <= GROWTH * tensors_norm(momentum)
    assert not exceeds_limit(tensors_norm(clipped), tensors_norm(momentum), tensors_norm(params), GROWTH)


def _rounds_until_applied(momentum_norm: float, first_mean_norm: float, clip: bool, max_rounds: int = 100) -> int:
    """Outer steps of a fragment whose outer momentum was made small by one lopsided round: each round's honest
    mean holds every inner step since the last applied round, so its norm grows with each void round. The
    number of rounds until one is applied as it is (max_rounds if none is)."""
    params = [torch.ones(64) * 5]
    momentum = [torch.full((64,), momentum_norm / 8)]  # ‖b‖ = momentum_norm
    held = 1
    for rounds in range(1, max_rounds + 1):
        mean = [torch.full((64,), first_mean_norm * held / 8)]
        verdict, applied = checked_mean(mean, momentum, params, GROWTH)
        if verdict.action == APPLY:
            return rounds
        if verdict.action == CLIPPED and clip:
            nesterov_step_(params[0], momentum[0], applied[0], lr=0.7, momentum=MU)
            held = 1  # applied: the next Δ starts from the merged θ_local
        else:
            held += 1  # void: the Δ stays in θ_local and the next one is larger
    return max_rounds


def test_a_lopsided_first_round_never_traps_the_run():
    """The stall at outer step 2 (issue 42): ‖b‖ = 0.073 after a round with a 2-step newcomer, then honest means
    of norm 6.2 and growing. Voiding them (the old rule, `clip=False`) never ends; clipping converges in a few."""
    assert _rounds_until_applied(0.073, 6.2, clip=False) == 100
    assert _rounds_until_applied(0.073, 6.2, clip=True) <= 3
    assert _rounds_until_applied(1e-6, 6.2, clip=True) <= 6  # even 10⁷ times too small a history
