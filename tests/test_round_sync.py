"""A round that applies nothing always says why: the swarm moved past it, this peer is stopping, or its
group averaged without it.

Two real DHT nodes on 127.0.0.1 with signed progress records; the round's sync reads them as a peer's would.
The first two cases never reach the all-reduce, so no averager is started; the third runs a real
averager in a process of its own (tests/left_behind_case.py).
"""

import hashlib
import json
import threading

import pytest

from p2p_diloco.swarm.progress import READY, TRAINING
from p2p_diloco.train.round_sync import ROUND_STOPPED, RoundSync
from tests.swarm_helpers import progress_pair, wait_until

pytestmark = pytest.mark.timeout(120)

FINGERPRINT = hashlib.sha256(b"settings").hexdigest()


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_a_round_not_applied_names_its_reason():
    with progress_pair(FINGERPRINT) as (nodes, progress):
        me = nodes[0].dht.peer_id.to_base58()
        progress[0].publish(3, sha("mine"), TRAINING)  # a peer's phases follow protocol.phases.TRANSITIONS
        progress[0].publish(3, sha("mine"), READY)
        progress[1].publish(4, sha("theirs"), TRAINING)  # the other peer applied outer step 4 already
        wait_until(lambda: len(progress[0].fetch()) == 2, 30, "both progress records")

        moved_past = RoundSync(progress[0], None, me, "direct", 10.0, threading.Event())(3, 0, [], 4, sha("mine"))
        assert moved_past.result is None and moved_past.event == "round_skipped"
        assert "the swarm moved past outer step 3" in moved_past.reason

        stopping = threading.Event()
        stopping.set()
        stopped = RoundSync(progress[0], None, me, "direct", 10.0, stopping)(3, 0, [], 4, sha("mine"))
        assert stopped.result is None and stopped.event == ROUND_STOPPED and "stopping" in stopped.reason


@pytest.mark.timeout(200)
def test_a_peer_its_group_left_behind_skips_the_round_while_it_matches(processes):
    """Both peers are ready at the step and both lead in the plan; the other one moves on without this
    one, which then skips the round (and catches up) instead of waiting out both leaders' windows and
    failing it."""
    case = processes.start("left-behind", module="tests.left_behind_case")
    assert case.wait(150) == 0, processes.log("left-behind")
    (line,) = [line for line in processes.log("left-behind").splitlines() if line.startswith('{"planned"')]
    outcome = json.loads(line)
    assert outcome["planned"], outcome
    assert outcome["event"] == "round_skipped", outcome
    assert "averaged without this peer while it was matching" in outcome["reason"], outcome
