"""Can the swarm dial this node? A dial-back check at start-up, and what a node does with the answer.

Most volunteers sit behind a home router, a CGNAT or a firewall: they can dial out, and nobody can
dial in. A node learns which it is by asking other nodes to dial it back (:func:`probe`). Every
p2p-diloco node, bootstrap nodes included, answers such requests (:func:`serve_dial_back`): it opens
a plain TCP connection to the address it sees the requester's connection come from, at the ports
the requester listens on. A dial-back never goes anywhere else, so a request cannot turn a node into
a scanner of third parties. The requester is directly reachable only if every node that answered
could dial it: a helper on the same LAN alone does not make it reachable from the internet.

An unreachable node runs as a DHT client and averages as hivemind's client: every connection it
needs, it dials itself (see :mod:`p2p_diloco.swarm.node` and docs/network.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from functools import partial
from typing import Optional, Sequence

from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2PContext
from hivemind.utils.multiaddr import Multiaddr

from p2p_diloco.swarm.handlers import ask_many, serve

logger = logging.getLogger(__name__)

DIAL_BACK = "p2p_diloco.dial_back"  # the handler's name on every node
DIAL_TIMEOUT_S = 3.0
MAX_PORTS = 4

DIRECT, UNREACHABLE = "direct", "unreachable"


@dataclass(frozen=True)
class Reachability:
    """What a node found out about how others reach it."""

    mode: str  # DIRECT, or UNREACHABLE: others reach it only over connections it opened itself
    detail: str  # how it was found, for the log line and the metrics

    @property
    def can_reduce(self) -> bool:
        """Others can dial it: it can reduce parts, lead groups and serve its state."""
        return self.mode == DIRECT

    def summary(self, port: int) -> str:
        """One line for the user: what the node found, what it does, and how to become reachable."""
        if self.can_reduce:
            return f"reachable from the swarm ({self.detail}): reduces parts, can lead groups and serves its state"
        return (f"not reachable from the swarm ({self.detail}): averaging as a client (it sends its parts to "
                f"reachable reducers, reduces none and serves no state); to reduce for others, open TCP port "
                f"{port or 31337} to this machine and pass --port {port or 31337} --announce-ip <your public IP>")


def _ip_and_ports(maddrs: Sequence[Multiaddr]) -> tuple[set[str], set[int]]:
    """The IP addresses and TCP ports in direct (not relayed) multiaddrs."""
    ips, ports = set(), set()
    for maddr in maddrs:
        text = str(maddr)
        if "/p2p-circuit" in text:
            continue
        parts = text.split("/")
        for proto, value in zip(parts[1::2], parts[2::2]):
            if proto in ("ip4", "ip6"):
                ips.add(value)
            elif proto == "tcp" and value.isdigit():
                ports.add(int(value))
    return ips, ports


async def _can_connect(ip: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), DIAL_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


async def _answer_dial_back(request: bytes, context: P2PContext, node: DHTNode) -> bytes:
    """Dial the requester back at the IPs its connections come from, at the ports it asks for."""
    try:
        ports = json.loads(request)["ports"]
        assert isinstance(ports, list) and 0 < len(ports) <= MAX_PORTS
        assert all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports)
    except Exception:  # a stranger's request: answer nothing
        return json.dumps({"reached": [], "error": "malformed request"}).encode()
    peers = await node.p2p.list_peers()
    observed = [addr for info in peers if info.peer_id == context.remote_id for addr in info.addrs]
    ips, _ = _ip_and_ports(observed)
    targets = [(ip, port) for ip in sorted(ips) for port in ports]
    reached = await asyncio.gather(*(_can_connect(ip, port) for ip, port in targets))
    answer = {"reached": [f"{ip}:{port}" for (ip, port), ok in zip(targets, reached) if ok],
              "tried": [f"{ip}:{port}" for ip, port in targets]}
    return json.dumps(answer).encode()


def serve_dial_back(dht: DHT) -> None:
    """Answer other nodes' dial-back requests (the handler runs in the DHT's own process)."""
    serve(dht, DIAL_BACK, _answer_dial_back)


def _parse_answer(reply: Optional[bytes]) -> Optional[dict]:
    try:
        answer = json.loads(reply) if reply is not None else None
    except ValueError:
        return None
    return answer if isinstance(answer, dict) and isinstance(answer.get("reached"), list) else None


async def _ask_dial_back(_dht: DHT, node: DHTNode, helpers: Sequence[str], timeout: float) -> dict:
    _, ports = _ip_and_ports(await node.p2p.get_visible_maddrs(latest=True))
    request = json.dumps({"ports": sorted(ports)[:MAX_PORTS]}).encode()
    replies = await ask_many(node, helpers, DIAL_BACK, request, timeout)
    return {"ports": sorted(ports), "answers": {helper: _parse_answer(reply) for helper, reply in replies.items()}}


def probe(dht: DHT, helpers: Sequence[str], timeout: float = 2 * DIAL_TIMEOUT_S + 2) -> Optional[Reachability]:
    """Ask `helpers` (peer IDs) to dial this node back. DIRECT if every helper that answered reached
    it, UNREACHABLE if one could not; None if nobody answered (then nothing is known)."""
    helpers = [h for h in dict.fromkeys(helpers) if h != dht.peer_id.to_base58()]
    if not helpers:
        return None
    found = dht.run_coroutine(partial(_ask_dial_back, helpers=helpers, timeout=timeout))
    answered = {helper: answer for helper, answer in found["answers"].items() if answer is not None}
    if not answered:
        return None
    ports = ", ".join(map(str, found["ports"])) or "none"
    failed = [helper for helper, answer in answered.items() if not answer["reached"]]
    if failed:
        return Reachability(UNREACHABLE, f"{len(failed)} of {len(answered)} peers could not dial TCP port(s) {ports} "
                                         f"back (asked {', '.join(h[-8:] for h in answered)})")
    return Reachability(DIRECT, f"{len(answered)} peer(s) dialed TCP port(s) {ports} back")
