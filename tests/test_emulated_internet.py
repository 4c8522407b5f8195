"""The emulated internet (tests/emulated_internet.py, tests/packet_router.py), and a swarm through it.

The router's decisions take the time as an argument: its token bucket, queue, delays, loss and counters are
checked without a clock. The swarm test runs the demo's model on 3 peers in two regions behind 20 Mbit/s
uplinks, one hash per outer step, and checks each peer's byte counts against the router's (issue 43: every
byte a peer sends or receives is in its metrics).
"""

import time
import tomllib

import pytest

from p2p_diloco.metrics import read_metrics
from tests import emulated_internet, netns
from tests.conftest import REPO
from tests.emulated_internet import Internet, Site, rtt_ms
from tests.packet_router import Router, Uplink, payload_length
from tests.swarm_helpers import FAST_TIMEOUTS, hashes_by_step, start_bootstrap, start_peer, tiny_config_file, wait_until


def ipv4(source: str, destination: str, payload: int, protocol: int = 6, seq: int = 0, tcp_flags: int = 0) -> bytes:
    """An IPv4 packet of `payload` bytes over a 20-byte header of `protocol` (6 TCP, from sequence number
    `seq`, with `tcp_flags`; 17 UDP: 8 bytes)."""
    inner = 20 if protocol == 6 else 8
    total = 20 + inner + payload
    header = bytes([0x45, 0]) + total.to_bytes(2, "big") + bytes(5) + bytes([protocol]) + bytes(2) + \
        bytes(int(p) for p in source.split(".")) + bytes(int(p) for p in destination.split("."))
    ports = (40000).to_bytes(2, "big") + (31337).to_bytes(2, "big")
    transport = ports + seq.to_bytes(4, "big") + bytes(4) + bytes([5 << 4, tcp_flags]) + bytes(6) if protocol == 6 \
        else bytes(8)
    return header + transport + bytes(payload)


def test_payload_is_what_is_above_tcp_or_udp():
    assert payload_length(ipv4("10.0.0.1", "10.0.0.2", 1448)) == 1448
    assert payload_length(ipv4("10.0.0.1", "10.0.0.2", 0)) == 0  # a pure ACK
    assert payload_length(ipv4("10.0.0.1", "10.0.0.2", 100, protocol=17)) == 100
    assert payload_length(b"\x45\x00") == 0


def test_each_tcp_byte_counts_once_and_a_retransmission_apart():
    ips = ["10.77.0.1", "10.77.0.2"]
    router = Router(ips, [Uplink(1000.0, 10**6, 1.0) for _ in ips], [[0.0, 0.0], [0.0, 0.0]])
    start = 2**32 - 1000  # the sequence numbers wrap after the first segment
    for seq, size in ((start, 1000), (0, 1000), (start, 1000), (500, 1000), (0, 0)):
        router.route(0.0, 0, ipv4(ips[0], ips[1], size, seq=seq))
    assert (router.counters[0].sent_payload, router.counters[0].sent_retransmitted) == (2500, 1500)


def test_an_uplink_sends_its_burst_at_once_then_paces_to_its_rate_and_drops_past_its_queue():
    link = Uplink(mbit=8.0, burst_bytes=3000, queue_s=0.0101)  # 1 MB/s: 1,000 bytes a millisecond
    assert [link.departure(0.0, 1000) for _ in range(3)] == [0.0, 0.0, 0.0]  # the bucket's 3,000 bytes
    assert link.departure(0.0, 1000) == pytest.approx(0.001)
    assert link.departure(0.0, 9000) == pytest.approx(0.010)  # waits 10 ms: about the queue's length
    assert link.departure(0.0, 1000) is None  # would wait 11 ms: dropped, and the bucket owes nothing for it
    assert link.departure(0.0105, 500) == pytest.approx(0.0105)
    assert link.departure(1.0, 3000) == pytest.approx(1.0)  # idle: full again


