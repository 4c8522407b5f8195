"""Reductions in a fixed order: the same bits on every CPU.

torch's ``sum``/``norm`` reduce in an order that depends on the kernel the CPU picks (AVX2, AVX-512 or
the default one vectorise differently), so two peers computing the norm of the same tensor may get
different last bits, and a decision taken on that norm (a clip, a vote) may differ. Here a sum is
reduced by pairwise folding, the second half added onto the first until one value is left: each step
is an element-wise IEEE add, rounded once whatever the kernel, and the pairing depends only on the
length. Squares and sums are taken in float64 (a chunk at a time, in one reused buffer), which also
keeps the result far more accurate than a float32 sum.
"""

from __future__ import annotations

import math
import struct

import torch


CHUNK = 1 << 16  # values converted to float64 at a time: a small buffer, reused, instead of a copy of the whole


def _fold_(x: torch.Tensor) -> float:
    """Σ x by pairwise folding, in place: the last ⌊n/2⌋ values are added onto the first ones (element-wise)
    until one is left; the pairing depends on the length alone."""
    size = x.numel()
    while size > 1:
        half = size // 2
        x[:half].add_(x[size - half:size])  # disjoint: size − half ≥ half; an odd middle value waits a level
        size -= half
    return float(x[0]) if size else 0.0


def _chunk_sums(values: torch.Tensor, square: bool) -> float:
    """Σ values (or Σ values²) in float64: each chunk of :data:`CHUNK` values folded, then the chunks' sums."""
    flat = values.detach().reshape(-1)
    buffer = torch.empty(min(CHUNK, flat.numel()), dtype=torch.float64)
    sums = []
    for start in range(0, flat.numel(), CHUNK):
        chunk = buffer[:min(CHUNK, flat.numel() - start)]
        chunk.copy_(flat[start:start + CHUNK])
        if square:
            chunk.mul_(chunk)  # a float32 value's square is exact in float64
        sums.append(_fold_(chunk))
    return _fold_(torch.tensor(sums, dtype=torch.float64))


def pairwise_sum(values: torch.Tensor) -> float:
    """Σ values in float64, in a fixed order: chunks of :data:`CHUNK` values folded pairwise, then their sums."""
    return _chunk_sums(values, square=False)


def sum_of_squares(values: torch.Tensor) -> float:
    """Σ values² in float64 (each square exact), in :func:`pairwise_sum`'s order."""
    return _chunk_sums(values, square=True)


def norm(values: torch.Tensor) -> float:
    """The Euclidean norm: ``sqrt`` (IEEE: rounded once) of :func:`sum_of_squares`."""
    return math.sqrt(sum_of_squares(values))


def lower_median(values: list[float]) -> float:
    """The ⌈n/2⌉-th smallest value: a member of the list, the smaller middle one for an even count."""
    if not values:
        raise ValueError("the median of no values")
    return sorted(values)[(len(values) - 1) // 2]


def as_float32(value: float) -> float:
    """`value` rounded to the nearest float32, as a Python float: a scalar that a float32 kernel uses
    exactly, whether it converts scalars to float32 or computes in float64 first."""
    return struct.unpack("f", struct.pack("f", value))[0]
