"""Reductions in a fixed order: the same bits on every CPU.

torch's ``sum``/``norm`` reduce in an order that depends on the kernel the CPU picks (AVX2, AVX-512 or
the default one vectorise differently), so two peers computing the norm of the same tensor may get
different last bits, and a decision taken on that norm (a clip, a vote) may differ. Here a sum is
reduced by pairwise halving, ``x[:n/2] + x[n/2:]`` until one value is left: each step is an element-wise
IEEE add, rounded once whatever the kernel, and the pairing depends only on the length. Squares and
sums are taken in float64, which also keeps the result far more accurate than a float32 sum.
"""

from __future__ import annotations

import math
import struct

import torch


def pairwise_sum(values: torch.Tensor) -> float:
    """Σ values in float64, by pairwise halving (zeros pad the length to a power of two)."""
    x = values.detach().reshape(-1).to(torch.float64)
    if x.numel() == 0:
        return 0.0
    size = 1 << (x.numel() - 1).bit_length()
    if size != x.numel():
        x = torch.cat([x, x.new_zeros(size - x.numel())])
    while size > 1:
        size //= 2
        x = x[:size] + x[size:]
    return float(x[0])


def norm(values: torch.Tensor) -> float:
    """The Euclidean norm, ``sqrt`` of :func:`pairwise_sum` of the squares (IEEE sqrt: rounded once)."""
    x = values.detach().reshape(-1).to(torch.float64)
    return math.sqrt(pairwise_sum(x * x))


def lower_median(values: list[float]) -> float:
    """The ⌈n/2⌉-th smallest value: a member of the list, the smaller middle one for an even count."""
    if not values:
        raise ValueError("the median of no values")
    return sorted(values)[(len(values) - 1) // 2]


def as_float32(value: float) -> float:
    """`value` rounded to the nearest float32, as a Python float: a scalar that a float32 kernel uses
    exactly, whether it converts scalars to float32 or computes in float64 first."""
    return struct.unpack("f", struct.pack("f", value))[0]