def test_the_router_counts_the_syns_a_full_queue_drops():
    """A connection's opening that a full queue drops is sent again only after 1, 2, 4, ... s: counted apart."""
    ips = ["10.77.0.1", "10.77.0.2"]
    router = Router(ips, [Uplink(8.0, 1000, 0.001) for _ in ips], [[0.0, 0.01], [0.01, 0.0]])
    syn, ack = 0x02, 0x10
    assert router.route(0.0, 0, ipv4(ips[0], ips[1], 960)) is not None  # the bucket's 1,000 bytes
    assert router.route(0.0, 0, ipv4(ips[0], ips[1], 960)) is not None  # waits 1 ms: the queue's length
    for flags in (syn, syn | ack, ack):
        assert router.route(0.0, 0, ipv4(ips[0], ips[1], 0, tcp_flags=flags)) is None
    assert (router.counters[0].dropped, router.counters[0].dropped_syn) == (3, 2)


def test_the_router_delivers_after_the_pairs_delay_counts_both_ends_and_loses_its_share():
    ips = ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    delay = [[0.01, 0.04, 0.08], [0.04, 0.01, 0.115], [0.08, 0.115, 0.01]]
    router = Router(ips, [Uplink(8.0, 1000, 0.2) for _ in ips], delay)
    packet = ipv4(ips[0], ips[2], 960)  # 1,000 bytes
    assert router.route(5.0, 0, packet) == (pytest.approx(5.08), 2)
    assert router.route(5.0, 0, ipv4(ips[0], ips[2], 960, seq=960)) == (pytest.approx(5.081), 2)  # at 1 MB/s
    router.delivered(2, packet)
    assert router.route(5.0, 1, ipv4(ips[1], "10.77.0.9", 10)) is None and router.unroutable == 1
    sent, received = router.counters[0], router.counters[2]
    assert (sent.sent_bytes, sent.sent_payload, received.received_bytes, received.received_payload) == \
        (2000, 1920, 1000, 960)
    lossy = Router(ips, [Uplink(1000.0, 10**6, 1.0) for _ in ips], delay, loss=0.25, seed=1)
    arrived = sum(lossy.route(0.0, 0, packet) is not None for _ in range(4000))
    assert lossy.counters[0].lost == 4000 - arrived and 900 < lossy.counters[0].lost < 1100


def test_round_trips_are_those_of_the_regions():
    assert [rtt_ms("us", "us"), rtt_ms("eu", "us"), rtt_ms("us", "asia"), rtt_ms("asia", "eu")] == [20, 80, 160, 230]
    with pytest.raises(ValueError, match="unknown region"):
        Internet([Site("a", "mars")])


# ----- a swarm through it -----------------------------------------------------------------------------
OUTER_STEPS = 3
BYTES_AGREE_WITHIN = 0.10


def demo_config(tmp_path):
    """The demo's model and data (peers/demo.toml), H = 10, on the tests' short timeouts."""
    demo = tomllib.loads((REPO / "peers" / "demo.toml").read_text())
    return tiny_config_file(tmp_path, model=demo["model"], data={**demo["data"], "max_documents": 60},
                            inner={"steps_per_outer": 10, "batch_size": 8}, swarm=FAST_TIMEOUTS)


def metrics_totals(metrics) -> tuple[int, int]:
    """(bytes sent, bytes received) of the peer's last record that counts them."""
    last = [r for r in read_metrics(metrics) if "bytes_sent" in r][-1]
    return last["bytes_sent"], last["bytes_received"]


def marked(*marks):
    def apply(test):
        for mark in marks:
            test = mark(test)
        return test
    return apply


@marked(pytest.mark.swarm, pytest.mark.timeout(420),
        *netns.required_marks("the emulated internet's swarm test", emulated_internet.unavailable))
