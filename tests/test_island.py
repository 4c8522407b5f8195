"""An island peer: one peer of two ranks (`torchrun … join`, gloo on the CPU) trains with a single-process peer.

Everything runs in a network namespace of its own with only a loopback (tests/netns.py): torchrun's
rendezvous store listens on every interface, which there reaches nothing else. One swarm serves the
whole test: the island and the single-process peer average together (one θ_global per step, the
island's samples twice its batch per inner step, the group's samples the sum of both peers', θ_local
the same bytes on both ranks after every inner step, its status record says 2 ranks); SIGKILL of rank 1 stops the island's rank 0, which leaves
the swarm, and the other peer goes on; the island restarted resumes from its checkpoint and averages
again, first data-parallel (DDP), then sharded (FSDP2).
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from p2p_diloco.metrics import read_metrics
from p2p_diloco.process_tree import descendant_pids
from tests import netns
from tests.conftest import TINY
from tests.swarm_helpers import (
    FAST_TIMEOUTS, IDLING, assert_consistent, last_step, outer_steps, peer_id_of, proc, start_bootstrap, start_peer,
    tiny_config_file, wait_until,
)

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(420), *netns.required_marks("island tests")]


BATCH = TINY["inner"]["batch_size"]
CHECKED = "island check: θ_local is the same on all 2 ranks after inner step"
REPLICAS_DIFFER = "differs across the island's ranks"  # train/island.py: the ranks' θ_local disagree


@pytest.fixture
def host(processes):
    with netns.Topology() as topology:
        yield topology, topology.add_loopback("island")
        processes.stop_all()  # every process in the namespace stops before the namespace goes


def start_island(processes, name, config, maddr, host, *extra) -> "os.PathLike":
    """`torchrun --nproc-per-node 2 -m p2p_diloco.cli join RUN --state-dir …` in `host`'s namespace, the same
    state directory each time (identity, checkpoint); returns its metrics file."""
    metrics = processes.log_dir / f"{name}.jsonl"
    processes.start(name, "--standalone", "--nproc-per-node", "2", "-m", "p2p_diloco.cli", "join", str(config),
                    "--state-dir", str(processes.log_dir / "island-state"), "--host", host.ip, "--initial-peers",
                    maddr, "--metrics-file", str(metrics), *extra, module="torch.distributed.run",
                    netns=host.namespace, env={"P2P_DILOCO_CHECK_ISLAND": "1", "P2P_DILOCO_FAULTS": IDLING})
    return metrics


def rank_pid(torchrun: subprocess.Popen, rank: int) -> int:
    """The PID of the worker torchrun started as `rank`."""
    for pid in descendant_pids(torchrun.pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if env.get(b"RANK") == str(rank).encode() and env.get(b"TORCHELASTIC_RUN_ID"):
            return pid
    raise AssertionError(f"torchrun {torchrun.pid} has no rank {rank}")


def running_until(processes, name: str, condition):
    """`condition`, checked only while the process `name` runs: a peer that exited fails the wait at once."""
    def check() -> bool:
        assert proc(processes, name).poll() is None, processes.log(name)[-3000:]
        return condition()
    return check


def samples_per_inner_step(metrics) -> set[float]:
    """Each round's samples over its inner steps, for a peer that loaded no state."""
    ratios, before = set(), 0
    for record in outer_steps(metrics):
        ratios.add(record["samples"] / (record["inner_steps"] - before))
        before = record["inner_steps"]
    return ratios


def joined(metrics) -> dict:
    return next(r for r in read_metrics(metrics) if r["event"] == "join")


def averaged_together(island, other) -> bool:
    """The island recorded an outer step in a group of 2 that the other peer recorded with the same θ_global."""
    theirs = {r["outer_step"]: r["global_sha256"] for r in outer_steps(other)}
    return any(r["group_size"] == 2 and theirs.get(r["outer_step"]) == r["global_sha256"] for r in outer_steps(island))


def status_row(topology, host, maddr, peer_id: str) -> dict:
    """The peer's row in `p2p-diloco status --json`, asked again until its record is read (a client that has
    just joined the DHT may not find every record at once)."""
    rows: dict = {}

    def read() -> bool:
        done = subprocess.run(topology.command(host, [sys.executable, "-m", "p2p_diloco.cli", "status",
                                                      "--initial-peers", maddr, "--run", "test", "--json"]),
                              capture_output=True, text=True, timeout=90)
        # its one-line error if it fails (a full run once had exit status 3, could not join, and no line to show)
        assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
        rows.update((row["peer_id"], row) for row in json.loads(done.stdout)["runs"][0]["peers"])
        return peer_id in rows

    wait_until(read, 120, f"the status record of {peer_id}")
    return rows[peer_id]


