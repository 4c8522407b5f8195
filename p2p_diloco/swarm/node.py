"""The DHT node every bootstrap and peer process runs: listen address, announced address, identity.

hivemind listens on loopback by default; a node reachable over the internet listens on ``0.0.0.0``
(``--host``) and announces its public address (``--announce-ip``). The identity file keeps the same
peer ID, hence the same multiaddr, across restarts: a bootstrap node's address stays valid. The same
identity key signs the node's DHT records (:mod:`p2p_diloco.swarm.identity`), and the node checks
every record it stores or receives with the validators it is given (:mod:`p2p_diloco.swarm.records`).
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Sequence

from hivemind import DHT
from hivemind.dht.validation import RecordValidatorBase
from hivemind.utils.multiaddr import Multiaddr

from p2p_diloco.swarm.identity import Identity

logger = logging.getLogger(__name__)


class NodeAddressError(ValueError):
    """A listen/announce address or an --initial-peers multiaddr is malformed; one line for the user."""


def _ip_protocol(ip: str, flag: str) -> str:
    try:
        return "ip6" if ipaddress.ip_address(ip).version == 6 else "ip4"
    except ValueError:
        raise NodeAddressError(f"{flag} {ip!r} is not an IPv4 or IPv6 address") from None


def listen_maddrs(host: str, port: int) -> list[str]:
    return [f"/{_ip_protocol(host, '--host')}/{host}/tcp/{port}"]


def announce_maddrs(announce_ip: str | None, port: int) -> list[str] | None:
    if not announce_ip:
        return None
    if port == 0:
        raise NodeAddressError("--announce-ip needs a fixed --port: the announced address must name the real port")
    return [f"/{_ip_protocol(announce_ip, '--announce-ip')}/{announce_ip}/tcp/{port}"]


def parse_initial_peers(maddrs: Sequence[str]) -> list[str]:
    """Check each --initial-peers value is a full multiaddr ending in /p2p/<peer id>."""
    parsed = []
    for text in maddrs:
        try:
            maddr = Multiaddr(text)
            maddr.value_for_protocol("p2p")
        except Exception:
            raise NodeAddressError(
                f"--initial-peers {text!r} is not a peer multiaddr; expected the form "
                f"/ip4/203.0.113.5/tcp/31337/p2p/QmXyZ... as printed by `p2p-diloco bootstrap`"
            ) from None
        parsed.append(str(maddr))
    return parsed


def start_dht(
    host: str,
    port: int,
    identity: Identity,
    record_validators: Sequence[RecordValidatorBase],
    announce_ip: str | None = None,
    initial_peers: Sequence[str] = (),
    startup_timeout: float = 60.0,
) -> DHT:
    """Start a DHT node (and its p2pd daemon); raise a one-line error if the swarm is unreachable."""
    with identity.key_file() as key_file:  # p2pd reads it while the node starts
        dht = DHT(
            host_maddrs=listen_maddrs(host, port),
            announce_maddrs=announce_maddrs(announce_ip, port),
            initial_peers=parse_initial_peers(initial_peers),
            identity_path=str(key_file),
            # hivemind's check asks the swarm whether another node already uses the key: not for a new one
            check_if_identity_free=not identity.is_new,
            record_validators=record_validators,
            start=True,
            await_ready=False,
        )
        try:
            dht.wait_until_ready(timeout=startup_timeout)
        except Exception as e:
            dht.shutdown()
            if initial_peers:
                raise ConnectionError(
                    f"could not join the swarm through {', '.join(initial_peers)}: {e}. Check that the bootstrap "
                    f"node runs and that its address and port are reachable from here."
                ) from None
            raise
    return dht


def visible_maddrs(dht: DHT) -> list[str]:
    """The multiaddrs others can dial to reach this node (copy one into --initial-peers)."""
    return [str(m) for m in dht.get_visible_maddrs(latest=True)]


def start_run_node(
    run_name: str,
    host: str,
    port: int,
    identity: Identity | None = None,
    announce_ip: str | None = None,
    initial_peers: Sequence[str] = (),
) -> tuple[DHT, Identity]:
    """The DHT node of a peer of run `run_name`: it signs its records and checks the run's record schema.

    Without `identity`, the node gets a fresh one for this process.
    """
    from p2p_diloco.swarm.records import run_validators

    identity = identity or Identity.load_or_create(None)
    dht = start_dht(host, port, identity, run_validators(identity, run_name), announce_ip, initial_peers)
    return dht, identity
