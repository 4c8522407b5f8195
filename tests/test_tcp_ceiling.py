"""benchmarks/tcp_ceiling.py, the all-reduce benchmark's plain-TCP probe: every peer sends and receives
the bytes of the pattern it names, on loopback."""

from __future__ import annotations

import threading
import time

import pytest

from benchmarks.tcp_ceiling import PATTERNS, Sink, bytes_per_destination, destinations, probe

PEERS = 3
S_BYTES = 300_000  # S_codec: each peer sends 2(N−1)/N of it


def test_every_peer_sends_and_receives_the_same_share_in_each_pattern():
    for pattern in PATTERNS:
        incoming = [sum(me in destinations(pattern, j, PEERS) for j in range(PEERS)) for me in range(PEERS)]
        assert incoming == [len(destinations(pattern, 0, PEERS))] * PEERS
        assert all(me not in destinations(pattern, me, PEERS) for me in range(PEERS))
        total = bytes_per_destination(pattern, PEERS, S_BYTES) * len(destinations(pattern, 0, PEERS))
        assert total == pytest.approx(2 * (PEERS - 1) / PEERS * S_BYTES, abs=PEERS)
    with pytest.raises(ValueError, match="unknown pattern"):
        destinations("broadcast", 0, PEERS)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_probe_moves_every_byte_of_its_pattern(pattern):
    sinks = [Sink("127.0.0.1", 0) for _ in range(PEERS)]
    addresses = [("127.0.0.1", sink.port) for sink in sinks]
    start = time.time() + 0.5
    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    def run(me: int) -> None:
        try:
            results[me] = probe(sinks[me], pattern, me, addresses, S_BYTES, f"test-{pattern}", start, 30.0)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(me,)) for me in range(PEERS)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(45)
    finally:
        for sink in sinks:
            sink.close()
    assert not errors and sorted(results) == list(range(PEERS))
    share = bytes_per_destination(pattern, PEERS, S_BYTES)
    flows = len(destinations(pattern, 0, PEERS))
    for result in results.values():
        assert result["sent"] == result["received"] == share * flows
        assert len(result["flow_ends"]) == flows
        assert result["start"] == start <= result["flow_ends"][0] <= result["end"] == result["flow_ends"][-1]


def test_a_tag_longer_than_the_header_is_refused():
    sink = Sink("127.0.0.1", 0)
    try:
        with pytest.raises(ValueError, match="longer than"):
            probe(sink, "all-to-all", 0, [("127.0.0.1", sink.port)] * PEERS, S_BYTES, "x" * 40, time.time(), 5.0)
    finally:
        sink.close()
