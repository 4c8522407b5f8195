"""Strangers on the run's DHT: malformed, forged and lying records, malformed and poisoned states, malformed
group metadata.

A hostile process (tests/hostile.py) joins a real swarm of `p2p-diloco peer` processes on 127.0.0.1
and does what no honest peer would. The honest swarm must keep stepping with one global state, no
honest process may exit, and the offence must be logged with the offender's peer ID.
"""

import json
import re
import subprocess
import sys

import pytest

from p2p_diloco.metrics import read_metrics
from p2p_diloco.sync.state_transfer import TRANSFER_FAILED
from tests.hostile import GROUPMATE_VARIANTS, STATE_VARIANTS
from tests.swarm_helpers import (
    IDLING, assert_consistent, events, last_step, outer_steps, peer_id_of, start_peer, swarm, wait_for_steps,
    wait_until,
)

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(480)]


def start_hostile(processes, mode, config, maddr, *extra):
    return processes.start(f"hostile-{mode}", mode, "--config", str(config), "--initial-peers", maddr, *extra,
                           module="tests.hostile")


def printed(processes, name, pattern):
    """Every match of `pattern` (one group) in what process `name` printed."""
    return re.findall(pattern, processes.log(name))


def honest_logs(processes, n):
    return "".join(processes.log(f"peer{i}") for i in range(n))


def keeps_stepping(processes, metrics, steps=3):
    at = max(last_step(m) for m in metrics)
    wait_for_steps(metrics, at + steps)
    assert_consistent(metrics)
    honest = [p for p in processes.procs if p.name.startswith("peer")]
    assert all(p.poll() is None for p in honest), [(p.name, p.returncode) for p in honest]


