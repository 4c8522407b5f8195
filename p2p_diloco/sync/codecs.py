"""Codecs for the pseudo-gradient parts that travel in an all-reduce: 1-D float32 tensors.

Each codec turns a part into bytes and back, and states how far the round trip may move a value:
``|decode(encode(x)) − x| ≤ error_bound(x)``, element by element (the tests check it on the
tensors a DiLoCo run produces and on the edges of each format). A caller that keeps error feedback
computes the residual ``x − decode(encode(x))`` itself; nothing here holds state between parts.

===============  ==========================================  ===========  =================================
codec            format                                      bytes/param  bound on |x̂ − x| (derived below)
===============  ==========================================  ===========  =================================
``none``         float32, little-endian                      4            0
``fp16``         IEEE half                                   2            2^-11·|x|; |x| below 2^-14
``bf16``         bfloat16                                    2            2^-8·|x|; |x| below 2^-126
``int8``         bitsandbytes dynamic 8-bit, 256 per block   1.015625     0.0075·absmax of the block
``nf4``          bitsandbytes NF4, 64 per block              0.5625       0.1520·absmax of the block
``fp4-bnb``      bitsandbytes FP4 (E2M1), 64 per block       0.5625       0.1668·absmax of the block
``fp4-e3m0``     sign, 3-bit exponent, no mantissa, 64/blk   0.5625       max(|x|/3, absmax/128)
``mask8-e3m0``   1 value in 8 (the round's mask), fp4-e3m0   0.0703125    fp4-e3m0's on a value sent; |x|
``mask16-e3m0``  1 value in 16 (the round's mask), fp4-e3m0  0.03515625   fp4-e3m0's on a value sent; |x|
``2bit``         sign, 2 levels × block mean |x|, 64/block   0.3125       max(0.6875·s, |x| − 1.875·s)
``1bit``         sign × block mean |x| (s), 64 per block     0.1875       max(s, |x| − s)
``mask4-2bit``   1 value in 4 (the round's mask), 2bit       0.078125     2bit's on a value sent; |x|
``mask2-1bit``   1 value in 2 (the round's mask), 1bit       0.09375      1bit's on a value sent; |x|
===============  ==========================================  ===========  =================================

The ``mask`` codecs send the values of a mask that every member of a round draws alike from the round's
ID (:meth:`Codec.for_round`, :class:`SharedMaskCodec`): each reducer still averages parts of one shape,
coordinate by coordinate, under any robust rule, and error feedback (which they need: the config refuses them
without it) keeps what a round did not send in θ_local, for the next round, whose mask is another. The outer step
moves only the values a round sent (:meth:`Codec.carried`, :meth:`~p2p_diloco.train.outer.GlobalModel.apply`). At
equal tokens they cost quality with their stride (1 in 8: +11 % held-out loss on the demo model over 14 rounds,
+5 % over 34): docs/benchmarks.md.

The block codecs carry one float32 scale (the block's absolute maximum) per block after the codes:
4/blocksize bytes per parameter of the figures above (1 + 4/256, 0.5 + 4/64). A block codec's
bound is absmax itself in a block whose absmax is a float32 subnormal, and the fp4-e3m0 bound has
a margin for float32 rounding (see each class).

**Decode is a pure function of the bytes, the same bits on every CPU.** It runs with no
randomness and no state, from a fixed little-endian layout, and with operations whose result IEEE
754 alone defines: the two-byte floats widen exactly to float32, and every block codec decodes a
value as one table lookup times its block's scale, a single rounded float32 multiply
(:func:`_scaled_lookup`), not with a C kernel that a CPU's instruction set may change. The code maps
of bitsandbytes are checked against a fingerprint, so a bitsandbytes release that changed them fails
loudly instead of decoding differently. When the reducer of a part encodes the averaged part once
and every peer, the reducer included, decodes the same bytes, every peer ends with a bit-identical
θ_global. Encode need not be reproducible across machines (a CPU may flush subnormals when it
converts to bf16); the bounds allow for that. The block codecs' encoders are IEEE arithmetic and table
lookups too (``Codec.reproducible_encode``), so a reducer's audit compares their bytes, not bounds.

**On a GPU, the same bytes.** ``encode`` runs on the device of the part it is given, a CPU's or a
CUDA GPU's, and ``decode(data, numel, device)`` on the device it names (the CPU by default): every step
is one of the IEEE operations above (CUDA's float32 division and multiply round to nearest and keep
subnormals, as PyTorch builds its kernels) or an integer operation, so a GPU encodes the bytes a CPU
does and decodes their bits (the CUDA cases of ``tests/test_codecs.py`` compare them, on every codec,
on the edge cases above and on each codec's rounding points; ``benchmarks/codec_speed.py --devices
cpu,cuda`` measures both). Only the tables move to the device, once each; the bytes always come back
to the host. The all-reduce codes on the CPU: it runs in hivemind's averager, a process forked from
the peer, which cannot use CUDA once the peer has (docs/benchmarks.md, "Codec throughput on a GPU").

**Nothing received is trusted** (:mod:`p2p_diloco.remote_input`): ``decode`` checks the length of
the bytes against :meth:`Codec.encoded_size` before it reads them, rejects block scales that are
negative or not finite, and rejects a result that is not finite (a crafted fp16 NaN, say), each
with a :class:`ValueError`. ``encode`` rejects a part with NaN or infinite values, and a part that
the format cannot hold (fp16 above 65504): a pseudo-gradient that large means the run diverged,
and clamping it would hide that.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional

import numpy as np
import torch

FLOAT32_MIN_NORMAL = 2.0**-126
FLOAT32_MIN_SUBNORMAL = 2.0**-149

# sha256 of the little-endian float32 code maps of bitsandbytes 0.50: they are part of the wire
# format, so peers with a bitsandbytes that changed them would decode the same bytes differently.
_BNB_MAP_SHA256 = {
    "dynamic": "e732639a65f497b4ad684bb166a4467708255edd5207757de8b8f0c7e1fda89c",
    "nf4": "8501941daa1b8a90ad1bbfeb632e5101b5dddbc4bb52d6e55abcfd777e60c06a",
    "fp4": "b830bcf8857895e5676b8e2ce608a60bb8af9b3ce6270073e9de34814196f09c",
}


# bitsandbytes 0.50's signed dynamic 8-bit map, ``create_dynamic_map(signed=True)``, as little-endian float32,
# 12 values a line. bitsandbytes computes it with torch.linspace, whose bits depend on ATen's CPU kernel (these
# are the AVX2 and AVX-512 kernels' values; the default kernel's differ), so the wire format keeps the values.
_DYNAMIC_MAP_HEX = (
    "33337ebf9a997abf000077bf666673bfcdcc6fbf33336cbf9a9968bf000065bf666661bfcdcc5dbf33335abf9a9956bf"
    "000053bf66664fbfcdcc4bbf333348bf9a9944bf000041bf66663dbfcdcc39bf343336bf9a9932bf00002fbf66662bbf"
    "cdcc27bf343324bf9a9920bf00001dbf666619bfcdcc15bf343312bf9a990ebf00000bbf666607bfcccc03bf333300bf"
    "3233f9be0000f2becccceabe9a99e3be6666dcbe3333d5be0000cebeccccc6be9a99bfbe6666b8be3333b1be0000aabe"
    "cccca2be9a999bbe666694be34338dbe000086be99997dbe33336fbecdcc60be666652be000044be9a9935be333327be"
    "cdcc18be66660abe0000f8bd3433dbbd85ebc9bdf728c4bd6766bebdd7a3b8bd48e1b2bdb81eadbd2a5ca7bd9a99a1bd"
    "0ad79bbd7b1496bdeb5190bd5d8f8abdcdcc84bd7b147ebd5d8f72bd3d0a67bd1f855bbd000050bde17a44bdc3f538bd"
    "a3702dbd85eb21bd676616bd48e10abd52b8febc15aee7bcd7a3d0bc9a99b9bc5d8fa2bc1f858bbcc3f568bc48e13abc"
    "643b1fbc180416bccdcc0cbc819503bc6abcf4bbd34de2bb3bdfcfbba470bdbb0d02abbb749398bbdd2486bb8a6c67bb"
    "5c8f42bb2db21dbbfca9f1ba9defa7baff6577ba3ee859ba806a3cbac1ec1eba016f01ba83e2c7b905e78cb90bd723b9"
    "4b1fbab8b3ef8ab8348037b80642b2b7ff0502b7941a5ab6b7a313b500000000b7a31335941a5a36ff0502370642b237"
    "34803738b3ef8a384b1fba380bd7233905e78c3983e2c739016f013ac1ec1e3a806a3c3a3ee8593aff65773a9defa73a"
    "fca9f13a2db21d3b5c8f423b8a6c673bdd24863b7493983b0d02ab3ba470bd3b3bdfcf3bd34de23b6abcf43b8195033c"
    "cdcc0c3c1804163c643b1f3c48e13a3cc3f5683c1f858b3c5d8fa23c9a99b93cd7a3d03c15aee73c52b8fe3c48e10a3d"
    "6766163d85eb213da3702d3dc3f5383de17a443d0000503d1f855b3d3d0a673d5d8f723d7b147e3dcdcc843d5d8f8a3d"
    "eb51903d7b14963d0ad79b3d9a99a13d2a5ca73db81ead3d48e1b23dd7a3b83d6766be3df728c43d85ebc93d3433db3d"
    "0000f83d66660a3ecdcc183e3333273e9a99353e0000443e6666523ecdcc603e33336f3e99997d3e0000863e34338d3e"
    "6666943e9a999b3ecccca23e0000aa3e3333b13e6666b83e9a99bf3eccccc63e0000ce3e3333d53e6666dc3e9a99e33e"
    "ccccea3e0000f23e3233f93e3333003fcccc033f6666073f00000b3f9a990e3f3433123fcdcc153f6666193f00001d3f"
    "9a99203f3433243fcdcc273f66662b3f00002f3f9a99323f3433363fcdcc393f66663d3f0000413f9a99443f3333483f"
    "cdcc4b3f66664f3f0000533f9a99563f33335a3fcdcc5d3f6666613f0000653f9a99683f33336c3fcdcc6f3f6666733f"
    "0000773f9a997a3f33337e3f0000803f"
)


@dataclass(frozen=True)
class Codec(ABC):
    """One way to send a 1-D float32 part, on a CPU or a CUDA GPU; ``encode`` and ``decode`` check their
    inputs first."""

    name: str
    # values coded together from a part's start (one scale per block; 1: each value alone). A part that
    # starts on this grid codes its values exactly as the whole tensor would (the all-reduce cuts on it)
    blocksize: int = 1
    # whether encode, like decode, is defined by IEEE arithmetic alone (a copy, or exact max, division and
    # comparisons): the same bytes on every CPU, except where a value or a block scale is a subnormal and
    # the CPU flushes subnormals. A reducer audit (p2p_diloco.sync.audit) then compares bytes, not bounds
    reproducible_encode: bool = False
    # whether every value of a part is sent (:meth:`carried` is None); False for a codec that sends a subset
    sends_every_value: ClassVar[bool] = True

    def encode(self, part: torch.Tensor) -> bytes:
        """The bytes of `part`: exactly ``encoded_size(part.numel())`` of them, coded on `part`'s device."""
        part = self._checked_part(part)
        if part.numel() == 0:
            return b""
        data = self._encode(part)
        assert len(data) == self.encoded_size(part.numel()), (self.name, len(data))
        return data

    def decode(self, data: bytes, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The float32 part of `numel` values that `data` encodes, decoded on `device` (a CPU or a CUDA
        GPU: the same bits); ValueError if `data` is malformed."""
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"codec {self.name!r}: numel must be an int >= 0, got {numel!r}")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"codec {self.name!r}: expected bytes, got {type(data).__name__}")
        data = bytes(data)
        device = _codec_device(self.name, torch.device(device))
        expected = self.encoded_size(numel)
        if len(data) != expected:
            raise ValueError(f"codec {self.name!r}: a part of {numel} values is {expected} bytes, got {len(data)}")
        if numel == 0:
            return torch.empty(0, dtype=torch.float32, device=device)
        part = self._decode(data, numel, device)
        bad = _non_finite(part)
        if bad:
            raise ValueError(f"codec {self.name!r}: the bytes decode to {bad} non-finite values of {numel}: "
                             "the part is malformed")
        return part

    def for_round(self, round_id: bytes) -> "Codec":
        """This codec as the members of the round `round_id` code their parts (`round_id`: bytes they all hold
        before any part moves, hivemind's group ID). Itself, for every codec whose format is fixed; a codec that
        sends a subset of the values (:class:`SharedMaskCodec`) draws the round's subset from it."""
        return self

    def carried(self, numel: int) -> Optional[torch.Tensor]:
        """Which values of a part of `numel` values this codec sends (bool, on the CPU); None: every value, as
        every dense codec does. A value not sent carries no information to the group's mean this round: it
        decodes to 0 there whatever it was, which the outer step must not read as "the group's mean is 0"
        (:meth:`p2p_diloco.train.outer.GlobalModel.apply`)."""
        return None

    @abstractmethod
    def encoded_size(self, numel: int) -> int:
        """The exact number of bytes that ``encode`` produces for a part of `numel` values."""

    @abstractmethod
    def error_bound(self, part: torch.Tensor) -> torch.Tensor:
        """float32 tensor like `part`: ``|decode(encode(part)) − part| ≤ error_bound(part)`` element-wise."""

    @abstractmethod
    def _encode(self, part: torch.Tensor) -> bytes:
        """`part` is checked: contiguous, 1-D, float32, finite, not empty, on a CPU or CUDA device."""

    @abstractmethod
    def _decode(self, data: bytes, numel: int, device: torch.device) -> torch.Tensor:
        """`data` has the right length and `numel` > 0; the result is on `device`, and the caller checks
        that it is finite."""

    def _checked_part(self, part: Any) -> torch.Tensor:
        if not isinstance(part, torch.Tensor):
            raise TypeError(f"codec {self.name!r}: expected a torch.Tensor, got {type(part).__name__}")
        if part.dtype != torch.float32 or part.dim() != 1:
            raise ValueError(f"codec {self.name!r}: expected a 1-D float32 tensor, got "
                             f"{part.dtype} of shape {tuple(part.shape)}")
        _codec_device(self.name, part.device)
        bad = _non_finite(part)
        if bad:
            raise ValueError(f"codec {self.name!r}: the part holds {bad} non-finite values (NaN or inf) of "
                             f"{part.numel()}; a pseudo-gradient that is not finite is never sent")
        return part.contiguous()


def _codec_device(codec: str, device: torch.device) -> torch.device:
    """`device` if the codecs run there (a CPU, or a CUDA GPU: the devices where the tests compare their
    bytes and bits); ValueError otherwise."""
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"codec {codec!r}: codes on a CPU or a CUDA GPU, not on {device}")
    return device


@functools.cache
def _on_device(device: torch.device, make: Callable, *args) -> Any:
    """``make(*args)``, a table of this module (a CPU tensor or a tuple of them), copied to `device`
    once: a codec's tables live where it codes."""
    table = make(*args)
    if isinstance(table, tuple):
        return tuple(t.to(device) for t in table)
    return table.to(device)


def _host_bytes(*tensors: torch.Tensor) -> bytes:
    """The bytes of `tensors`, each copied to the host first (where it is on a GPU), one after another, in
    the host's byte order: little-endian, the wire format's, on every platform torch ships for."""
    return b"".join((t if t.is_cpu else t.cpu()).numpy().tobytes() for t in tensors)


def _non_finite(values: torch.Tensor) -> int:
    """How many of `values` are NaN or infinite. A finite sum proves there are none (a NaN or an infinity
    makes the sum NaN or infinite): one reduction, several times faster than an element-wise test, which
    runs only when the sum is not finite (a part with such values, or finite values whose sum overflows)."""
    if math.isfinite(float(values.sum())):  # (a Python float: one dispatch fewer than torch.isfinite)
        return 0
    return values.numel() - int(torch.isfinite(values).sum())


@dataclass(frozen=True)
class RawFloat32Codec(Codec):
    """float32 as it is: exact, error bound 0."""

    name: str = "none"
    reproducible_encode: bool = True

    def encoded_size(self, numel: int) -> int:
        return 4 * numel

    def error_bound(self, part: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(self._checked_part(part))

    def _encode(self, part: torch.Tensor) -> bytes:
        return _host_bytes(part)

    def _decode(self, data: bytes, numel: int, device: torch.device) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(data, dtype="<f4").astype(np.float32)).to(device)


@dataclass(frozen=True)
class TwoByteFloatCodec(Codec):
    """float32 rounded to nearest (ties to even) in a 16-bit float: fp16 or bf16.

    With p significant bits (fp16: 11, bf16: 8), rounding a value in the normal range moves it by at
    most half an ulp, ``|x|·2^-p`` (Higham, *Accuracy and Stability of Numerical Algorithms*,
    Thm. 2.2). Below the smallest normal value (fp16: 2^-14 ≈ 6.1e-5, bf16: 2^-126) a value is
    rounded to a subnormal, which moves it by at most ``min(|x|, min_normal·2^-p)`` (half the
    subnormal spacing; fp16: 2^-25), or flushed to zero by a CPU that flushes subnormals, which
    moves it by ``|x|``. Hence the bound, element-wise::

        |x|·2^-p   if |x| ≥ min_normal,        |x|   otherwise.

    A value above the format's largest finite one (fp16: 65504, bf16: ≈3.39e38) would become inf:
    the part is rejected instead (a pseudo-gradient that large means the run diverged).
    """

    dtype: torch.dtype = torch.float16
    significant_bits: int = 11
    min_normal: float = 2.0**-14

    def encoded_size(self, numel: int) -> int:
        return 2 * numel

    def error_bound(self, part: torch.Tensor) -> torch.Tensor:
        magnitude = self._checked_part(part).abs()
        return torch.where(magnitude >= self.min_normal, magnitude * 2.0**-self.significant_bits, magnitude)

    def _encode(self, part: torch.Tensor) -> bytes:
        largest = torch.finfo(self.dtype).max
        low, high = torch.aminmax(part)  # one pass, and no temporary of the part's size
        too_large = int((part.abs() > largest).sum()) if max(float(high), -float(low)) > largest else 0
        if too_large:
            raise ValueError(f"codec {self.name!r}: {too_large} values exceed {self.dtype}'s largest finite value "
                             f"{largest:.6g} (max |x| = {float(part.abs().max()):.3g}); a pseudo-gradient that large "
                             "means training diverged: lower the learning rate, or use codec 'none'")
        return _host_bytes(part.to(self.dtype).view(torch.int16))

    def _decode(self, data: bytes, numel: int, device: torch.device) -> torch.Tensor:
        bits = torch.from_numpy(np.frombuffer(data, dtype="<i2").astype(np.int16)).to(device)
        return bits.view(self.dtype).float()  # exact: every fp16 and bf16 value is a float32 value


def _blocks(values: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full blocks of `values` as a [blocks, blocksize] view, and the shorter last block (maybe empty)."""
    numel = values.numel()
    if numel % blocksize == 0:  # every pass but a part's last: two dispatches, not four
        return values.view(-1, blocksize), values.narrow(0, numel, 0)
    full = numel // blocksize * blocksize
    return values.narrow(0, 0, full).view(-1, blocksize), values.narrow(0, full, numel - full)


def _block_absmax(part: torch.Tensor, blocksize: int, magnitude: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The largest |x| of each block of `blocksize` values (the last block may be shorter): float32, in `out`
    where given. `magnitude` is ``part.abs()`` where the caller has it."""
    full, tail = _blocks(part.abs() if magnitude is None else magnitude, blocksize)
    if out is None:
        out = torch.empty(full.shape[0] + (tail.numel() > 0), dtype=torch.float32, device=part.device)
    if not tail.numel():  # (a part on the block grid: no slicing, a dispatch of its own)
        return torch.amax(full, dim=1, out=out)
    torch.amax(full, dim=1, out=out.narrow(0, 0, full.shape[0]))
    torch.amax(tail, dim=0, keepdim=True, out=out.narrow(0, full.shape[0], 1))
    return out


# values a CPU codes in one pass of a block codec: each pass's temporaries (a few of 512 KB) stay in the core's
# caches, where a temporary of a whole part (16 MB for 4M values) goes to memory and first costs its pages
_PASS_VALUES = 2**17


def _passes(numel: int, blocksize: int, device: torch.device) -> list[tuple[int, int]]:
    """The spans [start, stop) in which a block codec codes a part of `numel` values on `device`: on a CPU, runs
    of about :data:`_PASS_VALUES` values on the block grid, so that each codes its values as the whole part
    does; on a GPU, the whole part at once."""
    step = numel if device.type != "cpu" else max(_PASS_VALUES // blocksize, 1) * blocksize
    return [(start, min(start + step, numel)) for start in range(0, numel, step)]


def _scale_blocks_(values: torch.Tensor, scales: torch.Tensor, blocksize: int, first_block: int = 0) -> torch.Tensor:
    """``values[i] *= scales[first_block + i // blocksize]`` in place, each block's scale broadcast over it (never
    copied per value): one float32 multiply per value."""
    full, tail = _blocks(values, blocksize)
    full.mul_(scales[first_block:first_block + full.shape[0], None])
    if tail.numel():
        tail.mul_(scales[first_block + full.shape[0]])
    return values


def _per_element(block_values: torch.Tensor, blocksize: int, numel: int) -> torch.Tensor:
    return block_values.repeat_interleave(blocksize)[:numel]


def _scales_from_bytes(codec: str, data: bytes, device: torch.device) -> torch.Tensor:
    """The float32 block scales at the end of a part, on `device`; ValueError unless each is finite and ≥ 0
    (checked on the host, before they move)."""
    scales = torch.from_numpy(np.frombuffer(data, dtype="<f4").astype(np.float32))
    bad = int((~torch.isfinite(scales) | (scales < 0)).sum())
    if bad:
        raise ValueError(f"codec {codec!r}: {bad} block scales of {scales.numel()} are negative or not finite: "
                         "the part is malformed")
    return scales.to(device)


def _scaled_lookup(table: torch.Tensor, data: bytes, numel: int, scales: torch.Tensor, blocksize: int,
                   device: torch.device, per_byte: int = 1) -> torch.Tensor:
    """The decode of every block codec: ``table[code]·scale`` of the value's block, one float32 multiply
    per value. A product of two float32 values is rounded once, to nearest, on every CPU (IEEE 754), so
    the decoded part is the same bits on every peer, whatever kernels its CPU has (bitsandbytes' own
    C decoders give the same bits on x86, but for the sign of FP4's zero code; the tests compare them).

    The codes are the first bytes of `data`, `per_byte` to a byte: one (`table` holds a float32 per code),
    two, the first in the high nibble (`table` holds a value pair per byte, :func:`_nibble_pairs`), or four or
    eight, the first in the low bits (`table` holds a byte's values as a row of int64,
    :func:`_mean_scaled_byte_values`); the pad codes of a `numel` off that grid are dropped. A byte is looked up
    by an index_select with int32 codes (several times faster on a CPU than indexing with int64), pass by pass
    (:func:`_passes`) into the decoded part."""
    decoded = torch.empty(-(-numel // per_byte) * per_byte, dtype=torch.float32, device=device)
    # a value pair is looked up as one int64, four as a row of two: moved bit for bit
    looked_up = decoded.view(table.dtype).view(-1, *table.shape[1:])
    codes = np.frombuffer(data, dtype=np.uint8, count=looked_up.shape[0])
    spans = _passes(looked_up.shape[0], max(blocksize // per_byte, 1), device)
    index = torch.empty(spans[0][1], dtype=torch.int32)
    for start, stop in spans:
        length = stop - start
        index_pass = index.narrow(0, 0, length)
        np.copyto(index_pass.numpy(), codes[start:stop], casting="safe")
        torch.index_select(table, 0, index_pass.to(device), out=looked_up.narrow(0, start, length))
        _scale_blocks_(decoded.narrow(0, start * per_byte, length * per_byte), scales, blocksize,
                       start * per_byte // blocksize)
    return decoded if decoded.numel() == numel else decoded[:numel].clone()


def _nibble_pairs(kind: str) -> torch.Tensor:
    """For each byte b of two 4-bit codes, the values of its codes (b >> 4, b & 15) in the decode table of
    `kind` (e3m0, nf4, fp4), their 8 bytes read as one int64, on the CPU: what :func:`_scaled_lookup` looks
    up (and :func:`_on_device` copies)."""
    table = _e3m0_values() if kind == "e3m0" else _bnb_4bit_decode_table(kind)
    pairs = torch.stack([table.repeat_interleave(16), table.repeat(16)], dim=1).contiguous()
    return pairs.view(torch.int64).view(-1)


def _pack_nibbles(codes: torch.Tensor, numel: int, out: torch.Tensor) -> torch.Tensor:
    """The first `numel` 4-bit `codes` (uint8, with room for one more) two per byte into `out` (uint8), the
    first in the high nibble; an odd count pads with code 0. The pairs are read as 16-bit words
    w = first + 256·second (little-endian, as on every platform torch ships for), so that one shift each way
    gives the byte: ``(w << 4 | w >> 8) & 0xFF``, the mask being the cast to uint8 (a strided multiply-add
    per pair was 4× slower)."""
    if numel % 2:
        codes.narrow(0, numel, 1).zero_()
    words = codes.narrow(0, 0, numel + numel % 2).view(torch.int16)
    return out.copy_((words << 4).bitwise_or_(words >> 8))


def _decode_nibbles(codec: str, kind: str, data: bytes, numel: int, blocksize: int,
                    device: torch.device) -> torch.Tensor:
    """A 4-bit part: `numel` codes of `kind` (e3m0, nf4, fp4) two per byte, the first in the high nibble (an odd
    numel's pad code dropped), then the block scales; decoded on `device`."""
    packed_bytes = -(-numel // 2)
    scales = _scales_from_bytes(codec, data[packed_bytes:], device)
    return _scaled_lookup(_on_device(device, _nibble_pairs, kind), data, numel, scales, blocksize, device, per_byte=2)


def _absmax_bound(part: torch.Tensor, blocksize: int, fraction_of_absmax: float) -> torch.Tensor:
    """``fraction·absmax`` of each value's block; ``absmax`` where absmax is subnormal (see below).

    bitsandbytes scales a block by ``1/absmax``, which overflows or loses its precision when absmax
    is below 2^-126. The decoded value is still ``code·absmax`` with ``|code| ≤ 1`` and, for x ≠ 0,
    with the sign of x (measured with bitsandbytes 0.50 on the CPU), so it is within absmax of x.
    """
    absmax = _per_element(_block_absmax(part, blocksize), blocksize, part.numel())
    return torch.where(absmax >= FLOAT32_MIN_NORMAL, absmax * fraction_of_absmax, absmax)


@functools.cache
def _bnb_functional():
    import bitsandbytes.functional  # imported on first use: it takes seconds and probes for GPUs

    return bitsandbytes.functional


@functools.cache
def _bnb_map(kind: str) -> torch.Tensor:
    """bitsandbytes' code map `kind` (dynamic, nf4, fp4), as float32 on the CPU, checked against the wire format.

    The dynamic map is the wire format's own copy (:data:`_DYNAMIC_MAP_HEX`); the 4-bit maps come from
    bitsandbytes, which divides constants by their largest (one IEEE division each, the same on every CPU)."""
    if kind == "dynamic":
        code = torch.from_numpy(np.frombuffer(bytes.fromhex(_DYNAMIC_MAP_HEX), dtype="<f4").copy())
    else:
        code = _bnb_functional().get_4bit_type(kind, device="cpu").to(device="cpu", dtype=torch.float32)
    code = code.contiguous()
    digest = hashlib.sha256(code.numpy().astype("<f4").tobytes()).hexdigest()
    if digest != _BNB_MAP_SHA256[kind]:
        import bitsandbytes

        raise RuntimeError(f"bitsandbytes {bitsandbytes.__version__} has a different {kind} code map than the one "
                           "this wire format uses (that of bitsandbytes 0.50): peers would decode the same bytes "
                           "differently; install bitsandbytes 0.50")
    return code


@functools.cache
def _bnb_4bit_decode_table(quant_type: str) -> torch.Tensor:
    """The value of each 4-bit code as bitsandbytes' C decoder gives it: its map, except that FP4 code 8
    (the sign bit over a zero magnitude) decodes to −0.0 where the map holds +0.0. bitsandbytes 0.50 itself
    gives −0.0 in its scalar loop and +0.0 in its AVX-512 loop (runs of 32 values on a CPU with AVX-512):
    the wire format takes −0.0 on every CPU."""
    table = _bnb_map(quant_type).clone()
    if quant_type == "fp4":
        table[8] = -0.0
    return table


@dataclass(frozen=True)
class BlockwiseInt8Codec(Codec):
    """bitsandbytes' blockwise dynamic 8-bit quantization (Dettmers et al. 2022, arXiv 2110.02861).

    Each block of 256 values is divided by its absolute maximum and each value is mapped to one of
    the 256 values of the signed dynamic map (``create_dynamic_map(signed=True)``, in [−0.993, 1]).
    Wire format: ``numel`` code bytes, then one float32 absmax per block; the map is fixed and
    checked against a fingerprint, not sent.

    Each value is scaled as bitsandbytes scales it and coded by :func:`_nearest_codes` (the nearest map
    value by the float32 midpoints, ties to the lower; bitsandbytes' own CPU kernel, a binary search,
    is slower and not quite nearest).

    Bound: ``0.0075·absmax`` of the value's block. The largest gap between neighbouring map values is
    0.0140625 (near ±1, where the map is linear), so rounding to nearest moves a value by at most
    0.00703·absmax; bitsandbytes' CPU kernel measured not quite nearest, by up to 3e-5·absmax next to
    a midpoint, and its worst measured error is 0.00705·absmax. The bound keeps a 6 % margin over that,
    for either encoder. For a block whose absmax is subnormal the bound is absmax
    (:func:`_absmax_bound`). For comparison, absmax/127 = 0.00787·absmax.
    """

    name: str = "int8"
    blocksize: int = 256
    fraction_of_absmax: float = 0.0075
    reproducible_encode: bool = True  # block absmax, one division, one multiply, comparisons with constant midpoints

    def encoded_size(self, numel: int) -> int:
        return numel + 4 * -(-numel // self.blocksize)

    def error_bound(self, part: torch.Tensor) -> torch.Tensor:
        return _absmax_bound(self._checked_part(part), self.blocksize, self.fraction_of_absmax)

    def _encode(self, part: torch.Tensor) -> bytes:
        return _host_bytes(*_blockwise_codes(part, self.blocksize, "dynamic"))

    def _decode(self, data: bytes, numel: int, device: torch.device) -> torch.Tensor:
        absmax = _scales_from_bytes(self.name, data[numel:], device)
        return _scaled_lookup(_on_device(device, _bnb_map, "dynamic"), data, numel, absmax, self.blocksize, device)


_PREFIX_BITS = 16  # a float32 is looked up by its 16 high bits: sign, exponent and 7 bits of mantissa


@functools.cache
def _prefix_tables(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`_nearest_codes` looks up, for each 16-bit prefix p of a float32 in [−1, 1] (offset by
    2^15 to count from 0): the one midpoint between two values of bitsandbytes' map `kind` (dynamic, nf4,
    fp4) that falls inside the prefix's interval (+inf if none), and the codes (uint8) of the map values
    nearest below and above it, at p and 2^16 + p. A prefix beyond ±1 down to ±(1 + 2^-7) codes as ±1:
    a value scaled by its block's reciprocal absolute maximum exceeds 1 by a rounding at most.

    Every interval of floats that share a prefix is narrower (2^-7 of its magnitude) than the gaps
    between these maps' midpoints (the dynamic map's are at least 1.06 % apart), so it holds at most one
    midpoint: checked here."""
    code = _bnb_map(kind)
    order = torch.argsort(code)
    midpoints = (code[order[:-1]] + code[order[1:]]) / 2
    prefixes = torch.arange(-(2 ** (_PREFIX_BITS - 1)), 2 ** (_PREFIX_BITS - 1), dtype=torch.int32)
    shift = 32 - _PREFIX_BITS
    ends = torch.stack([prefixes << shift, prefixes << shift | (2**shift - 1)]).view(torch.float32)
    finite = torch.isfinite(ends).all(dim=0)  # a prefix beyond [-1, 1] is never met: any entry will do
    low, high = torch.where(finite, ends, 0.0).clamp(-1.0, 1.0).sort(dim=0).values
    rank_low, rank_high = torch.bucketize(low, midpoints), torch.bucketize(high, midpoints)
    assert int((rank_high - rank_low).max()) <= 1, f"two {kind} midpoints under one float32 prefix"
    crossing = rank_high > rank_low
    inside = torch.where(crossing, midpoints[rank_low.clamp(max=len(midpoints) - 1)], torch.tensor(float("inf")))
    below_and_above = torch.cat([order[rank_low], order[rank_high]]).to(torch.uint8)
    return below_and_above, inside


def _nearest_codes(scaled: torch.Tensor, kind: str, out: torch.Tensor | None = None,
                   index: torch.Tensor | None = None, midpoint: torch.Tensor | None = None) -> torch.Tensor:
    """The code (uint8) of the nearest value of bitsandbytes' map `kind` to each `scaled` value in [−1, 1],
    ties to the lower value: exactly ``order[torch.bucketize(scaled, midpoints)]`` (the tests compare
    them), from two table lookups by the value's 16 high bits p: the midpoint in p's interval, and the
    code at p + (2^16 if the value is above that midpoint), where "above" is the sign bit of
    midpoint − value (+0 when equal), an integer shift (a CPU compares floats into booleans several
    times slower). `scaled` is left as it was; `out`, `index` (int32) and `midpoint` (float32), like
    `scaled`, are where the codes and the temporaries go, where given."""
    below_and_above, midpoints = _on_device(scaled.device, _prefix_tables, kind)
    prefix = torch.bitwise_right_shift(scaled.view(torch.int32), 32 - _PREFIX_BITS, out=index)
    prefix.add_(2 ** (_PREFIX_BITS - 1))
    minus_above = torch.index_select(midpoints, 0, prefix, out=midpoint).sub_(scaled).view(torch.int32)
    return torch.index_select(below_and_above, 0, prefix.sub_(minus_above.bitwise_right_shift_(31), alpha=2**_PREFIX_BITS),
                              out=out)


def _scaled_blocks(values: torch.Tensor, blocksize: int, absmax: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Each value times the reciprocal of its block's absolute maximum (at least 1e-38), as bitsandbytes
    scales a block before it quantizes it, within [−1, 1] but for a rounding (no clamp: the tables of
    :func:`_nearest_codes` code ±(1 + 2^-23) as ±1), into `out`; the blocks' absolute maxima into `absmax`."""
    _block_absmax(values, blocksize, torch.abs(values, out=out), out=absmax)
    reciprocal = 1.0 / absmax.clamp(min=1e-38)
    (full, tail), (full_out, tail_out) = _blocks(values, blocksize), _blocks(out, blocksize)
    if not tail.numel():
        torch.mul(full, reciprocal.unsqueeze(1), out=full_out)
        return out
    torch.mul(full, reciprocal[: full.shape[0], None], out=full_out)
    torch.mul(tail, reciprocal[-1], out=tail_out)
    return out


def _blockwise_codes(part: torch.Tensor, blocksize: int, kind: str, packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The code (uint8) of each value of `part` in bitsandbytes' map `kind`, two to a byte if `packed`
    (:func:`_pack_nibbles`), and the absolute maximum of each block: :func:`_scaled_blocks` and
    :func:`_nearest_codes`, pass by pass (:func:`_passes`)."""
    numel, device = part.numel(), part.device
    spans = _passes(numel, blocksize, device)
    codes = torch.empty(-(-numel // 2) if packed else numel, dtype=torch.uint8, device=device)
    absmax = torch.empty(-(-numel // blocksize), dtype=torch.float32, device=device)
    width = spans[0][1]
    scaled, midpoint = torch.empty(2, width, dtype=torch.float32, device=device)
    index = torch.empty(width, dtype=torch.int32, device=device)
    unpacked = torch.empty(width + 1, dtype=torch.uint8, device=device) if packed else None
    for start, stop in spans:  # (narrow: a third of the dispatch time of a slice)
        length = stop - start
        scaled_pass = scaled.narrow(0, 0, length)
        _scaled_blocks(part.narrow(0, start, length), blocksize,
                       absmax.narrow(0, start // blocksize, -(-length // blocksize)), scaled_pass)
        into = unpacked.narrow(0, 0, length) if packed else codes.narrow(0, start, length)
        _nearest_codes(scaled_pass, kind, into, index.narrow(0, 0, length), midpoint.narrow(0, 0, length))
        if packed:
            _pack_nibbles(unpacked, length, codes.narrow(0, start // 2, -(-length // 2)))
    return codes, absmax


@dataclass(frozen=True)
class Bnb4BitCodec(Codec):
    """bitsandbytes' 4-bit blockwise quantization, NF4 or FP4 (Dettmers et al. 2023, QLoRA, arXiv 2305.14314).

    Each block of 64 values is scaled by the reciprocal of its absolute maximum, as bitsandbytes scales
    it, and each value is rounded to the nearest of 16 map values, ties to the lower: by
    :func:`_nearest_codes`, six times faster than bitsandbytes 0.50's CPU quantizer (``torch.bucketize``
    on the midpoints) and the same codes, but where that quantizer's copy of the map moves a midpoint
    by a float32 rounding (one NF4 value in a million measured; FP4 below).
    Two codes per byte, the first in the high nibble; then one float32 absmax per block. The map is
    fixed by the quant type (checked against a fingerprint), so only absmax travels; decode is the
    map's value times absmax (:func:`_scaled_lookup`, what bitsandbytes' dequantize computes) and
    ignores the pad code of an odd ``numel``.

    * NF4: the quantiles of a normal distribution. Largest gap 1 − 0.6962 (between −1 and −0.6962),
      so the bound is ``0.1520·absmax`` (half of it, 0.15190, plus margin).
    * FP4 of bitsandbytes is **not** the E3M0 of Streaming DiLoCo (:class:`E3M0Codec`): it has two
      exponent bits, one mantissa bit and a subnormal code, with magnitudes
      {0, 1/192, 1/6, 1/4, 1/3, 1/2, 2/3, 1}·absmax. Largest gap 1/3 (between 2/3 and 1); bitsandbytes'
      own quantizer takes its midpoints from a 4-decimal copy of the map (0.6667), which shifts the
      midpoint by 2e-5, so the bound is ``0.1668·absmax``, for its encoder and for this one.

    For a block whose absmax is subnormal the bound is absmax (:func:`_absmax_bound`).
    """

    name: str = "nf4"
    quant_type: str = "nf4"
    blocksize: int = 64
    fraction_of_absmax: float = 0.1520
    reproducible_encode: bool = True  # block absmax, one division, one multiply, comparisons with constant midpoints

    def encoded_size(self, numel: int) -> int:
        return -(-numel // 2) + 4 * -(-numel // self.blocksize)

    def error_bound(self, part: torch.Tensor) -> torch.Tensor:
        return _absmax_bound(self._checked_part(part), self.blocksize, self.fraction_of_absmax)

    def _encode(self, part: torch.Tensor) -> bytes:
        return _host_bytes(*_blockwise_codes(part, self.blocksize, self.quant_type, packed=True))

    def _decode(self, data: bytes, numel: int, device: torch.device) -> torch.Tensor:
        return _decode_nibbles(self.name, self.quant_type, data, numel, self.blocksize, device)


# E3M0 magnitudes of codes 0..7, and the midpoints between neighbours (rounding to nearest value)
_E3M0_MAGNITUDES = [0.0] + [2.0**e for e in range(-6, 1)]
_E3M0_MIDPOINTS = torch.tensor([2.0**-7] + [3.0 * 2.0**e for e in range(-7, -1)], dtype=torch.float32)
_E3M0_VALUES = torch.tensor(_E3M0_MAGNITUDES + [-m for m in _E3M0_MAGNITUDES], dtype=torch.float32)
_BITS_OF_2_POW_MINUS_7 = 120 << 23  # the float32 bits of 2^-7


def _e3m0_values() -> torch.Tensor:
    """The value of each E3M0 code (code 8 is −0), on the CPU: what :func:`_on_device` copies."""
    return _E3M0_VALUES


def _e3m0_exponent_codes(ratio: torch.Tensor) -> torch.Tensor:
    """The code 0..7 of each ratio r ∈ [0, 1] (float32): its nearest level in {0, 2^-6, ..., 2^-1, 1}, ties
    to the lower, exactly ``torch.bucketize(r, _E3M0_MIDPOINTS)``, in a few integer passes instead of a
    binary search per value (the tests compare them).

    Read r's float32 bits b as an integer (non-negative floats are ordered as their bits). For r ≥ 2^-6,
    r = (1 + f)·2^(E−127) lies between the levels 2^(E−127) and 2^(E−126), whose midpoint 1.5·2^(E−127) has
    the mantissa field 2^22; adding 2^22 − 1 to b carries into the exponent field exactly when the mantissa
    field is above 2^22, so ``((b + 2^22 − 1) >> 23) − 120`` is the code (level 2^(e−7) has code e). Below
    2^-6 the levels are 0 and 2^-6, with midpoint 2^-7: the code is 1 exactly when b > bits(2^-7), and the
    shifted formula gives 0 or 1 there (clamped at 0), so the larger of the two is the code everywhere.
    `ratio` is overwritten; the codes are int32. (Integer arithmetic only: a CPU compares floats into
    booleans several times slower than it shifts integers.)"""
    bits = ratio.view(torch.int32)
    above_half_level = (bits - (_BITS_OF_2_POW_MINUS_7 + 1)).bitwise_right_shift_(31).add_(1)  # 1 iff b > bits(2^-7)
    codes = bits.add_(2**22 - 1).bitwise_right_shift_(23).sub_(120).clamp_(min=0)
    return torch.maximum(codes, above_half_level)


@functools.cache
def _e3m0_code_table() -> torch.Tensor:
    """The E3M0 code (uint8, sign included) of every signed ratio x/scale ∈ [−1, 1], by ``c = ceil(b / 2^16)``
    of its float32 bits b read as an int32 (offset by 2^15 to count from 0), on the CPU.

    A negative float's bits are its magnitude's minus 2^31, and 2^31 is a multiple of 2^16, so c of a value
    is c of its magnitude, offset by −2^15 when it is negative. All the magnitudes with one c, an interval
    ``((c − 1)·2^16, c·2^16]`` of bits, have one code: every midpoint between two E3M0 levels (2^-7, and
    3·2^k, whose mantissa field is 2^22) has bits that are a multiple of 2^16, so it is the top of its
    interval, which codes it to the lower magnitude, as the ties go; so the code of an interval is
    :func:`_e3m0_exponent_codes` of its top (the tests compare every level and midpoint, and their float32
    neighbours). A negative value whose magnitude does not code to 0 gets the sign bit (8)."""
    tops = (torch.arange(2**15, dtype=torch.int32) << 16).clamp_(max=0x3F800000)  # magnitudes up to 1
    magnitude_codes = _e3m0_exponent_codes(tops.view(torch.float32).clone()).to(torch.uint8)
    negative_codes = torch.where(magnitude_codes > 0, magnitude_codes | 8, magnitude_codes)
    return torch.cat([negative_codes, magnitude_codes])


def _codes_by_ratio(values: torch.Tensor, scales: torch.Tensor, blocksize: int, table: torch.Tensor,
                    ratio: torch.Tensor, out: torch.Tensor) -> None:
    """The code (uint8, into `out`) of each of `values` in a format whose code depends on r = x / scale alone,
    r being one IEEE division by its block's scale (a block of scale 0 is divided by 1; |x / s| is |x| / s, bit
    for bit), into `ratio`. The code is ``table[ceil(b / 2^16) + 2^15]``, b the float32 bits of r read as an
    int32, so `table` (2^16 codes) gives one code to every run of floats that share their 16 high bits, the
    run's top included: a format whose thresholds between codes have bits that are multiples of 2^16 (its ties
    go to the lower magnitude) is coded exactly, whatever r is (a negative float's bits are its magnitude's
    minus 2^31, so the table's first half holds the negative codes). One division and three integer passes: a
    CPU compares floats into booleans several times slower than it shifts integers."""
    divisors = torch.where(scales > 0, scales, 1.0)
    (full, tail), (full_ratio, tail_ratio) = _blocks(values, blocksize), _blocks(ratio, blocksize)
    torch.div(full, divisors[: full.shape[0], None], out=full_ratio)
    if tail.numel():
        torch.div(tail, divisors[-1], out=tail_ratio)
    # b + 2^16 − 1 never overflows: |r| is at most +inf (0x7F800000), never NaN
    index = ratio.view(torch.int32).add_(2**16 - 1).bitwise_right_shift_(16).add_(2**15)
    torch.index_select(table, 0, index, out=out)


@dataclass(frozen=True)
class E3M0Codec(Codec):
    """FP4 E3M0 as in Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512): 1 sign bit,
    3 exponent bits, no mantissa, with a float32 scale per block of 64 values.

    The paper fixes the bit layout only; the levels, the scale and the rounding here are this
    project's choice. Code ``s·8 + e`` (s the sign, e in 0..7) stands for ``±scale·m(e)``, with
    m(0) = 0 and m(e) = 2^(e−7) for e = 1..7: the magnitudes {0, 2^-6, 2^-5, …, 2^-1, 1}, seven powers
    of two and zero. The scale is the block's absolute maximum, so the largest value is exact. Each
    value goes to the **nearest** level (not the nearest in the log domain, whose worst relative
    error is √2 − 1 ≈ 0.41 instead of 1/3); ties go to the smaller magnitude, and zero is always
    encoded with the sign bit clear (decode reads code 8 as −0). Two codes per byte, the first in
    the high nibble (an odd ``numel`` pads with code 0, which decode ignores); then one float32
    scale per block, little-endian.

    Bound. Write r = |x|/scale ∈ [0, 1]. If 2^(k−1) ≤ r ≤ 2^k (k = −5..0), the nearest level is
    at most min(r − 2^(k−1), 2^k − r) away, largest at the midpoint r = 3·2^(k−2): 2^(k−2) = r/3.
    If r < 2^-6 the neighbours are 0 and 2^-6, at most 2^-7 away. So, with exact arithmetic,
    ``|x̂ − x| ≤ max(|x|/3, scale/128)``. In float32, r is rounded by at most 2^-24·r, which can only
    send a value within that distance of a midpoint to its other neighbour, and ``scale·m(e)`` is
    exact (a power of two times a float32) unless it falls below 2^-126, where it rounds by at most
    2^-150. The stated bound is therefore ``max(|x|/3, scale/128)·(1 + 2^-20) + 2^-149``.
    """

    name: str = "fp4-e3m0"
    blocksize: int = 64
    reproducible_encode: bool = True  # block absmax, one division, comparisons with constant midpoints

    def encoded_size(self, numel: int) -> int:
        return -(-numel // 2) + 4 * -(-numel // self.blocksize)

    def error_bound(self, part: torch.Tensor) -> torch.Tensor:
        part = self._checked_part(part)
        scale = _per_element(_block_absmax(part, self.blocksize), self.blocksize, part.numel())
        return torch.maximum(part.abs() / 3, scale / 128) * (1 + 2.0**-20) + FLOAT32_MIN_SUBNORMAL

    def _encode(self, part: torch.Tensor) -> bytes:
        numel, device, blocksize = part.numel(), part.device, self.blocksize
        spans = _passes(numel, blocksize, device)  # each pass's temporaries stay in the CPU's caches
        packed = torch.empty(-(-numel // 2), dtype=torch.uint8, device=device)
        scales = torch.empty(-(-numel // blocksize), dtype=torch.float32, device=device)
        width = spans[0][1]
        ratio, codes = torch.empty(width, device=device), torch.empty(width + 1, dtype=torch.uint8, device=device)
        for start, stop in spans:  # (narrow: a third of the dispatch time of a slice)
            length = stop - start
            self._codes(part.narrow(0, start, length), scales.narrow(0, start // blocksize, -(-length // blocksize)),
                        ratio.narrow(0, 0, length), codes.narrow(0, 0, length))
            _pack_nibbles(codes, length, packed.narrow(0, start // 2, -(-length // 2)))
        return _host_bytes(packed, scales)

    def _codes(self, values: torch.Tensor, scales: torch.Tensor, ratio: torch.Tensor, out: torch.Tensor) -> None:
        """The code of each of `values` into `out` (uint8), its blocks' scales into `scales`; `ratio` (float32,
        like `values`) takes x / scale (:func:`_codes_by_ratio`, :func:`_e3m0_code_table`)."""
        _block_absmax(values, self.blocksize, torch.abs(values, out=ratio), out=scales)
        _codes_by_ratio(values, scales, self.blocksize, _on_device(values.device, _e3m0_code_table), ratio, out)

    def _decode(self, data: bytes, numel: int, device: torch.device) -> torch.Tensor:
        return _decode_nibbles(self.name, "e3m0", data, numel, self.blocksize, device)


@dataclass(frozen=True)
class _MeanScaledFormat:
    """The levels of a :class:`MeanScaledCodec`, by its bits a value, in units of its block's mean |x|: the sign,
    and a magnitude code that is 1 where |x / scale| > `threshold` (ties below; its float32 bits a multiple of
    2^16, :func:`_codes_by_ratio`). All exact in float32. `reach`: the largest error below the threshold."""

    levels: tuple[float, ...]  # the magnitude of each magnitude code
    threshold: float  # +inf for one level
    reach: float


_MEAN_SCALED_FORMATS = {
    # the sign times the mean |x|: the scaled sign of EF-signSGD (Karimireddy et al. 2019, arXiv 1901.09847)
    1: _MeanScaledFormat(levels=(1.0,), threshold=math.inf, reach=1.0),
    # within 2.4 % of the optimal four levels of a Gaussian (Max 1960, Lloyd 1982: ±0.4528σ and ±1.510σ, the
    # threshold at 0.9816σ, with mean |x| = 0.798σ)
    2: _MeanScaledFormat(levels=(0.5625, 1.875), threshold=1.25, reach=1.25 - 0.5625),
}


@functools.cache
def _mean_scaled_code_table(bits: int) -> torch.Tensor:
    """The code (uint8) of every ratio r = x / scale, indexed as :func:`_codes_by_ratio` reads it, on the CPU: the
    top bit the sign of r, then (2 bits) whether |r| > the threshold; every |r| of a run of floats with 16 high
    bits c is above a threshold whose bits are a multiple of 2^16 exactly when c is above its 16 high bits."""
    threshold_high_bits = int(np.float32(_MEAN_SCALED_FORMATS[bits].threshold).view(np.int32)) >> 16  # ∞: 0x7F80
    magnitude_codes = (torch.arange(2**15, dtype=torch.int32) > threshold_high_bits).to(torch.uint8)
    return torch.cat([magnitude_codes | (1 << (bits - 1)), magnitude_codes])


@functools.cache
def _mean_scaled_byte_values(bits: int) -> torch.Tensor:
    """For each byte of 8 / `bits` codes (the first in the low bits), their values in units of the scale, read as
    int64 (a [256, 4 / bits] tensor), on the CPU: what :func:`_scaled_lookup` looks up (and :func:`_on_device`
    copies)."""
    levels = torch.tensor(_MEAN_SCALED_FORMATS[bits].levels)
    values = torch.cat([levels, -levels])  # code = sign · 2^(bits − 1) + magnitude code
    codes = torch.arange(256).unsqueeze(1).bitwise_right_shift(torch.arange(0, 8, bits)).bitwise_and_(2**bits - 1)
    return values[codes].contiguous().view(torch.int64)


def _pack_low_first(codes: torch.Tensor, numel: int, bits: int, out: torch.Tensor) -> torch.Tensor:
    """The first `numel` codes of `bits` bits (uint8, with room for a byte's worth more) 8 / `bits` per byte into
    `out` (uint8), the first in the low bits; a `numel` off that grid pads with code 0. A byte's codes are read as
    one word w = c0 + 2^8·c1 + 2^16·c2 + … (little-endian), whose low byte after ``w | w >> (8 − bits) |
    w >> 2(8 − bits) | …`` holds ``c0 | c1 << bits | c2 << 2·bits | …``, the cast to uint8 keeping it."""
    per_byte = 8 // bits
    padded = -(-numel // per_byte) * per_byte
    codes.narrow(0, numel, padded - numel).zero_()
    words = codes.narrow(0, 0, padded).view(torch.int64 if per_byte == 8 else torch.int32)
    packed = words.clone()
    for k in range(1, per_byte):
        packed.bitwise_or_(words >> (k * (8 - bits)))
    return out.copy_(packed)


def _row_sums(rows: torch.Tensor) -> torch.Tensor:
    """The sum of each row of `rows` ([n, 2^k]) as a tree of halves, ``s[:, :k] + s[:, k:]``: one IEEE addition
    after another on whole tensors, in the same order on every CPU and GPU whatever its vector width (the order
    of a torch.sum depends on it), so the same bits everywhere."""
    while rows.shape[1] > 1:
        half = rows.shape[1] // 2
        rows = torch.add(rows[:, :half], rows[:, half:])
    return rows.view(-1)


def _block_mean_abs(magnitude: torch.Tensor, blocksize: int, out: torch.Tensor) -> torch.Tensor:
    """The mean of each block of `magnitude` (|x|, overwritten), `blocksize` a power of two, into `out`: each value
    times 1/blocksize (exact but below 2^-126), then each block's :func:`_row_sums`; a last, shorter block of
    length L is padded with zeros and its sum multiplied by the float32 nearest blocksize / L. Scaled before it
    is summed, no block of finite values overflows but for a rounding at float32's largest."""
    magnitude.mul_(1.0 / blocksize)
    full, tail = _blocks(magnitude, blocksize)
    out.narrow(0, 0, full.shape[0]).copy_(_row_sums(full))
    if tail.numel():
        padded = torch.cat([tail, tail.new_zeros(blocksize - tail.numel())]).view(1, blocksize)
        widen = torch.tensor(blocksize / tail.numel(), dtype=torch.float32, device=tail.device)
        out.narrow(0, full.shape[0], 1).copy_(_row_sums(padded)).mul_(widen)
    return out


@dataclass(frozen=True)
class MeanScaledCodec(Codec):
    """1 or 2 bits a value with a float32 scale per block of 64 values, the block's mean |x|: each value's sign
    and, with 2 bits, one of two magnitudes, 0.5625 or 1.875 times the scale, the nearer as far as a threshold at
    1.25 times it decides (:data:`_MEAN_SCALED_FORMATS`); with 1 bit, the scale itself (EF-signSGD's scaled sign).
    A scale of the mean rather than the absolute maximum keeps the levels where most values are: a value beyond
    the top level is clipped, and what the clip or the rounding leaves is the error feedback's
    (:mod:`p2p_diloco.train.error_feedback`; MuLoCo's 2-bit and SparseLoCo's 2-bit values keep error feedback,
    arXiv 2505.23725, 2508.15706). 8 / bits codes per byte, the first in the low bits (a `numel` off that grid
    pads with code 0, which decode ignores); then one float32 scale per block, little-endian: 0.3125 bytes per
    parameter with 2 bits, 0.1875 with 1. Zero has no code: it decodes to ± the lowest level, within the bound.

    Encode is IEEE arithmetic and a table lookup (:func:`_block_mean_abs`, :func:`_codes_by_ratio`): the same
    bytes on every CPU and GPU, so a reducer's audit compares bytes. Decode is one table lookup times the scale
    (:func:`_scaled_lookup`).

    Bound. Write s for the scale, r = |x|/s, and l1 < l2 for the levels (one level l: l1 = l2 = l, threshold t =
    ∞). If r ≤ t the value decodes to l1·s, at most max(l1, t − l1)·s away (with one level, max(l, r − l)·s); if
    r > t, to l2·s, at most max(l2 − t, r − l2)·s away. So, exactly, ``|x̂ − x| ≤ max(reach·s, |x| − l2·s)``,
    reach = t − l1 = 0.6875 with 2 bits, 1 with 1 bit. In float32, r is rounded by at most 2^-24·r, which moves
    the threshold by t·2^-23·s at most, and the decoded value by 2^-24 of itself or, below 2^-126, by 2^-150. The
    stated bound is ``max(reach·s, |x| − l2·s) + 2^-20·(|x| + s) + 2^-149`` (s = 0 only in a block of zeros).
    """

    name: str = "2bit"
    bits: int = 2
    blocksize: int = 64
    reproducible_encode: bool = True  # a tree of additions, one division, a table lookup

    def __post_init__(self):
        if self.bits not in _MEAN_SCALED_FORMATS or self.blocksize < 1 or self.blocksize & (self.blocksize - 1):
            raise ValueError(f"codec {self.name!r}: 1 or 2 bits and a block size that is a power of two, got "
                             f"{self.bits} and {self.blocksize}")

    def encoded_size(self, numel: int) -> int:
        return -(-numel * self.bits // 8) + 4 * -(-numel // self.blocksize)

    def error_bound(self, part: torch.Tensor) -> torch.Tensor:
        part = self._checked_part(part)
        form = _MEAN_SCALED_FORMATS[self.bits]
        magnitude = part.abs()
        scales = _block_mean_abs(magnitude.clone(), self.blocksize, part.new_empty(-(-part.numel() // self.blocksize)))
        scale = _per_element(scales, self.blocksize, part.numel())
        worst = torch.maximum(scale * form.reach, magnitude - scale * form.levels[-1])
        return worst + (magnitude + scale) * 2.0**-20 + FLOAT32_MIN_SUBNORMAL

    def _encode(self, part: torch.Tensor) -> bytes:
        numel, device, blocksize, per_byte = part.numel(), part.device, self.blocksize, 8 // self.bits
        spans = _passes(numel, blocksize, device)
        packed = torch.empty(-(-numel // per_byte), dtype=torch.uint8, device=device)
        scales = torch.empty(-(-numel // blocksize), dtype=torch.float32, device=device)
        width = spans[0][1]
        ratio = torch.empty(width, device=device)
        codes = torch.empty(width + per_byte, dtype=torch.uint8, device=device)
        table = _on_device(device, _mean_scaled_code_table, self.bits)
        for start, stop in spans:
            length = stop - start
            values, pass_ratio = part.narrow(0, start, length), ratio.narrow(0, 0, length)
            pass_scales = scales.narrow(0, start // blocksize, -(-length // blocksize))
            _block_mean_abs(torch.abs(values, out=pass_ratio), blocksize, pass_scales)
            _codes_by_ratio(values, pass_scales, blocksize, table, pass_ratio, codes.narrow(0, 0, length))
            _pack_low_first(codes, length, self.bits, packed.narrow(0, start // per_byte, -(-length // per_byte)))
        if _non_finite(scales):  # (the mean of finite values overflows only within a rounding of float32's largest)
            raise ValueError(f"codec {self.name!r}: a block's mean |x| is beyond float32: the run diverged")
        return _host_bytes(packed, scales)

    def _decode(self, data: bytes, numel: int, device: torch.device) -> torch.Tensor:
        per_byte = 8 // self.bits
        scales = _scales_from_bytes(self.name, data[-(-numel // per_byte):], device)
        table = _on_device(device, _mean_scaled_byte_values, self.bits)
        return _scaled_lookup(table, data, numel, scales, self.blocksize, device, per_byte=per_byte)


# the multipliers of the mask's integer hash (odd, below 2^31 after the first, so that every product of a
# 32-bit value fits an int64: no overflow, whose result C leaves undefined)
_MASK_HASH_MULTIPLIERS = (0x9E3779B1, 0x7FEB352D, 0x6C8E9CF5)
_LOW_32_BITS = 2**32 - 1


@functools.lru_cache(maxsize=16)
def _mask_indices(seed: int, numel: int, stride: int, period: int) -> torch.Tensor:
    """The index (int64, on the CPU; read only) of the one value a part of `numel` values sends from each group
    of `stride` consecutive values (the last group may be shorter), in the round whose seed is `seed`.

    Group j sends its value ``h(seed, j mod G) mod (the group's length)``, G = period / stride, where h is an
    integer hash (a multiply and add, then two rounds of xor-shift and multiply, each kept to 32 bits):
    integer arithmetic only, so every peer and CPU draws the same mask. The mask repeats every `period`
    values, so that a span of a part that starts on that grid is coded as it would be alone (a reducer
    audit's chunk: :mod:`p2p_diloco.sync.spot_check`). Cached: in a round, the parts of one size share
    their mask, and each is encoded and decoded several times (a sender's part, a reducer's inputs, the mean)."""
    groups, period_groups = -(-numel // stride), period // stride
    first, *mixing = _MASK_HASH_MULTIPLIERS
    h = torch.arange(min(groups, period_groups), dtype=torch.int64).mul_(first).add_(seed).bitwise_and_(_LOW_32_BITS)
    for multiplier in mixing:
        h.bitwise_xor_(h >> 16).mul_(multiplier).bitwise_and_(_LOW_32_BITS)
    h.bitwise_xor_(h >> 16)
    last, last_hash = numel - (groups - 1) * stride, int(h[(groups - 1) % period_groups])
    offsets = h.bitwise_and_(stride - 1)  # `stride` is a power of two: its low bits, exactly h mod stride
    if groups > period_groups:
        offsets = offsets.repeat(-(-groups // period_groups))[:groups]
    if last < stride:
        offsets[-1] = last_hash % last
    return offsets.add_(torch.arange(0, groups * stride, stride, dtype=torch.int64))


@dataclass(frozen=True)
class SharedMaskCodec(Codec):
    """A random subset of the values, the same for every peer of a round, each value coded by another codec:
    one value of every `stride` (SPARTA's random sparse averaging, with a shared seed; here with error feedback,
    as SparseLoCo keeps it, arXiv 2508.15706).

    Every member of a round codes its parts with the mask drawn from the round's ID (:meth:`for_round`), so all
    the parts of one reducer have the same values selected, and it aggregates them coordinate by coordinate
    with any rule of :mod:`p2p_diloco.sync.robust`, as with a dense codec; its mean, coded in the same mask,
    is what every peer decodes. Each group of `stride` consecutive values of a part sends one value
    (:func:`_mask_indices`); the selected values, in order, are coded by `values` (wire format: `values`'s
    bytes of ``ceil(numel / stride)`` values, nothing else: the mask is not sent). Decode puts each decoded
    value back at its index and 0 everywhere else: a table lookup, a multiply and a copy, the same bits on
    every CPU. The peer's error feedback (:mod:`p2p_diloco.train.error_feedback`) keeps ``x − decode``, so a
    value not sent is carried whole into the next round, whose mask is another: a value waits `stride`
    rounds on average, and is never lost.

    Bound: `values`'s bound on a selected value (of the selected values coded as one part: E3M0's
    ``max(|x|/3, scale/128)``, its scale the largest of the block's 64 selected values), and ``|x|`` on the
    others. Bytes: ``values.encoded_size(ceil(numel / stride))``: 0.0703 per parameter for 1 in 8 with
    E3M0, 0.0352 for 1 in 16. The mask is drawn from each part's start and repeats every `period` values:
    a span of a part that starts on that grid is coded as it would be alone, and the spot check's chunks
    do (the whole tensor is coded as its parts are only where they start on that grid; nothing needs it:
    error feedback takes what was counted of each part). The round's ID is chosen by its leader, as
    hivemind's group ID is: a hostile leader could choose which values go, not what they are, and error
    feedback keeps the others for a later round.
    """

    name: str = "mask8-e3m0"
    stride: int = 8
    values: Codec = E3M0Codec()
    seed: int = 0  # the round's (for_round); 0 for a codec bound to no round
    # the mask repeats every `period` values (a power of two, a multiple of blocksize): the spot check's chunks
    # of 16,384 values start on its grid, so each is a slice of the part's bytes (spot_check.sliceable)
    period: int = 16384
    sends_every_value: ClassVar[bool] = False

    def __post_init__(self):
        if isinstance(self.values, SharedMaskCodec) or self.stride < 2 or self.stride & (self.stride - 1):
            raise ValueError(f"codec {self.name!r}: a stride that is a power of two >= 2 over a dense codec, got "
                             f"{self.stride} over {self.values.name!r}")
        if self.period % (self.stride * self.values.blocksize):
            raise ValueError(f"codec {self.name!r}: a period that is a multiple of {self.stride * self.values.blocksize} "
                             f"values, got {self.period}")
        object.__setattr__(self, "blocksize", self.stride * self.values.blocksize)
        object.__setattr__(self, "reproducible_encode", self.values.reproducible_encode)

    def for_round(self, round_id: bytes) -> "SharedMaskCodec":
        seed = int.from_bytes(hashlib.sha256(bytes(round_id)).digest()[:4], "little")
        return dataclasses.replace(self, seed=seed)

    def encoded_size(self, numel: int) -> int:
        return self.values.encoded_size(-(-numel // self.stride))

    def error_bound(self, part: torch.Tensor) -> torch.Tensor:
        part = self._checked_part(part)
        bound = part.abs()
        if part.numel():
            index = self._index(part.numel(), part.device)
            bound[index] = self.values.error_bound(torch.index_select(part, 0, index))
        return bound

    def carried(self, numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=torch.bool).index_fill_(0, self._index(numel, torch.device("cpu")), True)

    def _index(self, numel: int, device: torch.device) -> torch.Tensor:
        return _mask_indices(self.seed, numel, self.stride, self.period).to(device)

    def _encode(self, part: torch.Tensor) -> bytes:
        return self.values._encode(torch.index_select(part, 0, self._index(part.numel(), part.device)))

    def _decode(self, data: bytes, numel: int, device: torch.device) -> torch.Tensor:
        index = self._index(numel, device)
        selected = self.values._decode(data, index.numel(), device)
        return torch.zeros(numel, dtype=torch.float32, device=device).index_copy_(0, index, selected)


CODECS: dict[str, Codec] = {
    codec.name: codec
    for codec in (
        RawFloat32Codec(),
        TwoByteFloatCodec(name="fp16", dtype=torch.float16, significant_bits=11, min_normal=2.0**-14),
        TwoByteFloatCodec(name="bf16", dtype=torch.bfloat16, significant_bits=8, min_normal=FLOAT32_MIN_NORMAL),
        BlockwiseInt8Codec(),
        Bnb4BitCodec(name="nf4", quant_type="nf4", fraction_of_absmax=0.1520),
        Bnb4BitCodec(name="fp4-bnb", quant_type="fp4", fraction_of_absmax=0.1668),
        E3M0Codec(),
        SharedMaskCodec(name="mask8-e3m0", stride=8, values=E3M0Codec(name="mask8-e3m0")),
        SharedMaskCodec(name="mask16-e3m0", stride=16, values=E3M0Codec(name="mask16-e3m0")),
        MeanScaledCodec(name="2bit", bits=2),
        MeanScaledCodec(name="1bit", bits=1),
        SharedMaskCodec(name="mask4-2bit", stride=4, values=MeanScaledCodec(name="mask4-2bit", bits=2)),
        SharedMaskCodec(name="mask2-1bit", stride=2, values=MeanScaledCodec(name="mask2-1bit", bits=1)),
    )
}


def get_codec(name: str) -> Codec:
    """The codec called `name`; ValueError naming the valid ones otherwise."""
    codec = CODECS.get(name)
    if codec is None:
        raise ValueError(f"unknown codec {name!r}; valid codecs: {', '.join(CODECS)}")
    return codec


def bytes_per_parameter(name: str) -> float:
    """Bytes on the wire per value of a large part, block scales included (see the table above)."""
    numel = 2**24  # a multiple of every block size: no partial block
    return get_codec(name).encoded_size(numel) / numel