def test_a_swarm_over_two_regions_agrees_every_step_and_counts_the_bytes_the_router_saw(processes, tmp_path):
    sites = [Site("bootstrap", "us"), Site("us0", "us"), Site("us1", "us"), Site("eu0", "eu")]
    config = demo_config(tmp_path)
    with Internet(sites, workdir=tmp_path / "internet") as internet:
        try:
            maddr = start_bootstrap(processes, internet.hosts["bootstrap"])
            peers = {name: start_peer(processes, name, config, maddr, "--max-outer-steps", str(OUTER_STEPS),
                                      "--wait-for-peers", "3", host=internet.hosts[name])
                     for name in ("us0", "us1", "eu0")}
            procs = [p for p in processes.procs if p.name in peers]
            wait_until(lambda: all(p.poll() is not None for p in procs), 360, f"{OUTER_STEPS} outer steps")
            assert [p.returncode for p in procs] == [0, 0, 0], [processes.log(p.name)[-2000:] for p in procs]
            counted = internet.counters()
        finally:
            processes.stop_all()  # every process in the namespaces stops before the namespaces go

    by_step = hashes_by_step(list(peers.values()))
    assert sorted(by_step) == list(range(1, OUTER_STEPS + 1)) and all(len(h) == 1 for h in by_step.values()), by_step
    # the router counts each byte above TCP once (libp2p's framing and the DHT's own traffic included, the
    # retransmissions apart); the metrics, what the peer counted: they agree within 10 % (issue 43). Bytes sent
    # are counted as the peer writes them, always. Bytes received are counted as the peer reads them: the parts
    # that groupmates sent to a peer for an attempt it had not joined yet (still training its lead) reach its
    # host but are never read (+25 % on us1 in one run), so a peer with a failed attempt is judged on its sent
    disagree = []
    for name, metrics in peers.items():
        failed = any(r["event"] in ("attempt_failed", "round_failed") for r in read_metrics(metrics))
        ours = dict(zip(("sent", "received"), metrics_totals(metrics)))
        router = dict(sent=counted[name].sent_payload, received=counted[name].received_payload)
        disagree += [f"{name} {way}: metrics {ours[way] / 1e6:.2f} MB, router {router[way] / 1e6:.2f} MB"
                     for way in ours if abs(ours[way] - router[way]) > BYTES_AGREE_WITHIN * router[way]
                     and not (failed and way == "received")]
    assert not disagree, "; ".join(disagree)


PAIRS = 2


@marked(pytest.mark.swarm, pytest.mark.timeout(240),
        *netns.required_marks("the emulated internet's dial test", emulated_internet.unavailable))
def test_two_peers_that_dial_each_other_at_once_over_a_long_round_trip_both_connect(processes, tmp_path):
    """Every pair of an all-reduce's group that had not spoken before dials each other as the all-reduce begins.
    libp2p dialed from the port it listens on (SO_REUSEPORT), so two such dials were one TCP connection opened
    from both ends at once, on which both ends began libp2p's handshake as its initiator, and failed: the pair
    lost its streams, and the round (5 of 7 runs of benchmarks/allreduce_bandwidth.py --regions with 4 peers).
    A node dials from a port of its own (swarm/node.py). Here both nodes of a pair dial at once, 230 ms apart."""
    pairs = [(f"eu{i}", f"asia{i}") for i in range(PAIRS)]
    sites = [Site(name, name.rstrip("0123456789")) for pair in pairs for name in pair]
    out = tmp_path / "dials"
    out.mkdir()
    with Internet(sites, workdir=tmp_path / "internet") as internet:
        try:
            for a, b in pairs:
                for name, other in ((a, b), (b, a)):
                    host = internet.hosts[name]
                    processes.start(name, "--ip", host.ip, "--dir", str(out), "--name", name, "--dial", other,
                                    module="tests.dial_at_once", netns=host.namespace)
            names = [name for pair in pairs for name in pair]
            wait_until(lambda: all((out / f"{name}.maddr").exists() for name in names), 90, "every node's address")
            (out / "go").write_text(str(time.time() + 1.0))
            wait_until(lambda: all((out / f"{name}.result").exists() for name in names), 60, "every node's dial")
            results = {name: (out / f"{name}.result").read_text() for name in names}
        finally:
            processes.stop_all()
    assert all(result == "answered" for result in results.values()), results
