"""Initial weights that are a function of (model config, vocabulary, seed) alone, not of the peer's CPU.

Every peer builds θ_global's first value itself, so it must come out as the same bits on every
machine. torch's own samplers do not: ``Tensor.normal_`` fills a float tensor with a vectorised
Box–Muller transform whose ``log``/``cos`` come from SLEEF on ATen's AVX2 and AVX-512 kernels and
from libm on its default kernel (a tiny Llama: sha256 ``9f66759c…`` under
``ATEN_CPU_CAPABILITY=default``, ``963a9148…`` under AVX2), and ``trunc_normal_`` uses ``erfinv``.

While a model is built inside :func:`seeded_initialisation`, the random initialisers it calls are
routed to :class:`SeededDraws`, which keeps each call's semantics (the distribution, its mean, std
and bounds, which the architecture chooses) and draws the values from a bit stream and arithmetic
that no CPU kernel decides:

* **Bits.** Call k (counted from 0 in the order the model's code makes them) reads the 64-bit
  integers ``numpy.random.PCG64([seed, k]).random_raw()`` (O'Neill 2014, "PCG: A family of simple
  fast space-efficient statistically good algorithms for random number generation"); numpy keeps
  the stream of a BitGenerator for a given seed stable across versions and platforms (NEP 19).
* **Uniforms.** The top 53 bits r of an integer give U = r·2^-53 ∈ [0, 1) and V = r·2^-52 − 1
  ∈ [−1, 1), both exact in float64.
* **Normals.** Marsaglia's polar method (Marsaglia & Bray 1964, "A convenient method for generating
  normal variables", SIAM Review 6(3)): consecutive pairs (V₁, V₂), s = V₁² + V₂², pairs with
  0 < s < 1 kept, each giving the two standard normals V₁·f and V₂·f with f = √(−2·ln s / s). The
  logarithm is :func:`natural_log`: ``torch.frexp`` splits s = m·2^e exactly, and
  ln s = e·ln 2 + 2·atanh((m − 1)/(m + 1)) with the atanh series summed by Horner's rule.
* **Arithmetic.** Everything above is float64 multiply, add, subtract, divide and square root, one
  rounding each (IEEE 754) in a fixed order, then a value ``mean + std·z`` or ``a + (b − a)·U`` is
  rounded once to float32 (and from there to the parameter's dtype). No libm or SLEEF function, no
  fused multiply-add, and no kernel choice can change a bit.

Routed: ``torch.Tensor.normal_`` and ``torch.Tensor.uniform_`` (which ``torch.nn.init.normal_``,
``uniform_``, ``xavier_*``, ``kaiming_*`` and ``transformers.initialization`` call),
``torch.nn.init.trunc_normal_`` (rejection: values outside [a, b] are redrawn, as torch documents
it), and ``torch.randn``/``torch.rand`` of floating dtypes. ``orthogonal_`` (a QR factorisation by
the CPU's LAPACK) and ``sparse_`` cannot be made machine-independent this way and raise
:class:`UnsupportedInitialiser`. Only the thread that entered the context is routed, one build at a
time; everything is restored on the way out, on error too.
"""

from __future__ import annotations

import functools
import math
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

LN2 = math.log(2.0)  # the float64 nearest ln 2
SQRT_HALF = math.sqrt(0.5)
# 1/(2j + 1), j = 0..12: atanh(z) = z·Σ w^j/(2j + 1) with w = z²; |z| ≤ 3 − 2√2 < 0.1716, so
# w ≤ 0.0295 and the first term left out, w^13/27, is below 2^-68 of the sum
ATANH_COEFFICIENTS = [1.0 / (2 * j + 1) for j in range(13)]
BATCH_PAIRS = 1 << 16  # candidate pairs drawn at a time; the values do not depend on it


class UnsupportedInitialiser(RuntimeError):
    """The model initialises a parameter in a way whose result depends on the peer's CPU."""


def natural_log(s: torch.Tensor) -> torch.Tensor:
    """ln s of positive, finite float64 values with multiplies, adds and divides alone (no libm).

    s = m·2^e exactly (``torch.frexp``), with m moved into [√½, √2) (a doubling, exact); then
    ln s = e·ln 2 + 2·atanh(z), z = (m − 1)/(m + 1) (m − 1 is exact, Sterbenz's lemma), and
    atanh(z) = z·(1 + w/3 + w²/5 + …), w = z², by Horner's rule (Abramowitz & Stegun 4.1.25 and 4.6.22).
    """
    mantissa, exponent = torch.frexp(s)
    below = mantissa < SQRT_HALF
    mantissa = torch.where(below, torch.mul(mantissa, 2.0), mantissa)
    exponent = torch.sub(exponent, below.to(exponent.dtype))
    z = torch.div(torch.sub(mantissa, 1.0), torch.add(mantissa, 1.0))
    w = torch.mul(z, z)
    series = torch.full_like(w, ATANH_COEFFICIENTS[-1])
    for coefficient in reversed(ATANH_COEFFICIENTS[:-1]):
        series.mul_(w).add_(coefficient)
    return torch.mul(exponent.to(torch.float64), LN2).add_(torch.mul(z, 2.0).mul_(series))


