"""The bytes a peer sends and receives, by phase of the protocol, counted where our code hands them over.

Every phase counts at the boundary of our code, not on the wire: what it gives hivemind to send and
what hivemind gives it back. So the counts leave out protobuf and libp2p framing, TCP/IP headers,
the DHT's own routing (its lookups, pings and replication of others' records) and libp2p's own
traffic (identify, relays, hole punching); an outside count (at a router) is higher by those.

=============  ====================================================================================
phase          what is counted
=============  ====================================================================================
``allreduce``  the encoded tensor parts: this peer's inputs to the reducers and the averaged parts
               back, and as a reducer the parts it got and the results it sent (and what it relays)
``commit``     the round reports (:mod:`p2p_diloco.sync.commit`): the msgpack bytes of this peer's
               report stored, and of every report read back
``audit``      the spot checks (:mod:`p2p_diloco.sync.audit`): the request, the hash lists and the
               sampled chunks, as protobuf messages, by the auditor and by the reducer
``state``      θ_global and the outer optimizer's state served, downloaded or pushed
               (:mod:`p2p_diloco.sync.state_transfer`), and the DHT records that name its donors
``records``    the run's progress and status records (:mod:`p2p_diloco.swarm.records`): the msgpack
               bytes of each value stored and of each value read
``probes``     the liveness checks of a silent groupmate (:mod:`p2p_diloco.swarm.liveness`): the
               request and reply of each probe
=============  ====================================================================================

The counters live in shared memory, created before hivemind's averager forks its process, so the
averager (all-reduce, audit, state) and the peer's own process (records, reports, probes) add to the
same totals. Each DHT node has one set (:func:`traffic_of`): the peers of an in-process test keep
theirs apart.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
from typing import Any, Optional

from hivemind.utils.serializer import MSGPackSerializer

PHASES = ("allreduce", "commit", "audit", "state", "records", "probes")


class TrafficCounters:
    """Bytes sent and received by this peer, per phase of :data:`PHASES`, shared across processes."""

    def __init__(self):
        self._counts = mp.Array(ctypes.c_int64, 2 * len(PHASES))  # sent, received of each phase in turn

    def add(self, sent: int = 0, received: int = 0, phase: str = "allreduce") -> None:
        index = 2 * PHASES.index(phase)
        with self._counts.get_lock():
            self._counts[index] += sent
            self._counts[index + 1] += received

    @property
    def sent(self) -> int:
        """Bytes sent in every phase."""
        return sum(self._counts[0::2])

    @property
    def received(self) -> int:
        """Bytes received in every phase."""
        return sum(self._counts[1::2])

    def by_phase(self) -> dict[str, dict[str, int]]:
        """phase -> {"sent": bytes, "received": bytes}, since this peer started (the metrics' ``bytes_by_phase``)."""
        counts = self._counts[:]
        return {phase: {"sent": counts[2 * i], "received": counts[2 * i + 1]} for i, phase in enumerate(PHASES)}


def traffic_of(dht) -> TrafficCounters:
    """The counters of the peer whose DHT node is `dht`, made on first use; the averager takes them in its
    constructor, before it forks (see the module's docstring). None as `dht` gets counters of its own."""
    if dht is None:
        return TrafficCounters()
    counters = getattr(dht, "_p2p_diloco_traffic", None)
    if counters is None:
        counters = TrafficCounters()
        dht._p2p_diloco_traffic = counters
    return counters


def stored_bytes(key: str, subkey: Optional[bytes], value: Any) -> int:
    """What our code hands the DHT to store: the key, the subkey and the value, in msgpack (as the DHT sends it)."""
    return len(key) + len(subkey or b"") + len(MSGPackSerializer.dumps(value))


def found_bytes(found: Any) -> int:
    """What the DHT hands back of a read (:meth:`DHT.get`'s result): each subkey and its value, in msgpack."""
    if found is None:
        return 0
    value = getattr(found, "value", found)
    if not isinstance(value, dict):
        return len(MSGPackSerializer.dumps(value))
    return sum((len(subkey) if isinstance(subkey, bytes) else len(MSGPackSerializer.dumps(subkey)))
               + len(MSGPackSerializer.dumps(getattr(item, "value", item))) for subkey, item in value.items())


def counted_store(dht, key: str, value: Any, subkey: Optional[bytes], expiration_time: float, phase: str) -> bool:
    """``dht.store``, its bytes (:func:`stored_bytes`) counted in `phase`."""
    traffic_of(dht).add(sent=stored_bytes(key, subkey, value), phase=phase)
    return dht.store(key, value=value, subkey=subkey, expiration_time=expiration_time)


def counted_get(dht, key: str, phase: str) -> Any:
    """``dht.get(key, latest=True)``, the key sent and what came back (:func:`found_bytes`) counted in `phase`."""
    found = dht.get(key, latest=True)
    traffic_of(dht).add(sent=len(key), received=found_bytes(found), phase=phase)
    return found
