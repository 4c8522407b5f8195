"""A member waits for its groupmates' round reports (p2p_diloco/sync/commit.py): a groupmate that crashed before
its report costs one detection (it does not answer on the network twice), not ``commit_timeout``.

Real DHT nodes of run "test" on 127.0.0.1, each answering ALIVE requests as every run node does; a groupmate
"crashes" by shutting its node down.
"""

import functools
import threading

import pytest

from p2p_diloco.swarm.liveness import answering
from p2p_diloco.swarm.node import start_run_node, visible_maddrs
from p2p_diloco.sync.commit import RoundReports

pytestmark = pytest.mark.timeout(120)

MEAN = "ab" * 32
STEP, TOKEN = 3, "00" * 8
COMMIT_TIMEOUT_S = 60.0  # far above what one detection takes: the void's reason says which ended the wait


@pytest.fixture
def nodes():
    started = [start_run_node("test", "127.0.0.1", 0)]
    try:
        for _ in range(2):
            started.append(start_run_node("test", "127.0.0.1", 0, initial_peers=visible_maddrs(started[0].dht)))
        yield started
    finally:
        for node in started:
            node.dht.shutdown()


def reports_of(node) -> RoundReports:
    return RoundReports(node.dht, "test", ttl=30.0, record_subkey=node.identity.record_subkey,
                        answering=functools.partial(answering, node.dht))


def test_a_groupmate_that_crashed_before_its_report_voids_the_round_at_once(nodes):
    mine, alive, crashed = nodes
    ids = [node.dht.peer_id.to_base58() for node in nodes]
    reports_of(alive).publish(STEP, TOKEN, complete=True, mean_sha256=MEAN)
    crashed.dht.shutdown()
    tokens = {ids[1]: TOKEN, ids[2]: TOKEN}
    void, found = reports_of(mine).agree(STEP, tokens, MEAN, COMMIT_TIMEOUT_S, threading.Event(),
                                         dialable=[ids[1], ids[2]])
    assert void is not None and "does not answer on the network" in void.reason and ids[2][-8:] in void.reason, void
    assert set(found) == {ids[1]}


def test_a_groupmate_nobody_can_dial_is_waited_for_until_the_timeout(nodes):
    """A peer behind NAT may not answer a request: its silence says nothing, so only the timeout ends the wait."""
    mine, alive, crashed = nodes
    ids = [node.dht.peer_id.to_base58() for node in nodes]
    reports_of(alive).publish(STEP, TOKEN, complete=True, mean_sha256=MEAN)
    crashed.dht.shutdown()
    void, _ = reports_of(mine).agree(STEP, {ids[1]: TOKEN, ids[2]: TOKEN}, MEAN, 5.0, threading.Event(),
                                     dialable=[ids[1]])
    assert void is not None and "no report from 1 groupmate(s) within 5 s" in void.reason, void


def test_every_report_in_agrees_without_asking_anyone(nodes):
    mine, alive, other = nodes
    ids = [node.dht.peer_id.to_base58() for node in nodes]
    for node in (alive, other):
        reports_of(node).publish(STEP, TOKEN, complete=True, mean_sha256=MEAN)
    asked = []
    reports = RoundReports(mine.dht, "test", ttl=30.0, record_subkey=mine.identity.record_subkey,
                           answering=lambda peers: asked.extend(peers) or set())
    void, found = reports.agree(STEP, {ids[1]: TOKEN, ids[2]: TOKEN}, MEAN, COMMIT_TIMEOUT_S, threading.Event(),
                                dialable=ids[1:])
    assert void is None and set(found) == set(ids[1:]) and not asked
