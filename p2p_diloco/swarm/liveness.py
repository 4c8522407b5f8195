"""Is a peer still there? A request that any live node answers at once, even mid inner step.

A peer's progress record outlives the peer by up to ``progress_ttl``: a peer SIGKILLed while
training still reads "training" until it expires, and its groupmates would wait for it until
``round_wait_timeout``. Every node therefore answers :data:`ALIVE` requests (from its DHT process,
which keeps running while the training thread computes), and a peer that waits for groupmates asks
the ones it waits for (:meth:`p2p_diloco.swarm.progress.SwarmProgress.wait_for_groupmates`). A peer
that does not answer twice in a row has left or crashed; a slow live peer answers and is waited for.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial

from google.protobuf.wrappers_pb2 import BytesValue
from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2PContext, PeerID

logger = logging.getLogger(__name__)

ALIVE = "p2p_diloco.alive"  # the handler's name on every node
ANSWER_TIMEOUT_S = 2.0


async def _answer(_request: BytesValue, _context: P2PContext) -> BytesValue:
    return BytesValue()


async def _register(_dht: DHT, node: DHTNode) -> None:
    await node.p2p.add_protobuf_handler(ALIVE, _answer, BytesValue)


def serve_alive(dht: DHT) -> None:
    """Answer other nodes' ALIVE requests (in the DHT's own process)."""
    dht.run_coroutine(_register)


async def _ask(_dht: DHT, node: DHTNode, peer_id: str, timeout: float) -> bool:
    try:
        await asyncio.wait_for(
            node.p2p.call_protobuf_handler(PeerID.from_base58(peer_id), ALIVE, BytesValue(), BytesValue), timeout)
        return True
    except Exception as e:  # refused, timed out, no route: the same answer, it is not there
        logger.debug("no answer from %s: %r", peer_id, e)
        return False


def answers(dht: DHT, peer_id: str, timeout: float = ANSWER_TIMEOUT_S) -> bool:
    """Whether `peer_id` answers within `timeout` s (a peer that nobody can dial may not: ask only
    peers that others reach)."""
    return dht.run_coroutine(partial(_ask, peer_id=peer_id, timeout=timeout))