def test_malformed_forged_and_lying_records_are_ignored_and_malformed_group_data_bans_its_sender(processes, tmp_path):
    """Two strangers in one swarm (to keep CI short; neither changes what the other is judged on): one writes
    malformed, forged and lying records, the other joins groups with malformed metadata or parts."""
    # the honest peers idle (swarm_helpers.IDLING) while the strangers start
    maddr, config, metrics = swarm(processes, tmp_path, 3, dict.fromkeys(range(3), IDLING))
    wait_for_steps(metrics, 1)
    start_hostile(processes, "records", config, maddr)
    # every kind at once, one identity each for 10 s: one turn (4 lanes took two, 14 s more of CI; 2 lanes four)
    groupmate = start_hostile(processes, "groupmate", config, maddr, "--seconds-per-identity", "10",
                              "--lanes", str(len(GROUPMATE_VARIANTS)))
    wait_until(lambda: printed(processes, "hostile-records", r"(wrote records)"), 120, "the hostile records")
    (author,) = printed(processes, "hostile-records", r"records signed as (\w+)")
    wait_until(lambda: groupmate.poll() is not None, 300, "the hostile groupmate to try every kind of input")
    # `status` reads the records while the honest peers take their next steps (it reads; it changes nothing). Not
    # sooner: a read while the groupmate's 7 nodes were up found none of the stranger's status records (once in 3
    # runs; the nodes it asked need not hold them)
    status = subprocess.Popen([sys.executable, "-m", "p2p_diloco.cli", "status", "--initial-peers", maddr, "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        identities = dict(printed(processes, "hostile-groupmate", r"identity (\w+) sends (.+)"))
        assert sorted(identities.values()) == sorted(GROUPMATE_VARIANTS)
        keeps_stepping(processes, metrics)
        stdout, stderr = status.communicate(timeout=120)
    finally:
        if status.poll() is None:
            status.kill()
            status.wait(10)
    logs = honest_logs(processes, 3)
    # the records: refused by the DHT validators of the honest nodes, each logged once with its author
    assert f"ignoring a malformed test_progress record from peer {author}" in logs
    assert "that it did not sign" in logs  # the record under another peer's key
    # well-formed and signed, but not this run's settings, or a claim that no donor could serve
    assert f"ignoring the progress of a peer with other run settings from peer {author}" in logs
    assert f"setting aside the record of peer {author}: it claims outer step 1000000" in logs
    # `status` shows the honest peers, and skips the stranger's malformed and forged status records
    assert status.returncode == 0, stderr
    (run,) = json.loads(stdout)["runs"]  # the malformed run announcement is no run
    assert run["run"] == "test" and {p["peer_id"] for p in run["peers"]} == {peer_id_of(m) for m in metrics}, \
        (run, stderr[-3000:])
    assert f"ignoring a malformed status record from peer {author}" in stderr, stderr[-3000:]
    # the groupmate: each kind of malformed input bans the identity that sent it
    banned = {kind for peer, kind in identities.items()
              if re.search(f"ignoring (malformed group metadata|a malformed all-reduce part|a malformed averaged "
                           f"part) from peer {peer}", logs)}
    assert len(banned) >= len(GROUPMATE_VARIANTS) // 2, f"the honest peers met only {banned}"
    for path in metrics:  # no round ever counted the hostile peer
        assert all(r["group_size"] <= 3 for r in outer_steps(path))


def test_malformed_and_poisoned_states_from_a_donor_are_refused(processes, tmp_path):
    """One swarm for eight hostile donors: seven serve one malformed or unvouched state each, the eighth a
    well-formed poisoned state it claims one step ahead of the swarm (p2p_diloco/train/state_check.py)."""
    # the honest peers idle (swarm_helpers.IDLING) while the strangers and the joiners start
    maddr, config, metrics = swarm(processes, tmp_path, 2, dict.fromkeys(range(2), IDLING))
    # the seven start with the swarm (they claim no outer step: a peer only asks them when it loads the state), and
    # so does the eighth, which keeps its claim one step ahead of the honest peers from their first step on
    hostile = start_hostile(processes, "donor", config, maddr)
    start_hostile(processes, "poisoned-donor", config, maddr)
    wait_for_steps(metrics, 2)
    wait_until(lambda: printed(processes, "hostile-donor", r"(donors ready)"), 120, "the hostile donors")
    donors = dict(printed(processes, "hostile-donor", r"donor of (.+) ready as (\w+)"))  # state -> its donor
    assert sorted(donors) == sorted(STATE_VARIANTS)
    pattern = r"poisoned donor ready as (\w+), records signed as (\w+), poisoned state (\w+)"
    wait_until(lambda: printed(processes, "hostile-poisoned-donor", pattern), 120, "the poisoned donor")
    ((poisoner, claimant, poisoned),) = printed(processes, "hostile-poisoned-donor", pattern)
    honest = {peer_id_of(m) for m in metrics}

    def refusals() -> dict[str, str]:
        """Why a peer refused each hostile donor's state, by the state's name (an honest peer may have
        downloaded one too). A transfer cut short judges no state (the connection broke: CI once cut one
        after its first tensor), so it is left out, and another joiner asks that donor again."""
        found = {}
        for path in [*metrics, *joiners]:
            for record in read_metrics(path):
                if record["event"] in ("state_loaded", "state_load_failed", "state_refused"):
                    failed = record.get("failed_donors", {})
                    found.update((name, failed[donor]) for name, donor in donors.items()
                                 if donor in failed and not failed[donor].startswith(TRANSFER_FAILED))
        return found

    # the donors claim the highest priority: a joiner's download is offered each of their states before an
    # honest peer's, and goes on past each. A second joiner only if a donor was not on the first's list yet.
    joiners = []
    while set(refusals()) != set(STATE_VARIANTS) and len(joiners) < 2:
        joiners.append(joiner := start_peer(processes, f"joiner{len(joiners)}", config, maddr))
        wait_until(lambda: events(joiner, "state_loaded"), 120, f"joiner {len(joiners) - 1} to load the state")
        loaded = events(joiner, "state_loaded")[0]
        assert loaded["donor"] in honest, loaded  # an honest peer's state: the swarm's, or the joiner's before it
        honest.add(loaded["peer_id"])
    reasons = refusals()
    assert set(reasons) == set(STATE_VARIANTS), reasons
    *malformed, (unvouched, reason) = [(name, reasons[name]) for name in STATE_VARIANTS]
    assert all(r.startswith("malformed") for _, r in malformed), reasons
    assert reason.startswith("other state"), (unvouched, reason)
    assert hostile.poll() is None
    # each honest peer downloaded the poisoned state one step ahead, found it is no outer step from its
    # own, and refused it; no peer, joiners included, ever held it
    refused = lambda: {r["peer_id"]: r for path in metrics for r in read_metrics(path)  # noqa: E731
                       if r["event"] == "state_refused" and r.get("donor") == poisoner}
    wait_until(lambda: len(refused()) == len(metrics), 120, "every honest peer to refuse the poisoned state")
    for record in refused().values():
        assert record["target_sha256"] == poisoned and record["claimed_by"] == [claimant], record
        assert "is not θ − η·(g + μ·b')" in record["reason"] or "fails the update check" in record["reason"], record
    keeps_stepping(processes, [*metrics, *joiners], steps=2)
    for path in [*metrics, *joiners]:
        assert poisoned not in {r.get("global_sha256") for r in read_metrics(path)}, f"{path.name} took the poison"
