"""A run that starts from a pretrained model (`model.pretrained`): its weights are θ_global at outer step 0,
their sha256 is one of the run's shared settings, and what the model decides (its sizes, its tokenizer)
is checked against the run config. In-process, on tiny models saved with save_pretrained in tmp_path;
tests/test_export.py runs a real peer from such a folder."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from p2p_diloco.config import ConfigError, settings_differences, settings_fingerprint
from p2p_diloco.train.data import DataError, TextData, load_tokenizer
from p2p_diloco.train.model import build_model, build_run_model, run_settings
from p2p_diloco.train.pretrained import weights_sha256
from tests.conftest import tiny_config
from tests.swarm_helpers import pretrained_sections, save_pretrained_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_pretrained_folder(tmp_path_factory.mktemp("pretrained") / "model", seed=7)


def pretrained_config(folder, **sections):
    raw = pretrained_sections(folder)
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return tiny_config(**raw)


def built(cfg):
    tokenizer = load_tokenizer(cfg.data, cfg.model.revision)
    model = build_run_model(cfg, tokenizer)
    return model, run_settings(cfg, tokenizer, model)


def test_the_saved_weights_are_theta_global_at_step_0_and_their_hash_a_shared_setting(folder, tmp_path):
    cfg = pretrained_config(folder)
    model, settings = built(cfg)
    saved = load_file(folder / "model.safetensors")
    params = dict(model.named_parameters())
    assert params.keys() == saved.keys()
    assert all(torch.equal(params[name], saved[name]) for name in saved)
    scratch = build_model(tiny_config().model, model.config.vocab_size, cfg.run.seed, cfg.data.seq_len)
    assert not torch.equal(scratch.get_input_embeddings().weight, params["model.embed_tokens.weight"])

    again, settings_again = built(cfg)
    assert settings["model.pretrained_sha256"] == weights_sha256(again) == settings_again["model.pretrained_sha256"]
    assert "model.pretrained" not in settings and "model.revision" not in settings

    moved = tmp_path / "elsewhere"  # another peer's copy of the same weights, at another path
    shutil.copytree(folder, moved)
    assert settings_fingerprint(built(pretrained_config(moved))[1]) == settings_fingerprint(settings)

    changed = tmp_path / "changed"
    shutil.copytree(folder, changed)
    weights = load_file(changed / "model.safetensors")
    weights["model.norm.weight"][0] += 1e-3
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    other = built(pretrained_config(changed))[1]
    assert settings_fingerprint(other) != settings_fingerprint(settings)
    assert settings_differences(settings, other) == [
        f"model.pretrained_sha256 = {settings['model.pretrained_sha256'][:12]} here, "
        f"{other['model.pretrained_sha256'][:12]} there"]

    from_scratch = built(tiny_config())[1]
    assert "model.pretrained_sha256" not in from_scratch


def weights_less(folder, destination, name):
    shutil.copytree(folder, destination)
    weights = load_file(destination / "model.safetensors")
    del weights[name]
    save_file(weights, destination / "model.safetensors", metadata={"format": "pt"})
    return destination


@pytest.mark.parametrize("case, message", [
    ("size", "config: model.intermediate_size = 128 conflicts with model.pretrained = '{folder}', whose "
             "intermediate_size is 64; remove model.intermediate_size"),
    ("seq_len", "config: data.seq_len = 128 exceeds the 64 positions model '{folder}' takes"),
    ("missing", "config: model.pretrained = '{folder}' lacks weights for 1 parameter(s) (model.norm.weight, ...)"),
    ("absent", "data: tokenizer '{folder}' cannot be loaded: "),
    ("tokenizer-only", "config: model.pretrained = '{folder}' cannot be read: "),
    ("vocabulary", "config: tokenizer '{folder}' emits token ids up to 299, but model '{folder}' embeds only 280"),
])
def test_what_the_pretrained_model_decides_is_checked_against_the_run_config(folder, tmp_path, case, message):
    if case == "missing":
        folder = weights_less(folder, tmp_path / "partial", "model.norm.weight")
    elif case == "absent":
        folder = tmp_path / "absent"
    elif case == "tokenizer-only":
        load_tokenizer(tiny_config().data).save_pretrained(tmp_path / "tokenizer-only")
        folder = tmp_path / "tokenizer-only"
    elif case == "vocabulary":  # a model that embeds fewer tokens than its tokenizer emits
        cfg = tiny_config()
        build_model(cfg.model, 280, 0, cfg.data.seq_len).save_pretrained(tmp_path / "small")
        TextData(cfg.data).tokenizer.save_pretrained(tmp_path / "small")
        folder = tmp_path / "small"
    sections = {"size": {"model": {"intermediate_size": 128}}, "seq_len": {"data": {"seq_len": 128}}}
    cfg = pretrained_config(folder, **sections.get(case, {}))
    with pytest.raises((ConfigError, DataError)) as err:
        built(cfg)
    assert message.format(folder=folder) in str(err.value) and "\n" not in str(err.value)
