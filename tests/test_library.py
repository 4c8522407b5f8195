"""The library (issue 45): p2p_diloco.DiLoCo around training loops the CLI cannot run, in real swarms on loopback.

The peers are the shipped examples (examples/plain_loop.py, an MLP in a plain PyTorch loop; examples/trainer_script.py,
the same MLP under a transformers Trainer with DiLoCoCallback), each a process of its own; a test's own DiLoCo runs
in the test's process and is stopped by it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import p2p_diloco
from p2p_diloco.process_tree import descendant_pids, is_running, without_torch_shm_manager
from p2p_diloco.swarm.status import SYNCING
from tests.swarm_helpers import (events, hashes_by_step, last_step, outer_steps, peer_id_of, start_bootstrap, timeline,
                                 wait_until)

pytestmark = pytest.mark.timeout(240)


def start_example(processes, name: str, script: str, maddr: str, tmp_path: Path, *extra: str) -> Path:
    metrics = tmp_path / f"{name}.jsonl"
    processes.start(name, "--initial-peers", maddr, "--metrics-file", str(metrics), *extra,
                    module=f"examples.{script}")
    return metrics


def assert_one_history(metrics_files: list[Path]) -> None:
    for step, hashes in hashes_by_step(metrics_files).items():
        assert len(hashes) == 1, f"peers disagree after outer step {step}: {hashes}"


class OtherMLP(nn.Module):
    """Not the examples' model: other parameter shapes."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(16, 8)


def leave_by_ctrl_c(processes, names: list[str]) -> None:
    """SIGINT (Ctrl+C) to each: the loop's KeyboardInterrupt leaves the `with` block, which leaves the swarm
    (its metrics say "exit")."""
    procs = [p for p in processes.procs if p.name in names]
    for proc in procs:
        proc.send_signal(signal.SIGINT)
    for proc in procs:
        proc.wait(60)


