"""The DHT node every bootstrap and peer process runs: listen address, announced address, identity.

hivemind listens on loopback by default; a node reachable over the internet listens on ``0.0.0.0``
(``--host``) and announces its public address (``--announce-ip``). The identity file keeps the same
peer ID, hence the same multiaddr, across restarts: a bootstrap node's address stays valid. The same
identity key signs the node's DHT records (:mod:`p2p_diloco.swarm.identity`), and the node checks
every record it stores or receives with the validators it is given (:mod:`p2p_diloco.swarm.records`).

A peer checks at start-up whether the swarm can dial it (:mod:`p2p_diloco.swarm.reachability`). If
not, it restarts its node as a DHT client: others cannot dial it, so it must not be one of the nodes
that store records; everything it needs (storing and reading records, matchmaking, sending parts to
reducers, downloading state) it dials itself.
"""

from __future__ import annotations

import concurrent.futures
import errno
import functools
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass
from typing import Mapping, Sequence

import hivemind.dht.dht
from hivemind import DHT
from hivemind.dht.validation import RecordValidatorBase
from hivemind.utils.multiaddr import Multiaddr

from p2p_diloco.event_loop import keep_tasks_in
from p2p_diloco.process_tree import is_running
from p2p_diloco.swarm.identity import Identity
from p2p_diloco.swarm.join_failure import join_failure
from p2p_diloco.swarm.liveness import serve_alive
from p2p_diloco.swarm.reachability import DIRECT, UNREACHABLE, Reachability, probe, serve_dial_back

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


def check_listen_address(host: str, port: int) -> None:
    """Raise NodeAddressError if this node cannot listen on host:port, before its daemon starts. p2pd binds
    with SO_REUSEPORT, so a second node on a port that a first one holds would start and share its
    connections at random; a plain socket (SO_REUSEADDR alone: a port whose old connections linger in
    TIME_WAIT is free) cannot bind where another socket listens."""
    family = socket.AF_INET6 if _ip_protocol(host, "--host") == "ip6" else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe_socket:
        probe_socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe_socket.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise NodeAddressError(f"--port {port}: another program (another node?) listens on {host}:{port}; "
                                       f"stop it, or give this node another --port (0: any free port)") from None
            raise NodeAddressError(f"cannot listen on --host {host} --port {port}: {e.strerror}") from None


def announce_maddrs(announce_ip: str | None, port: int) -> list[str] | None:
    if not announce_ip:
        return None
    if port == 0:
        raise NodeAddressError("--announce-ip needs a fixed --port: the announced address must name the real port")
    return [f"/{_ip_protocol(announce_ip, '--announce-ip')}/{announce_ip}/tcp/{port}"]


def peer_ids_of(maddrs: Sequence[str]) -> list[str]:
    """The peer IDs (base58) at the end of peer multiaddrs (checked by :func:`parse_initial_peers`)."""
    return [Multiaddr(maddr).value_for_protocol("p2p") for maddr in parse_initial_peers(maddrs)]


def parse_initial_peers(maddrs: Sequence[str], where: str = "--initial-peers") -> list[str]:
    """Check each value (of --initial-peers, or `where`) is a full multiaddr ending in /p2p/<peer id>."""
    parsed = []
    for text in maddrs:
        try:
            maddr = Multiaddr(text)
            maddr.value_for_protocol("p2p")
        except Exception:
            raise NodeAddressError(
                f"{where} {text!r} is not a peer multiaddr; expected the form "
                f"/ip4/203.0.113.5/tcp/31337/p2p/QmXyZ... as printed by `p2p-diloco bootstrap`"
            ) from None
        parsed.append(str(maddr))
    return parsed


