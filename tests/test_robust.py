"""The reducers' aggregation rules (p2p_diloco.sync.robust) and the update check (p2p_diloco.train.update_check),
on parts like a run's: honest pseudo-gradients that share a direction, plus what a hostile sender sends."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from p2p_diloco.fixed_order import lower_median, norm, pairwise_sum
from p2p_diloco.sync.robust import (
    EXACT_MEAN, AggregationRule, aggregate, capped_claims, clip_to_median_norm, coordinate_median, counted_claims,
    trim_count, weighted_mean,
)
from p2p_diloco.train.update_check import tensors_norm, update_rejection

ROBUST = [AggregationRule("centered-clip"), AggregationRule("trimmed-mean")]
NUMEL = 4096


def honest_parts(count: int, seed: int = 0) -> list[torch.Tensor]:
    """`count` pseudo-gradients: a shared direction plus each peer's own noise of about the same size."""
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randn(NUMEL, generator=generator)
    return [shared + torch.randn(NUMEL, generator=generator) for _ in range(count)]


def relative_error(result: torch.Tensor, target: torch.Tensor) -> float:
    return float((result - target).norm() / target.norm())


def test_fixed_order_reductions_are_exact_enough():
    values = torch.randn(10_001, dtype=torch.float64)
    assert pairwise_sum(values) == pytest.approx(math.fsum(values.tolist()), rel=1e-12, abs=1e-9)
    assert norm(values.to(torch.float32)) == pytest.approx(float(values.to(torch.float32).double().norm()), rel=1e-12)
    assert pairwise_sum(torch.zeros(0)) == 0.0
    assert lower_median([3.0, 1.0, 2.0, 10.0]) == 2.0


def test_the_exact_mean_is_diloco_weighted_mean():
    parts, claims = honest_parts(3), [10.0, 20.0, 1e6]
    assert torch.equal(aggregate(parts, claims, EXACT_MEAN), weighted_mean(parts, claims))


@pytest.mark.parametrize("rule", ROBUST, ids=lambda r: r.name)
def test_honest_parts_give_about_their_mean(rule):
    """No attacker: the robust rules stay near DiLoCo's mean (the honest run's cost; measured in benchmarks)."""
    parts = honest_parts(5)
    claims = [128.0] * 5
    exact = weighted_mean(parts, claims)
    tolerance = 1e-6 if rule.name == "centered-clip" else 0.4  # CenteredClip converges to it; a trim drops values
    assert relative_error(aggregate(parts, claims, rule), exact) < tolerance


@pytest.mark.parametrize("rule", ROBUST, ids=lambda r: r.name)
@pytest.mark.parametrize("attack", ["scale100", "flip100", "noise100", "scale3", "claim"])
def test_one_hostile_sender_of_five_moves_the_result_little(rule, attack):
    """What the plain mean suffers from one hostile sender, and how far the robust rule lets it go."""
    parts = honest_parts(5)
    claims = [128.0] * 5
    honest = weighted_mean(parts[:4], claims[:4])
    hostile = {
        "scale100": parts[4] * 100, "flip100": parts[4] * -100, "scale3": parts[4] * 3,
        "noise100": torch.randn(NUMEL, generator=torch.Generator().manual_seed(7)) * 100 * parts[4].norm() / 64,
        "claim": parts[4],
    }[attack]
    parts[4] = hostile
    if attack == "claim":
        claims[4] = 2.0**47
    plain = relative_error(weighted_mean(parts, claims), honest)
    robust = relative_error(aggregate(parts, claims, rule), honest)
    assert robust < 0.6, (plain, robust)  # within the honest peers' own spread (their noise equals the signal)
    if attack != "scale3":
        assert plain > 2 * robust, (plain, robust)  # the attack hurts the plain mean far more


def test_claims_are_capped_at_the_median_and_norms_at_a_multiple_of_the_median():
    assert capped_claims([100.0, 120.0, 1e12]) == [100.0, 120.0, 120.0]
    assert capped_claims([100.0, 1e12]) == [100.0, 100.0]  # two senders: the smaller claim
    parts = [torch.full((4,), 1.0), torch.full((4,), 2.0), torch.full((4,), 400.0)]
    clipped = clip_to_median_norm(parts, clip_factor=2.0)
    assert clipped[0] is parts[0] and clipped[1] is parts[1]
    assert norm(clipped[2]) == pytest.approx(2.0 * norm(parts[1]), rel=1e-6)


