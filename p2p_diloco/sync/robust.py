"""What a reducer makes of the senders' parts of its shard: DiLoCo's weighted mean, or a robust mean.

Every sender of a public run is a stranger, and the all-reduce's mean is what every peer applies:
with the plain mean, one sender that sends 100·Δ, or claims 2^40 samples, moves θ_global wherever it
likes (measured in issue 19: 3·Δ from one of 3 peers raised the held-out loss 11 %, 100·Δ ended the
run for good). The rules here bound what any minority of senders can do to a part, in three steps:

1. **Sample claims weighed, within a bound** (:func:`fair_weights`; the trimmed mean uses no weights at
   all). Nobody can verify a claim (robust rules ignore claimed weights, arXiv 1902.06156, for this
   reason), but an honest peer that trains more samples per inner step (an island of k ranks, a faster
   device) should count more. Each claim counts as claimed up to a common cap C: at most ``claim_cap`` ×
   the group's median claim, and the largest C at which the ⌈n/2⌉ − 1 largest weights (the largest
   minority a robust rule tolerates) sum to no more than the others'. So any minority of senders
   together weighs at most what the rest weigh, whatever it claims, and an honest peer counts its
   samples in full unless it alone (with the next largest claims) would outweigh the rest.
2. **Norms bounded**: each sender's part is scaled down to at most ``norm_clip`` × the median of the
   parts' norms (the "Gauntlet" of Templar, arXiv 2505.21684, clips updates to the median norm; at
   ``norm_clip = 1``, the default, a scaled Δ becomes no larger than the median honest part, so scaling
   buys nothing).
3. **A robust centre** of the bounded parts:

   * ``centered-clip`` (Karimireddy, He & Jaggi, arXiv 2012.10333, eq. (CC); run inside the butterfly
     by BTARD, Gorbunov et al., arXiv 2106.11257): from the coordinate-wise median v₀,
     ``v ← v + Σᵢ wᵢ·(xᵢ − v)·min(1, τ/‖xᵢ − v‖) / Σᵢ wᵢ``, ``clip_iterations`` times, with radius
     ``τ = clip_factor`` × the median distance ‖xᵢ − v₀‖, weight-aware (:func:`counted_pull`): a sender
     heavier than the median weight w̃ counts in full only within τ·w̃/wᵢ of v, and as a median sender
     farther away. A sender pulls v by at most τ·w̃/Σw per iteration, whatever it claims and however
     far it is; honest parts within reach count fully, and when all of them are within it one iteration
     gives their weighted mean. A part that points away from v₀ (``⟨xᵢ, v₀⟩ < 0``: −Δ) counts nothing,
     while fewer than half do (``drop_opposed``, :func:`facing_the_centre`).
   * ``trimmed-mean``: per coordinate, the ⌈trim_fraction·n⌉ largest and smallest values dropped (at
     most (n − 1)/2 each side, so the median is left for 3 senders), the rest averaged (unweighted).
   * ``mean``: DiLoCo's exact weighted mean (:func:`weighted_mean`), with the claims as they are:
     no protection, for trusted swarms.

**The same bits on every CPU.** Every step is an element-wise IEEE operation in a fixed order, each
scalar rounded to float32 before use, norms as in :mod:`p2p_diloco.fixed_order`, medians and sorted
values from a sorting network of element-wise min and max, and signed zeros made positive where a
comparison could pick either. So any peer that holds the
same decoded parts computes the same bytes: a second peer can recompute a reducer's result.

What the rules tolerate, and what they do not (coordinated small shifts, arXiv 1902.06156), is in
docs/security.md.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from p2p_diloco.fixed_order import as_float32, lower_median, norm, pairwise_sum

RULES = ("centered-clip", "trimmed-mean", "mean")


@dataclass(frozen=True)
class AggregationRule:
    """A run's rule for a reducer's parts (``[outer]`` settings, part of the run's fingerprint)."""

    name: str = "centered-clip"
    clip_factor: float = 2.0  # CenteredClip's radius τ: this × the median distance to the coordinate median
    clip_iterations: int = 3  # of CenteredClip
    trim_fraction: float = 0.25  # of the trimmed mean, each side
    claim_cap: float = 4.0  # no claim counts above this × the group's median claim (1: the median cap)
    norm_clip: float = 1.0  # each part's norm at most this × the median norm
    drop_opposed: bool = True  # CenteredClip: a part that points away from the coordinate median counts nothing

    def __post_init__(self):
        if self.name not in RULES:
            raise ValueError(f"aggregation {self.name!r}: one of {', '.join(RULES)}")
        if not (math.isfinite(self.clip_factor) and self.clip_factor >= 1):
            raise ValueError(f"clip_factor {self.clip_factor}: a number >= 1")
        if self.clip_iterations < 1:
            raise ValueError(f"clip_iterations {self.clip_iterations}: an integer >= 1")
        if not 0 <= self.trim_fraction <= 0.5:
            raise ValueError(f"trim_fraction {self.trim_fraction}: a number in [0, 0.5]")
        for setting in ("claim_cap", "norm_clip"):
            value = getattr(self, setting)
            if not (math.isfinite(value) and value >= 1):
                raise ValueError(f"{setting} {value}: a number >= 1")


EXACT_MEAN = AggregationRule("mean")


def aggregation_rule(settings) -> AggregationRule:
    """The rule that `settings` name: the run's ``[outer]`` (:class:`~p2p_diloco.config.OuterConfig`), or an
    assistance request, which carries the same fields. ValueError if they are not a valid rule."""
    return AggregationRule(settings.aggregation, clip_factor=settings.clip_factor,
                           clip_iterations=settings.clip_iterations, trim_fraction=settings.trim_fraction,
                           claim_cap=settings.claim_cap, norm_clip=settings.norm_clip,
                           drop_opposed=settings.drop_opposed)


def aggregate(parts: Sequence[torch.Tensor], claims: Sequence[float], rule: AggregationRule) -> torch.Tensor:
    """The reducer's result for one part from the senders' parts (float32, one shape) and the sample
    counts they claimed, under `rule` (see the module's docstring). The parts are not modified."""
    if not parts or len(parts) != len(claims):
        raise ValueError(f"aggregate of {len(parts)} parts with {len(claims)} claims")
    if rule.name == "mean":
        return weighted_mean(parts, claims)
    bounded = clip_to_median_norm(parts, rule.norm_clip)
    if rule.name == "trimmed-mean":
        return trimmed_mean(bounded, trim_count(len(parts), rule.trim_fraction))
    return centered_clip(bounded, fair_weights(claims, rule.claim_cap), rule.clip_factor, rule.clip_iterations,
                         rule.drop_opposed)


def weighted_mean(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``Σᵢ wᵢ·xᵢ / Σᵢ wᵢ`` over the parts in the order given, in float32, defined by IEEE arithmetic
    alone: each product, each partial sum and the quotient rounded once.

    torch's ``add_(x, alpha=w)`` is not: ATen's AVX2/AVX-512 kernels fuse it into one multiply-add
    (one rounding), its default kernel rounds twice, so reducers on different CPUs would return
    different bits. A plain ``add_`` rounds ``a + b`` once in every kernel. The weights (sample
    counts, exact in float32 below 2^24) are summed in Python's float64, in the same order.
    """
    if not parts or len(parts) != len(weights):
        raise ValueError(f"weighted_mean of {len(parts)} parts with {len(weights)} weights")
    total = torch.zeros_like(parts[0], dtype=torch.float32)
    product = torch.empty_like(total)
    for part, weight in zip(parts, weights):
        torch.mul(part, weight, out=product)
        total.add_(product)
    return total.div_(sum(weights))


def counted_claims(claims: Sequence[float], rule: AggregationRule) -> list[float]:
    """The sample counts `rule` credits the senders with: :func:`fair_weights` for a robust rule, as claimed
    for DiLoCo's mean (what a run reports as the samples it averaged)."""
    return [float(claim) for claim in claims] if rule.name == "mean" else fair_weights(claims, rule.claim_cap)


def largest_minority(senders: int) -> int:
    """⌈n/2⌉ − 1: the most hostile senders of n that a robust rule tolerates (fewer than half)."""
    return (senders - 1) // 2


def fair_weights(claims: Sequence[float], claim_cap: float) -> list[float]:
    """Each claim capped at C = min(claim_cap × the (lower) median claim, C*), where C* is the largest cap at
    which the :func:`largest_minority` largest capped claims sum to no more than the other capped claims.

    The bound: for f ≤ ⌈n/2⌉ − 1 senders, Σ of any f weights ≤ Σ of the f largest ≤ Σ of the others, so
    a hostile minority weighs at most what the honest rest weigh (at most half the group's weight), and
    no weight exceeds claim_cap × the median claim (an honest value while hostile senders are fewer than
    half). With equal honest claims m and one liar, the liar counts at most 2·m in a group of 3 or 5,
    3·m in one of 4 or 16. An honest claim is cut only above that cap: an island of 2 ranks beside
    2 plain peers counts twice.

    C* from h(C) = Σ_rest min(yᵢ, C) − Σ_top min(yᵢ, C), the claims y sorted largest first, top the
    first f: h(0) = 0, h is piecewise linear with a breakpoint at each claim, rises while more rest
    claims than top ones exceed C, and once its slope is negative it never rises again (rest claims are
    the smaller ones), so {C ≥ 0 : h(C) ≥ 0} is one interval [0, C*]. Python floats in a fixed order:
    every peer computes the same weights."""
    if not claims:
        raise ValueError("fair_weights of no claims")
    capped = [min(float(claim), claim_cap * lower_median(list(claims))) for claim in claims]
    minority = largest_minority(len(capped))
    if minority == 0:
        return capped
    ordered = sorted(capped, reverse=True)
    top, rest = ordered[:minority], ordered[minority:]

    def balance(cap: float) -> float:
        return sum(min(y, cap) for y in rest) - sum(min(y, cap) for y in top)

    cap, below = ordered[0], 0.0  # C* is at least the largest claim unless h turns negative at a breakpoint
    for breakpoint in sorted(set(ordered)):
        if balance(breakpoint) < 0:
            slope = sum(y > below for y in rest) - sum(y > below for y in top)  # < 0 on (below, breakpoint]
            cap = below + balance(below) / -slope
            break
        below = breakpoint
    return [min(claim, cap) for claim in capped]


def clip_to_median_norm(parts: Sequence[torch.Tensor], norm_clip: float) -> list[torch.Tensor]:
    """Each part scaled down to norm ≤ norm_clip × the parts' (lower) median norm; the others as they are."""
    norms = [norm(part) for part in parts]
    bound = norm_clip * lower_median(norms)
    return [part * as_float32(bound / n) if n > bound else part for part, n in zip(parts, norms)]


def trim_count(senders: int, trim_fraction: float) -> int:
    """How many values the trimmed mean drops at each end of a coordinate's sorted values."""
    return min(math.ceil(trim_fraction * senders), (senders - 1) // 2)


@functools.lru_cache(maxsize=None)
def sorting_network(size: int) -> tuple[tuple[int, int], ...]:
    """The comparators (i, j), i < j, of Batcher's merge-exchange sort of `size` values (Knuth, TAOCP
    vol. 3, §5.2.2, Algorithm M): applied in order, each putting the smaller value at i, they sort any
    input. O(n log² n) comparators, each an element-wise min and max of two whole parts."""
    if size < 2:
        return ()
    t = (size - 1).bit_length()
    pairs = []
    p = 1 << (t - 1)
    while p > 0:
        q, r, d = 1 << (t - 1), 0, p
        while True:
            pairs.extend((i, i + d) for i in range(size - d) if i & p == r)
            if q == p:
                break
            d, q, r = q - p, q // 2, p
        p //= 2
    return tuple(pairs)


def order_statistics(parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The parts' values sorted per coordinate: the k-th tensor holds each coordinate's k-th smallest value.

    A sorting network of element-wise ``minimum``/``maximum`` (:func:`sorting_network`): each output is
    one of the input values, whatever the kernel, and far faster than ``torch.sort`` across a few rows.
    −0.0 is made +0.0 first, so that values that compare equal are the same bits (the decoded parts
    hold no NaN)."""
    zero = torch.zeros((), dtype=torch.float32)
    values = [torch.where(part == 0, zero, part.reshape(-1).to(torch.float32)) for part in parts]
    for i, j in sorting_network(len(values)):
        values[i], values[j] = torch.minimum(values[i], values[j]), torch.maximum(values[i], values[j])
    return values


def coordinate_median(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The coordinate-wise (lower) median of the parts, shaped like a part."""
    return order_statistics(parts)[(len(parts) - 1) // 2].reshape(parts[0].shape)


def trimmed_mean(parts: Sequence[torch.Tensor], trim: int) -> torch.Tensor:
    """Per coordinate, the mean of the values left once the `trim` smallest and largest are dropped,
    summed from the smallest up (unweighted: which sender a kept value came from differs per coordinate)."""
    kept = order_statistics(parts)[trim:len(parts) - trim]
    total = kept[0].clone()
    for values in kept[1:]:
        total.add_(values)
    return total.div_(len(kept)).reshape(parts[0].shape)


def centered_clip(parts: Sequence[torch.Tensor], weights: Sequence[float], clip_factor: float,
                  iterations: int, drop_opposed: bool = True) -> torch.Tensor:
    """CenteredClip (arXiv 2012.10333, eq. (CC)) from the coordinate-wise median, radius ``clip_factor``
    × the median distance of the parts to it, weight-aware (:func:`counted_pull`), without the parts that point
    away from the median (`drop_opposed`, :func:`facing_the_centre`); see the module's docstring."""
    centre = coordinate_median(parts).clone()
    typical = lower_median(list(weights))
    if drop_opposed:
        weights = facing_the_centre(parts, centre, weights)
    step = torch.empty_like(centre)
    pulls = [torch.sub(part, centre) for part in parts]
    distances = [norm(pull) for pull in pulls]
    radius = clip_factor * lower_median(distances)
    for iteration in range(iterations):
        if iteration:  # the first iteration's pulls are those the radius was taken from
            for pull, part in zip(pulls, parts):
                torch.sub(part, centre, out=pull)
            distances = [norm(pull) for pull in pulls]
        counted = [counted_pull(weight, distance, typical, radius) for weight, distance in zip(weights, distances)]
        total_weight = sum(weight for weight, _ in counted)
        step.zero_()
        for pull, (weight, scale) in zip(pulls, counted):
            step.add_(pull.mul_(as_float32(weight * scale / total_weight)))
        centre.add_(step)
    return centre


def facing_the_centre(parts: Sequence[torch.Tensor], centre: torch.Tensor, weights: Sequence[float]) -> list[float]:
    """The weights with 0 for each part that points away from the coordinate-wise median (``⟨xᵢ, v₀⟩ < 0``),
    unless that leaves half of the senders or fewer: then the weights as they are.

    A sender that sends −Δ (at the median norm, which is all the norm clip leaves it) pulls CenteredClip's centre
    back by up to τ/n per iteration, whatever the radius: one of 3 cost the demo run 3.6-4.4 % of held-out loss
    (issue 44). Honest pseudo-gradients of one θ_global share a direction, and the median of a majority of
    them points along it, so an honest part faces the median (FLTrust, Cao et al., NDSS 2021, arXiv 2012.13995,
    weighs each update by its cosine with a trusted one, ReLU'd; here the trusted one is the robust centre). What
    is left to a liar is a part at a right angle to the others' at most, a free rider's: the centre keeps the
    honest parts' direction and loses at most a liar's share of its length. The inner products are
    :func:`~p2p_diloco.fixed_order.pairwise_sum` of IEEE products: the same on every CPU."""
    facing = [pairwise_sum(torch.mul(part.reshape(-1), centre.reshape(-1))) >= 0 for part in parts]
    if 2 * sum(facing) <= len(parts):
        return list(weights)
    return [weight if faces else 0.0 for weight, faces in zip(weights, facing)]


def counted_pull(weight: float, distance: float, typical: float, radius: float) -> tuple[float, float]:
    """(the weight a sender counts with in one CenteredClip iteration, the factor of its pull xᵢ − v).

    A weight up to the median weight `typical` (an honest value while hostile senders are fewer than half)
    counts as CenteredClip counts it, its pull clipped to `radius`. A weight above it counts in full only
    for a part within radius × typical / weight of the centre (an island's Δ, which agrees with the
    others'); a heavier part farther away counts as a median sender, clipped to `radius`. So no sender
    pulls the centre harder than a median one can, τ·typical/Σ, and a liar that claims more but sends a
    part far from the others' (−100·Δ with 2^48 samples) moves the centre as it would claiming the median:
    extra weight is earned within the round, by agreeing."""
    clipped = min(1.0, radius / distance) if distance > 0 else 1.0
    if weight <= typical:
        return weight, clipped
    if distance * weight <= radius * typical:
        return weight, 1.0
    return typical, clipped
