"""The shared-mask codecs (``mask8-e3m0``, ``mask16-e3m0``, ``mask4-2bit``, ``mask2-1bit``): one value of every
8, 16, 4 or 2 sent, the same ones by every peer of a round, so that the all-reduce and its robust rules still apply
coordinate by coordinate.

tests/test_codecs.py holds what every codec must do (round trips within the bound, malformed bytes, sizes);
here: the mask, the bound on the values sent, error feedback over rounds of different masks, the bytes of a
reducer's mean under two CPU kernels, robust aggregation over the decoded parts, and the outer step that moves
only the values a round sent."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from p2p_diloco.sync.codecs import CODECS, SharedMaskCodec, get_codec
from p2p_diloco.sync.robust import AggregationRule, aggregate
from p2p_diloco.train.error_feedback import ErrorFeedback
from p2p_diloco.train.init_weights import SeededDraws
from p2p_diloco.train.outer import GlobalModel
from tests.conftest import REPO, tiny_config

MASK_CODECS = ["mask8-e3m0", "mask16-e3m0", "mask4-2bit", "mask2-1bit"]
NUMEL = 12345  # odd, and not a multiple of a stride: the last group is shorter


def _normal(numel: int, seed: int, std: float = 1e-3) -> torch.Tensor:
    """IEEE-only draws (torch.randn's bits depend on the CPU kernel: the two-kernel test needs the same parts)."""
    return SeededDraws(seed=seed).normal(numel, 0.0, std).to(torch.float32)


def _selected(codec: SharedMaskCodec, numel: int) -> torch.Tensor:
    """Which values the codec sends: the decode of a part of ones is nonzero exactly there."""
    return codec.decode(codec.encode(torch.ones(numel)), numel) != 0


@pytest.mark.parametrize("codec_name", MASK_CODECS)
def test_one_value_of_each_group_is_sent_and_the_round_draws_which(codec_name):
    codec = get_codec(codec_name)
    stride = codec.stride
    rounds = [codec.for_round(bytes([i]) * 32) for i in range(4)]
    masks = [_selected(c, NUMEL) for c in rounds]
    for mask in masks:
        padded = torch.cat([mask, torch.zeros(-NUMEL % stride, dtype=torch.bool)])
        assert torch.equal(padded.view(-1, stride).sum(1), torch.ones(-(-NUMEL // stride), dtype=torch.long))
    assert len({m.numpy().tobytes() for m in masks}) == 4  # each round its own mask
    # a peer that binds the same round ID draws the same mask; the dense codecs have no round
    assert torch.equal(_selected(codec.for_round(bytes([2]) * 32), NUMEL), masks[2])
    assert rounds[2].seed != codec.seed and codec.for_round(b"x").encoded_size(NUMEL) == codec.encoded_size(NUMEL)
    assert all(CODECS[name].for_round(b"x") is CODECS[name] for name in CODECS if name not in MASK_CODECS)
    # over many rounds every offset of a group is drawn about as often
    counts = torch.stack([_selected(codec.for_round(i.to_bytes(4, "little")), 64 * stride).view(-1, stride)
                          for i in range(200)]).sum(0)
    share, p = counts.double() / 200, 1 / stride
    assert float((share - p).abs().max()) < 5 * (p * (1 - p) / 200) ** 0.5  # within 5 binomial deviations


@pytest.mark.parametrize("codec_name", MASK_CODECS)
def test_sent_values_are_within_their_codecs_bound_of_the_selected_values_and_the_rest_decode_to_zero(codec_name):
    codec = get_codec(codec_name).for_round(b"round")
    part = _normal(NUMEL, 1)
    decoded = codec.decode(codec.encode(part), NUMEL)
    sent = _selected(codec, NUMEL)
    assert torch.equal(decoded[~sent], torch.zeros(int((~sent).sum())))
    selected = part[sent]
    values = dataclasses.replace(codec.values, name="values")  # the dense codec of the values sent
    assert torch.equal(decoded[sent], values.decode(values.encode(selected), selected.numel()))
    error = (decoded[sent].double() - selected.double()).abs()
    assert bool((error <= values.error_bound(selected).double()).all())
    bound = codec.error_bound(part)
    assert torch.equal(bound[~sent], part[~sent].abs()) and torch.equal(bound[sent], values.error_bound(selected))
    assert len(codec.encode(part)) == values.encoded_size(-(-NUMEL // codec.stride))


@pytest.mark.parametrize("codec_name", MASK_CODECS)
def test_carried_names_the_values_the_round_sends(codec_name):
    codec = get_codec(codec_name)
    assert not codec.sends_every_value
    for round_id in (b"a", b"b"):
        round_codec = codec.for_round(round_id)
        for numel in (1, codec.stride - 1, NUMEL):
            carried = round_codec.carried(numel)
            assert carried.dtype == torch.bool and torch.equal(carried, _selected(round_codec, numel))
    assert all(CODECS[name].sends_every_value and CODECS[name].carried(NUMEL) is None
               for name in CODECS if name not in MASK_CODECS)


def test_the_outer_step_moves_only_the_values_the_round_carried():
    """The lazy outer step: a value the round's mask did not send keeps its value and its momentum, bit for bit;
    a value it sent steps exactly as in a dense round (:meth:`GlobalModel.apply`)."""
    cfg = tiny_config().outer
    start = [_normal(NUMEL, 20), _normal(300, 21)]
    dense, lazy = GlobalModel(start, cfg), GlobalModel(start, cfg)
    first = [_normal(NUMEL, 22), _normal(300, 23)]
    for model in (dense, lazy):  # a dense round first: a momentum that is not zero
        model.apply(first, [0, 1])
    codec = get_codec("mask8-e3m0").for_round(b"round 2")
    carried = [codec.carried(NUMEL), codec.carried(300)]
    mean = [torch.where(c, g, torch.zeros(())) for c, g in zip(carried, [_normal(NUMEL, 24), _normal(300, 25)])]
    before = [[p.clone() for p in lazy.params], [b.clone() for b in lazy.momentum_buffer]]
    dense.apply(mean, [0, 1])
    lazy.apply(mean, [0, 1], carried)
    for i, c in enumerate(carried):
        assert torch.equal(lazy.params[i][~c], before[0][i][~c])
        assert torch.equal(lazy.momentum_buffer[i][~c], before[1][i][~c])
        assert torch.equal(lazy.params[i][c], dense.params[i][c])
        assert torch.equal(lazy.momentum_buffer[i][c], dense.momentum_buffer[i][c])
        # stepped with a mean of 0 there, the momentum would have gone on moving the values not sent
        assert not torch.equal(dense.params[i][~c], before[0][i][~c])
    assert lazy.outer_step == dense.outer_step == 2 and lazy.sha256() != dense.sha256()


@pytest.mark.parametrize("codec_name", MASK_CODECS)
def test_error_feedback_sends_every_value_in_time_and_loses_nothing(codec_name):
    """Δ in the first round only, then nothing new: each round sends the round's mask of Δ + e, and the
    residual keeps the rest. Σ sent + e = Δ all along (up to float32 roundings of e), every value is sent in some
    round, and the residual ends far below Δ."""
    codec, rounds = get_codec(codec_name), 12 * get_codec(codec_name).stride
    feedback = ErrorFeedback([torch.Size([NUMEL])])
    delta = _normal(NUMEL, 2)
    sent_sum = torch.zeros(NUMEL, dtype=torch.float64)
    ever_sent = torch.zeros(NUMEL, dtype=torch.bool)
    for round_ in range(rounds):
        new = delta if round_ == 0 else torch.zeros(NUMEL)
        (to_send,) = feedback.compensate([0], [new])
        round_codec = codec.for_round(round_.to_bytes(8, "little"))
        sent = round_codec.decode(round_codec.encode(to_send), NUMEL)
        feedback.commit([0], [to_send], [sent])
        sent_sum += sent.double()
        ever_sent |= _selected(round_codec, NUMEL)
        # exact but for the float32 rounding of each round's residual (none in E3M0, whose x − x̂ is a float32)
        lost = float((delta.double() - sent_sum - feedback.residual[0].double()).abs().max())
        assert lost <= (round_ + 1) * 2.0**-24 * float(delta.abs().max())
    assert bool(ever_sent.all())
    # the residual shrinks each time a value is sent: to 1e-4 of Δ's norm in E3M0 after 12 sends a value; the 2-
    # and 1-bit codes take about a tenth off a send (their scale, the block's mean |e|, shrinks with e): 0.09–0.11
    assert float(feedback.residual[0].norm()) < 0.15 * float(delta.norm())


@pytest.mark.parametrize("codec_name", MASK_CODECS + ["2bit", "1bit"])  # (the dense ones: a mask of every value)
@pytest.mark.parametrize("rule", ["centered-clip", "trimmed-mean"])
def test_robust_rules_over_decoded_parts_clip_a_hostile_part_and_keep_the_mask(rule, codec_name):
    """Five senders' parts through the round's codec, one of them ×1000: the robust result is zero off the
    mask, and on it within the honest parts' range, where the plain mean is dragged far off."""
    codec = get_codec(codec_name).for_round(b"group-id")
    parts = [codec.decode(codec.encode(_normal(NUMEL, 10 + i)), NUMEL) for i in range(5)]
    hostile = codec.decode(codec.encode(_normal(NUMEL, 15) * 1000), NUMEL)
    claims = [64.0] * 5
    result = aggregate(parts[:4] + [hostile], claims, AggregationRule(rule))
    mean = aggregate(parts[:4] + [hostile], claims, AggregationRule("mean"))
    sent = _selected(codec, NUMEL)
    assert torch.equal(result[~sent], torch.zeros(int((~sent).sum())))
    honest = torch.stack(parts[:4])
    spread = float((honest.max(0).values - honest.min(0).values).max())
    assert float((result - honest.mean(0)).abs().max()) <= spread
    assert float((mean - honest.mean(0)).abs().max()) > 50 * spread
    # and the result travels in the same mask: its round trip is zero off it, within the bound on it
    again = codec.decode(codec.encode(result), NUMEL)
    assert bool(((again - result).abs() <= codec.error_bound(result)).all()) and not bool(again[~sent].any())


@pytest.mark.parametrize("codec_name", MASK_CODECS)
def test_a_spot_checks_chunk_is_a_slice_of_the_parts_bytes(codec_name):
    """The mask repeats every 16,384 values, the spot check's chunk: an auditor fetches a sample of chunks,
    each the encoding of its values alone, not whole parts (p2p_diloco.sync.spot_check)."""
    from p2p_diloco.sync import spot_check

    codec = get_codec(codec_name).for_round(b"audited round")
    assert spot_check.CHUNK_VALUES % codec.period == 0 and spot_check.sliceable(codec)
    part = _normal(3 * spot_check.CHUNK_VALUES + 1000, 40)
    data = codec.encode(part)
    for start, stop in spot_check.chunk_spans(codec, part.numel()):
        assert spot_check.chunk_bytes(codec, data, part.numel(), start, stop) == codec.encode(part[start:stop])


def reducer_round() -> dict[str, str]:
    """sha256 of each sender's bytes and of the reducer's averaged bytes and their decode, for each mask
    codec (and the dense 2- and 1-bit codecs, whose scale is a sum) and rule, on fixed parts of many magnitudes (one
    ×100, one sign-flipped: the clips act)."""
    hashes = {}
    for name in MASK_CODECS + ["2bit", "1bit"]:
        codec = get_codec(name).for_round(b"fixed round")
        raw = [_normal(NUMEL, 30 + i) for i in range(5)]
        raw[3] = raw[3] * 100
        raw[4] = -raw[4]
        encoded = [codec.encode(p) for p in raw]
        parts = [codec.decode(data, NUMEL) for data in encoded]
        for rule in ("mean", "centered-clip", "trimmed-mean"):
            mean_bytes = codec.encode(aggregate(parts, [96.0, 128.0, 128.0, 112.0, 64.0], AggregationRule(rule)))
            decoded = codec.decode(mean_bytes, NUMEL).numpy().tobytes()
            hashes[f"{name} {rule}"] = hashlib.sha256(b"".join(encoded) + mean_bytes + decoded).hexdigest()
    return hashes


def _round_under(kernel: dict) -> dict:
    """What ``python -m tests.test_sparse_codec`` prints: this machine's kernel and :func:`reducer_round`,
    in a fresh process with `kernel` (ATEN_CPU_CAPABILITY or nothing) in its environment."""
    env = {name: value for name, value in os.environ.items() if name != "ATEN_CPU_CAPABILITY"}
    done = subprocess.run([sys.executable, "-m", "tests.test_sparse_codec"], cwd=REPO, capture_output=True, text=True,
                          env={**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **kernel}, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(120)
def test_the_bytes_of_the_mean_are_the_same_under_each_cpu_kernel():
    """A reducer's round in the mask codecs, in a process under ATen's default kernels and in one under this
    machine's best (AVX2 or AVX-512): the senders' bytes, the mean's bytes and its decode are the same."""
    with ThreadPoolExecutor(2) as pool:
        best, default = pool.map(_round_under, ({}, {"ATEN_CPU_CAPABILITY": "default"}))
    assert default["capability"] == "DEFAULT"
    assert best["hashes"] == default["hashes"] == reducer_round()


if __name__ == "__main__":
    print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "hashes": reducer_round()}))
