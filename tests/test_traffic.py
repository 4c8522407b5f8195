"""Every byte counted (p2p_diloco/traffic.py): the counters by phase, shared with a forked process as the
averager's, and the phases counted in the peer's own process on real DHT nodes of run "test" on 127.0.0.1:
the round reports (commit), the progress records (records) and the liveness probes (probes). The
all-reduce's and the audit's bytes are checked on real rounds (tests/test_exact_allreduce.py,
tests/test_reducer_audit.py)."""

import multiprocessing as mp

import pytest

from p2p_diloco.swarm.liveness import PROBE_BYTES, answering
from p2p_diloco.swarm.node import start_run_node, visible_maddrs
from p2p_diloco.swarm.records import RecordPublisher, RoundReportsValue, rounds_key, signed_records
from p2p_diloco.sync.commit import RoundReports
from p2p_diloco.traffic import PHASES, TrafficCounters, stored_bytes, traffic_of

pytestmark = pytest.mark.timeout(120)


def _add_in_child(counters: TrafficCounters) -> None:
    counters.add(sent=100, received=7, phase="audit")


def test_the_counters_add_up_by_phase_across_processes():
    counters = TrafficCounters()
    counters.add(sent=10, received=20)  # the all-reduce's, by default
    counters.add(sent=1, phase="records")
    child = mp.get_context("fork").Process(target=_add_in_child, args=(counters,))
    child.start()
    child.join(timeout=30)
    assert child.exitcode == 0
    by_phase = counters.by_phase()
    assert list(by_phase) == list(PHASES)
    assert by_phase["allreduce"] == {"sent": 10, "received": 20}
    assert by_phase["audit"] == {"sent": 100, "received": 7} and by_phase["records"] == {"sent": 1, "received": 0}
    assert (counters.sent, counters.received) == (111, 27)
    with pytest.raises(ValueError):
        counters.add(sent=1, phase="gossip")


@pytest.fixture
def nodes():
    started = [start_run_node("test", "127.0.0.1", 0)]
    try:
        started.append(start_run_node("test", "127.0.0.1", 0, initial_peers=visible_maddrs(started[0].dht)))
        yield started
    finally:
        for node in started:
            node.dht.shutdown()


def test_reports_records_and_probes_are_counted_each_in_its_phase(nodes):
    mine, other = nodes
    counted = traffic_of(mine.dht)
    assert traffic_of(mine.dht) is counted and traffic_of(other.dht) is not counted  # one set per node

    # commit: this peer's report stored (its bytes as handed to the DHT), the reports read back
    RoundReports(mine.dht, "test", ttl=30.0, record_subkey=mine.identity.record_subkey).publish(
        3, "00" * 8, complete=True, mean_sha256="ab" * 32)
    commit = counted.by_phase()["commit"]
    report = {"reports": [dict(outer_step=3, token="00" * 8, complete=True, mean_sha256="ab" * 32,
                               inputs={}, outputs={}, audits={})]}
    assert commit == {"sent": stored_bytes(rounds_key("test"), mine.identity.record_subkey, report), "received": 0}
    assert len(list(signed_records(mine.dht, rounds_key("test"), RoundReportsValue, "round report", "commit"))) == 1
    assert counted.by_phase()["commit"]["received"] > len(mine.identity.record_subkey)

    # records: a record stored, and read back; nothing of it counts as a report
    value = {"anything": 1}
    publisher = RecordPublisher(mine.dht, "traffic_test", mine.identity.record_subkey, ttl=30.0, what="test")
    try:
        publisher.publish(value, keep_fresh=False)
    finally:
        publisher.close()
    records = counted.by_phase()["records"]
    assert records["sent"] == stored_bytes("traffic_test", mine.identity.record_subkey, value)
    list(signed_records(mine.dht, "traffic_test", RoundReportsValue, "test record"))  # not a report: read all the same
    assert counted.by_phase()["records"]["received"] > 0

    # probes: each peer asked
    assert answering(mine.dht, [other.dht.peer_id.to_base58()]) == {other.dht.peer_id.to_base58()}
    assert counted.by_phase()["probes"] == {"sent": PROBE_BYTES, "received": 0}
    assert counted.by_phase()["allreduce"] == {"sent": 0, "received": 0}
    assert traffic_of(other.dht).by_phase()["commit"] == {"sent": 0, "received": 0}
