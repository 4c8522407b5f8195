"""Volunteers behind home routers train with the swarm: real processes behind real NAT.

Each test builds network namespaces (tests/netns.py): a public bridge with the bootstrap node and
the public peers, and one home router per NATed peer, which masquerades its home and drops every
connection from outside that the home did not open. Assertions read the metrics files: every peer
took part in the outer steps, with one global state per step, and no peer took a step alone.
"""

import re

import pytest

from p2p_diloco.metrics import read_metrics
from tests import netns
from tests.swarm_helpers import (
    FAST_TIMEOUTS, assert_consistent, last_step, outer_steps, proc, start_bootstrap, start_peer, tiny_config_file,
    wait_for_steps, wait_until,
)

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(420), *netns.required_marks("NAT tests")]


@pytest.fixture
def topology(processes):
    with netns.Topology() as topo:
        yield topo
        processes.stop_all()  # every process in the namespaces stops before the namespaces go


def start_swarm(processes, tmp_path, topology, public: int, homes: int, steps: int = 0, faults=None):
    """A bootstrap node on the public bridge, `public` public peers, `homes` peers behind NAT, started
    together; returns (maddr, config, {peer name: (host, metrics file)})."""
    config = tiny_config_file(tmp_path, inner={"steps_per_outer": 10}, swarm=FAST_TIMEOUTS)
    maddr = start_bootstrap(processes, topology.add_public("bootstrap"))
    hosts = [topology.add_public(f"public{i}") for i in range(public)] + [
        topology.add_home(f"home{i}") for i in range(homes)]
    limit = ["--max-outer-steps", str(steps)] if steps else []
    peers = {host.name: (host, start_peer(processes, host.name, config, maddr, "--wait-for-peers", str(len(hosts)),
                                          *limit, host=host, faults=(faults or {}).get(host.name, "")))
             for host in hosts}
    return maddr, config, peers


def reachability(metrics) -> str:
    return next(r for r in read_metrics(metrics) if r["event"] == "reachability")["reachability"]


def assert_everyone_in_every_step(peers: dict, steps: range, group_size: int) -> None:
    files = [metrics for _, metrics in peers.values()]
    assert_consistent(files)
    for name, (_, metrics) in peers.items():
        taken = {r["outer_step"]: r["group_size"] for r in outer_steps(metrics)}
        assert all(taken.get(step) == group_size for step in steps), (name, taken)
        assert all(size > 1 for size in taken.values()), f"{name} took a step alone: {taken}"


def wait_for_exit(processes, names, timeout_s=300):
    procs = [proc(processes, name) for name in names]
    wait_until(lambda: all(p.poll() is not None for p in procs), timeout_s, f"{', '.join(names)} to finish")
    assert [p.returncode for p in procs] == [0] * len(procs), [processes.log(name)[-2000:] for name in names]


@pytest.mark.long  # the keeper's test below has every peer behind NAT too, and checks the same
def test_the_bootstrap_node_reduces_when_every_peer_is_natted(processes, tmp_path, topology):
    _, _, peers = start_swarm(processes, tmp_path, topology, public=0, homes=3, steps=4)
    wait_for_exit(processes, list(peers))
    assert all(reachability(m) == "unreachable" for _, m in peers.values())
    assert_everyone_in_every_step(peers, range(1, 5), group_size=3)
    assert "reduced outer step 4 for 3 unreachable peer(s)" in processes.log("bootstrap")


@pytest.mark.long  # CI: the kill in test_faults.py, NAT in the keeper's test below
def test_natted_peer_killed_mid_allreduce(processes, tmp_path, topology):
    # home1, a client, pauses after the first part it sends in its second all-reduce: the kill lands there
    _, _, peers = start_swarm(processes, tmp_path, topology, public=2, homes=2,
                              faults={"home1": "allreduce_send_delay=4,allreduce_delay_round=2"})
    wait_until(lambda: "pausing mid all-reduce (sending)" in processes.log("home1"), 180,
               "home1 to pause mid all-reduce")
    processes.kill(proc(processes, "home1"))
    survivors = {name: peer for name, peer in peers.items() if name != "home1"}
    at_kill = max(last_step(m) for _, m in survivors.values())
    wait_for_steps([m for _, m in survivors.values()], at_kill + 2)
    assert_consistent([m for _, m in peers.values()])
    for name, (_, metrics) in survivors.items():
        after = [r for r in outer_steps(metrics) if r["outer_step"] > at_kill]
        assert after and all(r["group_size"] == 3 for r in after), (name, after)


@pytest.mark.long  # CI's NAT test is the keeper's below: every peer behind NAT, a reducer for them, a natted joiner
def test_a_natted_joiner_loads_the_state_and_one_public_peer_reduces_for_two_natted_peers(processes, tmp_path,
                                                                                           topology):
    """A public peer and a NATed one train; a second NATed peer joins, loads the state from the public peer
    (the only peer anyone can dial), and the three average, the public peer reducing for the other two."""
    maddr, config, peers = start_swarm(processes, tmp_path, topology, public=1, homes=1)
    wait_for_steps([m for _, m in peers.values()], 2)
    late = start_peer(processes, "late", config, maddr, host=topology.add_home("late"))
    wait_until(lambda: len(outer_steps(late)) >= 2, 240, "two outer steps of the joiner")
    assert [reachability(m) for m in (peers["public0"][1], peers["home0"][1], late)] == \
        ["direct", "unreachable", "unreachable"]
    assert "averaging as a client" in processes.log("home0") and "averaging as a client" in processes.log("late")
    loaded = next(r for r in read_metrics(late) if r["event"] == "state_loaded")
    assert loaded["donor"] == read_metrics(peers["public0"][1])[0]["peer_id"]
    assert all(r["group_size"] == 3 for r in outer_steps(late)), outer_steps(late)
    assert_consistent([*(m for _, m in peers.values()), late])


def test_the_keeper_follows_a_run_nobody_can_dial_and_serves_a_natted_joiner(processes, tmp_path, topology):
    """Every peer behind NAT, so none serves its state and none can reduce: the bootstrap node reduces for them
    (it assists), its keeper (--keep) gets each step pushed by the first of them (they dial it), and a NATed
    joiner loads the run's state from it."""
    config = tiny_config_file(tmp_path, inner={"steps_per_outer": 10}, swarm=FAST_TIMEOUTS)
    maddr = start_bootstrap(processes, topology.add_public("bootstrap"), "--keep", str(config))
    homes = [topology.add_home(f"home{i}") for i in range(2)]
    peers = [start_peer(processes, host.name, config, maddr, "--wait-for-peers", "2", host=host,
                        faults="inner_step_delay=0.2") for host in homes]
    wait_for_steps(peers, 2)
    assert all(reachability(m) == "unreachable" for m in peers)
    assert all(r["group_size"] == 2 for m in peers for r in outer_steps(m)), [outer_steps(m) for m in peers]
    assert re.search(r"reduced outer step \d+ for", processes.log("bootstrap"))
    assert "pushed outer step" in processes.log("home0") + processes.log("home1")
    late = start_peer(processes, "late", config, maddr, host=topology.add_home("late"))
    wait_until(lambda: len(outer_steps(late)) >= 1, 240, "an outer step of the joiner")
    loaded = [r for r in read_metrics(late) if r["event"] == "state_loaded"]
    assert loaded and loaded[0]["source"] == "keeper", loaded
    # it may load a step the run's peers have just left (the keeper gets the next one a moment after
    # them): it then waits for that one, and never steps alone while they train
    assert all(r["group_size"] > 1 for r in outer_steps(late)), outer_steps(late)
    assert_consistent(peers + [late])
