"""How much data a libp2p circuit relay carries in hivemind 1.1.12, between two peers behind NAT.

    sudo python benchmarks/relay_limit.py            # needs root: network namespaces (tests/netns.py)

A hivemind DHT node on a public bridge relays (told it is public, as a bootstrap node on a public
address would find out). Two hosts sit behind their own
NAT router, and each keeps a relay reservation on the bootstrap node (autorelay with the bootstrap as
its only static relay). One registers a stream handler that counts the bytes it receives. The other
sends it streams of growing size through the relay. The script prints one line per size and
whether it got through. It also prints whether libp2p's hole punching (DCUtR) turned the relayed
connection into a direct one.

This is why p2p-diloco does not relay averaging traffic (docs/network.md): the bundled p2pd caps
every relayed connection at 128 KiB.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import varint  # multiaddr's own dependency

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SIZES = (60_000, 120_000, 131_072, 1_000_000, 4_000_000)
CHUNK = 65_536
RESERVATION_S = 5.0
P2P_CODE, CIRCUIT_CODE = 421, 290  # multiaddr protocol codes of /p2p/ and /p2p-circuit


async def _count_bytes(_dht, node) -> None:
    from hivemind.proto import runtime_pb2

    async def handler(requests, _context):
        total = 0
        async for message in requests:
            total += len(message.buffer)
        yield runtime_pb2.Tensor(buffer=str(total).encode())

    await node.p2p.add_protobuf_handler("count", handler, runtime_pb2.Tensor, stream_input=True, stream_output=True)


async def _send(_dht, node, target: str, size: int) -> str:
    from hivemind.p2p import PeerID
    from hivemind.proto import runtime_pb2

    async def chunks():
        for start in range(0, size, CHUNK):
            yield runtime_pb2.Tensor(buffer=b"x" * min(CHUNK, size - start))

    try:
        stream = await node.p2p._iterate_protobuf_stream_handler(
            PeerID.from_base58(target), "count", chunks(), runtime_pb2.Tensor)
        replies = [message async for message in stream]
        return f"got through ({replies[0].buffer.decode()} bytes counted)" if replies else "no reply"
    except Exception as e:
        return f"failed: {e!r}"


class _BinaryAddr:
    """A multiaddr given by its bytes. hivemind's codec writes /p2p/ as a CID, which p2pd does not read."""

    def __init__(self, data: bytes):
        self.data = data

    def to_bytes(self) -> bytes:
        return self.data


