"""The causal language model a run trains, built identically on every peer from the run config."""

from __future__ import annotations

from typing import Optional

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from p2p_diloco.config import ConfigError, ModelConfig

# where model configs keep the longest sequence they can take, by architecture family
POSITION_LIMIT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def check_sequence_length(model_config, seq_len: int, model_name: str) -> None:
    """A hub model's own position limit, which the `[model]` sizes of the run config do not describe."""
    limit = next((getattr(model_config, key) for key in POSITION_LIMIT_KEYS
                  if isinstance(getattr(model_config, key, None), int)), None)
    if limit is not None and seq_len > limit:
        raise ConfigError(f"config: data.seq_len = {seq_len} exceeds the {limit} positions model {model_name!r} takes")


def build_model(cfg: ModelConfig, vocab_size: int, seed: int, seq_len: int | None = None) -> PreTrainedModel:
    """A freshly initialised model; the same (cfg, vocab_size, seed) gives bit-identical weights.

    ``cfg.name == "llama"`` builds a Llama-architecture model from the sizes in the config; any other
    name is looked up with ``AutoConfig`` (hub or local path) and initialised from scratch, and
    `seq_len`, when given, is checked against that model's own position limit.
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
        if seq_len is not None:
            check_sequence_length(model_config, seq_len, cfg.name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(model_config, attn_implementation="eager")
    return model


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters DiLoCo syncs, in the fixed order every peer uses (module registration order)."""
    return [p for p in model.parameters() if p.requires_grad]


@torch.no_grad()
def evaluate_loss(model: PreTrainedModel, sequences: torch.Tensor, batch_size: int = 16) -> Optional[float]:
    """Mean next-token cross-entropy of `model` over held-out sequences [n, seq_len]; None when n = 0."""
    if len(sequences) == 0:
        return None
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total = 0.0
    for start in range(0, len(sequences), batch_size):
        batch = sequences[start : start + batch_size].to(device)
        total += model(input_ids=batch, labels=batch).loss.item() * len(batch)
    model.train(was_training)
    return total / len(sequences)
