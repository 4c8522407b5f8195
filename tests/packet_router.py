"""The emulated internet's router: IPv4 packets between hosts' TUN devices, late by each pair's one-way delay.

    python -m tests.packet_router --plan PLAN.json --stats STATS.json   # started by tests/emulated_internet.py

One process holds one TUN file descriptor per host (passed to it open; their numbers are in the plan) and
moves every packet a host sends to the host that owns its destination address, unchanged:

    sent at t ──► the sender's uplink: a token bucket of `uplink_mbit`, `burst_bytes` deep, whose
                  queue holds `queue_ms` of its rate (a packet beyond it is dropped, as a full
                  home router drops it) ──► leaves at d ──► lost with probability `loss`, else
                  written to the receiver's TUN at d + the pair's one-way delay

Downlinks are not shaped (a home's downlink is several times its uplink). A pair's delay is constant, so
a flow's packets stay in order. :class:`Router` decides (time passed in, no I/O); :func:`serve` is the
loop around it. The router counts each host's bytes both ways, as IP packets (headers included) and as
their TCP/UDP payload (what the applications above TCP wrote: each TCP byte once, its retransmissions
counted apart), and how late it
wrote packets out (a busy CPU delays it), and writes them to the stats file every half second, when sent
SIGUSR1 (``seq`` goes up once written), and when it ends (SIGTERM or SIGINT).
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import select
import signal
import time
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

STATS_EVERY_S = 0.5
MAX_PACKET = 65536
READS_PER_TURN = 64  # packets read from one host before the others' turn
# real-time (SCHED_FIFO) priority of the router where allowed: the kernel's real-time throttling
# (sched_rt_runtime_us, 95 % by default) still leaves the rest of the CPU to the others
ROUTER_PRIORITY = 10


@dataclass
class Counters:
    """One host's traffic as the router saw it."""
    sent_bytes: int = 0  # IP packets the host put on its uplink, headers included
    sent_payload: int = 0  # their TCP/UDP payload, each TCP byte once (what the applications wrote)
    sent_retransmitted: int = 0  # TCP payload sent again (after a drop or a loss)
    received_bytes: int = 0  # IP packets delivered to the host
    received_payload: int = 0  # their TCP/UDP payload, each TCP byte once
    dropped: int = 0  # packets of the host's that its full uplink queue dropped
    dropped_syn: int = 0  # of those, TCP SYNs (a connection's opening, sent again only after 1, 2, 4, ... s)
    lost: int = 0  # packets of the host's lost on the way (the loss option)


def payload_length(packet: bytes) -> int:
    """The TCP or UDP payload of an IPv4 packet (0 for anything else, or a truncated packet)."""
    if len(packet) < 20:
        return 0
    ip_header = (packet[0] & 0x0F) * 4
    total = int.from_bytes(packet[2:4], "big")
    if packet[9] == 6 and len(packet) >= ip_header + 13:  # TCP: the header's length is its data offset
        return max(0, total - ip_header - (packet[ip_header + 12] >> 4) * 4)
    if packet[9] == 17:  # UDP
        return max(0, total - ip_header - 8)
    return 0


def is_syn(packet: bytes) -> bool:
    """Whether an IPv4 packet is a TCP SYN (a connection's first packet, or its answer: SYN-ACK)."""
    ip_header = (packet[0] & 0x0F) * 4
    return packet[9] == 6 and len(packet) > ip_header + 13 and bool(packet[ip_header + 13] & 0x02)


class FirstSeen:
    """Which TCP payload bytes are new: per flow (addresses and ports), the highest sequence number seen so
    far; a segment's bytes at or below it were seen before (a retransmission). Sequence numbers wrap at 2³²."""

    def __init__(self):
        self.top: dict[bytes, int] = {}

    def new_bytes(self, packet: bytes, payload: int) -> int:
        """How many of the packet's `payload` bytes were not seen before (all of them unless it is TCP)."""
        ip_header = (packet[0] & 0x0F) * 4
        if packet[9] != 6 or payload == 0:
            return payload
        flow = bytes(packet[12:20]) + bytes(packet[ip_header:ip_header + 4])
        end = (int.from_bytes(packet[ip_header + 4:ip_header + 8], "big") + payload) % 2**32
        top = self.top.get(flow)
        ahead = payload if top is None else ((end - top + 2**31) % 2**32) - 2**31
        if ahead > 0:
            self.top[flow] = end
        return max(0, min(payload, ahead))


class Uplink:
    """A token bucket of `mbit` Mbit/s holding `burst_bytes`, with a drop-tail queue of `queue_s` seconds.

    Kept as one time: `finish`, when the bucket's debt of packets accepted so far is paid. A packet of
    s bytes at `now` finishes at max(finish, now − burst) + s / rate (an idle link's bucket has refilled
    to its depth) and leaves at max(now, that): a burst leaves at once, a longer stream at the rate.
    A packet that would wait more than `queue_s` is dropped."""

    def __init__(self, mbit: float, burst_bytes: int, queue_s: float):
        self.bytes_per_s = mbit * 1e6 / 8
        self.burst_s = burst_bytes / self.bytes_per_s
        self.queue_s = queue_s
        self.finish = float("-inf")

    def departure(self, now: float, size: int) -> Optional[float]:
        """When a packet of `size` bytes handed over at `now` leaves, or None if the queue is full."""
        finish = max(self.finish, now - self.burst_s) + size / self.bytes_per_s
        if finish - now > self.queue_s:
            return None
        self.finish = finish
        return max(now, finish)


