"""Volunteers arrive when they arrive: peers of the demo run started 2 s apart, without --wait-for-peers, never
stall the run (issue 42: the first round, averaged with a newcomer of 2 inner steps, left an outer momentum so
small that the update check voided every round after it). The protocol's side of it is in the simulation
(tests/test_simulation.py: every arrival pattern, the stall's own scenario); this runs the real processes."""

import time

import pytest

from p2p_diloco.metrics import read_metrics
from tests.conftest import REPO
from tests.swarm_helpers import assert_consistent, start_bootstrap, start_peer, timeline, wait_for_steps

# In the default suite although the simulation tries the same arrivals (tests/test_simulation.py, [arrivals_2s_apart],
# [stall_at_step_2], ...): issue 42 asks for this run of real peers in CI, the demo run's own schedule end to end
pytestmark = [pytest.mark.swarm, pytest.mark.timeout(360)]

MAX_VOID_IN_A_ROW = 3


def void_streak(metrics) -> int:
    """The most rounds in a row whose mean the update check voided (``round_rejected``)."""
    longest = streak = 0
    for record in read_metrics(metrics):
        if record["event"] == "round_rejected":
            streak += 1
            longest = max(longest, streak)
        elif record["event"] == "outer_step":
            streak = 0
    return longest


def test_demo_peers_started_two_seconds_apart_reach_six_outer_steps_with_one_hash(processes, tmp_path):
    maddr = start_bootstrap(processes)
    metrics = []
    for i in range(3):
        metrics.append(start_peer(processes, f"peer{i}", REPO / "peers" / "demo.toml", maddr))
        time.sleep(2.0)
    try:
        wait_for_steps(metrics, 6, timeout_s=300)
    except TimeoutError as e:
        raise AssertionError(f"{e}: " + " | ".join(timeline(m) for m in metrics)) from None
    assert_consistent(metrics)
    assert all(void_streak(m) <= MAX_VOID_IN_A_ROW for m in metrics), [timeline(m) for m in metrics]