def test_an_island_of_two_ranks_trains_with_a_single_peer_fails_as_one_and_resumes(processes, tmp_path, host):
    topology, host = host
    config = tiny_config_file(tmp_path, inner={"steps_per_outer": 10}, swarm=FAST_TIMEOUTS)
    maddr = start_bootstrap(processes, host)
    # both idle (swarm_helpers.IDLING): at full speed the single peer, alone while the island restarts, kept a core
    # busy, and torchrun's three processes start on CI's other
    single = start_peer(processes, "single", config, maddr, "--wait-for-peers", "2", host=host, faults=IDLING)
    island = start_island(processes, "island", config, maddr, host, "--wait-for-peers", "2")
    # both peers' records of step 3: the other peer writes its own a moment after the island (a busy-core CI run)
    wait_until(running_until(processes, "island", lambda: min(last_step(island), last_step(single)) >= 3), 240,
               "3 outer steps of the island and of the other peer")

    # one peer of two ranks: one θ_global with the other peer, twice the samples, one θ_local on both ranks
    assert_consistent([single, island])
    assert all(r["group_size"] == 2 for r in outer_steps(island)[:3]), outer_steps(island)
    assert samples_per_inner_step(island) == {2.0 * BATCH}
    assert samples_per_inner_step(single) == {1.0 * BATCH}
    # the group counts both peers' samples, the island's twice the other's (the rule's bound: sync/robust.py)
    theirs = {r["outer_step"]: r for r in outer_steps(single)}
    for record in outer_steps(island)[:3]:
        other = theirs[record["outer_step"]]
        assert record["group_samples"] == other["group_samples"] == record["samples"] + other["samples"], (record, other)
    log = processes.log("island")
    assert log.count(CHECKED) >= outer_steps(island)[2]["inner_steps"], log[-3000:]
    # the ranks' check of θ_local (a round that failed and was averaged again says its result "differs" too)
    assert REPLICAS_DIFFER not in log and "[rank 1]" in log
    row = status_row(topology, host, maddr, peer_id_of(island))
    assert row["ranks"] == 2 and row["device"] == "cpu", row

    # SIGKILL of rank 1: the island's rank 0 leaves the swarm, torchrun stops, the other peer goes on
    torchrun = proc(processes, "island")
    os.kill(rank_pid(torchrun, 1), signal.SIGKILL)
    torchrun.wait(90)
    log = processes.log("island")
    assert "leaving the swarm" in log or "a rank of this island failed" in log, log[-3000:]
    assert "[rank 0] INFO p2p_diloco: peer stopped" in log, log[-3000:]
    stopped_at, single_at = last_step(island), last_step(single)

    # restarted, data-parallel (its start-up overlaps the other peer's steps without it): it resumes from its
    # checkpoint and averages with the other peer again
    restarted = start_island(processes, "island-restarted", config, maddr, host)
    wait_until(lambda: last_step(single) >= single_at + 2, 120, "the single peer's outer steps after the island left")
    wait_until(running_until(processes, "island-restarted", lambda: averaged_together(restarted, single)), 180,
               "an outer step of the restarted island with the other")
    assert joined(restarted)["from_checkpoint"] and joined(restarted)["outer_step"] == stopped_at, joined(restarted)
    assert REPLICAS_DIFFER not in processes.log("island-restarted")
    assert "cannot resume the data stream" not in processes.log("island-restarted")  # each rank goes on with its data
    restarted_proc = proc(processes, "island-restarted")
    restarted_proc.send_signal(signal.SIGTERM)  # torchrun passes it on to every rank; rank 0 leaves the swarm
    restarted_proc.wait(90)
    assert processes.log("island-restarted").count("[rank 0] INFO p2p_diloco: peer stopped") == 1

    # restarted sharded (FSDP2) from the same checkpoint: its optimizer state is sharded, its θ_global the same
    sharded = start_island(processes, "island-sharded", config, maddr, host, "--shard")
    wait_until(running_until(processes, "island-sharded", lambda: averaged_together(sharded, single)), 180,
               "an outer step of the sharded island with the other")
    assert joined(sharded)["from_checkpoint"], joined(sharded)
    assert "model sharded (FSDP2)" in processes.log("island-sharded")
    assert_consistent([single, island, restarted, sharded])
