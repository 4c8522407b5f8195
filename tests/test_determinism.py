"""θ_global does not depend on the peer's CPU (issue 18): whatever must be identical on every peer (the
initial weights, the outer Nesterov step, the merge, the codecs' decode) comes out as the same bits
under ATen's default kernels (``ATEN_CPU_CAPABILITY=default``, a CPU without AVX2) and under the best
kernels of this machine (AVX2 or AVX-512), each computed in a process of its own; torch's SGD, the
old outer step, does not. Also: a model whose config names bf16 is built in fp32, the block codecs
decode to bitsandbytes' own bits, and two real peers on different kernels keep one θ_global.

Run as ``python -m tests.test_determinism`` it prints the hashes of one process (what the tests compare).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from p2p_diloco.hashing import tensors_sha256
from p2p_diloco.sync.codecs import CODECS, Bnb4BitCodec, BlockwiseInt8Codec, RawFloat32Codec, TwoByteFloatCodec
from p2p_diloco.sync.robust import RULES, AggregationRule, aggregate
from p2p_diloco.train.init_weights import SeededDraws, natural_log, seeded_initialisation
from p2p_diloco.train.model import build_model, trainable_parameters
from p2p_diloco.train.outer import GlobalModel
from p2p_diloco.train.update_check import tensors_norm
from p2p_diloco.metrics import read_metrics
from tests.conftest import REPO, tiny_config
from tests.swarm_helpers import LOOPBACK, hashes_by_step, start_bootstrap, tiny_config_file, wait_until

VOCAB = 300
OUTER_STEPS = 4
MERGE_ALPHA = 0.5
DECODED_NUMEL = 1001  # odd, and not a multiple of any block size
KERNELS = {"default": {"ATEN_CPU_CAPABILITY": "default"}, "best": {}}  # "best": the variable unset
SUBPROCESS_TIMEOUT_S = 240

pytestmark = pytest.mark.timeout(600)


# ---- what each process computes -------------------------------------------------------------------------

def initial_parameters() -> list[torch.Tensor]:
    """θ_global's first value for the tests' tiny config."""
    cfg = tiny_config()
    return trainable_parameters(build_model(cfg.model, VOCAB, cfg.run.seed))


def drifts(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Fixed stand-ins for OUTER_STEPS rounds of inner steps, one per parameter, from IEEE-only draws
    (torch.randn itself depends on the kernel)."""
    draws = SeededDraws(seed=1234)
    return [[draws.normal(p.numel(), 0.0, 1e-2).to(torch.float32).view(p.shape) for p in params]
            for _ in range(OUTER_STEPS)]


def outer_step_hashes(params: list[torch.Tensor]) -> list[str]:
    """OUTER_STEPS DiLoCo rounds with GlobalModel: θ_local drifts, Δ = θ_global − θ_local, the outer
    step on 0.9·Δ (a stand-in for the group's mean), and the merge with α = 0.5; the hash of the global
    state and of θ_local after each round."""
    local = [p.detach().clone() for p in params]
    global_model = GlobalModel(local, tiny_config().outer)
    everything = list(range(len(local)))
    hashes = []
    for drift in drifts(params):
        with torch.no_grad():
            for p, d in zip(local, drift):
                p.add_(d)
        delta = global_model.pseudo_gradient(local, everything)
        global_model.apply([torch.mul(d, 0.9) for d in delta], everything)
        global_model.merge_into(local, everything, MERGE_ALPHA)
        hashes.append(global_model.sha256() + "/" + tensors_sha256(local))
    return hashes


def torch_sgd_hashes(params: list[torch.Tensor]) -> list[str]:
    """The outer step as it was before issue 18: torch's Nesterov SGD (``add_(…, alpha=…)`` inside)."""
    outer = tiny_config().outer
    theta = [p.detach().clone() for p in params]
    optimizer = torch.optim.SGD(theta, lr=outer.lr, momentum=outer.momentum, nesterov=True)
    hashes = []
    for drift in drifts(params):
        for p, d in zip(theta, drift):
            p.grad = torch.mul(d, 0.9)
        optimizer.step()
        hashes.append(tensors_sha256(theta))
    return hashes


