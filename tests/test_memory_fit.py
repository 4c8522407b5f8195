"""The memory estimate of a training step and the micro-batch it picks (p2p_diloco.train.memory)."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.config import ConfigError, ModelConfig, load_config
from p2p_diloco.train.memory import (GIB, SAFETY_MARGIN_PERCENT, MemoryBudget, MemoryFit, MemoryFitError, ModelShape,
                                     activation_bytes_per_sequence, cap_allocator, choose_micro_batch,
                                     fit_micro_batch, largest_divisor, layer_activation_bytes, memory_budget,
                                     step_memory)
from p2p_diloco.train.model import build_model
from tests.conftest import REPO, tiny_config

LLAMA_150M_VOCAB = 32000  # the Llama-2 tokenizer of peers/llama-150m-c4.toml
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def llama_150m():
    """The run config of peers/llama-150m-c4.toml and its model's shape, built without memory (meta device)."""
    cfg = load_config(REPO / "peers" / "llama-150m-c4.toml")
    with torch.device("meta"):
        model = build_model(cfg.model, LLAMA_150M_VOCAB, cfg.run.seed)
    return cfg, ModelShape.of(model, cfg.model.name)


def budget_for(total_bytes: int) -> MemoryBudget:
    return MemoryBudget(total_bytes, "cuda:0", "--max-memory")


