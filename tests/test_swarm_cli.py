"""A real swarm through the CLI: a bootstrap node and peer processes on 127.0.0.1."""

import pytest

from p2p_diloco.metrics import read_metrics
from tests.swarm_helpers import (
    hashes_by_step, outer_steps, peer_id_of, start_bootstrap, start_peer, tiny_config_file, wait_until,
)

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(420)]


# DiLoCo in fp32; and Streaming DiLoCo (2 fragments, the sync overlapped with 2 inner steps) with a
# 4-bit codec and error feedback: one θ_global on every peer either way
# (CI runs the streaming one, which goes through more of the code; the in-process oracles of
# tests/test_streaming.py and tests/test_reference_math.py check DiLoCo's mean itself)
@pytest.mark.parametrize("outer", [
    pytest.param({"codec": "none"}, id="dense", marks=pytest.mark.long),
    pytest.param({"codec": "fp4-e3m0", "error_feedback": True, "fragments": 2, "sync_delay": 2, "merge_alpha": 0.5},
                 id="streaming"),
])
def test_three_peers_agree_after_every_outer_step_and_loss_falls(processes, tmp_path, outer):
    config = tiny_config_file(tmp_path, model={"num_layers": 2}, inner={"steps_per_outer": 10}, outer=outer)
    maddr = start_bootstrap(processes)
    metrics = [start_peer(processes, f"peer{i}", config, maddr, "--max-outer-steps", "6", "--wait-for-peers", "3")
               for i in range(3)]
    peers = processes.procs[1:]
    wait_until(lambda: all(p.poll() is not None for p in peers), 360, "three peers to take 6 outer steps")
    assert [p.returncode for p in peers] == [0, 0, 0], [processes.log(p.name)[-2000:] for p in peers]

    by_step = hashes_by_step(metrics)
    assert sorted(by_step) == [1, 2, 3, 4, 5, 6]
    for step, hashes in by_step.items():
        assert len(hashes) == 1, f"peers disagree after outer step {step}: {hashes}"
    for path in metrics:
        records = outer_steps(path)
        # started together (--wait-for-peers 3), the peers take their outer steps together; only a
        # first round that one peer voided while the others committed would have it load step 1
        steps = [r["outer_step"] for r in records]
        assert steps == list(range(steps[0], 7)) and steps[0] <= 2, steps
        assert records[-1]["group_size"] == 3 and records[-2]["group_size"] == 3
        sent = [r["bytes_sent"] for r in records]  # cumulative
        assert sent == sorted(sent) and sent[-1] > sent[-2] > 0, sent
        for field in ("peer_id", "samples", "bytes_received", "time"):
            assert field in records[0]
        assert records[-1]["codec"] == outer["codec"]
        assert [r["fragment"] for r in records] == [(r["outer_step"] - 1) % outer.get("fragments", 1) for r in records]
        assert all(0 < r["compute_utilization"] <= 1 and r["inner_seconds"] > 0 for r in records), records
    losses_at = {step: [r["loss"] for m in metrics for r in outer_steps(m) if r["outer_step"] == step]
                 for step in (1, 6)}
    assert max(losses_at[6]) < min(losses_at[1]) - 0.1, losses_at


@pytest.mark.long  # CI: tests/test_join_status.py's peer on other settings; a joiner that loads its run's state and
# agrees with it in tests/test_hostile.py's donors' test
def test_peers_with_other_settings_never_average_together_and_a_late_joiner_loads_its_runs_state(processes, tmp_path):
    first = tiny_config_file(tmp_path / "a", inner={"steps_per_outer": 10})
    second = tiny_config_file(tmp_path / "b", inner={"steps_per_outer": 10}, data={"max_documents": 30})
    maddr = start_bootstrap(processes)
    pairs = {config: [start_peer(processes, f"{config.parent.name}{i}", config, maddr, "--wait-for-peers", "2")
                      for i in range(2)] for config in (first, second)}
    metrics = [m for pair in pairs.values() for m in pair]
    wait_until(lambda: all(len(outer_steps(m)) >= 3 for m in metrics), 300, "three outer steps of each peer")
    for pair in pairs.values():
        assert all(r["group_size"] <= 2 for m in pair for r in outer_steps(m))
        assert any(r["group_size"] == 2 for m in pair for r in outer_steps(m))  # the twins did average
    for name in ("a0", "a1", "b0", "b1"):
        assert "ignoring the progress of a peer with other run settings" in processes.log(name)

    # a peer of the first run's settings joins late: it loads the state of its own run, and agrees with it
    late = start_peer(processes, "a-late", first, maddr)
    wait_until(lambda: len(outer_steps(late)) >= 2, 240, "two outer steps of the late joiner")
    events = [r["event"] for r in read_metrics(late)]
    assert events[:2] == ["reachability", "join"] and "state_loaded" in events
    loaded = next(r for r in read_metrics(late) if r["event"] == "state_loaded")
    assert loaded["outer_step"] >= 2
    by_step = hashes_by_step([*pairs[first], late])
    for record in outer_steps(late):
        assert by_step[record["outer_step"]] == {record["global_sha256"]}, f"late joiner differs at {record}"
    pairs[first].append(late)
    hashes = {config: set().union(*hashes_by_step(pair).values()) for config, pair in pairs.items()}
    assert not hashes[first] & hashes[second]  # no θ_global of one run is ever the other's
    for pair in pairs.values():  # each downloaded state came from a peer of its own run
        twins = {peer_id_of(m) for m in pair}
        assert all(r["donor"] in twins for m in pair for r in read_metrics(m) if r["event"] == "state_loaded")
