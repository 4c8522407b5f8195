"""An emulated internet on one machine: hosts in regions, round trips of real ones, home uplinks, loss.

    with Internet([Site("boot", "us"), Site("a", "us"), Site("b", "eu", uplink_mbit=10)], loss=0.01) as net:
        net.popen(net.hosts["a"], ["python", "-m", "p2p_diloco.cli", "peer", "--host", net.hosts["a"].ip, ...])
        net.counters()["a"].sent_payload     # what the router saw host "a" send

This kernel has no netem (tc offers tbf, htb and pfifo), so the delay is added in user space. Each host is
a network namespace whose only interface besides its loopback is a TUN device, `tun0`, with the address
10.77.0.i/24 (i = 1, 2, ... in the order of the sites; the namespaces reach no other network). One process,
tests/packet_router.py, holds every TUN's file descriptor and moves each IPv4 packet to the host of its
destination address, unchanged, after the sender's uplink (a token bucket of the site's Mbit/s) and the
pair's one-way delay, half the round trip of their regions (`RTT_MS`), losing a share `loss` of them. It
counts each host's bytes, sent and received: a check of the peers' own metrics from outside.

Needs root, `ip` (iproute2) and /dev/net/tun; :func:`unavailable` says why not, in one line. The router is
stopped by its PID and the namespaces deleted by :meth:`Internet.close` (the context manager's exit, and
at the interpreter's exit if nobody closed it); the TUN devices go with the router, which alone holds
them. Processes started with :meth:`Internet.popen` are the caller's to stop.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from tests.netns import PUBLIC_NET, Host, Namespaces, _run
from tests.packet_router import Counters

REPO = Path(__file__).resolve().parent.parent
REGIONS = ("us", "eu", "asia")
# round trips between regions, ms: within one ~20, North America-Europe ~80, North America-Asia ~160,
# Europe-Asia ~230 (typical internet round trips between those regions' cloud sites)
RTT_MS = {frozenset({"us"}): 20, frozenset({"eu"}): 20, frozenset({"asia"}): 20,
          frozenset({"us", "eu"}): 80, frozenset({"us", "asia"}): 160, frozenset({"eu", "asia"}): 230}
UPLINKS_MBIT = (10, 20, 50)  # home uplinks: Psyche asks 10 Mbit/s at least and recommends 20
TUN_DEVICE = "tun0"
ROUTER_START_S = 30.0
ROUTER_STOP_S = 10.0

_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000


@dataclass(frozen=True)
class Site:
    """A host to be: its name, its region (one of REGIONS) and its uplink in Mbit/s."""
    name: str
    region: str
    uplink_mbit: float = 20.0


def rtt_ms(a: str, b: str) -> float:
    return RTT_MS[frozenset({a, b})]


def _open_tun(name: str) -> int:
    """A new TUN device `name` in this process's namespace, and its file descriptor (raw IP packets,
    no header before them). It lives as long as some process holds the descriptor."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def unavailable() -> Optional[str]:
    """Why the emulated internet cannot be made here, or None if it can."""
    if os.geteuid() != 0:
        return "network namespaces and TUN devices need root"
    if shutil.which("ip") is None:
        return "`ip` is not installed (Debian: apt-get install iproute2)"
    if not os.path.exists("/dev/net/tun"):
        try:  # some containers lack the node, not the driver
            os.makedirs("/dev/net", exist_ok=True)
            os.mknod("/dev/net/tun", 0o666 | 0o020000, os.makedev(10, 200))
        except OSError as e:
            return f"/dev/net/tun is missing and cannot be made ({e})"
    try:
        os.close(_open_tun(f"dlprobe{os.getpid() % 10000}"))
    except OSError as e:
        return f"cannot make a TUN device: {e}"
    probe = f"dlprobe{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
    except subprocess.CalledProcessError as e:
        return f"cannot make a network namespace: {(e.stderr or e.stdout).strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