DHT_CHECK_PERIOD_S = 0.5
# libp2p's TCP transport dials from the port it listens on (SO_REUSEPORT) unless this is "false". Two nodes that
# dial each other within a one-way delay of each other (each pair of an all-reduce's group that had not spoken
# before, as the all-reduce begins) then open one TCP connection from both ends at once (a TCP simultaneous
# open), on which both begin libp2p's security handshake as its initiator and fail ("noise: message is too
# short"): the pair's streams, and the round, were lost in 5 of 7 runs of 4 peers over the emulated internet.
# A node dials from a port of its own: what libp2p dials from its listening port for, hole punching,
# p2p-diloco does not use (docs/network.md). An operator who sets the variable keeps the value.
REUSEPORT_ENV = "LIBP2P_TCP_REUSEPORT"
# How a node stores and reads records. hivemind's defaults write each record on 5 nodes, keep a copy of what a
# node reads and push it to one more node, and every node that holds a key answers each read with the whole
# value: every read here asks for the latest (latest=True), so it reaches every node holding the key, and a
# copy kept by a reader saves nothing but adds an answer. Among 8 peers of the 14.7M model over the emulated
# internet (benchmarks/emulated_internet.py --peers 8), the DHT's requests moved 4.0 MB sent per peer and round
# (28 % of the all-reduce's 14.4 MB) with the defaults, 2.4 MB without the copies, 1.5 MB (10.6 %) with each
# record on 3 nodes as well. The owners of the run's records refresh them within a third of their TTL, onto the
# 3 nodes then nearest, so a record outlives 2 of its 3 nodes leaving.
DHT_STORAGE = dict(num_replicas=3, cache_locally=False, cache_nearest=0)


def _fails_once_the_process_is_gone(call):
    """A DHT call that, unless asked for its future, waits for the DHT process's answer only while that
    process lives (hivemind's waits for ever)."""

    @functools.wraps(call)
    def wait_while_alive(dht: SwarmDHT, *args, return_future: bool = False, **kwargs):
        future = call(dht, *args, return_future=True, **kwargs)
        if return_future:
            return future
        while True:
            try:
                return future.result(timeout=DHT_CHECK_PERIOD_S)
            except concurrent.futures.TimeoutError:
                if not is_running(dht.pid):
                    raise ConnectionError(f"the DHT process ({dht.pid}) is gone") from None

    return wait_while_alive


class SwarmDHT(DHT):
    """hivemind's DHT, whose calls fail once its process is gone instead of hanging: a peer whose DHT
    process was killed (its service manager stops every process of the unit at once, the OOM killer)
    must still leave within seconds.

    ``members`` holds the peer IDs of a private run whose records the node's validators alone accept
    (:class:`~p2p_diloco.swarm.records.RunMembers`), None if it takes anyone's: the averager built on
    this node averages with those peers alone (:mod:`p2p_diloco.sync.group_screen`).

    Every request the node makes or answers counts in its peer's traffic counters
    (:func:`~p2p_diloco.traffic.traffic_of`), in the phase of the key it is about: `key_phases` (key -> phase)
    and those added with :meth:`count_keys` (:mod:`p2p_diloco.swarm.dht_traffic`).
    """

    def __init__(self, *args, record_validators: Sequence[RecordValidatorBase] = (),
                 key_phases: Mapping[str, str] = (), **kwargs):
        from p2p_diloco.swarm.dht_traffic import KeyPhases, handler_phases
        from p2p_diloco.swarm.records import RunMembers
        from p2p_diloco.traffic import TrafficCounters

        self.members = next((v.peer_ids for v in record_validators if isinstance(v, RunMembers)), None)
        # made before the DHT's process forks (hivemind's DHT starts it in its constructor), which adds to them
        self._p2p_diloco_traffic = TrafficCounters()
        self._key_phases = KeyPhases(key_phases, handler_phases())
        super().__init__(*args, record_validators=record_validators, **kwargs)

    def run(self) -> None:
        from p2p_diloco.swarm.dht_traffic import count_requests

        keep_tasks_in(hivemind.dht.dht)  # this is the DHT's process: its loop keeps the tasks it runs
        os.environ.setdefault(REUSEPORT_ENV, "false")  # read by the p2pd that this process starts
        count_requests(self._p2p_diloco_traffic, self._key_phases)
        super().run()

    def count_keys(self, key_phases: Mapping[str, str]) -> None:
        """Count the requests about these keys (key -> phase) in their phase from now on."""
        self.run_coroutine(functools.partial(_count_keys, key_phases=dict(key_phases)))

    get = _fails_once_the_process_is_gone(DHT.get)
    store = _fails_once_the_process_is_gone(DHT.store)
    run_coroutine = _fails_once_the_process_is_gone(DHT.run_coroutine)


