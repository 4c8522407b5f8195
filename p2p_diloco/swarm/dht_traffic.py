"""The DHT's bytes, counted in the DHT's own process, request by request, in the phase of the key they are about.

A peer's DHT node runs in a process of its own (hivemind's ``DHT``), and every read and write of a record, by
whichever of the peer's processes, is made there, as requests to other nodes: the lookups that find a key's
nodes, a copy of each write to each of them (``num_replicas``: :data:`p2p_diloco.swarm.node.DHT_STORAGE`), and
for a read, the answer of every node asked that holds the key, each with the whole value it holds. The node
also answers other nodes' reads and writes. Counted where our code handed a value over (once per write, once
per read), a swarm of 8 peers of the 14.7M model over the emulated internet counted 15.2 MB sent per round and
its router saw 19.3 MB; its bootstrap node, which averages nothing, sent 11.4 MB in 3 rounds: the DHT's answers.

:func:`count_requests` wraps the request-response calls of every ``P2P`` in the process (hivemind's handle on
libp2p): each call this node makes and each one it answers adds its bytes (the handler's name and the protobuf
messages; libp2p's framing and encryption apart) to the peer's counters (:mod:`p2p_diloco.traffic`). A DHT
request about a key of :class:`KeyPhases` counts in that key's phase (a run's round reports in ``commit``, its
records in ``records``), a liveness probe in ``probes``, the rest in ``dht`` (lookups, pings, and other keys:
hivemind's matchmaking, other runs' records that this node stores and serves).
"""

from __future__ import annotations

import functools
from typing import Mapping, Optional

from google.protobuf.message import Message
from hivemind.dht.routing import DHTID
from hivemind.p2p import P2P

from p2p_diloco.traffic import TrafficCounters

DHT_HANDLERS = ("DHTProtocol.rpc_find", "DHTProtocol.rpc_store")  # whose requests name keys (`keys`)
OTHER = "dht"


class KeyPhases:
    """The phase (:data:`p2p_diloco.traffic.PHASES`) of each DHT key named in `phases` (key -> phase), and of the
    request-response handlers named in `handlers` (name -> phase); :data:`OTHER` for everything else."""

    def __init__(self, phases: Mapping[str, str], handlers: Mapping[str, str] = ()):
        self._by_id: dict[bytes, str] = {}
        self._handlers = dict(handlers)
        self.add(phases)

    def add(self, phases: Mapping[str, str]) -> None:
        """Count the requests about these keys (key -> phase) in their phase."""
        self._by_id.update({DHTID.generate(source=key).to_bytes(): phase for key, phase in dict(phases).items()})

    def of(self, handler: str, request: Message) -> str:
        """The phase of a request to `handler`: its first key's, for a DHT request."""
        if handler in DHT_HANDLERS:
            keys = getattr(request, "keys", ())
            return self._by_id.get(keys[0], OTHER) if keys else OTHER
        return self._handlers.get(handler, OTHER)


def handler_phases() -> dict[str, str]:
    """The phase of each of our request-response handlers that is not ``dht``'s."""
    from p2p_diloco.swarm.liveness import ALIVE

    return {ALIVE: "probes"}


def _size(message: Optional[Message]) -> int:
    return message.ByteSize() if isinstance(message, Message) else 0


def count_requests(counters: TrafficCounters, phases: KeyPhases) -> None:
    """Count every request-response call of this process's ``P2P`` objects, made or answered, in `counters`
    (streams are counted by those who use them: the averager's parts, the audit, the state). For the DHT's
    process only: it changes the ``P2P`` class of the process it runs in."""
    call, add = P2P.call_protobuf_handler, P2P.add_protobuf_handler

    @functools.wraps(call)
    async def counted_call(self, peer_id, name, input, output_protobuf_type):
        output = await call(self, peer_id, name, input, output_protobuf_type)
        if isinstance(input, Message):
            counters.add(sent=len(name) + _size(input), received=_size(output), phase=phases.of(name, input))
        return output

    @functools.wraps(add)
    async def counted_add(self, name, handler, input_protobuf_type, *, stream_input=False, stream_output=False,
                          balanced=False):
        if not (stream_input or stream_output):
            handler = _counted_handler(handler, name, counters, phases)
        return await add(self, name, handler, input_protobuf_type, stream_input=stream_input,
                         stream_output=stream_output, balanced=balanced)

    P2P.call_protobuf_handler, P2P.add_protobuf_handler = counted_call, counted_add


def _counted_handler(handler, name: str, counters: TrafficCounters, phases: KeyPhases):
    async def answer(request, context):
        response = await handler(request, context)
        counters.add(received=len(name) + _size(request), sent=_size(response), phase=phases.of(name, request))
        return response

    return answer
