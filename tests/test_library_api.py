"""The library's pieces without a swarm: the hand-over of inner steps, the settings fingerprint of any model,
named fragments, config errors, and state_dict refusals (issue 45). The swarm itself: tests/test_library.py."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import p2p_diloco
from p2p_diloco.api import library_config, model_settings
from p2p_diloco.config import ConfigError, settings_differences, settings_fingerprint
from p2p_diloco.train.fragments import FragmentError, named_fragments
from p2p_diloco.train.user_loop import DriverStopped, LoopEnded, UserLoop

pytestmark = pytest.mark.timeout(60)


def mlp(seed: int = 0, hidden: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2))


def settings_of(model: nn.Module, **kwargs) -> dict:
    return model_settings(model, library_config("lib", kwargs.pop("sync_every", 10), 1, **kwargs))


def test_the_fingerprint_holds_shapes_initial_weights_and_sync_settings():
    same = settings_fingerprint(settings_of(mlp())) == settings_fingerprint(settings_of(mlp()))
    assert same, "the same model built the same way must share a fingerprint"
    differing = {
        "shapes": settings_of(mlp(hidden=16)),
        "weights": settings_of(mlp(seed=1)),
        "sync_every": settings_of(mlp(), sync_every=20),
        "outer": settings_of(mlp(), outer={"lr": 0.5}),
    }
    base = settings_of(mlp())
    for what, settings in differing.items():
        assert settings_fingerprint(settings) != settings_fingerprint(base), what
    # what a refused peer is told names the settings that differ, in one line
    told = "; ".join(settings_differences(base, differing["shapes"]))
    assert "model.parameters_sha256" in told and "model.parameter_count" in told and "\n" not in told, told


def test_config_errors_are_one_line_and_name_the_keyword():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(p2p_diloco.DiLoCoError, match="sync_every"):
        p2p_diloco.DiLoCo(model, optimizer, run="lib", sync_every=0)
    with pytest.raises(p2p_diloco.DiLoCoError, match=r"outer\.momentum"):
        p2p_diloco.DiLoCo(model, optimizer, run="lib", outer={"momentum": 2.0})
    with pytest.raises(p2p_diloco.DiLoCoError, match="unknown"):
        p2p_diloco.DiLoCo(model, optimizer, run="lib", swarm={"no_such_key": 1})
    with pytest.raises(p2p_diloco.DiLoCoError, match="name the run"):
        p2p_diloco.DiLoCo(model, optimizer)
    with pytest.raises(p2p_diloco.DiLoCoError, match="torch.optim.Optimizer"):
        p2p_diloco.DiLoCo(model, "adamw", run="lib")
    with pytest.raises(p2p_diloco.DiLoCoError, match="transformer block"):
        p2p_diloco.DiLoCo(model, optimizer, run="lib", fragments=2)  # no numbered blocks to split: name them
    with pytest.raises(p2p_diloco.DiLoCoError, match="initial-peers|multiaddr"):
        p2p_diloco.DiLoCo(model, optimizer, run="lib", initial_peers=["not an address"])


def test_named_fragments_cover_every_parameter_once():
    model = mlp()
    assert named_fragments(model, [["0"], ["2"]]) == [[0, 1], [2, 3]]
    assert named_fragments(model, [["0.weight", "2"], ["0.bias"]]) == [[0, 2, 3], [1]]
    with pytest.raises(FragmentError, match="'2.weight' is in 0 fragments"):
        named_fragments(model, [["0"]])
    with pytest.raises(FragmentError, match="in 2 fragments"):
        named_fragments(model, [["0", "2"], ["2"]])
    with pytest.raises(FragmentError, match="names no trainable parameter"):
        named_fragments(model, [["0", "2"], ["no_such_module"]])
    with pytest.raises(FragmentError, match="list of fragments"):
        named_fragments(model, ["0", "2"])


def test_state_dict_is_refused_before_the_peer_starts_and_for_other_settings():
    model = mlp()
    diloco = p2p_diloco.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), run="lib", sync_every=10)
    with pytest.raises(p2p_diloco.DiLoCoError, match="not started"):
        diloco.state_dict()
    with pytest.raises(p2p_diloco.DiLoCoError, match="not a DiLoCo state"):
        diloco.load_state_dict({"outer_step": 3})
    state = {"outer_step": 3, "fingerprint": "0" * 64, "global_state": [], "local": {}}
    with pytest.raises(p2p_diloco.DiLoCoError, match="other settings"):
        diloco.load_state_dict(state)
    diloco.load_state_dict({**state, "fingerprint": diloco.fingerprint})
    assert diloco.outer_step == 3  # joins at the step it was saved at
    with pytest.raises(p2p_diloco.DiLoCoError, match="inside `with"):
        diloco.step(samples=4)  # before it joined: told how to use it, no hang
    with pytest.raises(p2p_diloco.DiLoCoError, match="samples"):
        diloco.step(samples=0)


def test_the_hand_over_alternates_the_two_threads_and_ends_on_stop():
    """The driver's step() waits for the user's step, and the user's took_step() waits until the driver asks
    again: the driver's work between two steps never overlaps the user's step."""
    model = mlp()
    stop = threading.Event()
    loop = UserLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), stop)
    trace: list[str] = []
    reported: list[tuple] = []

    def driver() -> None:
        try:
            for _ in range(3):
                reported.append(loop.step())
                trace.append("driver works")
            loop.step()  # waits for a step that never comes: the stop ends it
        except LoopEnded:
            trace.append("driver ended")
        finally:
            loop.ended("the peer left")

    thread = threading.Thread(target=driver)
    thread.start()
    loop.wait_for_turn()
    for i in range(3):
        trace.append("user steps")
        loop.took_step(samples=i + 1, loss=0.5)
    assert reported == [(0.5, 1), (0.5, 2), (0.5, 3)] and loop.steps_done == 3
    stop.set()
    thread.join(5)
    assert not thread.is_alive()
    assert trace == ["user steps", "driver works"] * 3 + ["driver ended"]
    with pytest.raises(DriverStopped, match="the peer left"):
        loop.took_step(samples=1, loss=None)
    loop.fast_forward_schedule(10)
    loop.fast_forward_schedule(5)  # never back
    assert loop.steps_done == 10 and loop.lr == 0.1


def test_a_manifest_gives_the_run_its_bootstrap_nodes_and_sync_settings():
    model = mlp()
    diloco = p2p_diloco.DiLoCo.from_manifest("demo", model, torch.optim.SGD(model.parameters(), lr=0.1),
                                             outer={"lr": 0.5})
    assert diloco.config.run.name == "demo" and diloco.config.inner.steps_per_outer == 25
    assert diloco.initial_peers and diloco.initial_peers[0].endswith("/p2p/QmUdbHDXRitPagPZ6sLk9aJYp7nwtCYcCkEVC2dy1SDqft")
    assert diloco.config.outer.lr == 0.5  # a keyword over the manifest's value
    with pytest.raises(p2p_diloco.DiLoCoError, match="no-such-run"):
        p2p_diloco.DiLoCo.from_manifest("no-such-run", model, torch.optim.SGD(model.parameters(), lr=0.1))