async def _count_keys(dht: SwarmDHT, _node, key_phases: dict[str, str]) -> None:
    dht._key_phases.add(key_phases)  # in the DHT's process, whose copy counts


def start_dht(
    host: str,
    port: int,
    identity: Identity,
    record_validators: Sequence[RecordValidatorBase],
    announce_ip: str | None = None,
    initial_peers: Sequence[str] = (),
    client_mode: bool = False,
    startup_timeout: float = 60.0,
    key_phases: Mapping[str, str] = (),
) -> SwarmDHT:
    """Start a DHT node (and its p2pd daemon); raise a one-line error if it cannot listen on host:port
    (NodeAddressError), if the swarm is unreachable (ConnectionError, naming why) or if a node with its
    identity key is already in the swarm (IdentityError): :mod:`p2p_diloco.swarm.join_failure`.
    `key_phases`: the traffic phase of the requests about each key it names (:class:`SwarmDHT`).

    A `client_mode` node stores no records for others and answers no DHT requests: for a node that
    others cannot dial. Every node answers dial-back requests (:func:`serve_dial_back`) and liveness
    requests (:func:`~p2p_diloco.swarm.liveness.serve_alive`).
    """
    check_listen_address(host, port)
    with identity.key_file() as key_file:  # p2pd reads it while the node starts
        dht = SwarmDHT(
            host_maddrs=listen_maddrs(host, port),
            announce_maddrs=announce_maddrs(announce_ip, port),
            initial_peers=parse_initial_peers(initial_peers),
            identity_path=str(key_file),
            # hivemind's check asks the swarm whether another node already uses the key: not for a new one
            check_if_identity_free=not identity.is_new,
            record_validators=record_validators,
            client_mode=client_mode,
            key_phases=key_phases,
            **DHT_STORAGE,
            start=True,
            await_ready=False,
        )
        try:
            dht.wait_until_ready(timeout=startup_timeout)
        except Exception as e:
            dht.shutdown()
            if initial_peers:
                raise join_failure(parse_initial_peers(initial_peers), identity, e) from None
            raise
    serve_dial_back(dht)
    serve_alive(dht)
    return dht


def visible_maddrs(dht: DHT) -> list[str]:
    """The multiaddrs others can dial to reach this node (copy one into --initial-peers)."""
    return [str(m) for m in dht.get_visible_maddrs(latest=True)]


@dataclass
class RunNode:
    """A peer's node in the swarm of its run, and how others reach it."""

    dht: DHT
    identity: Identity
    reachability: Reachability


def start_run_node(
    run_name: str,
    host: str,
    port: int,
    identity: Identity | None = None,
    announce_ip: str | None = None,
    initial_peers: Sequence[str] = (),
    allowed_peers: Sequence[str] = (),
) -> RunNode:
    """The DHT node of a peer of run `run_name`: it signs its records, checks the run's record schema
    (and, in a private run, that their authors are among `allowed_peers`), and has found out whether the
    swarm can dial it (a node that others cannot dial is restarted as a DHT client; see the module
    docstring). Without `identity`, the node gets a fresh one.
    """
    from p2p_diloco.swarm.records import key_phases, run_validators

    identity = identity or Identity.load_or_create(None)
    validators = run_validators(identity, run_name, allowed_peers)
    phases = key_phases(run_name)
    dht = start_dht(host, port, identity, validators, announce_ip, initial_peers, key_phases=phases)
    helpers = peer_ids_of(initial_peers)
    found = probe(dht, helpers)
    if found is None:
        reason = "no initial peer" if not helpers else "no initial peer answered a dial-back request"
        return RunNode(dht, identity, Reachability(DIRECT, f"{reason}: assuming the swarm can dial this node"))
    if found.mode == UNREACHABLE:
        dht.shutdown()
        dht = start_dht(host, port, identity, validators, announce_ip, initial_peers, client_mode=True,
                        key_phases=phases)
    return RunNode(dht, identity, found)
