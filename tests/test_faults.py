"""Peers crash, freeze, leave and come back: the swarm goes on and never diverges.

Each case runs real `p2p-diloco` processes on 127.0.0.1 and injects a real fault (SIGKILL, SIGSTOP,
SIGTERM) at a controlled phase. P2P_DILOCO_FAULTS only widens a phase's window so the signal lands
in it (see p2p_diloco/faults.py). Assertions read the metrics files: outer steps keep coming, every
outer step has one θ_global across peers, no NaN, and returning peers converge to the swarm's hash.
"""

import os
import signal

import pytest

from p2p_diloco.metrics import read_metrics
from p2p_diloco.process_tree import is_running
from tests.conftest import descendants
from tests.swarm_helpers import (
    assert_consistent, last_step, outer_steps, start_bootstrap, start_peer, tiny_config_file, wait_until,
)

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(420)]

FAST_TIMEOUTS = {"next_chunk_timeout": 3.0, "round_wait_timeout": 15.0, "progress_ttl": 12.0}


def swarm(processes, tmp_path, n, faults_by_peer=None, **sections):
    """A bootstrap node and n peers; returns (maddr, config, metrics files)."""
    config = tiny_config_file(tmp_path, inner={"steps_per_outer": 10}, swarm=FAST_TIMEOUTS, **sections)
    maddr = start_bootstrap(processes)
    faults_by_peer = faults_by_peer or {}
    metrics = [start_peer(processes, f"peer{i}", config, maddr, faults=faults_by_peer.get(i, "")) for i in range(n)]
    return maddr, config, metrics


def proc(processes, name):
    return next(p for p in processes.procs if p.name == name)


def wait_for_steps(metrics, count, timeout_s=240):
    wait_until(lambda: all(last_step(m) >= count for m in metrics), timeout_s, f"outer step {count} on all peers")


def test_kill_during_inner_steps(processes, tmp_path):
    _, _, metrics = swarm(processes, tmp_path, 3, {2: "inner_step_delay=0.3"})
    wait_for_steps(metrics, 2)
    victim_at = last_step(metrics[2])
    victim = proc(processes, "peer2")
    orphans = descendants(victim.pid)
    processes.kill(victim, children=False)  # it spends ~3 s of every round in inner steps
    survivors = metrics[:2]
    wait_for_steps(survivors, victim_at + 3)
    assert_consistent(metrics)
    assert outer_steps(survivors[0])[-1]["group_size"] == 2
    # nobody stopped the dead peer's DHT and averager processes and p2pd: they notice and exit
    wait_until(lambda: not any(is_running(pid) for pid in orphans), 30, f"the killed peer's children {orphans} to exit")


# peer2, as a reducer, holds back its averaged parts for 4 s in its second all-reduce
PAUSE_IN_SECOND_ROUND = "allreduce_delay=4,allreduce_delay_round=2"


def wait_for_pause(processes, name):
    wait_until(lambda: "pausing mid all-reduce" in processes.log(name), 180, f"{name} to pause mid all-reduce")


def test_kill_mid_allreduce(processes, tmp_path):
    _, _, metrics = swarm(processes, tmp_path, 3, {2: PAUSE_IN_SECOND_ROUND})
    wait_for_pause(processes, "peer2")
    processes.kill(proc(processes, "peer2"))
    at_kill = max(last_step(m) for m in metrics[:2])
    wait_for_steps(metrics[:2], at_kill + 2)
    assert_consistent(metrics)
    # the survivors were waiting on peer2's parts: that round was partial, detected, and not applied
    failed = [r for m in metrics[:2] for r in read_metrics(m) if r["event"] == "round_failed"]
    assert failed and all("not averaged" in r["reason"] for r in failed), failed


def test_freeze_mid_allreduce_then_resume(processes, tmp_path):
    _, _, metrics = swarm(processes, tmp_path, 3, {2: PAUSE_IN_SECOND_ROUND})
    wait_for_pause(processes, "peer2")
    frozen = [proc(processes, "peer2").pid, *descendants(proc(processes, "peer2").pid)]
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    at_freeze = max(last_step(m) for m in metrics[:2])
    wait_for_steps(metrics[:2], at_freeze + 2)
    for pid in frozen:
        os.kill(pid, signal.SIGCONT)
    resumed_records = len(outer_steps(metrics[2]))
    wait_until(lambda: len(outer_steps(metrics[2])) >= resumed_records + 2, 240, "two outer steps of the thawed peer")
    assert_consistent(metrics)


