"""The inner loop on a CUDA GPU: bf16 autocast with fused AdamW, 8-bit AdamW, compile, gradient
checkpointing, and a micro-batch fitted to a memory limit that the allocator enforces."""

from __future__ import annotations

import gc

import pytest
import torch

from p2p_diloco.config import ComputeConfig
from p2p_diloco.train.inner import InnerTrainer, autocast_dtype, prepare_for_compute
from p2p_diloco.train.memory import GIB, ModelShape, choose_micro_batch, largest_divisor, step_memory
from p2p_diloco.train.model import build_model
from tests.conftest import tiny_config
from tests.cuda_marks import NEEDS_CUDA
from tests.test_inner_compute import CountingStream, parameters_of

pytestmark = NEEDS_CUDA

VOCAB = 300
CUDA = torch.device("cuda")
# big enough that a batch of 16 takes about 2.8 GB (p2p_diloco.train.memory): a 1.25 GiB limit fits 4 sequences
MEDIUM = dict(model={"hidden_size": 512, "num_layers": 4, "num_heads": 8, "intermediate_size": 1376,
                     "max_position_embeddings": 512},
              data={"seq_len": 512}, inner={"batch_size": 16})
MEDIUM_VOCAB = 8000


def cuda_model(cfg, compute: ComputeConfig, vocab: int):
    model = build_model(cfg.model, vocab, cfg.run.seed).to(CUDA)
    prepare_for_compute(model, compute)
    return model


def cuda_trainer(cfg, compute: ComputeConfig = ComputeConfig(), micro_batch_size=None, vocab=VOCAB,
                 model=None) -> InnerTrainer:
    model = model or cuda_model(cfg, compute, vocab)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (cfg.inner.batch_size, cfg.data.seq_len), generator=generator) for _ in range(4)]
    return InnerTrainer(model, cfg.inner, CountingStream(batches), compute, micro_batch_size)


def stepped(trainer: InnerTrainer, steps: int = 2) -> list[float]:
    before = parameters_of(trainer)
    losses = [trainer.step()[0] for _ in range(steps)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(a, b) for a, b in zip(before, parameters_of(trainer)))
    assert all(p.dtype == torch.float32 for p in trainer.params)
    return losses


def test_bf16_step_with_fused_adamw():
    trainer = cuda_trainer(tiny_config())
    if torch.cuda.get_device_capability(CUDA)[0] >= 8:
        assert trainer.autocast_dtype is torch.bfloat16
    assert trainer.optimizer.defaults["fused"] is True
    stepped(trainer)


def test_8bit_adamw_step():
    trainer = cuda_trainer(tiny_config(inner={"optimizer": "adamw8bit"}))
    assert type(trainer.optimizer).__name__ == "AdamW8bit"
    stepped(trainer)
    embedding = trainer.model.get_input_embeddings().weight  # 9600 values: large enough for 8-bit state
    assert trainer.optimizer.state[embedding]["state1"].dtype == torch.uint8


def test_compile_trains_in_place():
    cfg = tiny_config()
    eager = cuda_trainer(cfg, ComputeConfig(precision="fp32"))
    compiled = cuda_trainer(cfg, ComputeConfig(precision="fp32", compile=True))
    assert [id(p) for p in compiled.model.parameters()] == [id(p) for p in compiled.params]
    first_eager, first_compiled = stepped(eager)[0], stepped(compiled)[0]
    assert first_compiled == pytest.approx(first_eager, rel=1e-4)  # the same model before any update


def fresh_peak() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(CUDA)


def test_gradient_checkpointing_same_gradient_less_memory():
    cfg = tiny_config(**MEDIUM)
    peaks, grads = [], []
    for checkpointing in (False, True):
        trainer = cuda_trainer(cfg, ComputeConfig(gradient_checkpointing=checkpointing), vocab=MEDIUM_VOCAB)
        trainer.model.train()
        fresh_peak()  # after the previous trainer is gone: only this one's model is on the GPU
        trainer._accumulate([next(trainer.batches).to(CUDA)])
        peaks.append(torch.cuda.max_memory_allocated(CUDA))
        grads.append([p.grad.detach().cpu() for p in trainer.params])  # off the GPU before the next peak
        del trainer
        fresh_peak()
    assert peaks[1] < peaks[0] * 0.7
    for plain, checkpointed in zip(*grads):
        torch.testing.assert_close(checkpointed, plain, rtol=2e-2, atol=1e-4)


@pytest.fixture
def memory_limit_gib():
    """The caching allocator refuses to hold more than 1.25 GiB for this test: real out-of-memory errors."""
    limit_gib = 1.25
    fresh_peak()
    torch.cuda.set_per_process_memory_fraction(limit_gib * GIB / torch.cuda.get_device_properties(CUDA).total_memory)
    yield limit_gib
    torch.cuda.set_per_process_memory_fraction(1.0)
    fresh_peak()


def test_the_fitted_micro_batch_runs_within_the_limit(memory_limit_gib):
    cfg = tiny_config(**MEDIUM).replace(compute={"max_memory_gib": memory_limit_gib})
    model = cuda_model(cfg, cfg.compute, MEDIUM_VOCAB)
    fit = choose_micro_batch(model, cfg, CUDA, bf16=autocast_dtype(cfg.compute.precision, CUDA) is not None)
    assert 1 < fit.micro_batch_size < cfg.inner.batch_size
    trainer = cuda_trainer(cfg, cfg.compute, fit.micro_batch_size, MEDIUM_VOCAB, model)
    stepped(trainer)
    assert trainer.micro_batch_size == fit.micro_batch_size  # no out-of-memory error on the way


def halved_until_it_fits(batch_size: int, step_bytes, limit_bytes: int) -> int:
    """The micro-batch the inner loop ends at, halving from the whole batch, if a step of m sequences
    takes step_bytes(m): the first of batch_size, its largest divisor <= half, ... that fits."""
    micro = batch_size
    while micro > 1 and step_bytes(micro) > limit_bytes:
        micro = largest_divisor(batch_size, micro // 2)
    return micro


def test_a_real_out_of_memory_error_halves_the_micro_batch(memory_limit_gib):
    cfg = tiny_config(**MEDIUM)
    trainer = cuda_trainer(cfg, vocab=MEDIUM_VOCAB)  # the whole batch of 16: about 2.8 GB
    estimate = step_memory(ModelShape.of(trainer.model, "llama"), cfg.data.seq_len, cfg.inner.optimizer,
                           trainer.autocast_dtype is not None, gradient_checkpointing=False)
    # the allocator enforces the whole limit (no safety margin): 16 and 8 do not fit, 4 does
    expected = halved_until_it_fits(cfg.inner.batch_size, estimate.bytes_at, int(memory_limit_gib * GIB))
    assert 1 < expected < cfg.inner.batch_size
    stepped(trainer, steps=1)
    assert trainer.micro_batch_size == expected
    assert trainer.batches.position == 1 and trainer.steps_done == 1
