"""Why a node could not join the swarm through its initial peers, in one line that names the cause.

p2pd reports only "failed to connect to bootstrap peers", and hivemind that an identity "is already
taken". After such a failure the node dials each initial peer once more from a bare daemon (about
0.2 s): libp2p's dial error says whether nothing listens at the address's host and port, whether a node
answers there under another peer ID than the address names (its security handshake names the real
one: a mistyped or stale address), or why else the host does not answer. When every initial peer
answers, the node asks the swarm whether another node already runs with its own identity key.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Optional, Sequence

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from p2p_diloco.swarm.identity import Identity, IdentityError

DIAL_TIMEOUT_S = 10.0  # a host that drops packets answers nothing: libp2p's own dial timeout is longer

_MISMATCH = re.compile(r"peer id mismatch: expected (\w+), but remote key matches (\w+)")


def join_failure(initial_peers: Sequence[str], identity: Identity, error: BaseException) -> Exception:
    """The error to raise for a node with `identity` that could not join through `initial_peers` (checked
    multiaddrs) with `error`: ConnectionError naming what each unanswering initial peer did, IdentityError if
    the swarm already has a node with this identity's key."""
    return asyncio.run(_join_failure(list(initial_peers), identity, error))


async def _join_failure(initial_peers: list[str], identity: Identity, error: BaseException) -> Exception:
    through = f"could not join the swarm through {', '.join(initial_peers)}"
    try:
        p2p = await P2P.create(dht_mode="client", no_listen=True, auto_nat=False, nat_port_map=False)
    except Exception:  # no daemon to ask: the error as it came
        return ConnectionError(f"{through}: {error}")
    try:
        causes = [cause for cause in [await dial(p2p, maddr) for maddr in initial_peers] if cause]
    finally:
        await p2p.shutdown()
    if causes:
        return ConnectionError(f"{through}: {'; '.join(causes)}")
    if identity.path is not None and await _identity_taken(identity.path, initial_peers):  # a fresh key is nobody's
        return IdentityError(
            f"--identity-path {str(identity.path)!r}: a node with this key's peer ID {identity.peer_id} is already in "
            f"the swarm (another process runs with this key); stop it, or give this node another --identity-path "
            f"(`join`: another --state-dir)")
    return ConnectionError(f"{through}: {error}")


async def dial(p2p: P2P, maddr: str) -> Optional[str]:
    """None if the node at `maddr` answers `p2p`'s dial as the address's peer ID, else what went wrong and what
    to do."""
    address = Multiaddr(maddr)
    peer_id = address.value_for_protocol("p2p")
    host_port = address.decapsulate(Multiaddr(f"/p2p/{peer_id}"))
    try:
        await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(peer_id), [host_port]), DIAL_TIMEOUT_S)
        return None
    except asyncio.TimeoutError:
        reason = f"no answer within {DIAL_TIMEOUT_S:.0f} s"
    except Exception as e:  # the daemon's dial error, e.g. "* [/ip4/.../tcp/...] dial tcp4 ...: connection refused"
        reason = str(e).strip().splitlines()[-1].split("] ", 1)[-1]
    mismatch = _MISMATCH.search(reason)
    if mismatch:
        return (f"the node at {host_port} answers with another peer ID than the address's {mismatch[1]} "
                f"(got {mismatch[2]}): copy the address the bootstrap node printed")
    if "connection refused" in reason:
        return (f"nothing listens at {host_port} (connection refused): check that the bootstrap node runs and "
                f"listens on that port")
    return (f"{host_port} does not answer ({reason}): check that the bootstrap node runs and that its address and "
            f"port are reachable from here")


async def _identity_taken(identity_path: Path, initial_peers: list[str]) -> bool:
    """Whether the swarm reached through `initial_peers` has a node with the peer ID of this identity key
    (hivemind's check, as the node's daemon ran it; False if it cannot tell)."""
    try:
        return await P2P.is_identity_taken(str(identity_path), initial_peers=initial_peers, tls=True,
                                           use_auto_relay=False, use_ipfs=False, use_relay=True)
    except Exception:
        return False