def test_plain_loops_average_every_outer_step_and_a_late_peer_loads_the_state(processes, tmp_path):
    maddr = start_bootstrap(processes)
    common = ("--outer-steps", "1000000", "--sync-every", "20")  # until stopped
    first = [start_example(processes, f"loop{i}", "plain_loop", maddr, tmp_path, *common, "--data-seed", str(i),
                           "--wait-for-peers", "2") for i in range(2)]
    wait_until(lambda: all(last_step(m) >= 1 for m in first), 120, "outer step 1 on both plain loops")
    late = start_example(processes, "late", "plain_loop", maddr, tmp_path, *common, "--data-seed", "2")

    # a model of other shapes is refused in one line, before it trains
    model = OtherMLP()
    with pytest.raises(p2p_diloco.DiLoCoError) as refused:
        with p2p_diloco.DiLoCo(model, torch.optim.AdamW(model.parameters()), run="plain-loop", initial_peers=[maddr],
                               host="127.0.0.1", sync_every=20):
            pytest.fail("a peer of other settings joined the run")
    message = str(refused.value)
    assert "\n" not in message and "is trained with other settings" in message, message
    assert "model.parameters_sha256" in message and "ignore_other_settings=True" in message, message

    wait_until(lambda: events(late, "state_loaded") and last_step(late) >= events(late, "state_loaded")[0]["outer_step"]
               + 3, 120, "three outer steps of the late peer after it loaded the run's state")
    files = [*first, late]
    # library peers publish status records: `p2p-diloco status` lists the three, with the run's model as they see it
    shown = subprocess.run([sys.executable, "-m", "p2p_diloco.cli", "status", "--initial-peers", maddr, "--run",
                            "plain-loop", "--json"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    for metrics in files:
        assert peer_id_of(metrics) in shown.stdout, (metrics.name, shown.stdout[:2000])
    averaged_until = min(last_step(m) for m in files)  # after this, a peer may be alone as the others leave
    leave_by_ctrl_c(processes, ["loop0", "loop1", "late"])
    for metrics in files:
        assert events(metrics, "exit"), f"{metrics.name}: no clean leave on Ctrl+C"
    assert_one_history(files)
    loaded = events(late, "state_loaded")[0]["outer_step"]
    assert loaded >= 1, timeline(late)  # it joined by downloading the run's state, not from outer step 0
    for metrics in first:  # the two averaged at every outer step, each in a group of two or more ...
        records = [r for r in outer_steps(metrics) if r["outer_step"] <= averaged_until]
        applied = [r["outer_step"] for r in records]
        assert applied[:loaded] == list(range(1, loaded + 1)), timeline(metrics)
        assert all(r["group_size"] >= 2 for r in records), timeline(metrics)
        # ... but where the newcomer's first round formed without it: that step it loads (one history, no gap)
        reached = set(applied) | {r["outer_step"] for r in events(metrics, "state_loaded")}
        assert reached >= set(range(1, averaged_until + 1)), timeline(metrics)
    joined = [r for r in outer_steps(late) if r["outer_step"] <= averaged_until]
    assert joined and all(r["group_size"] >= 2 for r in joined), timeline(late)


def test_a_trainer_with_the_callback_and_a_plain_loop_average_together(processes, tmp_path):
    maddr = start_bootstrap(processes)
    common = ("--outer-steps", "4", "--sync-every", "20", "--wait-for-peers", "2")
    files = [start_example(processes, "trainer", "trainer_script", maddr, tmp_path, *common, "--data-seed", "0"),
             start_example(processes, "loop", "plain_loop", maddr, tmp_path, *common, "--data-seed", "1")]
    wait_until(lambda: all(last_step(m) >= 4 for m in files), 180, "outer step 4 on the Trainer and the loop")
    for proc in processes.procs[1:]:  # each leaves at outer step 4 by itself, through the `with` block or the callback
        assert proc.wait(60) == 0, f"{proc.name} exited with {proc.returncode}"
    for metrics in files:
        assert events(metrics, "exit"), f"{metrics.name}: no clean leave"
    assert_one_history(files)
    for metrics in files:
        assert all(r["group_size"] == 2 for r in outer_steps(metrics)), timeline(metrics)


def own_processes() -> set[int]:
    """The processes running under this one (zombies, exited but not yet reaped, do not count)."""
    return {pid for pid in without_torch_shm_manager(descendant_pids(os.getpid())) if is_running(pid)}


def started_since(before: set[int]) -> set[int]:
    """The processes running under this one that were not in `before`, nor under one of those: an example process
    started earlier starts its own DHT and averager meanwhile, and those are not the library peer's."""
    theirs = set(before)
    for pid in before:
        theirs.update(descendant_pids(pid))
    return own_processes() - theirs


def test_leaving_the_with_block_mid_sync_exits_cleanly(processes, tmp_path):
    """The sync runs beside the next inner steps (the default outer.sync_delay, 10 of them; the example's too, or
    the two would not share a fingerprint): the loop leaves as soon as its Δ went to the sync, whose all-reduce
    is then under way (or just done: either way the round is not over, and the leave must be clean). That is
    after its 20th inner step, or before it when the other peer was ready first (the fastest peer ends the
    round: a CI run beside a busy core left after the round's outer step, 20 inner steps in)."""
    maddr = start_bootstrap(processes)
    other = start_example(processes, "other", "plain_loop", maddr, tmp_path, "--outer-steps", "1000000", "--sync-every",
                          "20", "--wait-for-peers", "2")
    before = own_processes()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    diloco = p2p_diloco.DiLoCo(model, optimizer, run="plain-loop", initial_peers=[maddr], host="127.0.0.1",
                               sync_every=20, wait_for_peers=2)
    with diloco:
        assert diloco.peer_id and diloco.outer_step == 0
        started = started_since(before)
        assert started, "the peer started no DHT or averager process"
        for _ in range(20):  # by the 20th step, the Δ went to the sync, which runs while the loop takes its next steps
            x = torch.randn(32, 16)
            nn.functional.mse_loss(model(x), x[:, :4]).backward()
            optimizer.step()
            optimizer.zero_grad()
            diloco.step(samples=len(x))
            if diloco.peer.view.status.phase == SYNCING:
                break
        assert diloco.peer.view.status.phase == SYNCING, diloco.peer.view.status.phase
        assert diloco.outer_step == 0  # the round is not over: its outer step comes after an overlap step
    assert diloco.node is None and diloco._driver is None
    assert not (own_processes() & started), "processes of the peer outlived its with block"
    with pytest.raises(p2p_diloco.DiLoCoError, match="left the swarm"):
        diloco.step(samples=32)  # the peer has left: one line, not a hang
    assert processes.procs[-1].poll() is None, "the other peer died with this one's leave"


def train_until(diloco, model, optimizer, outer_step: int, max_inner_steps: int = 2000) -> None:
    for _ in range(max_inner_steps):
        if diloco.outer_step >= outer_step:
            return
        x = torch.randn(8, 16)
        nn.functional.mse_loss(model(x), x[:, :4]).backward()
        optimizer.step()
        optimizer.zero_grad()
        diloco.step(samples=len(x))
    pytest.fail(f"outer step {outer_step} not reached in {max_inner_steps} inner steps (at {diloco.outer_step})")


def test_a_saved_state_resumes_the_peer_at_its_outer_step(tmp_path):
    """state_dict() after two outer steps; a new peer on a freshly built model loads it and goes on from there
    (alone in its run: no bootstrap node, it starts the DHT)."""
    def fresh():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3)

    model, optimizer = fresh()
    with p2p_diloco.DiLoCo(model, optimizer, run="resume", host="127.0.0.1", sync_every=5) as diloco:
        train_until(diloco, model, optimizer, 2)
        state = diloco.state_dict()
        saved_hash = diloco.global_sha256
    assert state["outer_step"] == 2 and state["sha256"] == saved_hash
    restored = torch.load(_saved(tmp_path, state), weights_only=True)  # it survives torch.save/torch.load

    model, optimizer = fresh()
    diloco = p2p_diloco.DiLoCo(model, optimizer, run="resume", host="127.0.0.1", sync_every=5)
    diloco.load_state_dict(restored)
    with diloco:
        assert diloco.outer_step == 2 and diloco.global_sha256 == saved_hash
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), state["local"]["params"]))  # θ_local too
        train_until(diloco, model, optimizer, 3)
    assert diloco.outer_step == 3 and diloco.global_sha256 != saved_hash


def _saved(tmp_path: Path, state: dict) -> Path:
    path = tmp_path / "diloco.pt"
    torch.save(state, path)
    return path
