"""Config validation: every bad value is refused up front with one line naming key, value and rule."""

import pytest

from p2p_diloco.config import ConfigError, config_from_dict, load_config, run_fingerprint
from p2p_diloco.train.data import TextData, order_seed
from p2p_diloco.train.model import build_model
from tests.conftest import REPO


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"inner": {"lr": -1}}, "inner.lr = -1 is invalid: must be a number > 0"),
        ({"inner": {"steps_per_outer": 0}}, "inner.steps_per_outer = 0 is invalid: must be an integer >= 1"),
        ({"inner": {"batch_size": 2.5}}, "inner.batch_size = 2.5 is invalid: must be an integer >= 1"),
        ({"outer": {"momentum": 1.5}}, "outer.momentum = 1.5 is invalid: must be a number in [0.0, 0.999999]"),
        ({"data": {"source": "web"}}, "data.source = 'web' is invalid: must be one of 'pydoc', 'files', 'hub'"),
        ({"outer": {"codec": "int4"}}, "outer.codec = 'int4' is invalid: must be one of 'none', 'fp16'"),
        ({"run": {"name": "a b"}}, "run.name = 'a b' is invalid"),
        ({"inner": {"lrr": 1}}, "unknown key inner.lrr"),
        ({"innr": {}}, "unknown section [innr]"),
        ({"model": {"hidden_size": 30, "num_heads": 4}}, "model.hidden_size = 30 must be divisible by"),
        ({"data": {"source": "files"}}, "data.paths = [] is invalid when data.source = 'files'"),
        ({"swarm": {"request_timeout": 5.0, "matchmaking_time": 2.0}}, "swarm.request_timeout = 5.0 must be smaller"),
        ({"inner": {"warmup_steps": 10, "total_steps": 10}}, "inner.warmup_steps = 10 must be smaller"),
        ({"inner": {"warmup_steps": 10, "total_steps": 40, "steps_per_outer": 50}},
         "inner.steps_per_outer = 50 exceeds inner.total_steps = 40"),
        ({"model": {"hidden_size": 24, "num_heads": 8}}, "model.hidden_size / model.num_heads = 3 must be even"),
        ({"data": {"seq_len": 1024}}, "data.seq_len = 1024 exceeds model.max_position_embeddings = 512"),
        ({"data": {"shards": 0}}, "data.shards = 0 is invalid: must be an integer >= 1"),
        ({"data": {"tokenizer_documents": 0}}, "data.tokenizer_documents = 0 is invalid: must be an integer >= 1"),
        ({"eval": {"every": -1}}, "eval.every = -1 is invalid: must be an integer >= 0"),
        ({"eval": {"every": 2.5}}, "eval.every = 2.5 is invalid: must be an integer >= 0"),
        ({"eval": {"sequences": 0}}, "eval.sequences = 0 is invalid: must be an integer >= 1"),
        ({"eval": {"every_steps": 1}}, "unknown key eval.every_steps"),
        ({"outer": {"codec": "mask16-e3m0", "error_feedback": False}},
         "outer.codec = 'mask16-e3m0' sends 1 value in 16 of each pseudo-gradient and needs outer.error_feedback"),
        ({"outer": {"codec": "2bit", "error_feedback": False}},
         "outer.codec = '2bit' codes each value in 2 bit(s) around its block's mean |x|, clipping the largest, and "
         "needs outer.error_feedback"),
        ({"model": {"revision": "v1"}}, "model.revision = 'v1' needs model.pretrained"),
        ({"model": {"pretrained": "org/lm", "name": "gpt2"}, "data": {"tokenizer": "org/lm"}},
         "model.name = 'gpt2' conflicts with model.pretrained = 'org/lm': the pretrained model's own config is"),
        ({"model": {"pretrained": "org/lm"}}, "data.tokenizer = 'local-bpe' is invalid with model.pretrained = "
                                               "'org/lm': the model reads the token ids of its own tokenizer; set "
                                               "data.tokenizer = 'org/lm'"),
    ],
)
def test_bad_values_name_key_value_and_rule(raw, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_shipped_configs_are_valid_and_their_data_loads():
    """Every shipped config validates; a config whose data is local loads it from a clone, and builds its
    model. A hub source needs the internet (`test_data.py` covers the hub path with a local dataset)."""
    configs = sorted((REPO / "peers").glob("*.toml"))
    assert len(configs) >= 3
    for path in configs:
        cfg = load_config(path)
        if cfg.data.source == "hub" or cfg.model.name != "llama":
            continue
        data = TextData(cfg.data)
        data.peer_batches(cfg.inner.batch_size, order_seed(cfg.run.seed, "a peer"))  # enough for one batch
        assert len(data.heldout) > 0, path
        build_model(cfg.model, data.vocab_size, cfg.run.seed, cfg.data.seq_len)


def test_relative_data_paths_resolve_against_the_config_file(tmp_path):
    (tmp_path / "corpus").mkdir()
    config = tmp_path / "run.toml"
    config.write_text('[data]\nsource = "files"\npaths = ["corpus/a.txt", "/abs/b.txt"]\n')
    assert load_config(config).data.paths == [str(tmp_path / "corpus" / "a.txt"), "/abs/b.txt"]


def test_fingerprint_covers_what_peers_must_share_and_nothing_else():
    cfg = config_from_dict({})
    base = run_fingerprint(cfg, "tokenizer-a")
    assert run_fingerprint(cfg, "tokenizer-b") != base  # same settings, another tokenizer
    for section, values in [("inner", {"lr": 5e-3}), ("model", {"intermediate_size": 512}),
                            ("outer", {"momentum": 0.8}), ("outer", {"codec": "nf4"}), ("run", {"seed": 1}),
                            ("data", {"seq_len": 128}), ("data", {"shards": 8}),
                            ("data", {"tokenizer_documents": 100})]:
        assert run_fingerprint(cfg.replace(**{section: values}), "tokenizer-a") != base, section
    # each peer's own: timeouts, its held-out evaluation, where its files are, how it splits its batch
    assert run_fingerprint(cfg.replace(swarm={"round_wait_timeout": 5.0}), "tokenizer-a") == base
    assert run_fingerprint(cfg.replace(eval={"every": 0, "sequences": 64}), "tokenizer-a") == base
    assert run_fingerprint(cfg.replace(data={"paths": ["/elsewhere/a.txt"]}), "tokenizer-a") == base
    split = cfg.replace(inner={"batch_size": 8, "grad_accumulation": 2})
    assert run_fingerprint(split, "tokenizer-a") == base


def test_a_hub_model_is_checked_against_its_own_position_limit(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_positions=64, n_embd=32, n_layer=1, n_head=2).save_pretrained(tmp_path)
    cfg = config_from_dict({"model": {"name": str(tmp_path), "max_position_embeddings": 8},
                            "data": {"seq_len": 128}})  # the [model] sizes say nothing about a hub model
    with pytest.raises(ConfigError, match=r"data.seq_len = 128 exceeds the 64 positions model"):
        build_model(cfg.model, 300, 0, cfg.data.seq_len)
    build_model(cfg.model, 300, 0, 64)


def test_a_hub_model_whose_decoder_sits_in_a_sub_config_gets_the_run_vocabulary_and_position_limit(tmp_path):
    """Gemma 3, Llama 4, Qwen3.5: AutoConfig.from_pretrained(name, vocab_size=...) would not reach the text decoder."""
    from transformers import Gemma3Config

    text = dict(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4).save_pretrained(tmp_path)
    cfg = config_from_dict({"model": {"name": str(tmp_path)}, "data": {"seq_len": 128}})
    with pytest.raises(ConfigError, match=r"data.seq_len = 128 exceeds the 64 positions model"):
        build_model(cfg.model, 1000, 0, cfg.data.seq_len)
    model = build_model(cfg.model, 1000, 0, 64)
    assert model.get_input_embeddings().num_embeddings == model.get_output_embeddings().out_features == 1000


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[inner\nlr = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_replace_revalidates():
    cfg = config_from_dict({})
    assert cfg.replace(inner={"steps_per_outer": 7}).inner.steps_per_outer == 7
    with pytest.raises(ConfigError):
        cfg.replace(inner={"steps_per_outer": -7})


def test_the_demo_manifest_names_the_peer_id_of_the_shipped_demo_bootstrap_key():
    from p2p_diloco.swarm.identity import Identity

    key = REPO / "bootstrap" / "demo-bootstrap.key"
    (maddr,) = load_config(REPO / "peers" / "demo.toml").swarm.initial_peers
    assert maddr.endswith("/p2p/" + Identity.load_or_create(str(key)).peer_id)


def test_config_names_exactly_the_codecs_that_exist():
    from p2p_diloco.config import CODEC_NAMES
    from p2p_diloco.sync.codecs import CODECS

    assert CODEC_NAMES == tuple(CODECS)


def test_config_names_exactly_the_aggregation_rules_that_exist():
    from p2p_diloco.config import AGGREGATION_NAMES
    from p2p_diloco.sync.robust import RULES, aggregation_rule

    assert AGGREGATION_NAMES == RULES
    assert aggregation_rule(config_from_dict({}).outer).name == "centered-clip"  # on by default


def test_the_aggregation_settings_are_checked_and_part_of_the_fingerprint(tmp_path):
    bad = tmp_path / "bad.toml"
    for setting, value in [("aggregation", '"median"'), ("clip_factor", "0.5"), ("clip_iterations", "0"),
                           ("trim_fraction", "0.6"), ("max_update_growth", "-1"), ("claim_cap", "0.5"),
                           ("norm_clip", "0"), ("drop_opposed", '"yes"')]:
        bad.write_text(f"[outer]\n{setting} = {value}\n")
        with pytest.raises(ConfigError, match=f"outer.{setting}"):
            load_config(bad)
    base = run_fingerprint(config_from_dict({}), "0" * 64)
    exact = tmp_path / "exact.toml"
    exact.write_text('[outer]\naggregation = "mean"\n')
    assert run_fingerprint(load_config(exact), "0" * 64) != base
    for setting, value in (("claim_cap", "2.0"), ("norm_clip", "2.0"), ("drop_opposed", "false")):
        exact.write_text(f"[outer]\n{setting} = {value}\n")
        assert run_fingerprint(load_config(exact), "0" * 64) != base, setting


def test_advice_names_a_mask_codecs_momentum_and_leaves_the_settings_as_they_are():
    from p2p_diloco.config import advice

    assert advice(config_from_dict({})) == []  # the defaults: fp4-e3m0
    cfg = config_from_dict({"outer": {"codec": "mask2-1bit"}})
    (note,) = advice(cfg)
    assert note.startswith("outer.codec = 'mask2-1bit' with outer.momentum = 0.9: a value is sent one round in 2")
    assert "outer.lr = 1.4 and outer.momentum = 0.5" in note and cfg.outer.momentum == 0.9
    assert advice(config_from_dict({"outer": {"codec": "mask2-1bit", "lr": 1.4, "momentum": 0.5}})) == []
    assert advice(config_from_dict({"outer": {"codec": "2bit"}})) == []  # dense: every value moves every round
