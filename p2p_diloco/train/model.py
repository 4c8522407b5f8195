"""The causal language model a run trains, built identically on every peer from the run config."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from p2p_diloco.config import ModelConfig


def build_model(cfg: ModelConfig, vocab_size: int, seed: int) -> PreTrainedModel:
    """A freshly initialised model; the same (cfg, vocab_size, seed) gives bit-identical weights.

    ``cfg.name == "llama"`` builds a Llama-architecture model from the sizes in the config; any other
    name is looked up with ``AutoConfig`` (hub or local path) and initialised from scratch.
    """
    if cfg.name == "llama":
        model_config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_heads,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=False,
        )
    else:
        model_config = AutoConfig.from_pretrained(cfg.name, vocab_size=vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(model_config, attn_implementation="eager")
    return model


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters DiLoCo syncs, in the fixed order every peer uses (module registration order)."""
    return [p for p in model.parameters() if p.requires_grad]


@torch.no_grad()
def evaluate_loss(model: PreTrainedModel, sequences: torch.Tensor, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy of `model` over held-out sequences [n, seq_len]."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, len(sequences), batch_size):
        batch = sequences[start : start + batch_size].to(device)
        out = model(input_ids=batch, labels=batch)
        total += out.loss.item() * len(batch)
        count += len(batch)
    model.train(was_training)
    return total / max(count, 1)
