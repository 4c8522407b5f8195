"""Small requests that every p2p-diloco node answers, beside the DHT: a name, bytes in, bytes out.

A handler runs in the node's DHT process, which keeps answering while the training thread
computes. It is registered with :func:`serve` and asked with :func:`ask_many`, which asks several
peers at once and reads any failure (refused, timed out, no route, an old version without the
handler) as no answer.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Awaitable, Callable, Optional, Sequence

from google.protobuf.wrappers_pb2 import BytesValue
from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2PContext, PeerID

logger = logging.getLogger(__name__)

# (request bytes, the requester's context, this node) -> reply bytes; module-level, so that it pickles
Handler = Callable[[bytes, P2PContext, DHTNode], Awaitable[bytes]]


async def _answer(request: BytesValue, context: P2PContext, node: DHTNode, handler: Handler) -> BytesValue:
    return BytesValue(value=await handler(request.value, context, node))


async def _register(_dht: DHT, node: DHTNode, name: str, handler: Handler) -> None:
    await node.p2p.add_protobuf_handler(name, partial(_answer, node=node, handler=handler), BytesValue)


def serve(dht: DHT, name: str, handler: Handler) -> None:
    """Answer the requests called `name` with `handler`, in the DHT's own process."""
    dht.run_coroutine(partial(_register, name=name, handler=handler))


async def ask_many(node: DHTNode, peer_ids: Sequence[str], name: str, request: bytes,
                   timeout: float) -> dict[str, Optional[bytes]]:
    """Each peer's reply to `request`, asked at once; None for a peer that did not answer in `timeout` s."""

    async def ask(peer_id: str) -> Optional[bytes]:
        try:
            reply = await asyncio.wait_for(node.p2p.call_protobuf_handler(
                PeerID.from_base58(peer_id), name, BytesValue(value=request), BytesValue), timeout)
            return reply.value
        except Exception as e:  # no answer: whatever the reason, the same to the caller
            logger.debug("no answer to %s from %s: %r", name, peer_id, e)
            return None

    return dict(zip(peer_ids, await asyncio.gather(*(ask(peer_id) for peer_id in peer_ids))))