async def _dial_through_relay(_dht, node, relay: str, target: str) -> None:
    """Connect to `target` by its circuit address on `relay` (the only way to reach a NATed host)."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    transport, relay_id = relay.split("/p2p/")
    multihash = PeerID.from_base58(relay_id).to_bytes()
    circuit = (Multiaddr(transport).to_bytes() + varint.encode(P2P_CODE) + varint.encode(len(multihash)) + multihash
               + varint.encode(CIRCUIT_CODE))
    await node.p2p._client.connect(PeerID.from_base58(target), [_BinaryAddr(circuit)])


async def _disconnect(_dht, node, target: str) -> None:
    from hivemind.p2p import PeerID

    await node.p2p._client.disconnect(PeerID.from_base58(target))


async def _connections(_dht, node) -> list[str]:
    return [str(addr) for info in await node.p2p.list_peers() for addr in info.addrs]


def run_relay(ip: str) -> None:
    """The public node that relays: a hivemind DHT node with libp2p's relay service. It is told that it
    is public (force_reachability): libp2p serves relay reservations only then, and its AutoNAT
    cannot find out by itself on private 10.77.0.0/24 addresses."""
    from hivemind import DHT

    dht = DHT(host_maddrs=[f"/ip4/{ip}/tcp/31337"], start=True, force_reachability="public")
    print(dht.get_visible_maddrs()[0], flush=True)
    try:
        while True:
            time.sleep(1)
    finally:
        dht.shutdown()


def run_role(role: str, ip: str, relay: str, workdir: Path) -> None:
    """One NATed host: a hivemind DHT with a reservation on `relay`; the sink counts, the sender sends."""
    from hivemind import DHT
    from hivemind.p2p import P2P
    from hivemind.utils.timed_storage import get_dht_time

    make_args = P2P._make_process_args

    def static_relay_only(*args, **kwargs):  # hivemind cannot pass it; without it autorelay waits minutes
        return make_args(*args, **kwargs, relayDiscovery=False)

    P2P._make_process_args = staticmethod(static_relay_only)
    dht = DHT(initial_peers=[relay], host_maddrs=[f"/ip4/{ip}/tcp/0"], start=True, client_mode=True,
              use_auto_relay=True, force_reachability="private", trusted_relays=[relay])
    try:
        time.sleep(RESERVATION_S)  # autorelay reserves a slot on its static relay within a second
        if role == "sink":
            dht.run_coroutine(_count_bytes)
            dht.store("relay_limit_sink", dht.peer_id.to_base58(), get_dht_time() + 120)
            (workdir / "sink.ready").touch()
            while not (workdir / "sender.done").exists():
                time.sleep(0.5)
            return
        found = None
        for _ in range(40):
            found = dht.get("relay_limit_sink", latest=True)
            if found is not None:
                break
            time.sleep(0.5)
        target = found.value
        for size in SIZES:  # each on a new relayed connection: the relay's limits count per connection
            dht.run_coroutine(partial(_disconnect, target=target))
            dht.run_coroutine(partial(_dial_through_relay, relay=relay, target=target))
            print(f"| {size:,} | {dht.run_coroutine(partial(_send, target=target, size=size))} |", flush=True)
            if size == SIZES[0]:
                time.sleep(5)  # time for hole punching to replace the relayed connection, if it can
                direct = [a for a in dht.run_coroutine(_connections) if "p2p-circuit" not in a and "10.77.0.1/" not in a]
                print(f"direct connection after 5 s (hole punching): {direct or 'none'}", flush=True)
        (workdir / "sender.done").touch()
    finally:
        dht.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("relay", "sink", "sender"), help=argparse.SUPPRESS)
    parser.add_argument("--ip", help=argparse.SUPPRESS)
    parser.add_argument("--relay", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default="bench-out/relay-limit")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    if args.role:  # SIGTERM from the main process: run the role's `finally`, which stops its DHT and p2pd
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if args.role == "relay":
        return run_relay(args.ip)
    if args.role:
        return run_role(args.role, args.ip, args.relay, workdir)

    from tests.netns import Topology, unavailable

    if (why := unavailable()) is not None:
        sys.exit(f"error: {why}")
    workdir.mkdir(parents=True, exist_ok=True)
    for leftover in workdir.glob("*.ready"), workdir.glob("*.done"):
        for path in leftover:
            path.unlink()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    me = [sys.executable, str(Path(__file__).resolve())]
    procs: list[subprocess.Popen] = []
    with Topology() as topology:
        try:
            boot, sink, sender = topology.add_public("bootstrap"), topology.add_home("sink"), topology.add_home("sender")
            bootstrap = topology.popen(boot, [*me, "--role", "relay", "--ip", boot.ip],
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
            procs.append(bootstrap)
            relay = bootstrap.stdout.readline().strip()
            log = open(workdir / "sink.log", "w")
            procs.append(topology.popen(sink, [*me, "--role", "sink", "--ip", sink.ip, "--relay", relay,
                                               "--workdir", str(workdir)], stdout=log, stderr=log, env=env))
            print("| stream size (bytes) | through the relay |\n|---:|---|", flush=True)
            procs.append(topology.popen(sender, [*me, "--role", "sender", "--ip", sender.ip, "--relay", relay,
                                                 "--workdir", str(workdir)], env=env,
                                        stderr=open(workdir / "sender.log", "w")))
            procs[-1].wait(300)
        finally:
            for proc in reversed(procs):
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()


if __name__ == "__main__":
    main()
