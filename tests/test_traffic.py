"""Every byte counted (p2p_diloco/traffic.py): the counters by phase, shared with a forked process as the
averager's, and the phases counted in the DHT's process (swarm/dht_traffic.py) on real DHT nodes of run "test"
on 127.0.0.1: the round reports (commit), the progress records (records), the liveness probes (probes) and
the rest (dht). The all-reduce's and the audit's bytes are checked on real rounds (tests/test_exact_allreduce.py,
tests/test_reducer_audit.py)."""

import multiprocessing as mp

import pytest
from google.protobuf.wrappers_pb2 import BytesValue
from hivemind.dht.routing import DHTID
from hivemind.proto import dht_pb2
from hivemind.utils.serializer import MSGPackSerializer

from p2p_diloco.swarm.dht_traffic import KeyPhases, handler_phases
from p2p_diloco.swarm.liveness import ALIVE, answering
from p2p_diloco.swarm.node import start_run_node, visible_maddrs
from p2p_diloco.swarm.records import (ProgressValue, RecordPublisher, RoundReportsValue, progress_key, rounds_key,
                                      signed_records)
from p2p_diloco.sync.commit import RoundReports
from p2p_diloco.traffic import PHASES, TrafficCounters, traffic_of
from tests.swarm_helpers import wait_until

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


def test_a_request_counts_in_the_phase_of_its_first_key_or_its_handler():
    phases = KeyPhases({rounds_key("test"): "commit"}, handler_phases())
    phases.add({progress_key("test"): "records"})
    key = DHTID.generate(source=rounds_key("test")).to_bytes()
    other = DHTID.generate(source="elsewhere").to_bytes()
    assert phases.of("DHTProtocol.rpc_find", dht_pb2.FindRequest(keys=[key, other])) == "commit"
    assert phases.of("DHTProtocol.rpc_store", dht_pb2.StoreRequest(
        keys=[DHTID.generate(source=progress_key("test")).to_bytes()])) == "records"
    assert phases.of("DHTProtocol.rpc_find", dht_pb2.FindRequest(keys=[other, key])) == "dht"
    assert phases.of("DHTProtocol.rpc_ping", dht_pb2.PingRequest()) == "dht"
    assert phases.of(ALIVE, BytesValue()) == "probes" and phases.of("p2p_diloco.dial_back", BytesValue()) == "dht"
    assert set(handler_phases().values()) | {"dht"} <= set(PHASES)


@pytest.fixture
def nodes():
    started = [start_run_node("test", "127.0.0.1", 0)]
    try:
        started.append(start_run_node("test", "127.0.0.1", 0, initial_peers=visible_maddrs(started[0].dht)))
        yield started
    finally:
        for node in started:
            node.dht.shutdown()


def test_each_request_counts_on_both_nodes_in_the_phase_of_its_key(nodes):
    """Each DHT request counts in the DHT's process of the node that makes it and of the node that answers it
    (swarm/dht_traffic.py): what one counts sent, the other counts received."""
    mine, other = nodes
    counted, served = traffic_of(mine.dht), traffic_of(other.dht)
    assert traffic_of(mine.dht) is counted and served is not counted  # one set per node

    def mirrored(phase: str) -> bool:
        ours, theirs = counted.by_phase()[phase], served.by_phase()[phase]
        return ours["sent"] == theirs["received"] and ours["received"] == theirs["sent"]

    # commit: this peer's report, stored on the other node too, and the reports read back from it
    report = {"reports": [dict(outer_step=3, token="00" * 8, complete=True, mean_sha256="ab" * 32,
                               inputs={}, outputs={}, audits={})]}
    RoundReports(mine.dht, "test", ttl=30.0, record_subkey=mine.identity.record_subkey).publish(
        3, "00" * 8, complete=True, mean_sha256="ab" * 32)
    wait_until(lambda: mirrored("commit"), 10, "the report's store counted by both nodes")
    value_bytes = len(MSGPackSerializer.dumps(report))
    assert counted.by_phase()["commit"]["sent"] > value_bytes  # it went over in a request
    received = counted.by_phase()["commit"]["received"]
    assert len(list(signed_records(mine.dht, rounds_key("test"), RoundReportsValue, "round report"))) == 1
    wait_until(lambda: mirrored("commit"), 10, "the reports' read counted by both nodes")
    assert counted.by_phase()["commit"]["received"] > received + value_bytes  # the other node's answer held it

    # records: a read of the run's progress records (none yet) asks the other node
    list(signed_records(mine.dht, progress_key("test"), ProgressValue, "progress record"))
    wait_until(lambda: mirrored("records") and served.by_phase()["records"]["received"] > 0, 10,
               "the records' read counted by both nodes")

    # a key of no phase's: the DHT's own
    records, dht = counted.by_phase()["records"], counted.by_phase()["dht"]["sent"]
    publisher = RecordPublisher(mine.dht, "traffic_test", mine.identity.record_subkey, ttl=30.0, what="test")
    try:
        publisher.publish({"anything": "x" * 1000}, keep_fresh=False)
    finally:
        publisher.close()
    assert counted.by_phase()["records"] == records and counted.by_phase()["dht"]["sent"] > dht + 1000

    # probes: the other node asked, and its answer
    assert answering(mine.dht, [other.dht.peer_id.to_base58()]) == {other.dht.peer_id.to_base58()}
    wait_until(lambda: mirrored("probes"), 10, "the probe counted by both nodes")
    assert counted.by_phase()["probes"] == {"sent": len(ALIVE), "received": 0}  # its name and an empty message
    assert counted.by_phase()["allreduce"] == served.by_phase()["allreduce"] == {"sent": 0, "received": 0}
