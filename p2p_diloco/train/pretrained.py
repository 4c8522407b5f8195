"""A run that starts from a pretrained model's weights (``model.pretrained``): continued pretraining.

The model comes from a hub id (at ``model.revision``) or a local ``save_pretrained`` folder, in fp32 on
the CPU, and its weights are θ_global at outer step 0 on every peer. Its own config is the
architecture: a ``[model]`` size given in the run config that contradicts it is refused, as are weights
the folder lacks (transformers would initialise them at random, differently on every peer). The
sha256 of the loaded weights (:func:`weights_sha256`) is one of the run's shared settings, so a peer
that loaded other weights (another revision, a changed folder) is refused like any other setting
mismatch. A peer joining past step 0 loads θ_global from the run's peers, as in any run.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from p2p_diloco.config import ConfigError, ModelConfig
from p2p_diloco.hashing import named_tensors_sha256

# [model] sizes and the names the model's (text) config keeps them under
SIZE_KEYS = {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "intermediate_size": "intermediate_size", "max_position_embeddings": "max_position_embeddings"}


def _one_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def pretrained_config(cfg: ModelConfig):
    """The pretrained model's transformers config, checked against the `[model]` sizes the run config gives."""
    try:
        model_config = AutoConfig.from_pretrained(cfg.pretrained, revision=cfg.revision or None)
    except (OSError, ValueError) as e:
        raise ConfigError(f"config: model.pretrained = {cfg.pretrained!r} cannot be read: {_one_line(e)}") from None
    check_sizes(cfg, model_config)
    return model_config


def check_sizes(cfg: ModelConfig, model_config) -> None:
    """A `[model]` size other than its default must be the pretrained model's own: the run config would
    otherwise describe a model other than the one trained."""
    text_config = model_config.get_text_config(decoder=True)
    defaults = ModelConfig()
    for key, config_key in SIZE_KEYS.items():
        given, own = getattr(cfg, key), getattr(text_config, config_key, None)
        if given != getattr(defaults, key) and own is not None and given != own:
            raise ConfigError(f"config: model.{key} = {given} conflicts with model.pretrained = {cfg.pretrained!r}, "
                              f"whose {config_key} is {own}; remove model.{key} (the pretrained model's config is "
                              f"the architecture)")


def load_pretrained(cfg: ModelConfig, model_config) -> PreTrainedModel:
    """The pretrained model of `cfg` (its config read by :func:`pretrained_config`) on the CPU, every
    parameter fp32 and loaded from its files."""
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            cfg.pretrained, config=model_config, revision=cfg.revision or None, dtype=torch.float32,
            attn_implementation="eager", output_loading_info=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"config: model.pretrained = {cfg.pretrained!r} cannot be loaded: {_one_line(e)}") from None
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ConfigError(f"config: model.pretrained = {cfg.pretrained!r} lacks weights for {len(missing)} "
                          f"parameter(s) ({missing[0]}, ...); every peer must start from the same weights, not "
                          f"random ones")
    return model


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 of the model's parameters by name, dtype, shape and bytes: the same loaded weights give the
    same value on every peer, whatever the files they were read from."""
    return named_tensors_sha256(dict(model.named_parameters()))