class Internet(Namespaces):
    """The hosts of `sites`, one namespace and one TUN each, and the router between them; a context manager.

    `loss`: the share of packets lost on the way (after the uplink), drawn from `seed`. `mtu`: the TUN's
    (1,500, the internet's). `queue_ms`: the uplink's queue, in time at its rate; `burst_bytes`: its token
    bucket's depth. `workdir`: where the router's plan, counters and log go (default: a new temporary folder)."""

    def __init__(self, sites: Sequence[Site], loss: float = 0.0, mtu: int = 1500, queue_ms: float = 200.0,
                 burst_bytes: int = 15_000, seed: int = 0, workdir: Optional[Path] = None):
        if unknown := sorted({s.region for s in sites} - set(REGIONS)):
            raise ValueError(f"unknown region(s) {', '.join(unknown)}; valid: {', '.join(REGIONS)}")
        if len({s.name for s in sites}) != len(sites) or not 0 < len(sites) < 255:
            raise ValueError("sites need 1 to 254 distinct names")
        if not 0.0 <= loss < 1.0 or any(s.uplink_mbit <= 0 for s in sites):
            raise ValueError("loss must be in [0, 1) and every uplink positive")
        super().__init__()
        self.sites = list(sites)
        self.hosts: dict[str, Host] = {}
        self.router: Optional[subprocess.Popen] = None
        self._dir = Path(workdir or tempfile.mkdtemp(prefix=f"internet-{self.tag}-"))
        self._dir.mkdir(parents=True, exist_ok=True)
        self.stats_path = self._dir / "stats.json"
        atexit.register(self.close)
        fds: list[int] = []
        try:
            for index, site in enumerate(self.sites, start=1):
                fds.append(self._add_host(index, site, mtu))
            plan = dict(hosts=[dict(name=s.name, ip=self.hosts[s.name].ip, fd=fd, uplink_mbit=s.uplink_mbit)
                               for s, fd in zip(self.sites, fds)],
                        delay_ms=[[rtt_ms(a.region, b.region) / 2 for b in self.sites] for a in self.sites],
                        loss=loss, queue_ms=queue_ms, burst_bytes=burst_bytes, seed=seed)
            (self._dir / "plan.json").write_text(json.dumps(plan, indent=1))
            with open(self._dir / "router.log", "w") as log:
                self.router = subprocess.Popen(
                    [sys.executable, "-m", "tests.packet_router", "--plan", str(self._dir / "plan.json"),
                     "--stats", str(self.stats_path)], pass_fds=fds, cwd=REPO, stderr=log)
            deadline = time.monotonic() + ROUTER_START_S
            while not self.stats_path.exists():
                if self.router.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the packet router did not start: {self.router_log()}")
                time.sleep(0.05)
        except BaseException:
            self.close()
            raise
        finally:
            for fd in fds:  # the router holds them now (or nobody: the devices go)
                os.close(fd)

    def _add_host(self, index: int, site: Site, mtu: int) -> int:
        namespace = self._namespace(f"i{index}")
        _run("ip", "netns", "exec", namespace, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1",
             "net.ipv6.conf.default.disable_ipv6=1")  # no IPv6 chatter on the links
        device = f"dl{self.tag}t{index}"  # made in this namespace, then moved into the host's
        fd = _open_tun(device)
        try:
            _run("ip", "link", "set", device, "netns", namespace)
            self._ip(namespace, "link", "set", device, "name", TUN_DEVICE, "mtu", str(mtu), "up")
            ip = f"{PUBLIC_NET}.{index}"
            self._ip(namespace, "addr", "add", f"{ip}/24", "dev", TUN_DEVICE)
        except BaseException:
            os.close(fd)
            raise
        self.hosts[site.name] = Host(site.name, namespace, ip, TUN_DEVICE)
        return fd

    def router_log(self) -> str:
        path = self._dir / "router.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else "(no log)"

    def _read_stats(self) -> dict:
        return json.loads(self.stats_path.read_text())

    def counters(self, timeout_s: float = 5.0) -> dict[str, Counters]:
        """Each host's counters as of now: the router is asked to write them, and they are read once written."""
        if self.router is None or self.router.poll() is not None:
            stats = self._read_stats()  # its last word
        else:
            before = self._read_stats()["seq"]
            self.router.send_signal(signal.SIGUSR1)
            deadline = time.monotonic() + timeout_s
            while (stats := self._read_stats())["seq"] <= before:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the packet router wrote no counters within {timeout_s:.0f} s")
                time.sleep(0.02)
        return {name: Counters(**values) for name, values in stats["hosts"].items()}

    def close(self) -> None:
        """Stop the router (by its PID: SIGTERM, then SIGKILL) and delete every namespace. Idempotent."""
        atexit.unregister(self.close)
        if self.router is not None and self.router.poll() is None:
            self.router.send_signal(signal.SIGTERM)
            try:
                self.router.wait(ROUTER_STOP_S)
            except subprocess.TimeoutExpired:
                self.router.kill()
                self.router.wait(ROUTER_STOP_S)
        super().close()


def parse_site(text: str) -> Site:
    """NAME:REGION[:MBIT], e.g. ``a:eu:20``."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[0]:
        raise ValueError(f"a site is NAME:REGION[:MBIT] (e.g. a:eu:20), not {text!r}")
    return Site(parts[0], parts[1], float(parts[2]) if len(parts) == 3 else 20.0)


def main() -> None:
    """Build an internet of the sites given, print how to run a command on each host, and keep it until
    Ctrl+C (or SIGTERM); then print what each host sent and received."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sites", nargs="+", metavar="NAME:REGION[:MBIT]",
                        help=f"a host: its name, region ({', '.join(REGIONS)}) and uplink (default 20 Mbit/s)")
    parser.add_argument("--loss", type=float, default=0.0, help="share of packets lost on the way (e.g. 0.01)")
    parser.add_argument("--workdir", default=None, help="where the router's plan, counters and log go")
    args = parser.parse_args()
    try:
        sites = [parse_site(text) for text in args.sites]
    except ValueError as e:
        parser.error(str(e))
    if why := unavailable():
        sys.exit(f"error: {why}")
    stop = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.append(True))
    with Internet(sites, loss=args.loss, workdir=args.workdir) as internet:
        for site in sites:
            host = internet.hosts[site.name]
            print(f"{site.name}: {site.region}, {site.uplink_mbit:g} Mbit/s up, {host.ip}:  "
                  f"ip netns exec {host.namespace} COMMAND", flush=True)
        print("Ctrl+C ends it", flush=True)
        while not stop:
            time.sleep(0.2)
        counted = internet.counters()
    print("| host | sent MB (payload) | received MB (payload) | dropped | lost |\n|---|---:|---:|---:|---:|")
    for name, c in counted.items():
        print(f"| {name} | {c.sent_bytes / 1e6:.2f} ({c.sent_payload / 1e6:.2f}) | "
              f"{c.received_bytes / 1e6:.2f} ({c.received_payload / 1e6:.2f}) | {c.dropped} | {c.lost} |")


if __name__ == "__main__":
    main()
