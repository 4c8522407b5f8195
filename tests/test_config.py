"""Config validation: every bad value is refused up front with one line naming key, value and rule."""

import pytest

from p2p_diloco.config import ConfigError, config_from_dict, load_config
from tests.conftest import REPO


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"inner": {"lr": -1}}, "inner.lr = -1 is invalid: must be a number > 0"),
        ({"inner": {"steps_per_outer": 0}}, "inner.steps_per_outer = 0 is invalid: must be an integer >= 1"),
        ({"inner": {"batch_size": 2.5}}, "inner.batch_size = 2.5 is invalid: must be an integer >= 1"),
        ({"outer": {"momentum": 1.5}}, "outer.momentum = 1.5 is invalid: must be a number in [0.0, 0.999999]"),
        ({"data": {"source": "web"}}, "data.source = 'web' is invalid: must be one of 'pydoc', 'files', 'hub'"),
        ({"run": {"name": "a b"}}, "run.name = 'a b' is invalid"),
        ({"inner": {"lrr": 1}}, "unknown key inner.lrr"),
        ({"innr": {}}, "unknown section [innr]"),
        ({"model": {"hidden_size": 30, "num_heads": 4}}, "model.hidden_size = 30 must be divisible by"),
        ({"data": {"source": "files"}}, "data.paths = [] is invalid when data.source = 'files'"),
        ({"swarm": {"request_timeout": 5.0, "matchmaking_time": 2.0}}, "swarm.request_timeout = 5.0 must be smaller"),
        ({"inner": {"warmup_steps": 10, "total_steps": 10}}, "inner.warmup_steps = 10 must be smaller"),
    ],
)
def test_bad_values_name_key_value_and_rule(raw, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_shipped_configs_are_valid():
    for path in sorted((REPO / "peers").glob("*.toml")):
        load_config(path)


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