def torch_init_hash() -> str:
    """The initial weights as they were built before issue 18: torch's own samplers, seeded."""
    cfg = tiny_config()
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=cfg.model.hidden_size,
                         intermediate_size=cfg.model.intermediate_size, num_hidden_layers=cfg.model.num_layers,
                         num_attention_heads=cfg.model.num_heads, num_key_value_heads=cfg.model.num_heads,
                         max_position_embeddings=cfg.model.max_position_embeddings, tie_word_embeddings=False)
    torch.manual_seed(cfg.run.seed)
    return tensors_sha256(trainable_parameters(AutoModelForCausalLM.from_config(config)))


def fixed_bytes(codec, numel: int) -> bytes:
    """Valid, fixed encoded bytes of `numel` values for `codec`: random bits from PCG64, with the bits
    that would make a value or a block scale infinite, NaN or negative cleared."""
    size = codec.encoded_size(numel)
    data = np.frombuffer(np.random.PCG64([7, numel]).random_raw(size // 8 + 1).tobytes(), np.uint8)[:size].copy()
    if isinstance(codec, RawFloat32Codec):
        data.view("<u4")[:] &= np.uint32(0xBFFFFFFF)  # the top exponent bit: finite
    elif isinstance(codec, TwoByteFloatCodec):
        data.view("<u2")[:] &= np.uint16(0xBFFF)
    else:
        scale_bytes = 4 * -(-numel // codec.blocksize)
        data[size - scale_bytes:].view("<u4")[:] &= np.uint32(0x3FFFFFFF)  # ≥ 0 and finite
    return data.tobytes()


def decode_hashes() -> dict[str, str]:
    return {name: tensors_sha256([codec.decode(fixed_bytes(codec, DECODED_NUMEL), DECODED_NUMEL)])
            for name, codec in CODECS.items()}


def encode_hashes() -> dict[str, str]:
    """Each codec that claims a reproducible encoding (Codec.reproducible_encode), on fixed values of many
    magnitudes: the reducer audit compares those bytes between CPUs."""
    draws = SeededDraws(seed=5)
    exponents = draws.normal(DECODED_NUMEL, -10.0, 4.0).round()  # exact powers of two: pow would differ by kernel
    values = torch.ldexp(draws.normal(DECODED_NUMEL, 0.0, 1.0), exponents).to(torch.float32)
    return {name: hashlib.sha256(codec.encode(values)).hexdigest() for name, codec in CODECS.items()
            if codec.reproducible_encode}


def aggregate_hashes() -> dict[str, str]:
    """Each aggregation rule's result over fixed parts (one ×100, one sign-flipped, one claiming 1e9
    samples: every clip and the trim act), with the norm the update check takes of them."""
    draws = SeededDraws(seed=99)
    parts = [draws.normal(DECODED_NUMEL, 0.0, 1e-2).to(torch.float32) for _ in range(5)]
    parts[3].mul_(100.0)
    parts[4].neg_()
    claims = [96.0, 128.0, 128.0, 112.0, 1e9]
    hashes = {rule: tensors_sha256([aggregate(parts, claims, AggregationRule(rule))]) for rule in RULES}
    hashes["norm"] = repr(tensors_norm(parts))
    return hashes


def hashes_of_this_process() -> dict:
    torch.set_num_threads(1)
    params = initial_parameters()
    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "initial": tensors_sha256(params),
        "outer_steps": outer_step_hashes(params),
        "decode": decode_hashes(),
        "aggregate": aggregate_hashes(),
        "encode": encode_hashes(),
        "log": tensors_sha256([natural_log(torch.linspace(1e-300, 1.0, 10001, dtype=torch.float64)[1:])]),
        "torch_sgd": torch_sgd_hashes(params),
        "torch_init": torch_init_hash(),
    }


# ---- the same computation under each kernel ------------------------------------------------------------

def run_under(env: dict) -> dict:
    """hashes_of_this_process() in a fresh process with `env` added to (and ATEN_CPU_CAPABILITY removed from)
    this one's environment."""
    base = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    done = subprocess.run([sys.executable, "-m", "tests.test_determinism"], cwd=REPO, capture_output=True,
                          text=True, timeout=SUBPROCESS_TIMEOUT_S,
                          env={**base, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def by_kernel() -> dict[str, dict]:
    with ThreadPoolExecutor(len(KERNELS)) as pool:
        results = dict(zip(KERNELS, pool.map(run_under, KERNELS.values())))
    if results["default"]["capability"] == results["best"]["capability"]:
        pytest.skip(f"this CPU has no kernels beyond ATen's default ({results['best']['capability']})")
    return results


def test_the_two_processes_run_different_kernels(by_kernel):
    assert by_kernel["default"]["capability"] == "DEFAULT"
    assert by_kernel["best"]["capability"] in ("AVX2", "AVX512"), by_kernel["best"]["capability"]


def test_torch_sgd_and_torch_init_would_differ_between_the_kernels(by_kernel):
    """What the tests below guard against, seen on this machine: they can fail here."""
    default, best = by_kernel["default"], by_kernel["best"]
    assert default["torch_sgd"] != best["torch_sgd"]
    assert default["torch_init"] != best["torch_init"]


@pytest.mark.parametrize("what", ["initial", "outer_steps", "log", "aggregate", "encode"])
def test_the_same_bits_under_each_kernel(by_kernel, what):
    assert by_kernel["default"][what] == by_kernel["best"][what]


@pytest.mark.parametrize("codec", list(CODECS))
def test_each_codec_decodes_the_same_bits_under_each_kernel(by_kernel, codec):
    assert by_kernel["default"]["decode"][codec] == by_kernel["best"]["decode"][codec]


def test_the_outer_steps_here_are_those_of_the_subprocesses(by_kernel):
    """The subprocesses ran what this process runs (no stale or skipped computation)."""
    torch.set_num_threads(1)
    params = initial_parameters()
    assert tensors_sha256(params) == by_kernel["best"]["initial"]
    assert outer_step_hashes(params) == by_kernel["best"]["outer_steps"]


# ---- the pieces, in this process -------------------------------------------------------------------------

def test_natural_log_is_accurate():
    s = torch.cat([torch.logspace(-300, 0, 5000, dtype=torch.float64), torch.rand(5000, dtype=torch.float64)])
    s = s[s > 0]
    assert torch.allclose(natural_log(s), torch.log(s), rtol=4e-16, atol=1e-15)


def test_seeded_draws_have_the_right_distributions():
    draws = SeededDraws(seed=5)
    normal = draws.normal(200_000, 1.0, 2.0)
    assert abs(normal.mean().item() - 1.0) < 0.02 and abs(normal.std().item() - 2.0) < 0.02
    assert abs(((normal - 1.0) / 2.0).pow(4).mean().item() - 3.0) < 0.1  # the normal's kurtosis
    uniform = draws.uniform(200_000, -3.0, 1.0)
    assert uniform.min() >= -3.0 and uniform.max() < 1.0 and abs(uniform.mean().item() + 1.0) < 0.02
    truncated = draws.truncated_normal(100_000, 0.0, 1.0, -0.5, 2.0)
    assert truncated.min() >= -0.5 and truncated.max() <= 2.0 and len(truncated) == 100_000
    assert draws.calls == 3


def test_seeded_draws_are_a_function_of_the_seed_and_the_call():
    first, again, other = SeededDraws(seed=3), SeededDraws(seed=3), SeededDraws(seed=4)
    a = [first.normal(1000, 0.0, 1.0), first.normal(1000, 0.0, 1.0)]
    b = [again.normal(1000, 0.0, 1.0), again.normal(1000, 0.0, 1.0)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], other.normal(1000, 0.0, 1.0))
    # a known answer: the construction itself (PCG64's stream, the polar method) must not change
    digest = hashlib.sha256(SeededDraws(seed=0).normal(8, 0.0, 1.0).numpy().tobytes()).hexdigest()
    assert digest == KNOWN_NORMALS_SHA256, digest


KNOWN_NORMALS_SHA256 = "acc7dc63acf3066682b6eae3ed6dbd9c3e445da8a0b95a41ba77c073a9eec210"  # the 8 float64 values, little-endian


def test_the_initialisers_keep_the_architecture_semantics_and_are_restored():
    originals = (torch.Tensor.normal_, torch.Tensor.uniform_, torch.nn.init.trunc_normal_, torch.randn, torch.rand)
    cfg = tiny_config()
    model = build_model(cfg.model, VOCAB, cfg.run.seed)
    assert originals == (torch.Tensor.normal_, torch.Tensor.uniform_, torch.nn.init.trunc_normal_, torch.randn,
                         torch.rand)
    assert "normal_" not in vars(torch.Tensor)  # inherited from TensorBase, as before
    for name, p in model.named_parameters():
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name  # RMSNorm weights start at 1
        else:
            assert abs(p.std().item() - model.config.initializer_range) < 0.002, name
    with pytest.raises(ZeroDivisionError):
        with seeded_initialisation(0):
            1 / 0
    assert originals == (torch.Tensor.normal_, torch.Tensor.uniform_, torch.nn.init.trunc_normal_, torch.randn,
                         torch.rand)


def test_routed_calls_fill_like_torch():
    with seeded_initialisation(0) as draws:
        weight = torch.empty(50, 40)
        torch.nn.init.trunc_normal_(weight, std=0.02, a=-0.03, b=0.03)
        assert weight.abs().max() <= 0.03
        torch.nn.init.kaiming_uniform_(weight, a=5 ** 0.5)
        bound = 1 / 40 ** 0.5
        assert weight.abs().max() <= bound and weight.abs().max() > 0.9 * bound
        assert torch.randn(3, 4).shape == (3, 4) and torch.rand((5,)).max() < 1
        assert torch.randint(0, 5, (3,)).dtype == torch.int64  # not routed
        with pytest.raises(RuntimeError, match="orthogonal_"):
            torch.nn.init.orthogonal_(weight)
        assert draws.calls == 4


def test_a_model_whose_config_says_bf16_is_built_in_fp32(tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=64, dtype=torch.bfloat16).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    # what from_config alone makes of it
    assert {p.dtype for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path)).parameters()} \
        == {torch.bfloat16}
    cfg = tiny_config(model={"name": str(tmp_path)})
    model = build_model(cfg.model, VOCAB, cfg.run.seed, cfg.data.seq_len)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    again = build_model(cfg.model, VOCAB, cfg.run.seed, cfg.data.seq_len)
    assert tensors_sha256(trainable_parameters(model)) == tensors_sha256(trainable_parameters(again))


def test_the_dynamic_map_is_bitsandbytes_own_on_avx2():
    """The int8 codec's map (a constant of the wire format) is what bitsandbytes computes under the AVX2
    and AVX-512 kernels; under the default kernel its torch.linspace gives other bits (the subprocess
    under ATEN_CPU_CAPABILITY=default decodes int8 all the same)."""
    import bitsandbytes.functional as functional

    from p2p_diloco.sync.codecs import _bnb_map

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("bitsandbytes' map is computed with another kernel here")
    assert torch.equal(functional.create_dynamic_map(signed=True).float(), _bnb_map("dynamic"))


@pytest.mark.parametrize("numel", [1, 63, 64, 65, 255, 256, 257, 1001, 4096])
@pytest.mark.parametrize("codec", ["int8", "nf4", "fp4-bnb"])
def test_block_decodes_give_bitsandbytes_own_bits(codec, numel):
    """The pure-torch decode against bitsandbytes' own dequantize (its C kernels on the CPU) of the same bytes."""
    import bitsandbytes.functional as functional

    from p2p_diloco.sync.codecs import _bnb_map

    codec = CODECS[codec]
    generator = torch.Generator().manual_seed(numel)
    part = torch.randn(numel, generator=generator) * torch.logspace(-6, 1, numel)[torch.randperm(numel, generator=generator)]
    part[::7] = 0.0
    data = codec.encode(part)
    if isinstance(codec, BlockwiseInt8Codec):
        codes = torch.from_numpy(np.frombuffer(data, np.uint8, count=numel).copy())
        absmax = torch.from_numpy(np.frombuffer(data[numel:], "<f4").copy())
        state = functional.QuantState(absmax=absmax, code=_bnb_map("dynamic"), blocksize=codec.blocksize,
                                      dtype=torch.float32)
        expected = functional.dequantize_blockwise(codes, state).reshape(numel)
    else:
        assert isinstance(codec, Bnb4BitCodec)
        packed_bytes, even_numel = -(-numel // 2), numel + numel % 2  # its C kernel takes even lengths only
        packed = torch.from_numpy(np.frombuffer(data, np.uint8, count=packed_bytes).copy()).view(-1, 1)
        absmax = torch.from_numpy(np.frombuffer(data[packed_bytes:], "<f4").copy())
        state = functional.QuantState(absmax=absmax, shape=torch.Size([even_numel]), code=_bnb_map(codec.quant_type),
                                      blocksize=codec.blocksize, quant_type=codec.quant_type, dtype=torch.float32)
        expected = functional.dequantize_4bit(packed, state).reshape(even_numel)[:numel]
    decoded = codec.decode(data, numel)
    if codec.name == "fp4-bnb":
        # FP4 code 8 (the sign over a zero magnitude) is −0.0 in bitsandbytes' scalar loop and +0.0 in its
        # AVX-512 loop: the wire format takes −0.0 wherever it falls (codecs._bnb_4bit_decode_table)
        codes = torch.stack([packed.view(-1) >> 4, packed.view(-1) & 0xF], dim=1).reshape(-1)[:numel]
        code_8 = codes == 8
        assert decoded[code_8].eq(0).all() and decoded[code_8].signbit().all()
        expected = torch.where(code_8, decoded, expected)
    assert torch.equal(decoded.view(torch.int32), expected.view(torch.int32))


# ---- a real swarm -------------------------------------------------------------------------------------------

@pytest.mark.swarm
def test_two_peers_on_different_kernels_keep_one_global_model(processes, tmp_path, monkeypatch):
    """Two peers through the CLI on 127.0.0.1, one under ATen's default kernels: one θ_global after every
    outer step, and neither ever downloads the state (before issue 18 the default one did, every step).
    With a 4-bit codec and the merge, so that the decode and θ_local ← α·θ_local + (1 − α)·θ_global run too."""
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    config = tiny_config_file(tmp_path, outer={"codec": "fp4-e3m0", "merge_alpha": MERGE_ALPHA})
    maddr = start_bootstrap(processes)
    metrics = []
    for name, env in KERNELS.items():
        metrics.append(processes.log_dir / f"{name}.jsonl")
        processes.start(name, "peer", "--config", str(config), "--host", LOOPBACK.ip, "--initial-peers", maddr,
                        "--metrics-file", str(metrics[-1]), "--max-outer-steps", "3", "--wait-for-peers", "2", env=env)
    peers = [p for p in processes.procs if p.name in KERNELS]
    wait_until(lambda: all(p.poll() is not None for p in peers), 300, "both peers to take 3 outer steps")
    assert [p.returncode for p in peers] == [0, 0], [processes.log(p.name)[-2000:] for p in peers]
    by_step = hashes_by_step(metrics)
    assert sorted(by_step) == [1, 2, 3], by_step
    for step, hashes in by_step.items():
        assert len(hashes) == 1, f"the peers disagree after outer step {step}: {hashes}"
    for path in metrics:
        assert "state_loaded" not in [r["event"] for r in read_metrics(path)], path.name


if __name__ == "__main__":
    print(json.dumps(hashes_of_this_process()))
