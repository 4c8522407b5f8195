"""The progress records on a simulated DHT: stores that land late, reads that lag or miss, TTL expiry, partitions.

Each author's records are kept in the order stored, each with the time it lands. A read by a peer returns,
for each author, the newest record that landed at least the reader's read delay ago, unless this read misses
it (a DHT node that answered too late); a record expires `ttl` seconds after its author's last store while
the author is alive (a live publisher keeps its record fresh), and `ttl` after its last store once it is gone.
A partition hides the authors on the other side. Every draw comes from the simulation's seeded generator.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from p2p_diloco.protocol.view import PeerProgress


@dataclass
class Faults:
    """What the simulated network does to records until `quiet_at` (virtual seconds); nothing after it."""

    store_delay_s: float = 0.3  # a store lands up to this late
    read_delay_s: float = 0.5  # a reader sees records up to this old (drawn per reader)
    miss: float = 0.05  # the chance that one read misses one record
    quiet_at: float = math.inf


@dataclass
class _Stored:
    record: PeerProgress
    lands: float


@dataclass
class SimDHT:
    rng: random.Random
    faults: Faults
    ttl: float
    _records: dict[str, list[_Stored]] = field(default_factory=dict)
    _gone_at: dict[str, float] = field(default_factory=dict)  # author -> when it stopped refreshing
    read_delays: dict[str, float] = field(default_factory=dict)
    partition: dict[str, int] = field(default_factory=dict)  # peer -> its side; absent: side 0
    stores: int = 0
    reads: int = 0

    def store(self, record: PeerProgress, now: float) -> None:
        delay = self.rng.uniform(0, self.faults.store_delay_s) if now < self.faults.quiet_at else 0.0
        stored = self._records.setdefault(record.peer_id, [])
        stored.append(_Stored(record, now + delay))
        del stored[:-8]  # older stores have landed long before these: no read returns them
        self._gone_at.pop(record.peer_id, None)
        self.stores += 1

    def gone(self, author: str, now: float) -> None:
        """`author` stopped refreshing its record (it crashed or left): the record expires `ttl` later."""
        self._gone_at[author] = now

    def read_delay(self, reader: str) -> float:
        if reader not in self.read_delays:
            self.read_delays[reader] = self.rng.uniform(0, self.faults.read_delay_s)
        return self.read_delays[reader]

    def read(self, reader: str, now: float) -> list[tuple[PeerProgress, float]]:
        """(record, its expiration) as `reader` reads them at `now`."""
        self.reads += 1
        faulty = now < self.faults.quiet_at
        seen_until = now - (self.read_delay(reader) if faulty else 0.0)
        side = self.partition.get(reader, 0)
        found = []
        for author, stored in self._records.items():
            if self.partition.get(author, 0) != side and author != reader:
                continue
            landed = [(s.record.time, order, s) for order, s in enumerate(stored) if s.lands <= seen_until]
            if not landed or (faulty and author != reader and self.rng.random() < self.faults.miss):
                continue
            newest = max(landed)[2]  # the one stored last: a DHT keeps the later expiration, not the later arrival
            gone = self._gone_at.get(author)
            expiration = math.inf if gone is None else gone + self.ttl
            found.append((newest.record, expiration))
        return found
