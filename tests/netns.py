"""Hosts on one machine, some behind home routers: network namespaces for the NAT tests and benchmark.

    public bridge 10.77.0.0/24 (a namespace of its own)
    ├── public host i (i = 1, 2, ...): 10.77.0.i
    └── home router j (j = 1, 2, ...): WAN 10.77.0.(100 + j), LAN 192.168.(10 + j).1
        └── home host j: 192.168.(10 + j).2, default route via its router

The namespaces have no route to any other network.

A home router masquerades its LAN behind its WAN address and drops every connection from the WAN
that the home did not open (iptables: MASQUERADE, and FORWARD accepts only ESTABLISHED,RELATED
inward), as a home router, a CGNAT or a firewall does. A link's rate can be limited with
`tc ... tbf` on the bridge side of its veth pair (both directions are shaped where they leave a
namespace, so each direction gets its own limit).

Needs root, `ip` (iproute2), `iptables` and `tc`; :func:`unavailable` says why not, in one line.
Every namespace carries a per-topology tag and is deleted by :meth:`Topology.close` (which also
deletes the veth pairs inside them); processes started with :meth:`Topology.popen` run inside a
namespace and are the caller's to stop.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

PUBLIC_NET = "10.77.0"


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)


def unavailable() -> Optional[str]:
    """Why namespaces with NAT cannot be made here, or None if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian: apt-get install iproute2 iptables)"
    probe = f"dlprobe{secrets.token_hex(3)}"
    try:
        _run("ip", "netns", "add", probe)
        _run("ip", "netns", "exec", probe, "iptables", "-t", "nat", "-L")
    except subprocess.CalledProcessError as e:
        return f"cannot make a network namespace with NAT: {(e.stderr or e.stdout).strip().splitlines()[-1:]}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


def required_marks(tests: str, check: Callable[[], Optional[str]] = unavailable) -> list:
    """The pytest marks of a module of `tests` that need namespaces (`check` says why they cannot be made, or
    None): a skip where they cannot be made; on CI (.ci/run sets P2P_DILOCO_REQUIRE_NETNS) RuntimeError instead,
    since CI must run them."""
    import pytest

    why_not = check()
    if why_not and os.environ.get("P2P_DILOCO_REQUIRE_NETNS"):
        raise RuntimeError(f"{tests} need network namespaces: {why_not}")
    return [pytest.mark.skip(reason=f"{tests} need network namespaces: {why_not}")] if why_not else []


@dataclass(frozen=True)
class Host:
    name: str
    namespace: Optional[str]  # None: this machine's own network (loopback)
    ip: str
    link: str  # the bridge-side end of its (or its router's) veth pair, where its rate is limited; or its TUN device
    router: Optional[str] = None  # the router's namespace, for a home host


class Namespaces:
    """Network namespaces of one topology, each with its loopback up; :meth:`close` deletes them all."""

    def __init__(self):
        self.tag = secrets.token_hex(2)  # namespaces of concurrent or leftover topologies never clash
        self.namespaces: list[str] = []

    def _namespace(self, role: str) -> str:
        name = f"dl{self.tag}-{role}"
        _run("ip", "netns", "add", name)
        self.namespaces.append(name)
        self._ip(name, "link", "set", "lo", "up")
        return name

    @staticmethod
    def _ip(namespace: str, *args: str) -> None:
        _run("ip", "-n", namespace, *args)

    def command(self, host: Host, argv: Sequence[str]) -> list[str]:
        """`argv` run inside the host's namespace (`ip netns exec` execs it: the PID is the program's)."""
        return ["ip", "netns", "exec", host.namespace, *argv]

    def popen(self, host: Host, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, argv), **kwargs)

    def close(self) -> None:
        """Delete every namespace (with its devices, routes and iptables rules)."""
        for namespace in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        self.namespaces.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Topology(Namespaces):
    """A public bridge with hosts on it and homes behind NAT routers; :meth:`close` removes it all."""

    def __init__(self):
        super().__init__()
        self._public_count = self._home_count = 0
        self.bridge_ns = self._namespace("br")
        self._ip(self.bridge_ns, "link", "add", "br0", "type", "bridge")
        self._ip(self.bridge_ns, "link", "set", "br0", "up")

    def _veth(self, namespace: str, inside: str, peer_namespace: str, outside: str) -> None:
        _run("ip", "link", "add", inside, "netns", namespace, "type", "veth", "peer", "name", outside,
             "netns", peer_namespace)
        self._ip(namespace, "link", "set", inside, "up")
        self._ip(peer_namespace, "link", "set", outside, "up")

    def _on_bridge(self, namespace: str, device: str, ip: str, link: str) -> None:
        self._veth(namespace, device, self.bridge_ns, link)
        self._ip(self.bridge_ns, "link", "set", link, "master", "br0")
        self._ip(namespace, "addr", "add", f"{ip}/24", "dev", device)

    def add_public(self, name: str) -> Host:
        """A host with an address on the public bridge: anybody there can dial it."""
        index = self._public_count = self._public_count + 1
        namespace = self._namespace(f"p{index}")
        ip, link = f"{PUBLIC_NET}.{index}", f"p{self.tag}{index}"
        self._on_bridge(namespace, "eth0", ip, link)
        return Host(name, namespace, ip, link)

    def add_loopback(self, name: str) -> Host:
        """A namespace with nothing but its own loopback, 127.0.0.1: for programs that listen on every
        interface (torchrun's rendezvous store), which there reach no other network."""
        return Host(name, self._namespace(f"l{name[:4]}"), "127.0.0.1", "lo")

    def add_home(self, name: str) -> Host:
        """A host behind its own NAT router: it can dial out, nobody can dial in."""
        index = self._home_count = self._home_count + 1
        router, home = self._namespace(f"r{index}"), self._namespace(f"h{index}")
        lan = f"192.168.{10 + index}"
        link = f"r{self.tag}{index}"
        self._on_bridge(router, "wan", f"{PUBLIC_NET}.{100 + index}", link)
        self._veth(home, "eth0", router, "lan")
        self._ip(router, "addr", "add", f"{lan}.1/24", "dev", "lan")
        self._ip(home, "addr", "add", f"{lan}.2/24", "dev", "eth0")
        self._ip(home, "route", "add", "default", "via", f"{lan}.1")
        _run("ip", "netns", "exec", router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        iptables = ("ip", "netns", "exec", router, "iptables")
        _run(*iptables, "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
        _run(*iptables, "-A", "FORWARD", "-i", "wan", "-o", "lan", "-m", "conntrack", "--ctstate",
             "ESTABLISHED,RELATED", "-j", "ACCEPT")
        _run(*iptables, "-A", "FORWARD", "-i", "wan", "-o", "lan", "-j", "DROP")
        return Host(name, home, f"{lan}.2", link, router)

    def limit_rate(self, host: Host, mbit: float, burst_ms: float = 2.0) -> None:
        """Shape the host's link (its router's, for a home) to `mbit` Mbit/s in each direction.

        The token bucket holds `burst_ms` of the rate, at least 64 KiB (a whole GSO segment of the
        veth): an idle link refills it and then sends it at veth speed, so a larger bucket (100 ms
        once) let a transfer of a few MB beat the physical limit."""
        burst = max(65536, int(mbit * 1e6 / 8 * burst_ms / 1000))
        inner_ns = host.router or host.namespace
        inner_dev = "wan" if host.router else "eth0"
        for namespace, device in ((self.bridge_ns, host.link), (inner_ns, inner_dev)):
            _run("ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", device, "root", "tbf",
                 "rate", f"{mbit}mbit", "burst", str(burst), "latency", "50ms")