def test_kill_while_serving_state(processes, tmp_path):
    # each donor takes 2 s to serve (less than next_chunk_timeout): the kill lands mid-transfer
    maddr, config, metrics = swarm(processes, tmp_path, 2, {0: "serve_state_delay=2", 1: "serve_state_delay=2"})
    wait_for_steps(metrics, 2)
    late = start_peer(processes, "late", config, maddr)
    servers = ["peer0", "peer1"]
    wait_until(lambda: any("serving state slowly" in processes.log(n) for n in servers), 120,
               "a peer to start serving its state")
    server = next(n for n in servers if "serving state slowly" in processes.log(n))
    processes.kill(proc(processes, server))
    survivor = [m for n, m in zip(servers, metrics) if n != server]
    wait_until(lambda: len(outer_steps(late)) >= 2, 240, "two outer steps of the joiner")
    assert "state_loaded" in [r["event"] for r in read_metrics(late)]
    assert outer_steps(late)[-1]["group_size"] == 2, "the joiner should train with the surviving donor"
    assert_consistent([*survivor, late])


def test_slow_peer_contributes_what_it_managed(processes, tmp_path):
    # peer2 sleeps 0.3 s per inner step: several times slower than the others
    _, _, metrics = swarm(processes, tmp_path, 3, {2: "inner_step_delay=0.3"})
    wait_for_steps(metrics, 5)
    assert_consistent(metrics)
    slow = [r for r in outer_steps(metrics[2]) if r["group_size"] == 3]
    fast = [r for r in outer_steps(metrics[0]) if r["group_size"] == 3]
    assert slow and fast
    # the round closed when the fast peers were done: the slow one took part with fewer samples
    assert sum(r["samples"] for r in slow) / len(slow) < sum(r["samples"] for r in fast) / len(fast)


def test_clean_leave_on_sigterm(processes, tmp_path):
    _, _, metrics = swarm(processes, tmp_path, 3)
    wait_for_steps(metrics, 2)
    leaver = proc(processes, "peer2")
    children = descendants(leaver.pid)
    leaver.send_signal(signal.SIGTERM)
    assert leaver.wait(10) == 0
    # torch's shared-memory manager exits as its client does, a moment after: give it that moment
    wait_until(lambda: not any(is_running(pid) for pid in children), 5,
               f"the leaving peer's children {children} to exit", poll_s=0.1)
    assert read_metrics(metrics[2])[-1]["event"] == "exit"
    at_leave = max(last_step(m) for m in metrics[:2])
    wait_for_steps(metrics[:2], at_leave + 2)
    assert outer_steps(metrics[0])[-1]["group_size"] == 2
    assert_consistent(metrics)


def test_restart_from_checkpoint(processes, tmp_path):
    maddr, config, metrics = swarm(processes, tmp_path, 3)
    ckpt = tmp_path / "ckpt"
    # peer3 keeps checkpoints; it is killed and restarted with the same directory
    restarted = start_peer(processes, "peer3", config, maddr, "--checkpoint-dir", str(ckpt))
    wait_for_steps([*metrics, restarted], 2)
    processes.kill(proc(processes, "peer3"))
    assert (ckpt / "checkpoint.pt").exists()
    start_peer(processes, "peer3", config, maddr, "--checkpoint-dir", str(ckpt))
    joins = lambda: [r for r in read_metrics(restarted) if r["event"] == "join"]  # noqa: E731
    wait_until(lambda: len(joins()) == 2, 120, "the restarted peer to join")
    assert joins()[1]["from_checkpoint"] is True and joins()[1]["outer_step"] >= 2
    resumed_at = len(outer_steps(restarted))
    wait_until(lambda: len(outer_steps(restarted)) >= resumed_at + 2, 240, "two outer steps after the restart")
    assert_consistent([*metrics, restarted])


def test_bootstrap_killed_then_new_peer_joins_through_a_peer(processes, tmp_path):
    _, config, metrics = swarm(processes, tmp_path, 2)
    wait_for_steps(metrics, 2)
    processes.kill(proc(processes, "bootstrap"))
    at_kill = max(last_step(m) for m in metrics)
    wait_for_steps(metrics, at_kill + 2)
    peer_maddr = next(line.split("peer reachable at ")[1].strip()
                      for line in processes.log("peer0").splitlines() if "peer reachable at " in line)
    late = start_peer(processes, "late", config, peer_maddr)
    wait_until(lambda: len(outer_steps(late)) >= 2, 240, "two outer steps of the new peer")
    assert "state_loaded" in [r["event"] for r in read_metrics(late)]
    assert_consistent([*metrics, late])