class Router:
    """Where and when each packet goes; `delay_s[i][j]` is the one-way delay from host i to host j."""

    def __init__(self, ips: Sequence[str], uplinks: Sequence[Uplink], delay_s: Sequence[Sequence[float]],
                 loss: float = 0.0, seed: int = 0):
        self.host_of = {bytes(int(part) for part in ip.split(".")): i for i, ip in enumerate(ips)}
        self.uplinks, self.delay_s, self.loss = list(uplinks), delay_s, loss
        self.random = random.Random(seed)
        self.counters = [Counters() for _ in ips]
        self.unroutable = 0  # packets to no host's address (or not IPv4)
        self.undelivered = 0  # packets a receiver's TUN refused
        self.late_s_max = self.late_s_sum = 0.0  # how late the loop wrote packets out (a busy CPU delays it)
        self.delivered_packets = 0
        self.first_sent, self.first_received = FirstSeen(), FirstSeen()

    def route(self, now: float, source: int, packet: bytes) -> Optional[tuple[float, int]]:
        """(the time it arrives, the receiving host) for a packet host `source` sent at `now`; None if it
        is dropped, lost or has nowhere to go."""
        counters = self.counters[source]
        counters.sent_bytes += len(packet)
        if len(packet) < 20 or packet[0] >> 4 != 4:
            self.unroutable += 1
            return None
        payload = payload_length(packet)
        new = self.first_sent.new_bytes(packet, payload)
        counters.sent_payload += new
        counters.sent_retransmitted += payload - new
        target = self.host_of.get(bytes(packet[16:20]))
        if target is None:
            self.unroutable += 1
            return None
        leaves = self.uplinks[source].departure(now, len(packet))
        if leaves is None:
            counters.dropped += 1
            counters.dropped_syn += is_syn(packet)
            return None
        if self.loss and self.random.random() < self.loss:
            counters.lost += 1
            return None
        return leaves + self.delay_s[source][target], target

    def delivered(self, target: int, packet: bytes, late_s: float = 0.0) -> None:
        self.delivered_packets += 1
        self.late_s_sum += late_s
        self.late_s_max = max(self.late_s_max, late_s)
        self.counters[target].received_bytes += len(packet)
        self.counters[target].received_payload += self.first_received.new_bytes(packet, payload_length(packet))

    def stats(self, names: Sequence[str]) -> dict:
        return dict(hosts={name: asdict(c) for name, c in zip(names, self.counters)}, unroutable=self.unroutable,
                    undelivered=self.undelivered, late_ms_max=round(1000 * self.late_s_max, 3),
                    late_ms_mean=round(1000 * self.late_s_sum / max(1, self.delivered_packets), 3))


class _Signals:
    def __init__(self):
        self.stop = self.report = False
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        signal.signal(signal.SIGUSR1, self._report)

    def _stop(self, *_):
        self.stop = True

    def _report(self, *_):
        self.report = True


def write_stats(path: str, stats: dict) -> None:
    temporary = f"{path}.tmp"
    with open(temporary, "w") as f:
        json.dump(stats, f)
    os.replace(temporary, path)


def serve(fds: Sequence[int], names: Sequence[str], router: Router, stats_path: str) -> None:
    """Move packets until SIGTERM/SIGINT: read what each TUN has, write each packet out when it is due."""
    signals = _Signals()
    poller = select.epoll()
    for fd in fds:
        os.set_blocking(fd, False)
        poller.register(fd, select.EPOLLIN)
    source_of = {fd: i for i, fd in enumerate(fds)}
    in_flight: list[tuple[float, int, int, bytes]] = []  # (arrives, order, receiving host, packet)
    order = seq = 0
    next_stats = 0.0
    while not signals.stop:
        now = time.monotonic()
        wait = min(STATS_EVERY_S, max(0.0, in_flight[0][0] - now)) if in_flight else STATS_EVERY_S
        try:
            ready = poller.poll(wait)
        except InterruptedError:
            ready = []
        for fd, _ in ready:
            for _ in range(READS_PER_TURN):
                try:
                    packet = os.read(fd, MAX_PACKET)
                except BlockingIOError:
                    break
                routed = router.route(time.monotonic(), source_of[fd], packet)
                if routed is not None:
                    order += 1
                    heapq.heappush(in_flight, (routed[0], order, routed[1], packet))
        now = time.monotonic()
        while in_flight and in_flight[0][0] <= now:
            due, _, target, packet = heapq.heappop(in_flight)
            try:
                os.write(fds[target], packet)
                router.delivered(target, packet, now - due)
            except (BlockingIOError, OSError):
                router.undelivered += 1  # the receiver's TUN refused it
        if signals.report or now >= next_stats:
            seq += 1
            signals.report = False
            write_stats(stats_path, dict(router.stats(names), seq=seq, written=time.time()))
            next_stats = now + STATS_EVERY_S
    write_stats(stats_path, dict(router.stats(names), seq=seq + 1, written=time.time(), final=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, help="JSON: hosts (name, ip, fd, uplink_mbit), delay_ms, loss, "
                                                      "burst_bytes, queue_ms, seed")
    parser.add_argument("--stats", required=True, help="where the counters go (JSON, replaced as a whole)")
    args = parser.parse_args()
    with open(args.plan) as f:
        plan = json.load(f)
    hosts = plan["hosts"]
    try:  # a late router is extra delay on every packet: it runs before the peers whenever a packet is due
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(ROUTER_PRIORITY))
    except OSError:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, -5)
        except OSError:
            pass
    uplinks = [Uplink(h["uplink_mbit"], plan["burst_bytes"], plan["queue_ms"] / 1000) for h in hosts]
    delay_s = [[ms / 1000 for ms in row] for row in plan["delay_ms"]]
    router = Router([h["ip"] for h in hosts], uplinks, delay_s, plan["loss"], plan["seed"])
    serve([h["fd"] for h in hosts], [h["name"] for h in hosts], router, args.stats)


if __name__ == "__main__":
    main()
