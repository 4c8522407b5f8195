"""Joining a run from its manifest, one config per run, and seeing the swarm: real processes on 127.0.0.1.

* `join` with a shipped manifest trains, keeps its state in its state directory, continues from it
  after a restart, and refuses a state directory that another peer holds;
* a peer whose settings differ from the run's is told which ones and exits, and the run never
  averages with it; with --ignore-other-settings it trains alone;
* (`status` of a real swarm, as a table, as JSON and as a page: tests/test_run_page.py)
* peers on a sharded stream (a local dataset read through datasets' streaming path) read different
  shards, and a restarted one goes on with its shard where it was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from p2p_diloco.exit_codes import EXIT_OTHER_SETTINGS, EXIT_USAGE
from p2p_diloco.manifest import lock_state_dir
from tests.cli_run import invoke_cli
from tests.conftest import REPO
from tests.swarm_helpers import (
    FAST_TIMEOUTS, IDLING, events, last_step, proc, start_bootstrap, start_peer, swarm, tiny_config_file,
    wait_for_steps, wait_until,
)

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(480)]


def cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """A `p2p-diloco` command that ends by itself (bounded: killed after `timeout_s`)."""
    return subprocess.run([sys.executable, "-m", "p2p_diloco.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "PYTHONPATH": str(REPO)})


def exited(processes, name: str, timeout_s: float = 240) -> int:
    process = proc(processes, name)
    wait_until(lambda: process.poll() is not None, timeout_s, f"{name} to exit")
    return process.returncode


def test_join_a_shipped_manifest_then_continue_after_a_restart(processes, tmp_path):
    maddr = start_bootstrap(processes)
    state = tmp_path / "state"

    def join(name: str, outer_steps: int):
        # the demo manifest's own bootstrap address is replaced by this test's node
        processes.start(name, "join", "demo", "--host", "127.0.0.1", "--initial-peers", maddr,
                        "--state-dir", str(state), "--max-outer-steps", str(outer_steps))
        return exited(processes, name)

    assert join("first", 2) == 0, processes.log("first")
    assert f"joining run 'demo' from {REPO / 'peers' / 'demo.toml'}" in processes.log("first")
    metrics = state / "metrics.jsonl"
    assert last_step(metrics) == 2
    saved = torch.load(state / "checkpoint" / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert saved["outer_step"] == 2 and (state / "identity.key").exists()

    assert join("again", 3) == 0, processes.log("again")
    first, again = events(metrics, "join")
    # the same peer, back with its checkpoint and its place in the data, then one more outer step
    assert again["peer_id"] == first["peer_id"] and again["from_checkpoint"] is True
    assert (again["outer_step"], again["global_sha256"]) == (saved["outer_step"], saved["sha256"])
    assert again["data_position"] == saved["data_state"]["position"] > 0
    assert last_step(metrics) == 3


def test_join_refuses_a_state_directory_in_use_and_an_unknown_manifest(processes, tmp_path):
    held = lock_state_dir(tmp_path / "state")  # as a running peer holds it
    try:
        result = cli("join", "demo", "--host", "127.0.0.1", "--state-dir", str(held.path))
    finally:
        held.lock.close()
    assert result.returncode == EXIT_USAGE and "another peer already runs from" in result.stderr, result.stderr
    # refused before any node starts: checked in this process (tests/cli_run.py)
    result = invoke_cli("join", "no-such-run", "--host", "127.0.0.1", "--state-dir", str(tmp_path / "s"))
    assert result.returncode == EXIT_USAGE and "no run manifest 'no-such-run'" in result.stderr
    assert "demo" in result.stderr  # it lists the manifests it knows


def test_a_peer_with_other_settings_is_told_which_and_exits(processes, tmp_path):
    # alone, the run's peer steps as fast as it can (one core of CI's two) while the newcomers start: it idles
    maddr, _, metrics = swarm(processes, tmp_path, 1, {0: IDLING})
    wait_for_steps(metrics, 1)
    other = tiny_config_file(tmp_path / "other", inner={"steps_per_outer": 10, "lr": 5e-3}, swarm=FAST_TIMEOUTS)
    newcomer = start_peer(processes, "newcomer", other, maddr)
    assert exited(processes, "newcomer") == EXIT_OTHER_SETTINGS
    message = [line for line in processes.log("newcomer").splitlines() if line.startswith("error:")]
    assert len(message) == 1 and "run 'test' is trained with other settings" in message[0], message
    assert "inner.lr = 0.005 here, 0.003 there" in message[0]
    at = last_step(metrics[0])
    wait_for_steps(metrics, at + 1)
    # it never trained in the run: no outer step, no state downloaded (it did write its exit)
    assert events(newcomer, "exit") and not events(newcomer, "outer_step") and not events(newcomer, "state_loaded")
    # told to ignore the run's settings, it trains: alone, as the run never averages with it
    ignorer = start_peer(processes, "ignorer", other, maddr, "--ignore-other-settings", "--max-outer-steps", "1")
    assert exited(processes, "ignorer") == 0, processes.log("ignorer")
    assert "training anyway (--ignore-other-settings): run 'test' is trained with other settings" in \
        processes.log("ignorer")
    assert [r["group_size"] for r in events(ignorer, "outer_step")] == [1]


def write_jsonl_dataset(folder, files: int, docs_per_file: int):
    folder.mkdir()
    for f in range(files):
        lines = [json.dumps({"text": f"document {f}-{d}: " + " ".join(f"word{(f * 7 + d * 3 + i) % 50}" for i in range(60))})
                 for d in range(docs_per_file)]
        (folder / f"part-{f}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


@pytest.mark.long  # CI: the shard choice in tests/test_status_records.py, a stream's resume in tests/test_data.py
def test_peers_of_a_sharded_stream_read_their_own_shard_and_resume_it(processes, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # the peers inherit it: no hub, a local dataset
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dataset = write_jsonl_dataset(tmp_path / "dataset", files=4, docs_per_file=60)
    data = {"source": "hub", "hub_dataset": str(dataset), "shards": 4, "tokenizer_documents": 100,
            "holdout_fraction": 0.05, "max_documents": 0}
    maddr, config, metrics = swarm(processes, tmp_path, 0, data=data)
    keep = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--identity-path", str(tmp_path / "peer0.key")]
    metrics = [start_peer(processes, "peer0", config, maddr, "--wait-for-peers", "2", *keep),
               start_peer(processes, "peer1", config, maddr, "--wait-for-peers", "2")]
    wait_for_steps(metrics, 2)
    shards = [events(m, "join")[0]["data_shard"] for m in metrics]
    assert len(set(shards)) == 2 and all(0 <= s < 4 for s in shards), shards

    proc(processes, "peer0").terminate()
    assert exited(processes, "peer0", 60) == 0
    saved = torch.load(tmp_path / "ckpt" / "checkpoint.pt", map_location="cpu", weights_only=False)
    start_peer(processes, "peer0-again", config, maddr, *keep)
    wait_until(lambda: len(events(processes.log_dir / "peer0-again.jsonl", "join")) == 1
               if (processes.log_dir / "peer0-again.jsonl").exists() else False, 120, "the restarted peer to join")
    (again,) = events(processes.log_dir / "peer0-again.jsonl", "join")
    assert again["from_checkpoint"] is True and again["data_shard"] == shards[0] == saved["data_shard"]
    assert again["data_position"] == saved["data_state"]["position"] > 0