def test_trim_counts_and_medians_are_members_and_signed_zeros_are_one_value():
    assert [trim_count(n, 0.25) for n in (1, 2, 3, 4, 5, 8, 16)] == [0, 0, 1, 1, 2, 2, 4]
    parts = [torch.tensor([-0.0, 1.0]), torch.tensor([0.0, 3.0]), torch.tensor([-0.0, 2.0])]
    median = coordinate_median(parts)
    assert median.tolist() == [0.0, 2.0] and math.copysign(1.0, median[0].item()) == 1.0


@pytest.mark.parametrize("rule", [*ROBUST, EXACT_MEAN], ids=lambda r: r.name)
def test_the_result_does_not_depend_on_anything_but_the_parts(rule):
    """Bit-equal on a second computation, and the parts untouched: an auditor can recompute it (the
    kernels' part of this is tests/test_determinism.py)."""
    parts = honest_parts(4)
    parts[3] = parts[3] * 50
    copies = [p.clone() for p in parts]
    first = aggregate(parts, [100.0, 90.0, 110.0, 1e9], rule)
    assert torch.equal(first, aggregate(copies, [100.0, 90.0, 110.0, 1e9], rule))
    assert all(torch.equal(p, c) for p, c in zip(parts, copies))


def test_invalid_rules_are_refused_with_the_reason():
    for kwargs, message in [(dict(name="median"), "aggregation 'median'"), (dict(clip_factor=0.5), "clip_factor"),
                            (dict(clip_iterations=0), "clip_iterations"), (dict(trim_fraction=0.7), "trim_fraction")]:
        with pytest.raises(ValueError, match=message):
            AggregationRule(**kwargs)


def test_an_update_far_above_the_run_history_is_rejected():
    params = [torch.ones(100), torch.ones(10)]
    momentum = [torch.full((100,), 0.01), torch.zeros(10)]
    honest = [torch.full((100,), 0.01), torch.full((10,), 0.01)]
    assert update_rejection(honest, momentum, params, max_growth=16.0) is None
    reason = update_rejection([m * 100 for m in honest], momentum, params, max_growth=16.0)
    assert reason is not None and "outer momentum" in reason
    assert update_rejection([m * 100 for m in honest], momentum, params, max_growth=0.0) is None  # off
    nan = [torch.full((100,), float("nan")), torch.zeros(10)]
    assert update_rejection(nan, momentum, params, max_growth=16.0) is not None


def test_the_first_update_of_a_fragment_is_bounded_by_its_parameters():
    params, zeros = [torch.ones(100)], [torch.zeros(100)]
    assert update_rejection([torch.full((100,), 0.5)], zeros, params, max_growth=16.0) is None
    reason = update_rejection([torch.full((100,), 2.0)], zeros, params, max_growth=16.0)
    assert reason is not None and "first outer step" in reason
    assert tensors_norm(params) == 10.0


def test_the_reducer_returns_the_rule_result_whatever_order_the_senders_arrive_in():
    """hivemind's reducer protocol, as the all-reduce drives it (tests/test_exact_allreduce.py's
    reduce_parts): the aggregate, computed in a worker thread, is the rule's, in sender order."""
    from p2p_diloco.sync.exact_allreduce import SenderOrderReducer
    from tests.test_exact_allreduce import reduce_parts, reducer_inputs

    parts, claims = reducer_inputs()
    parts[2] = [p * 100 for p in parts[2]]
    rule = AggregationRule("centered-clip")
    reducer = functools.partial(SenderOrderReducer, rule=rule)
    results = [reduce_parts(reducer, parts, claims, order) for order in ([0, 1, 2, 3], [3, 1, 0, 2])]
    for k, (first, second) in enumerate(zip(*results)):
        assert torch.equal(first, second)
        assert torch.equal(first, aggregate([p[k] for p in parts], claims, rule))


def test_a_run_reports_the_samples_its_rule_counted():
    claims = [100.0, 120.0, 2.0**47]
    assert counted_claims(claims, AggregationRule("centered-clip")) == [100.0, 120.0, 120.0]
    assert counted_claims(claims, EXACT_MEAN) == claims
