"""Is a peer still there? A request that any live node answers at once, even mid inner step.

A peer's progress record outlives the peer by up to ``progress_ttl``: a peer SIGKILLed while
training still reads "training" until it expires, and its groupmates would wait for it until
``round_wait_timeout``. Every node therefore answers :data:`ALIVE` requests (from its DHT process,
which keeps running while the training thread computes), and a peer that waits for groupmates asks
the ones it waits for (:meth:`p2p_diloco.swarm.progress.SwarmProgress.wait_for_groupmates`), as does a
member that waits for its groupmates' round reports (:mod:`p2p_diloco.sync.commit`). A peer that does not
answer twice in a row has left or crashed (:class:`SilentPeers`); a slow live peer answers and is waited for.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Callable, Optional, Sequence

from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2PContext

from p2p_diloco.swarm.handlers import ask_many, serve

ALIVE = "p2p_diloco.alive"  # the handler's name on every node
ANSWER_TIMEOUT_S = 2.0


async def _answer(_request: bytes, _context: P2PContext, _node: DHTNode) -> bytes:
    return b""


def serve_alive(dht: DHT) -> None:
    """Answer other nodes' ALIVE requests (in the DHT's own process)."""
    serve(dht, ALIVE, _answer)


async def _ask(_dht: DHT, node: DHTNode, peer_ids: Sequence[str], timeout: float) -> set[str]:
    replies = await ask_many(node, peer_ids, ALIVE, b"", timeout)
    return {peer_id for peer_id, reply in replies.items() if reply is not None}


def answering(dht: DHT, peer_ids: Sequence[str], timeout: float = ANSWER_TIMEOUT_S) -> set[str]:
    """Those of `peer_ids` that answer within `timeout` s, all asked at once (a peer that nobody can
    dial may not answer: ask only peers that others reach). The DHT's process counts each probe, asked and
    answered (:mod:`p2p_diloco.swarm.dht_traffic`, phase ``probes``)."""
    if not peer_ids:
        return set()
    return dht.run_coroutine(partial(_ask, peer_ids=list(peer_ids), timeout=timeout))


class SilentPeers:
    """The peers a waiting peer stops waiting for: those that do not answer twice in a row, CHECK_PERIOD_S
    apart. Only peers that others can dial are asked (the caller says which): a peer behind NAT may not
    answer, and is waited for until the wait's timeout."""

    CHECK_PERIOD_S = 2.0
    MISSES = 2

    def __init__(self, answering: Optional[Callable[[list[str]], set[str]]], check_period_s: float = CHECK_PERIOD_S):
        self.answering = answering
        self.check_period_s = check_period_s
        self.gone: set[str] = set()
        self._misses: dict[str, int] = {}
        self._next_check = time.monotonic() + check_period_s

    def confirm(self, dialable: Sequence[str]) -> list[str]:
        """The peers among `dialable` that do not answer :data:`MISSES` times in a row, asked now and then every
        `check_period_s` while any of them is still silent (a bounded wait: ``MISSES`` asks of
        :data:`ANSWER_TIMEOUT_S` each); [] when this peer cannot ask."""
        missing = list(dialable)
        for ask in range(self.MISSES):
            if self.answering is None or not missing:
                return []
            if ask:
                time.sleep(self.check_period_s)
            answered = self.answering(missing)
            missing = [peer for peer in missing if peer not in answered]
        return missing

    def check(self, dialable: Sequence[str]) -> list[str]:
        """The peers among `dialable` (the waited-for peers that others can dial) found gone by this check
        (none between checks)."""
        if self.answering is None or time.monotonic() < self._next_check:
            return []
        self._next_check = time.monotonic() + self.check_period_s
        asked = list(dialable)
        answered = self.answering(asked) if asked else set()
        found = []
        for peer_id in asked:
            misses = 0 if peer_id in answered else self._misses.get(peer_id, 0) + 1
            self._misses[peer_id] = misses
            if misses >= self.MISSES:
                self.gone.add(peer_id)
                found.append(peer_id)
        return found
