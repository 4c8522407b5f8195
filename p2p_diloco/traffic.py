"""The bytes a peer sends and receives, by phase of the protocol.

The tensors' streams (all-reduce, audit, state) count where our code hands bytes to hivemind and gets them
back. Everything that goes through the peer's DHT node (records, round reports, probes, and the DHT's own
requests) counts in the DHT's process, request by request, as it leaves and arrives
(:mod:`p2p_diloco.swarm.dht_traffic`): each copy of a write on each node that stores it, each node's answer
to a read, and what the node answers for other nodes. The counts leave out protobuf and libp2p framing,
encryption, TCP/IP headers and libp2p's own traffic (identify, its own routing); an outside count (at a
router) is higher by those.

=============  ====================================================================================
phase          what is counted
=============  ====================================================================================
``allreduce``  the encoded tensor parts: this peer's inputs to the reducers and the averaged parts
               back, and as a reducer the parts it got and the results it sent (and what it relays)
``commit``     the round reports (:mod:`p2p_diloco.sync.commit`): the DHT's requests about them, made
               and answered
``audit``      the spot checks (:mod:`p2p_diloco.sync.audit`): the request, the hash lists and the
               sampled chunks, as protobuf messages, by the auditor and by the reducer
``state``      θ_global and the outer optimizer's state served, downloaded or pushed
               (:mod:`p2p_diloco.sync.state_transfer`), and the DHT's requests about its donors
``records``    the run's progress and status records and the swarm's shared ones
               (:mod:`p2p_diloco.swarm.records`): the DHT's requests about them, made and answered
``probes``     the liveness checks (:mod:`p2p_diloco.swarm.liveness`), asked and answered
``dht``        the rest of the DHT's requests: its lookups and pings, hivemind's matchmaking keys, and
               other runs' records that the node stores and serves
=============  ====================================================================================

The counters live in shared memory, created before hivemind forks the DHT's and the averager's processes,
so the DHT (records, reports, probes), the averager (all-reduce, audit, state) and the peer's own process
add to the same totals. Each DHT node has one set (:func:`traffic_of`): the peers of an in-process test keep
theirs apart.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp

PHASES = ("allreduce", "commit", "audit", "state", "records", "probes", "dht")


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