def budget_fitting(memory, sequences: int) -> MemoryBudget:
    """The smallest budget whose usable part holds a step of exactly `sequences` sequences."""
    needed = memory.bytes_at(sequences)
    return budget_for(-(-needed * 100 // (100 - SAFETY_MARGIN_PERCENT)))


def test_largest_divisor():
    assert [largest_divisor(16, k) for k in (16, 15, 9, 8, 7, 5, 3, 2, 1)] == [16, 8, 8, 8, 4, 4, 2, 2, 1]
    assert [largest_divisor(12, k) for k in (6, 5, 4, 3, 1, 100)] == [6, 4, 4, 3, 1, 12]


@pytest.mark.parametrize("fitting, chosen",
                         [(16, 16), (15, 8), (9, 8), (8, 8), (7, 4), (5, 4), (3, 2), (1, 1), (40, 16)])
def test_a_budget_for_k_sequences_picks_the_largest_divisor_up_to_k(llama_150m, fitting, chosen):
    cfg, shape = llama_150m
    memory = step_memory(shape, cfg.data.seq_len, "adamw", bf16=True, gradient_checkpointing=False)
    budget = budget_fitting(memory, fitting)
    fit = fit_micro_batch(memory, 16, budget)
    assert (fit.micro_batch_size, fit.accumulation) == (chosen, 16 // chosen)
    assert fit.estimated_bytes == memory.bytes_at(chosen) <= budget.usable_bytes
    assert fit.budget_bytes == budget.total_bytes
    if fitting < 16:  # one sequence more would not fit
        assert memory.bytes_at(fitting + 1) > budget.usable_bytes


def test_checkpointing_and_8bit_adamw_lower_the_estimate_and_bf16_changes_the_layers(llama_150m):
    cfg, shape = llama_150m

    def estimate(optimizer="adamw", bf16=True, checkpointing=False):
        return step_memory(shape, cfg.data.seq_len, optimizer, bf16, checkpointing)

    base = estimate()
    assert estimate(checkpointing=True).per_sequence_bytes < base.per_sequence_bytes / 2
    assert estimate(checkpointing=True).fixed_bytes == base.fixed_bytes
    assert estimate(optimizer="adamw8bit").fixed_bytes < base.fixed_bytes
    assert estimate(optimizer="adamw8bit").per_sequence_bytes == base.per_sequence_bytes
    # bf16 autocast adds its weight copies; the loss head takes 12 bytes per logit either way, so the
    # sequences differ only by what the layers keep (under autocast, fp32 softmax plus its bf16 cast)
    fp32 = estimate(bf16=False)
    assert base.fixed_bytes - fp32.fixed_bytes == 2 * shape.trainable_parameters
    assert base.per_sequence_bytes - fp32.per_sequence_bytes == shape.layers * (
        layer_activation_bytes(shape, cfg.data.seq_len, True) - layer_activation_bytes(shape, cfg.data.seq_len, False))


def test_sharded_over_ranks_each_holds_its_share_of_the_state_and_one_layer_whole(llama_150m):
    cfg, shape = llama_150m
    whole = step_memory(shape, cfg.data.seq_len, "adamw", True, False)
    sharded = step_memory(shape, cfg.data.seq_len, "adamw", True, False, shards=8)
    assert sharded.fixed_bytes == whole.fixed_bytes // 8 + 8 * shape.parameters // shape.layers
    assert sharded.per_sequence_bytes == whole.per_sequence_bytes  # each rank computes its own sequences


def test_the_150m_llama_estimate_is_in_a_sane_range(llama_150m):
    cfg, shape = llama_150m
    assert 130e6 < shape.parameters == shape.trainable_parameters < 140e6
    assert (shape.layers, shape.hidden_size, shape.heads, shape.vocab_size) == (12, 768, 12, LLAMA_150M_VOCAB)
    memory = step_memory(shape, cfg.data.seq_len, "adamw", bf16=True, gradient_checkpointing=False)
    assert 2.0 * GIB < memory.fixed_bytes < 2.6 * GIB  # 18 B per parameter
    assert 1.3 * GIB < memory.per_sequence_bytes < 2.0 * GIB  # 1024 tokens, eager attention, 32k logits
    checkpointed = step_memory(shape, cfg.data.seq_len, "adamw", bf16=True, gradient_checkpointing=True)
    assert 0.3 * GIB < checkpointed.per_sequence_bytes < 0.6 * GIB
    # an 80 GB GPU takes the run's whole batch of 16; a 24 GB one half of it; a 12 GB one with checkpointing all
    assert fit_micro_batch(memory, 16, budget_for(80 * GIB)).micro_batch_size == 16
    assert fit_micro_batch(memory, 16, budget_for(24 * GIB)).micro_batch_size == 8
    assert fit_micro_batch(checkpointed, 16, budget_for(12 * GIB)).micro_batch_size == 16


def test_too_little_memory_is_a_one_line_error_with_the_numbers(llama_150m):
    cfg, shape = llama_150m
    memory = step_memory(shape, cfg.data.seq_len, "adamw", bf16=True, gradient_checkpointing=False)
    with pytest.raises(MemoryFitError) as raised:
        fit_micro_batch(memory, 16, budget_for(2 * GIB))
    message = str(raised.value)
    assert isinstance(raised.value, ConfigError)  # the peer prints it as one line and exits
    assert "\n" not in message
    assert message == (
        f"model llama ({shape.parameters / 1e6:.1f}M parameters) needs {memory.fixed_bytes / GIB:.1f} GiB for "
        f"weights, gradients and AdamW state plus {memory.per_sequence_bytes / GIB:.1f} GiB per sequence of 1024 "
        "tokens; 2.0 GiB available on cuda:0 (--max-memory), 90% of it usable: use a GPU with more memory, "
        "inner.optimizer = 'adamw8bit', --gradient-checkpointing, or a smaller model")
    eight_bit = step_memory(shape, cfg.data.seq_len, "adamw8bit", bf16=True, gradient_checkpointing=True)
    with pytest.raises(MemoryFitError, match=r"8-bit AdamW state .*: use a GPU with more memory, or a smaller model$"):
        fit_micro_batch(eight_bit, 16, budget_for(GIB))


def test_budget_is_max_memory_else_free_cuda_memory_else_none():
    assert memory_budget(CPU, 0.0) is None
    budget = memory_budget(CPU, 1.5)
    assert (budget.total_bytes, budget.usable_bytes, budget.device) == (int(1.5 * GIB), int(1.5 * GIB) * 9 // 10, "cpu")


def test_max_memory_caps_the_cuda_allocator(monkeypatch):
    """On CUDA --max-memory is a limit: torch's allocator gets that fraction of the device (faked here)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: type("P", (), {"total_memory": 80 * GIB}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda *args: calls.append(args))
    assert cap_allocator(torch.device("cuda"), 20.0) == 20 * GIB
    assert cap_allocator(torch.device("cuda:1"), 100.0) == 80 * GIB  # at most the whole device
    assert calls == [(0.25, 0), (1.0, 1)]
    assert cap_allocator(torch.device("cuda"), 0.0) is None  # no --max-memory: nothing capped
    assert cap_allocator(CPU, 2.0) is None  # on a CPU it is the estimate's budget only
    assert len(calls) == 2


def test_choose_micro_batch_on_a_tiny_model():
    cfg = tiny_config(inner={"batch_size": 8})
    model = build_model(cfg.model, 300, cfg.run.seed)
    unlimited = choose_micro_batch(model, cfg, CPU, bf16=False)  # CPU, no --max-memory: the whole batch
    assert (unlimited.micro_batch_size, unlimited.accumulation, unlimited.budget_bytes) == (8, 1, None)
    assert unlimited.estimated_bytes > 0
    assert unlimited.describe_split() == "micro-batch 8 x 1 per batch of 8"
    assert unlimited.describe_memory() == f"estimated {unlimited.estimated_bytes / 2**20:.0f} MiB"  # under 1 GiB
    assert MemoryFit(8, 2, int(21.34 * GIB), int(70.2 * GIB)).describe_memory() == "estimated 21.3 GiB of 70.2 GiB"

    memory = step_memory(ModelShape.of(model, "llama"), cfg.data.seq_len, "adamw", False, False)
    limit_gib = budget_fitting(memory, 3).total_bytes / GIB
    fitted = choose_micro_batch(model, cfg.replace(compute={"max_memory_gib": limit_gib}), CPU, bf16=False)
    assert (fitted.micro_batch_size, fitted.accumulation) == (2, 4)
    given = choose_micro_batch(model, cfg.replace(compute={"micro_batch_size": 4, "max_memory_gib": limit_gib}), CPU,
                               bf16=False)
    assert (given.micro_batch_size, given.accumulation) == (4, 2)  # as given, even over the estimate


def saved_activation_bytes(model, seq_len: int, bf16: bool) -> int:
    """Bytes of the tensors autograd saves in a forward pass of one sequence, each storage once, without
    the weights and autocast's 16-bit copies of them (counted with the parameters)."""
    weight_shapes = {shape for p in model.parameters() for shape in (p.shape, p.t().shape if p.dim() == 2 else p.shape)}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and not (tensor.dtype == torch.bfloat16 and tensor.shape in weight_shapes):
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    tokens = torch.randint(0, model.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model(input_ids=tokens, labels=tokens).loss.backward()
    return sum(storages.values())


@pytest.mark.parametrize("bf16", [True, False])
def test_the_layer_estimate_is_what_autograd_saves(bf16):
    """Sizes that no activation shares with a weight (s=48, h=64, i=160, V=300), so weights are told apart.

    It matches what transformers' eager attention and Llama block save today tensor for tensor (see
    p2p_diloco/train/memory.py), so a transformers upgrade that changes them may need the estimate's
    constants (LAYER_BYTES) and this test updated."""
    seq_len, vocab = 48, 300
    sizes = dict(hidden_size=64, num_heads=4, intermediate_size=160, max_position_embeddings=seq_len)
    models = [build_model(ModelConfig(num_layers=layers, **sizes), vocab, 0) for layers in (1, 2)]
    one_layer, two_layers = (saved_activation_bytes(model, seq_len, bf16) for model in models)
    shape = ModelShape.of(models[1], "llama")
    estimate = layer_activation_bytes(shape, seq_len, bf16)
    rsqrt = 2 * seq_len * 4  # the norms' fp32 1/rms, one value per token: left out of the estimate
    assert two_layers - one_layer == estimate + rsqrt
    assert one_layer < activation_bytes_per_sequence(ModelShape.of(models[0], "llama"), seq_len, bf16, False)
