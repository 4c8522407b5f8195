"""The causal language model a run trains, built identically on every peer from the run config."""

from __future__ import annotations

from typing import Optional

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from p2p_diloco.config import Config, ConfigError, ModelConfig, shared_settings
from p2p_diloco.train.data import largest_token_id, tokenizer_sha256
from p2p_diloco.train.init_weights import UnsupportedInitialiser, seeded_initialisation
from p2p_diloco.train.pretrained import load_pretrained, pretrained_config, weights_sha256

# where model configs keep the longest sequence they can take, by architecture family
POSITION_LIMIT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def check_sequence_length(model_config, seq_len: int, model_name: str) -> None:
    """A hub model's own position limit, which the `[model]` sizes of the run config do not describe.

    A composite config (a vision tower beside a text decoder) keeps the limit in its text sub-config.
    """
    configs = (model_config.get_text_config(decoder=True), model_config)
    limit = next((getattr(config, key) for config in configs for key in POSITION_LIMIT_KEYS
                  if isinstance(getattr(config, key, None), int)), None)
    if limit is not None and seq_len > limit:
        raise ConfigError(f"config: data.seq_len = {seq_len} exceeds the {limit} positions model {model_name!r} takes")


def build_model(cfg: ModelConfig, vocab_size: int, seed: int, seq_len: int | None = None) -> PreTrainedModel:
    """A freshly initialised fp32 model; the same (cfg, vocab_size, seed) gives bit-identical weights on
    every machine: the random initialisers the architecture calls draw from
    :func:`~p2p_diloco.train.init_weights.seeded_initialisation`, not from torch's CPU kernels.

    ``cfg.name == "llama"`` builds a Llama-architecture model from the sizes in the config; any other
    name is looked up with ``AutoConfig`` (hub or local path) and initialised from scratch, and
    `seq_len`, when given, is checked against that model's own position limit. A hub model embeds
    `vocab_size` tokens, whatever its own tokenizer has (:func:`fit_vocabulary`): it is trained from
    scratch on the run's tokenizer. :func:`check_vocabulary_fits` tells whether it does. The weights
    are fp32 whatever dtype a hub config names (``torch_dtype = "bfloat16"``, say): the inner loop
    casts under autocast, and θ_global is fp32.
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
        model_config = AutoConfig.from_pretrained(cfg.name)
        fit_vocabulary(model_config, vocab_size)
        if seq_len is not None:
            check_sequence_length(model_config, seq_len, cfg.name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # for whatever else draws from torch's generator while the model is made
        try:
            with seeded_initialisation(seed):
                model = AutoModelForCausalLM.from_config(model_config, attn_implementation="eager",
                                                         dtype=torch.float32)
        except UnsupportedInitialiser as e:
            raise ConfigError(f"config: model {cfg.name!r} cannot be trained here: {e}") from None
    check_fp32(model, cfg.name)
    return model


def check_fp32(model: torch.nn.Module, model_name: str) -> None:
    """RuntimeError unless every floating-point parameter of `model` is fp32."""
    other = sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point() and p.dtype != torch.float32})
    if other:
        raise RuntimeError(f"model {model_name!r} was built with {', '.join(other)} parameters; fp32 was asked for")


SPECIAL_TOKEN_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id")


def fit_vocabulary(model_config, vocab_size: int) -> None:
    """Make a hub model's config embed `vocab_size` tokens, the run tokenizer's.

    ``AutoConfig.from_pretrained(name, vocab_size=n)`` sets only attributes the top-level config has:
    a composite config (Gemma 3, Llama 4, Qwen3.5: a vision tower beside a text decoder) keeps its
    vocabulary in a text sub-config, and the keyword would be dropped without a word, leaving an
    embedding of the model's own size. Special token ids of the model's own tokenizer that fall
    outside the new vocabulary are cleared: ``nn.Embedding`` refuses a ``padding_idx`` (the config's
    pad_token_id) past its size.
    """
    text_config = model_config.get_text_config(decoder=True)
    text_config.vocab_size = vocab_size
    for config in {id(c): c for c in (model_config, text_config)}.values():
        for key in SPECIAL_TOKEN_KEYS:
            ids = getattr(config, key, None)
            if isinstance(ids, int) and ids >= vocab_size:
                setattr(config, key, None)
            elif isinstance(ids, list) and any(isinstance(i, int) and i >= vocab_size for i in ids):
                setattr(config, key, [i for i in ids if i < vocab_size] or None)


def check_vocabulary_fits(model: PreTrainedModel, tokenizer, model_name: str, tokenizer_name: str) -> None:
    """A token id the embedding cannot look up fails mid-run (a CUDA device-side assert): refuse it at start.

    Checked on the built model, whatever its config is made of: :func:`fit_vocabulary` sizes the
    architectures this project knows of, and this catches one whose config keeps its vocabulary
    where that does not look.
    """
    embedded = model.get_input_embeddings().num_embeddings
    head = model.get_output_embeddings()  # the labels index its logits
    if isinstance(head, torch.nn.Linear):
        embedded = min(embedded, head.out_features)
    largest = largest_token_id(tokenizer)
    if largest >= embedded:
        raise ConfigError(f"config: tokenizer {tokenizer_name!r} emits token ids up to {largest}, but model "
                          f"{model_name!r} embeds only {embedded} tokens; use a tokenizer whose vocabulary fits "
                          f"the model (for a hub model, its own tokenizer)")


def build_run_model(cfg: Config, tokenizer) -> PreTrainedModel:
    """The model of run config `cfg` for the run's tokenizer, on the CPU: freshly initialised, or with
    ``model.pretrained`` that model's weights (p2p_diloco.train.pretrained), whose embedding keeps its
    own size. What every peer trains, and what `p2p-diloco export --config` rebuilds. Raises ConfigError
    when the tokenizer's ids do not fit it."""
    if cfg.model.pretrained:
        model_config = pretrained_config(cfg.model)
        check_sequence_length(model_config, cfg.data.seq_len, cfg.model.pretrained)
        model = load_pretrained(cfg.model, model_config)
        check_fp32(model, cfg.model.pretrained)
    else:
        model = build_model(cfg.model, largest_token_id(tokenizer) + 1, cfg.run.seed, cfg.data.seq_len)
    check_vocabulary_fits(model, tokenizer, cfg.model.label, cfg.data.tokenizer)
    return model


def run_settings(cfg: Config, tokenizer, model: PreTrainedModel) -> dict:
    """The run's shared settings (:func:`p2p_diloco.config.shared_settings`) with this tokenizer and, for a
    pretrained run, the sha256 of `model`'s weights: call it on the model :func:`build_run_model` gave,
    before any step changes it."""
    return shared_settings(cfg, tokenizer_sha256(tokenizer), weights_sha256(model) if cfg.model.pretrained else None)


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
