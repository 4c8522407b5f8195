"""A run outlives its peers (issue 21): its state is kept in a checkpoint store, and a newcomer that
finds the run ahead of it and nothing to load from never starts a second history of the run.

Real processes on loopback: two peers take 3 outer steps, writing each to the run's store, and
leave. A newcomer without the store sees their records at outer step 3, waits its bound without
training and exits 5 with one line; a newcomer with the store skips a state cut short mid-write,
starts from the newest whole one and goes on with the run's history. And with the bootstrap node
keeping the run (``bootstrap --keep``), a newcomer after the peers left goes on from the keeper."""

import json

import pytest

from p2p_diloco.metrics import read_metrics
from tests.swarm_helpers import (
    FAST_TIMEOUTS, LOOPBACK, assert_consistent, hashes_by_step, outer_steps, proc, start_bootstrap, start_peer,
    tiny_config_file, wait_until,
)
from tests.test_join_status import cli

RUN_STEPS = 3
# records of peers that left must outlive the newcomers' start-up (FAST_TIMEOUTS' 12 s is for crashes); a newcomer
# with nothing to load from tries again once (train/catch_up.py polls every 5 s) before it gives up
SWARM = {**FAST_TIMEOUTS, "progress_ttl": 90.0, "state_wait_timeout": 5.0}
EXIT_NO_STATE = 5


@pytest.mark.swarm
@pytest.mark.timeout(420)
def test_a_newcomer_continues_from_the_runs_store_and_without_one_stops_rather_than_fork(processes, tmp_path):
    store = tmp_path / "store"
    with_store = tiny_config_file(tmp_path / "with-store", inner={"steps_per_outer": 10},
                                  swarm={**SWARM, "checkpoint_store": str(store), "checkpoint_every": 1})
    without_store = tiny_config_file(tmp_path / "without-store", inner={"steps_per_outer": 10}, swarm=SWARM)
    maddr = start_bootstrap(processes)
    first = [start_peer(processes, f"peer{i}", with_store, maddr, "--wait-for-peers", "2",
                        "--max-outer-steps", str(RUN_STEPS)) for i in range(2)]
    for i in range(2):
        assert proc(processes, f"peer{i}").wait(240) == 0, processes.log(f"peer{i}")[-3000:]
    assert_consistent(first)
    run_state = hashes_by_step(first)[RUN_STEPS]
    manifests = sorted(json.loads(p.read_text())["outer_step"] for p in (store / "steps").glob("*.json"))
    assert manifests == list(range(1, RUN_STEPS + 1)), manifests

    # the run's peers are gone; their records still say outer step 3
    alone = start_peer(processes, "newcomer-without-store", without_store, maddr)
    assert proc(processes, "newcomer-without-store").wait(120) == EXIT_NO_STATE
    last_line = processes.log("newcomer-without-store").strip().splitlines()[-1]
    assert f"is at outer step {RUN_STEPS}" in last_line and "second history" in last_line, last_line
    assert outer_steps(alone) == []  # it trained nothing under the run's name

    # a write of outer step 4 cut short: its manifest is there, half of its file
    newest = json.loads((store / "steps" / f"{RUN_STEPS:012d}.json").read_text())
    data = (store / newest["file"]).read_bytes()
    (store / "states" / ("0" * 64 + ".pt")).write_bytes(data[: len(data) // 2])
    cut = {**newest, "outer_step": RUN_STEPS + 1, "sha256": "0" * 64, "file": f"states/{'0' * 64}.pt"}
    (store / "steps" / f"{RUN_STEPS + 1:012d}.json").write_text(json.dumps(cut))

    newcomer = start_peer(processes, "newcomer", with_store, maddr, "--max-outer-steps", str(RUN_STEPS + 1))
    assert proc(processes, "newcomer").wait(180) == 0, processes.log("newcomer")[-3000:]
    loaded = [r for r in read_metrics(newcomer) if r["event"] == "state_loaded"]
    assert [(r["source"], r["outer_step"], r["global_sha256"]) for r in loaded] == \
        [("store", RUN_STEPS, next(iter(run_state)))], loaded
    assert [r["outer_step"] for r in outer_steps(newcomer)] == [RUN_STEPS + 1]  # the run's history goes on
    assert "skipping outer step 4" in processes.log("newcomer")


@pytest.mark.long  # the keeper's following and serving are checked in CI by tests/test_nat.py's keeper test
@pytest.mark.swarm
@pytest.mark.timeout(420)
def test_the_bootstrap_node_keeps_the_run_for_a_newcomer_after_its_peers_left(processes, tmp_path):
    config = tiny_config_file(tmp_path, inner={"steps_per_outer": 10}, swarm=SWARM)
    store = tmp_path / "store"  # the keeper writes the run's state there; peers only read it (checkpoint_every 0)
    keeping = tiny_config_file(tmp_path / "keeper", inner={"steps_per_outer": 10},
                               swarm={**SWARM, "checkpoint_store": str(store), "checkpoint_every": 1})
    maddr = start_bootstrap(processes, LOOPBACK, "--keep", str(keeping))
    # rounds of a few seconds, as a keeper that reads the records every 2 s expects (10 inner steps of the tiny
    # model took 0.4 s: the peers took 3 outer steps before its first read, in a tie of 1 record to 1)
    first = [start_peer(processes, f"peer{i}", config, maddr, "--wait-for-peers", "2",
                        "--max-outer-steps", str(RUN_STEPS), faults="inner_step_delay=0.4") for i in range(2)]
    for i in range(2):
        assert proc(processes, f"peer{i}").wait(240) == 0, processes.log(f"peer{i}")[-3000:]
    run_states = hashes_by_step(first)

    status = cli("status", "--initial-peers", maddr, "--run", "test", "--json")
    assert status.returncode == 0, status.stderr
    (run,) = json.loads(status.stdout)["runs"]
    (keeper,) = run["peers"]  # the peers left: the keeper alone is live, keeping the run's last state
    assert keeper["phase"] == "keeping" and keeper["outer_step"] == RUN_STEPS, keeper  # they waited for it to have it
    # the table names the keeper and the newest state in the run's store (a status record refreshes every 10 s);
    # the keeper is checked in the table that showed the newest step (one command less, seconds of start-up)
    table = {}

    def shows_the_newest_step() -> bool:
        table["stdout"] = cli("status", "--initial-peers", maddr, "--run", "test").stdout
        return f"newest checkpoint in the store: outer step {RUN_STEPS}" in table["stdout"]

    wait_until(shows_the_newest_step, 60, "the store's newest step in status")
    assert f"kept by {keeper['peer_id'][-8:]}" in table["stdout"], table["stdout"]
    assert sorted(int(p.stem) for p in (store / "steps").glob("*.json")) == list(range(1, RUN_STEPS + 1))

    newcomer = start_peer(processes, "newcomer", config, maddr, "--max-outer-steps", str(RUN_STEPS + 1))
    assert proc(processes, "newcomer").wait(180) == 0, processes.log("newcomer")[-3000:]
    loaded = [r for r in read_metrics(newcomer) if r["event"] == "state_loaded"]
    assert [(r["source"], r["outer_step"]) for r in loaded] == [("keeper", RUN_STEPS)], loaded
    assert {loaded[0]["global_sha256"]} == run_states[RUN_STEPS]  # the state the run's peers agreed on last
    assert [r["outer_step"] for r in outer_steps(newcomer)] == [RUN_STEPS + 1]  # and the run goes on from it
