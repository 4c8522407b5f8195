"""The part codecs: round trips within each stated bound, exact sizes, pure decode, malformed bytes rejected."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch._dynamo.utils

from p2p_diloco.sync.codecs import CODECS, E3M0Codec, SharedMaskCodec, MeanScaledCodec, bytes_per_parameter, get_codec
from p2p_diloco.train.error_feedback import ErrorFeedback
from tests.cuda_marks import ON_CUDA, needs_cuda

NUMEL = 12345  # not a multiple of any block size (256, 64) and odd
BLOCK_CODECS = ["int8", "nf4", "fp4-bnb", "fp4-e3m0", "2bit", "1bit"]
BNB_CODECS = ["int8", "nf4", "fp4-bnb"]


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _random_signs(numel: int) -> torch.Tensor:
    return torch.randint(0, 2, (numel,), generator=_generator()).float() * 2 - 1


def _heavy_tailed(numel: int) -> torch.Tensor:
    """Student-t with 2 degrees of freedom, scaled like a pseudo-gradient: normal / sqrt(chi²₂ / 2)."""
    g = _generator()
    normal = torch.randn(numel, generator=g, dtype=torch.float64)
    chi2 = -2 * torch.log(torch.rand(numel, generator=g, dtype=torch.float64))  # chi² with 2 dof = Exp(1/2)
    return (1e-3 * normal / torch.sqrt(chi2 / 2)).float()


def _tensor(kind: str, codec: str) -> torch.Tensor:
    g = _generator()
    if kind == "normal":  # a pseudo-gradient
        return torch.randn(NUMEL, generator=g) * 1e-3
    if kind == "heavy_tailed":
        return _heavy_tailed(NUMEL)
    if kind == "zeros":
        return torch.zeros(NUMEL)
    if kind == "tiny":  # flushed to zero by fp16
        return _random_signs(NUMEL) * torch.rand(NUMEL, generator=g) * 1e-30
    if kind == "float32_subnormal":
        return _random_signs(NUMEL) * torch.rand(NUMEL, generator=g) * 1e-40
    if kind == "wide":  # 11 decades in every block
        return _random_signs(NUMEL) * 10 ** (torch.rand(NUMEL, generator=g) * 11 - 12)
    if kind == "huge":
        if codec == "fp16":
            part = (torch.randn(NUMEL, generator=g) * 2e4).clamp(-65504, 65504)
            part[:2] = torch.tensor([65504.0, -65504.0])
            return part
        return torch.randn(NUMEL, generator=g) * 1e37
    if kind == "length_1":
        return torch.tensor([3e-4])
    if kind == "length_2":
        return torch.tensor([3e-4, -1e-5])
    raise AssertionError(kind)


KINDS = ["normal", "heavy_tailed", "zeros", "tiny", "float32_subnormal", "wide", "huge", "length_1", "length_2"]


def _error_over_bound(codec_name: str, part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bytes]:
    codec = get_codec(codec_name)
    data = codec.encode(part)
    decoded = codec.decode(data, part.numel())
    error = (decoded.double() - part.double()).abs()  # exact: the difference of two float32 values
    return error, codec.error_bound(part).double(), data


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("codec_name", list(CODECS))
def test_round_trip_stays_within_the_stated_bound(codec_name, kind):
    codec = get_codec(codec_name)
    part = _tensor(kind, codec_name)
    data = codec.encode(part)
    assert isinstance(data, bytes) and len(data) == codec.encoded_size(part.numel())
    decoded = codec.decode(data, part.numel())
    assert decoded.dtype == torch.float32 and decoded.shape == part.shape
    error = (decoded.double() - part.double()).abs()
    bound = codec.error_bound(part)
    assert bound.dtype == torch.float32 and bound.shape == part.shape
    worst = int(torch.argmax(error - bound.double()))
    assert bool((error <= bound.double()).all()), (
        f"{codec_name} on {kind}: x={part[worst].item():.6g} decoded={decoded[worst].item():.6g} "
        f"error={error[worst].item():.3g} > bound={bound[worst].item():.3g}")
    # decode is a pure function of the bytes: again, and from a copy
    assert torch.equal(codec.decode(bytes(bytearray(data)), part.numel()), decoded)
    assert codec.encode(part) == data


@pytest.mark.parametrize("kind", ["normal", "heavy_tailed"])
@pytest.mark.parametrize("codec_name", [name for name in CODECS if name != "none"])
def test_bound_is_not_loose(codec_name, kind):
    """On pseudo-gradient-like parts the worst error reaches most of the bound: the bound says something."""
    error, bound, _ = _error_over_bound(codec_name, _tensor(kind, codec_name))
    ratio = float((error / bound).max())
    assert 0.5 < ratio <= 1.0, ratio


def test_none_is_exact():
    part = _tensor("heavy_tailed", "none")
    part[0] = -0.0
    decoded = get_codec("none").decode(get_codec("none").encode(part), NUMEL)
    assert torch.equal(decoded.view(torch.int32), part.view(torch.int32))


@pytest.mark.parametrize("codec_name", ["fp16", "bf16"])
def test_values_beyond_the_format_are_rejected_not_made_infinite(codec_name):
    largest = torch.finfo(torch.float16 if codec_name == "fp16" else torch.bfloat16).max
    codec = get_codec(codec_name)
    codec.encode(torch.tensor([largest, -largest]))  # the largest finite value itself is fine
    beyond = 70000.0 if codec_name == "fp16" else 3.4e38
    with pytest.raises(ValueError, match=rf"codec '{codec_name}': 2 values exceed .*diverged"):
        codec.encode(torch.tensor([1e-3, beyond, -beyond]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("codec_name", list(CODECS))
def test_non_finite_input_is_rejected_before_encoding(codec_name, bad):
    part = _tensor("normal", codec_name)
    part[[3, 700]] = bad
    with pytest.raises(ValueError, match=rf"codec '{codec_name}': the part holds 2 non-finite values"):
        get_codec(codec_name).encode(part)
    with pytest.raises(ValueError, match=rf"codec '{codec_name}'"):
        get_codec(codec_name).error_bound(part)


@pytest.mark.parametrize("codec_name", list(CODECS))
def test_input_that_is_not_a_1d_float32_tensor_on_a_cpu_or_gpu_is_rejected(codec_name):
    codec = get_codec(codec_name)
    with pytest.raises(ValueError, match="1-D float32 tensor"):
        codec.encode(torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="1-D float32 tensor"):
        codec.encode(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="codes on a CPU or a CUDA GPU, not on meta"):
        codec.encode(torch.zeros(8, device="meta"))
    with pytest.raises(ValueError, match="codes on a CPU or a CUDA GPU, not on meta"):
        codec.decode(codec.encode(torch.ones(8)), 8, device="meta")
    with pytest.raises(TypeError):
        codec.encode([0.0, 1.0])
    with pytest.raises(TypeError, match="expected bytes"):
        codec.decode("0000", 1)


@pytest.mark.parametrize("codec_name", list(CODECS))
def test_bytes_of_the_wrong_length_are_rejected(codec_name):
    codec = get_codec(codec_name)
    data = codec.encode(_tensor("normal", codec_name))
    for malformed in (data[:-1], data + b"\0", b"", data[: len(data) // 2]):
        with pytest.raises(ValueError, match=rf"codec '{codec_name}': a part of {NUMEL} values is {len(data)} bytes"):
            codec.decode(malformed, NUMEL)
    with pytest.raises(ValueError, match="is 0 bytes"):
        codec.decode(data, 0)
    with pytest.raises(ValueError, match="numel must be an int"):
        codec.decode(data, -1)


@pytest.mark.parametrize("codec_name", list(CODECS))
def test_empty_part(codec_name):
    codec = get_codec(codec_name)
    assert codec.encode(torch.zeros(0)) == b"" and codec.encoded_size(0) == 0
    assert codec.decode(b"", 0).shape == (0,)


@pytest.mark.parametrize(("codec_name", "non_finite"), [
    ("none", np.array([np.nan, 1.0], dtype="<f4").tobytes()),
    ("none", np.array([1.0, -np.inf], dtype="<f4").tobytes()),
    ("fp16", np.array([np.nan, 1.0], dtype="<f2").tobytes()),
    ("fp16", np.array([1.0, np.inf], dtype="<f2").tobytes()),
    ("bf16", np.array([0x7FC0, 0x3F80], dtype="<u2").tobytes()),  # bf16 NaN, 1.0
    ("bf16", np.array([0x3F80, 0xFF80], dtype="<u2").tobytes()),  # 1.0, bf16 -inf
])
def test_crafted_non_finite_floats_are_rejected(codec_name, non_finite):
    with pytest.raises(ValueError, match=rf"codec '{codec_name}': the bytes decode to 1 non-finite values of 2"):
        get_codec(codec_name).decode(non_finite, 2)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0])
@pytest.mark.parametrize("codec_name", BLOCK_CODECS)
def test_crafted_block_scales_are_rejected(codec_name, scale):
    codec = get_codec(codec_name)
    data = codec.encode(_tensor("normal", codec_name))
    crafted = data[:-4] + np.array([scale], dtype="<f4").tobytes()  # the last block's scale
    with pytest.raises(ValueError, match=rf"codec '{codec_name}': 1 block scales of \d+ are negative or not finite"):
        codec.decode(crafted, NUMEL)


@pytest.mark.parametrize("numel", [1, 2, 63, 64, 65, 255, 256, 257, NUMEL])
@pytest.mark.parametrize("codec_name", BNB_CODECS)
def test_bitsandbytes_decode_is_the_plain_formula(codec_name, numel):
    """bitsandbytes' kernels decode exactly to map[code]·absmax: nothing depends on the kernel or the machine."""
    from p2p_diloco.sync.codecs import _bnb_map

    codec = get_codec(codec_name)
    data = codec.encode(_tensor("heavy_tailed", codec_name)[:numel])
    if codec_name == "int8":
        codes, code_map = torch.from_numpy(np.frombuffer(data, np.uint8, count=numel).copy()), _bnb_map("dynamic")
        absmax_bytes = data[numel:]
    else:
        packed = torch.from_numpy(np.frombuffer(data, np.uint8, count=(numel + 1) // 2).copy())
        codes = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:numel]
        code_map = _bnb_map("nf4" if codec_name == "nf4" else "fp4")
        absmax_bytes = data[(numel + 1) // 2:]
    absmax = torch.from_numpy(np.frombuffer(absmax_bytes, "<f4").copy())
    expected = code_map[codes.long()] * absmax.repeat_interleave(codec.blocksize)[:numel]
    assert torch.equal(codec.decode(data, numel), expected)


@pytest.mark.parametrize("numel", [1, 2, 3, 7, 8, 9, 63, 64, 65, NUMEL])
@pytest.mark.parametrize("codec_name", ["2bit", "1bit"])
def test_mean_scaled_decode_is_the_plain_formula(codec_name, numel):
    """Each code, read from its bits in numpy (the first code of a byte in its low bits), is the sign and a
    level, times its block's scale."""
    codec = get_codec(codec_name)
    data = _wire_bytes(codec_name, numel)
    per_byte = 8 // codec.bits
    bits = np.unpackbits(np.frombuffer(data, np.uint8, count=-(-numel // per_byte)), bitorder="little")
    codes = bits.reshape(-1, codec.bits) @ (1 << np.arange(codec.bits))  # each code's bits, low first
    levels = {"2bit": [0.5625, 1.875, -0.5625, -1.875], "1bit": [1.0, -1.0]}[codec_name]
    scales = np.frombuffer(data[-(-numel // per_byte):], "<f4")
    expected = np.array(levels, np.float32)[codes[:numel]] * np.repeat(scales, 64)[:numel]
    assert np.array_equal(codec.decode(data, numel).numpy().view(np.int32), expected.view(np.int32))


@pytest.mark.parametrize("numel", [1, 3, 9, 64, 65, NUMEL])
@pytest.mark.parametrize("codec_name", ["2bit", "1bit"])
def test_mean_scaled_encode_is_the_plain_formula(codec_name, numel):
    """The scale is the block's mean |x| as a float32 tree of halves (each |x| / 64 first; a short last block
    padded with zeros, its sum times the float32 nearest 64 / L), and each code is the sign bit over whether
    |x / scale| > 1.25 (2 bits): numpy's float32, comparisons and np.packbits give the same bytes."""
    codec = get_codec(codec_name)
    part = _tensor("wide", codec_name)[:numel].numpy()
    padded = np.zeros(-(-numel // 64) * 64, np.float32)
    padded[:numel] = np.abs(part) * np.float32(1 / 64)
    rows = padded.reshape(-1, 64)
    while rows.shape[1] > 1:
        rows = rows[:, : rows.shape[1] // 2] + rows[:, rows.shape[1] // 2:]
    scales = rows[:, 0].copy()
    if numel % 64:
        scales[-1] *= np.float32(64 / (numel % 64))
    ratio = part / np.where(scales > 0, scales, np.float32(1)).repeat(64)[:numel]
    codes = (ratio < 0).astype(np.int64) << (codec.bits - 1)
    if codec.bits == 2:
        codes |= (np.abs(ratio) > np.float32(1.25)).astype(np.int64)
    bits = ((codes[:, None] >> np.arange(codec.bits)) & 1).astype(np.uint8).reshape(-1)
    expected = np.packbits(bits, bitorder="little").tobytes() + scales.astype("<f4").tobytes()
    assert codec.encode(torch.from_numpy(part)) == expected


def test_odd_lengths_do_not_make_bitsandbytes_compile():
    """bitsandbytes 0.50 decodes an odd-length 4-bit part with torch.compile, once per new length."""
    frames = dict(torch._dynamo.utils.counters["frames"])
    for codec_name in ("nf4", "fp4-bnb"):
        codec = get_codec(codec_name)
        for numel in (1, 3, 129, 4097):
            codec.decode(codec.encode(torch.ones(numel)), numel)
    assert dict(torch._dynamo.utils.counters["frames"]) == frames


def test_e3m0_levels_and_rounding():
    codec = get_codec("fp4-e3m0")
    assert isinstance(codec, E3M0Codec) and codec.blocksize == 64
    levels = [0.0] + [2.0**-k for k in range(6, -1, -1)]  # 0, 2^-6, ..., 1
    exact = torch.tensor(levels + [-v for v in levels[1:]], dtype=torch.float32) * 3.0
    assert torch.equal(codec.decode(codec.encode(exact), exact.numel()), exact)
    # nearest value, ties to the smaller magnitude: midpoints 2^-7, 3·2^-7, ..., 0.75 (times the scale 1)
    part = torch.tensor([1.0, 0.75, 0.7501, 0.74, 2.0**-7, 2.0**-7 * 1.001, 3 * 2.0**-7, -0.3, 1e-9])
    expected = torch.tensor([1.0, 0.5, 1.0, 0.5, 0.0, 2.0**-6, 2.0**-6, -0.25, 0.0])
    assert torch.equal(codec.decode(codec.encode(part), part.numel()), expected)
    # a zero is encoded with the sign bit clear: -0.0 and tiny negatives give the same bytes as 0.0
    assert codec.encode(torch.tensor([-0.0, -1e-9, 1.0])) == codec.encode(torch.tensor([0.0, 0.0, 1.0]))
    # every value decodes to 0 or ±scale·2^-k, k = 0..6
    part = _tensor("heavy_tailed", "fp4-e3m0")
    decoded = codec.decode(codec.encode(part), NUMEL)
    scale = part.abs().view(-1)[: NUMEL // 64 * 64].view(-1, 64).amax(1).repeat_interleave(64)
    ratio = (decoded[: scale.numel()].abs() / scale).unique()
    assert set(ratio.tolist()) <= set(levels)


def _two_bit_blocks_of_scale_1(points: torch.Tensor) -> torch.Tensor:
    """Blocks of 64 whose mean |x| is exactly 1 (the 2-bit codec's scale: a value is coded as it is): each holds
    a point p in [0, 2], its float32 neighbours, both signs, at indices i and the partner 2 − p at i + 32 (the
    first additions of the codec's tree of halves, exact), and ±1 elsewhere."""
    points = torch.cat([points, torch.nextafter(points, points + 1), torch.nextafter(points, points - 1)])
    points = points[(points >= 0) & (points <= 2)]
    blocks = []
    for k in range(0, points.numel(), 16):
        chunk = points[k:k + 16]
        block = torch.ones(64)
        block[1::2] = -1.0
        block[:chunk.numel()] = chunk * torch.tensor([1.0, -1.0]).repeat(8)[:chunk.numel()]
        block[32:32 + chunk.numel()] = 2 - chunk
        blocks.append(block)
    return torch.cat(blocks)


def test_two_bit_levels_rounding_and_scale():
    codec = get_codec("2bit")
    assert isinstance(codec, MeanScaledCodec) and codec.blocksize == 64
    part = _two_bit_blocks_of_scale_1(torch.tensor([1.25, 0.5625, 1.875, 0.0, 2.0]))
    decoded = codec.decode(codec.encode(part), part.numel())
    # scale 1: the nearest of ±0.5625 and ±1.875 with the threshold at 1.25, a tie (1.25 itself) to the lower;
    # zero has no code of its own (±0.5625 by its sign bit)
    expected = torch.where(part.abs() > 1.25, 1.875, 0.5625) * torch.where(part.view(torch.int32) < 0, -1.0, 1.0)
    assert torch.equal(decoded, expected)
    assert int((part.abs() == 1.25).sum()) > 0 and int((part.abs() == torch.nextafter(torch.tensor(1.25),
                                                                                       torch.tensor(2.0))).sum()) > 0
    # the scale is each block's mean |x|, the last, shorter block's too, within float32 rounding
    part = _tensor("heavy_tailed", "2bit")
    data = codec.encode(part)
    scales = torch.from_numpy(np.frombuffer(data[(NUMEL + 3) // 4:], "<f4").copy()).double()
    magnitude = torch.cat([part.abs().double(), torch.zeros(-NUMEL % 64, dtype=torch.float64)]).view(-1, 64)
    means = magnitude.sum(1) / torch.tensor([64.0] * (magnitude.shape[0] - 1) + [NUMEL % 64])
    assert float(((scales - means).abs() / means).max()) < 2.0**-20
    levels = (codec.decode(data, NUMEL).double() / scales.repeat_interleave(64)[:NUMEL]).abs()
    nearest = torch.where(levels > 1.25, 1.875, 0.5625)  # each decoded value one float32 rounding from a level
    assert float(((levels - nearest) / nearest).abs().max()) <= 2.0**-24 and {0.5625, 1.875} == set(nearest.tolist())


def test_bitsandbytes_fp4_is_not_e3m0():
    part = torch.tensor([1.0, 2 / 3, 0.5, 0.25, 1 / 6])
    bnb = get_codec("fp4-bnb").decode(get_codec("fp4-bnb").encode(part), 5)
    e3m0 = get_codec("fp4-e3m0").decode(get_codec("fp4-e3m0").encode(part), 5)
    assert bnb[1].item() == pytest.approx(2 / 3) and e3m0[1].item() == 0.5  # 2/3 is an E2M1 value, not a power of 2


def test_bytes_per_parameter():
    expected = {"none": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1 + 4 / 256,
                "nf4": 0.5 + 4 / 64, "fp4-bnb": 0.5 + 4 / 64, "fp4-e3m0": 0.5 + 4 / 64,
                "mask8-e3m0": (0.5 + 4 / 64) / 8, "mask16-e3m0": (0.5 + 4 / 64) / 16,
                "2bit": 0.25 + 4 / 64, "1bit": 0.125 + 4 / 64, "mask4-2bit": (0.25 + 4 / 64) / 4,
                "mask2-1bit": (0.125 + 4 / 64) / 2}
    assert set(expected) == set(CODECS)
    for name, ratio in expected.items():
        assert bytes_per_parameter(name) == ratio
    for numel in (1, 2, 63, 64, 65, 256, 257, NUMEL):
        blocks_64, blocks_256 = -(-numel // 64), -(-numel // 256)
        assert get_codec("int8").encoded_size(numel) == numel + 4 * blocks_256
        for name in ("nf4", "fp4-bnb", "fp4-e3m0"):
            assert get_codec(name).encoded_size(numel) == (numel + 1) // 2 + 4 * blocks_64
        assert get_codec("2bit").encoded_size(numel) == (numel + 3) // 4 + 4 * blocks_64
        assert get_codec("1bit").encoded_size(numel) == (numel + 7) // 8 + 4 * blocks_64


def test_get_codec():
    for name, codec in CODECS.items():
        assert get_codec(name) is codec and codec.name == name
    valid = ("none, fp16, bf16, int8, nf4, fp4-bnb, fp4-e3m0, mask8-e3m0, mask16-e3m0, 2bit, 1bit, mask4-2bit, "
             "mask2-1bit")
    with pytest.raises(ValueError, match=f"unknown codec 'fp8'; valid codecs: {valid}"):
        get_codec("fp8")


def test_residual_for_error_feedback_is_the_round_trip_error():
    codec = get_codec("fp4-e3m0")
    part = _tensor("normal", "fp4-e3m0")
    residual = part - codec.decode(codec.encode(part), NUMEL)
    assert bool(torch.isfinite(residual).all())
    assert 0 < float(residual.abs().max()) <= float(codec.error_bound(part).max())


@pytest.mark.parametrize("codec", ["fp16", "int8", "nf4", "fp4-e3m0", "2bit", "1bit"])
def test_error_feedback_delays_what_the_codec_drops_and_loses_nothing(codec):
    """Sent values summed over rounds, plus the residual still held, are the pseudo-gradients summed:
    Σ Q(Δ_t + e_t) + e_T = Σ Δ_t (error feedback telescopes), and the residual stays within the bound.
    Here every part is sent (the all-reduce's own parts: tests/test_exact_allreduce.py)."""
    feedback = ErrorFeedback([torch.Size([NUMEL]), torch.Size([40, 3])])
    g = _generator()
    sent_sum = [torch.zeros(NUMEL, dtype=torch.float64), torch.zeros(40, 3, dtype=torch.float64)]
    delta_sum = [torch.zeros_like(s) for s in sent_sum]
    owed = [torch.zeros(NUMEL), torch.zeros(40, 3)]  # the Δ of a round that applied nothing stays in θ_local
    for round_ in range(6):
        deltas = [torch.randn(NUMEL, generator=g) * 1e-3, torch.randn(40, 3, generator=g) * 1e-3]
        for i in range(2):
            delta_sum[i] += deltas[i].double()
        deltas = [d + o for d, o in zip(deltas, owed)]
        to_send = feedback.compensate([0, 1], deltas)
        if round_ == 3:  # a round that applied nothing: nothing committed, its Δ goes into the next one
            owed = deltas
            continue
        sent = [_roundtrip(codec, x) for x in to_send]
        feedback.commit([0, 1], to_send, sent)
        owed = [torch.zeros_like(o) for o in owed]
        for i in range(2):
            sent_sum[i] += sent[i].double()
    for i in range(2):
        lost = (delta_sum[i] - sent_sum[i] - feedback.residual[i].double()).abs().max().item()
        assert lost <= 1e-9
        assert feedback.residual[i].abs().max().item() <= CODECS[codec].error_bound(to_send[i].reshape(-1)).max()


def _roundtrip(codec: str, tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1).contiguous()
    return get_codec(codec).decode(get_codec(codec).encode(flat), flat.numel()).reshape(tensor.shape)


# ----- the wire format, fixed: a faster codec must give the same bits ---------------------------------------
def _wire_bytes(codec_name: str, numel: int = NUMEL) -> bytes:
    """Well-formed bytes of a part of `numel` values, from integer arithmetic only (the same on every machine):
    every code, and block scales among which a zero and a float32 subnormal."""
    codec = get_codec(codec_name)
    blocks = -(-numel // codec.blocksize)
    codes = bytes((i * 197 + 11) % 256 for i in range(codec.encoded_size(numel) - 4 * blocks))
    scales = [0.0 if k == 3 else 1e-40 if k == 5 else (k % 17 + 1) * 2.0 ** -(k % 13) for k in range(blocks)]
    return codes + np.array(scales, dtype="<f4").tobytes()


def _sha256(data) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


DECODED_SHA256 = {  # of the float32 part each codec decodes from _wire_bytes (the implementation of 2026-11-25)
    "int8": "35b2aa6011ccd0c536a28c8a730ee45837a3ecfdc48c7dc3511e919e7be74495",
    "nf4": "1545916c88ab12606330fd31a0956015fb2df5b3e6b11825101b8c11a2ceae03",
    "fp4-bnb": "cbe78ddd9c0a6a811fafc4606a54842c8fd6be519ed4d1c5dc879bfa47d09f32",
    "fp4-e3m0": "1c71da9c004dbd9c87fe62c81216c44e512953fcf199015e0a29042619d2698d",
    "2bit": "47d9999bf2a3a922df8cdec2b22875989c17c7c20b1d8248c5ac4abc5202cea4",  # (2026-11-29)
    "1bit": "492121df1fdc21d0e4b6a7962e9e98d375e40c942cbfde8564c7c354824e8dc6",
}


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("codec_name", BLOCK_CODECS)
def test_decode_gives_the_wire_formats_bits(codec_name, device):
    decoded = get_codec(codec_name).decode(_wire_bytes(codec_name), NUMEL, device=device)
    assert decoded.device.type == device
    assert _sha256(decoded.cpu().numpy().astype("<f4").tobytes()) == DECODED_SHA256[codec_name]


ENCODED_SHA256 = {  # of the bytes each codec encodes from the part below (the implementations of 2026-11-25)
    "int8": "db8bcfc45b15fd57bb8a4238ce76d419f362496d911a0f7b4840eeed57d1991c",
    "nf4": "349c4233b005ebe4d1071edcaa3818dd008fd007a39ba64b770e3fd732b3b4d9",
    "fp4-bnb": "3d57568ddc9dc3e4e795fc17ff9540309076daf1729041214a983a5c4bc620b9",
    "fp4-e3m0": "4118a7494aaa7f1f543da0bc51b4a21816b09b2af77453bdec880a919ae74a70",
    "2bit": "a2e96004b9d4d1e50170e7ba84e10214536efc8211a91b93885ac27743f6a0dc",  # (2026-11-29)
    "1bit": "e1a46910d61577d6931a431e91ba3040744f7446f49539e178e239d796a37116",
}


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("codec_name", BLOCK_CODECS)
def test_encode_gives_the_wire_formats_bytes(codec_name, device):
    """Every block codec's encode is IEEE arithmetic (a division or a reciprocal and a multiply, exact
    comparisons, table lookups), so a faster encode must give the same bytes as the first implementation
    of this pure-torch form: values across 22 binades, both signs, an odd length and a block of zeros."""
    part = torch.tensor([((i * 7919) % 2001 - 1000) * 2.0 ** -(i % 23) / 1000 for i in range(NUMEL)],
                        dtype=torch.float32)
    part[64:128] = 0  # a block of zeros: scale 0
    assert _sha256(get_codec(codec_name).encode(part.to(device))) == ENCODED_SHA256[codec_name]


def _midpoints_and_neighbours(codec_name: str) -> torch.Tensor:
    """Blocks that each begin with 1.0 (scale 1: a value is coded as it is) and go on with the points
    where a code changes, each with its two float32 neighbours: the map's midpoints for a block codec,
    the values halfway between two fp16 or bf16 values for those; both signs."""
    from p2p_diloco.sync.codecs import _E3M0_MIDPOINTS, _bnb_map

    codec = get_codec(codec_name)
    values_codec = codec.values if isinstance(codec, SharedMaskCodec) else codec
    if isinstance(values_codec, MeanScaledCodec):
        return _two_bit_blocks_of_scale_1(torch.tensor([1.25, 0.5625, 1.875, 0.0]))
    if codec_name in ("fp16", "bf16"):
        dtype = torch.float16 if codec_name == "fp16" else torch.bfloat16
        grid = (torch.rand(4000, generator=_generator()) * 8 - 4).to(dtype)
        points = (grid.float() + torch.nextafter(grid, torch.full_like(grid, 100.0)).float()) / 2
    elif isinstance(values_codec, E3M0Codec):
        points = _E3M0_MIDPOINTS
    elif codec_name == "none":
        points = torch.rand(100, generator=_generator())
    else:
        code = _bnb_map({"int8": "dynamic", "nf4": "nf4", "fp4-bnb": "fp4"}[codec_name]).sort().values
        points = (code[:-1] + code[1:]) / 2
    points = torch.cat([points, torch.nextafter(points, points + 1), torch.nextafter(points, points - 1)])
    points = torch.cat([points, -points]).clamp(-0.999, 0.999)
    blocksize = max(values_codec.blocksize, 2)
    per_block = points.split(blocksize - 1)
    return torch.cat([torch.cat([torch.ones(1), values]) for values in per_block])


@needs_cuda
@pytest.mark.parametrize("kind", KINDS + ["midpoints"])
@pytest.mark.parametrize("codec_name", list(CODECS))
def test_a_gpu_encodes_the_bytes_and_decodes_the_bits_of_a_cpu(codec_name, kind):
    """Encode and decode on a CUDA GPU give what they give on the CPU, byte for byte and bit for bit: on
    every kind of part above (subnormal values and scales, huge values, lengths off the block grid) and on
    the values where rounding decides between two codes."""
    part = _midpoints_and_neighbours(codec_name) if kind == "midpoints" else _tensor(kind, codec_name)
    codec = get_codec(codec_name)
    on_cpu = codec.encode(part)
    assert codec.encode(part.cuda()) == on_cpu
    decoded = codec.decode(on_cpu, part.numel(), device="cuda")
    assert decoded.device.type == "cuda"
    assert torch.equal(decoded.cpu().view(torch.int32), codec.decode(on_cpu, part.numel()).view(torch.int32))


_E3M0_LEVELS = [0.0] + [2.0**-k for k in range(6, -1, -1)]  # 0, 2^-6, ..., 1


def test_e3m0_exponent_codes_are_bucketize_on_the_midpoints():
    """The integer computation of E3M0's codes against a binary search on its midpoints: every level and
    midpoint, each float32 neighbour of each, and ratios across [0, 1] in every binade."""
    from p2p_diloco.sync.codecs import _E3M0_MIDPOINTS, _e3m0_exponent_codes

    points = torch.cat([_E3M0_MIDPOINTS, torch.tensor(_E3M0_LEVELS)])
    neighbours = torch.cat([points, torch.nextafter(points, torch.zeros_like(points)),
                            torch.nextafter(points, torch.ones_like(points))])
    spread = 2.0 ** -(torch.rand(200_000, generator=_generator()) * 30)  # 2^-30 .. 1
    ratios = torch.cat([neighbours, spread, torch.tensor([0.0, 1e-45, 1.0])]).clamp(0, 1)
    expected = torch.bucketize(ratios, _E3M0_MIDPOINTS)
    assert torch.equal(_e3m0_exponent_codes(ratios.clone()).long(), expected)



@pytest.mark.parametrize("quant_type", ["dynamic", "nf4", "fp4"])
def test_nearest_codes_are_bucketize_on_the_midpoints(quant_type):
    """The table lookup of the int8 and 4-bit codecs' encode against a binary search on the map's
    midpoints: every midpoint and its float32 neighbours, values across [-1, 1] and near 0, the edges, and
    the edges' outer neighbours (a value times its block's reciprocal absolute maximum may round past them)."""
    from p2p_diloco.sync.codecs import _bnb_map, _nearest_codes

    code = _bnb_map(quant_type)
    order = torch.argsort(code)
    midpoints = (code[order[:-1]] + code[order[1:]]) / 2
    g = _generator()
    scaled = torch.cat([
        midpoints, torch.nextafter(midpoints, torch.full_like(midpoints, 2.0)),
        torch.nextafter(midpoints, torch.full_like(midpoints, -2.0)), torch.rand(300_000, generator=g) * 2 - 1,
        (torch.rand(100_000, generator=g) * 2 - 1) * 1e-3, torch.tensor([-1.0, 1.0, 0.0, -0.0, 1e-30, -1e-30, 1e-45]),
        torch.nextafter(torch.tensor([-1.0, 1.0]), torch.tensor([-2.0, 2.0])), torch.tensor([-1.0 - 2**-20, 1.0 + 2**-20]),
    ])
    assert torch.equal(_nearest_codes(scaled.clone(), quant_type).long(), order[torch.bucketize(scaled, midpoints)])


def test_e3m0_code_table_is_the_nearest_level_with_its_sign():
    """E3M0's encode looks each ratio x/scale up by ceil(bits / 2^16) (_e3m0_code_table): against the rule it
    stands for (the nearest level by bucketize on the midpoints, ties to the smaller magnitude, the sign bit
    on a negative value not coded 0) on the top of every one of its intervals, each neighbour above and
    below, every level and midpoint and theirs, both signs."""
    from p2p_diloco.sync.codecs import _E3M0_MIDPOINTS, _e3m0_code_table

    tops = (torch.arange(1, 0x3F81, dtype=torch.int32) << 16).view(torch.float32)
    points = torch.cat([tops, _E3M0_MIDPOINTS, torch.tensor(_E3M0_LEVELS)])
    magnitudes = torch.cat([points, torch.nextafter(points, torch.zeros_like(points)),
                            torch.nextafter(points, torch.ones_like(points)), torch.tensor([0.0, 1e-45])]).clamp(0, 1)
    ratios = torch.cat([magnitudes, -magnitudes])
    level = torch.bucketize(ratios.abs(), _E3M0_MIDPOINTS)
    expected = torch.where((ratios < 0) & (level > 0), level | 8, level)
    index = ratios.view(torch.int32).add(2**16 - 1).bitwise_right_shift(16).add(2**15)
    assert torch.equal(_e3m0_code_table()[index.long()].long(), expected)