def _top_53_bits(bits: np.random.PCG64, n: int) -> torch.Tensor:
    """n integers r ∈ [0, 2^53) from the next n 64-bit outputs, as (exact) float64."""
    return torch.from_numpy((bits.random_raw(n) >> np.uint64(11)).astype(np.float64))


def standard_uniforms(bits: np.random.PCG64, n: int) -> torch.Tensor:
    """n float64 values U = r·2^-53, uniform on [0, 1)."""
    return torch.mul(_top_53_bits(bits, n), 2.0**-53)


def standard_normal_batches(bits: np.random.PCG64, wanted: int) -> Iterator[torch.Tensor]:
    """Standard normal float64 values by Marsaglia's polar method (module docstring), batch after
    batch: the first batch sized for about `wanted` values, the next ones BATCH_PAIRS pairs each.
    Their concatenation does not depend on the batch sizes (the pairs are read in order)."""
    pairs = min(BATCH_PAIRS, wanted // 2 * 33 // 25 + 16)  # 4/π < 1.32 pairs per kept pair
    while True:
        symmetric = torch.mul(_top_53_bits(bits, 2 * pairs), 2.0**-52).sub_(1.0)  # V ∈ [−1, 1)
        pairs = BATCH_PAIRS
        first, second = symmetric[0::2], symmetric[1::2]
        s = torch.mul(first, first).add_(torch.mul(second, second))
        inside = (s > 0) & (s < 1)
        first, second, s = first[inside], second[inside], s[inside]
        factor = torch.sqrt(torch.div(torch.mul(natural_log(s), -2.0), s))
        yield torch.stack([torch.mul(first, factor), torch.mul(second, factor)], dim=1).reshape(-1)


def _first(batches: Iterator[torch.Tensor], n: int, keep: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
           ) -> torch.Tensor:
    """The first n values of the batches (of those that `keep` maps to True, if given)."""
    taken, count = [], 0
    while count < n:
        batch = next(batches)
        if keep is not None:
            batch = batch[keep(batch)]
        taken.append(batch[: n - count])
        count += len(taken[-1])
    return torch.cat(taken) if taken else torch.empty(0, dtype=torch.float64)


class SeededDraws:
    """The routed initialisers of one model build: call k draws from ``PCG64([seed, k])``."""

    def __init__(self, seed: int):
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        self.seed = seed
        self.calls = 0

    def _next_stream(self) -> np.random.PCG64:
        bits = np.random.PCG64([self.seed, self.calls])
        self.calls += 1
        return bits

    def uniform(self, n: int, low: float, high: float) -> torch.Tensor:
        """n float64 values low + (high − low)·U (torch's ``uniform_(low, high)``)."""
        return torch.mul(standard_uniforms(self._next_stream(), n), float(high) - float(low)).add_(float(low))

    def normal(self, n: int, mean: float, std: float) -> torch.Tensor:
        """n float64 values mean + std·Z (torch's ``normal_(mean, std)``)."""
        z = _first(standard_normal_batches(self._next_stream(), n), n)
        return torch.mul(z, float(std)).add_(float(mean))

    def truncated_normal(self, n: int, mean: float, std: float, low: float, high: float) -> torch.Tensor:
        """n float64 values mean + std·Z, those outside [low, high] left out and the next ones taken
        (torch's ``trunc_normal_``: "values outside [a, b] redrawn until they are within the bounds")."""
        if not low < high or not std > 0:
            raise ValueError(f"trunc_normal_ needs a < b and std > 0, got a={low}, b={high}, std={std}")
        shifted = (torch.mul(z, float(std)).add_(float(mean)) for z in standard_normal_batches(self._next_stream(), n))
        return _first(shifted, n, keep=lambda x: (x >= low) & (x <= high))


def _fill_(tensor: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Write float64 `values` into `tensor` (element order: row-major over its shape), rounded once to
    float32 and from there to the tensor's dtype."""
    with torch.no_grad():
        tensor.copy_(values.to(torch.float32).view(tensor.shape))
    return tensor


def _routable(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and tensor.device.type != "meta"


class _Routes:
    """The replacements :func:`seeded_initialisation` installs; each passes other threads' calls, and
    calls it does not handle (integer tensors, meta tensors), to the original."""

    def __init__(self, draws: SeededDraws, originals: dict[str, Callable], thread: int):
        self.draws, self.originals, self.thread = draws, originals, thread

    def _mine(self) -> bool:
        return threading.get_ident() == self.thread

    def tensor_normal_(self, tensor, mean=0.0, std=1.0, *, generator=None):
        if not (self._mine() and _routable(tensor)):
            return self.originals["normal_"](tensor, mean, std, generator=generator)
        return _fill_(tensor, self.draws.normal(tensor.numel(), mean, std))

    def tensor_uniform_(self, tensor, low=0.0, high=1.0, *, generator=None, **bounds):
        low, high = bounds.pop("from", low), bounds.pop("to", high)  # torch's own keyword names
        if not (self._mine() and _routable(tensor)):
            return self.originals["uniform_"](tensor, low, high, generator=generator, **bounds)
        return _fill_(tensor, self.draws.uniform(tensor.numel(), low, high))

    def trunc_normal_(self, tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
        if not (self._mine() and _routable(tensor)):
            return self.originals["trunc_normal_"](tensor, mean, std, a, b, generator=generator)
        return _fill_(tensor, self.draws.truncated_normal(tensor.numel(), mean, std, a, b))

    def _new_tensor(self, name: str, fill: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
        def create(*size, generator=None, requires_grad=False, **options):
            if self._mine():
                tensor = torch.empty(*size, **options)
                if _routable(tensor):
                    return fill(tensor).requires_grad_(requires_grad)
            return self.originals[name](*size, generator=generator, requires_grad=requires_grad, **options)

        return create

    def randn(self) -> Callable:
        return self._new_tensor("randn", lambda t: _fill_(t, self.draws.normal(t.numel(), 0.0, 1.0)))

    def rand(self) -> Callable:
        return self._new_tensor("rand", lambda t: _fill_(t, self.draws.uniform(t.numel(), 0.0, 1.0)))

    def refuse(self, name: str) -> Callable:
        def refused(*args: Any, **kwargs: Any):
            if not self._mine():
                return self.originals[name](*args, **kwargs)
            raise UnsupportedInitialiser(f"the model initialises a parameter with torch.nn.init.{name}, whose "
                                         "result depends on the CPU (its LAPACK or sampling kernels): peers would "
                                         "start from different weights")

        return refused


def _torch_init_table() -> Optional[dict]:
    """transformers' own copies of torch.nn.init's functions (``transformers.initialization``, which it
    calls instead of the attributes), or None for a transformers without it."""
    try:
        from transformers import initialization
    except ImportError:
        return None
    return getattr(initialization, "TORCH_INIT_FUNCTIONS", None)


def _as_method(route: Callable) -> Callable:
    """A plain function calling `route`: unlike a bound method, it binds to the tensor as a method of torch.Tensor."""
    def method(tensor, *args, **kwargs):
        return route(tensor, *args, **kwargs)

    return method


_BUILD_LOCK = threading.RLock()  # one build at a time (a nested one, in the same thread, is allowed)


@contextmanager
def seeded_initialisation(seed: int) -> Iterator[SeededDraws]:
    """Within the block, the current thread's random initialisers draw from :class:`SeededDraws`
    (`seed`); the originals are restored on leaving it, whether it ends or raises."""
    draws = SeededDraws(seed)
    table = _torch_init_table()
    with _BUILD_LOCK:
        originals = {"normal_": torch.Tensor.normal_, "uniform_": torch.Tensor.uniform_,
                     "trunc_normal_": torch.nn.init.trunc_normal_, "randn": torch.randn, "rand": torch.rand,
                     "orthogonal_": torch.nn.init.orthogonal_, "sparse_": torch.nn.init.sparse_}
        routes = _Routes(draws, originals, threading.get_ident())
        replacements: list[tuple[Any, str, Any]] = [
            (torch.Tensor, "normal_", _as_method(routes.tensor_normal_)),
            (torch.Tensor, "uniform_", _as_method(routes.tensor_uniform_)),
            (torch.nn.init, "trunc_normal_", routes.trunc_normal_),
            (torch, "randn", routes.randn()),
            (torch, "rand", routes.rand()),
            (torch.nn.init, "orthogonal_", routes.refuse("orthogonal_")),
            (torch.nn.init, "sparse_", routes.refuse("sparse_")),
        ]
        if table is not None:
            replacements += [(table, name, routes.trunc_normal_ if name == "trunc_normal_" else routes.refuse(name))
                             for name in ("trunc_normal_", "orthogonal_", "sparse_") if name in table]
        with _replaced(replacements):
            yield draws


@contextmanager
def _replaced(replacements: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Set each (owner, name) to its value (an attribute, or a key of a dict owner); on exit put back
    what was there (an attribute the owner inherited is removed again), whether the block ends or raises."""
    restore: list[Callable[[], None]] = []
    try:
        for owner, name, value in replacements:
            if isinstance(owner, dict):
                restore.append(functools.partial(owner.__setitem__, name, owner[name]))
                owner[name] = value
            else:
                if name in vars(owner):
                    restore.append(functools.partial(setattr, owner, name, vars(owner)[name]))
                else:  # inherited (torch.Tensor's methods come from torch._C.TensorBase)
                    restore.append(functools.partial(delattr, owner, name))
                setattr(owner, name, value)
        yield
    finally:
        for undo in reversed(restore):
            undo()
