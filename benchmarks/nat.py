"""Peers behind NAT on rate-limited links: seconds per outer step, and the bytes each node sends.

    sudo python benchmarks/nat.py                       # ~9 min on 2 cores; needs root (network namespaces)
    sudo python benchmarks/nat.py --mbit 100 --outer-steps 4 --out bench-out/nat

Three layouts of a bootstrap node and 3 peers on a public bridge, built with tests/netns.py:
- all public;
- 1 public peer and 2 peers behind their own NAT router;
- only the bootstrap node public, and 3 peers behind NAT. Here the bootstrap node's assistant
  reduces for them (docs/network.md).

Every link (each host's, or each home router's) is shaped with `tc tbf` to --mbit in each
direction. The peers run `peers/demo.toml` with a larger model (hidden 256, 4 layers: 3.9M
parameters, 15.7 MB fp32), so that averaging has weight on these links. The peers start together
and take --outer-steps outer steps.

Per layout the script reports:
- the median seconds between consecutive outer steps;
- the bytes each node sent per outer step, counted on its own network interface (everything:
  averaging, DHT, TCP);
- whether every step had every peer and one hash.

It prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from p2p_diloco.metrics import read_metrics  # noqa: E402
from tests.netns import Host, Topology, unavailable  # noqa: E402

LAYOUTS = {  # name: (public peers, NATed peers)
    "all public": (3, 0),
    "1 public + 2 NATed": (1, 2),
    "only the bootstrap public, 3 NATed": (0, 3),
}
MODEL = {"hidden_size": 256, "num_layers": 4, "intermediate_size": 768}


def write_config(out: Path) -> Path:
    """peers/demo.toml with the benchmark's model sizes."""
    text = (REPO / "peers" / "demo.toml").read_text()
    for key, value in MODEL.items():
        lines = [f"{key} = {value}" if line.split("=")[0].strip() == key else line for line in text.splitlines()]
        text = "\n".join(lines) + "\n"
    path = out / "run.toml"
    path.write_text(text)
    return path


def tx_bytes(host: Host) -> int:
    """Bytes the host has sent on its interface (inside its own namespace)."""
    out = subprocess.run(["ip", "netns", "exec", host.namespace, "cat", "/sys/class/net/eth0/statistics/tx_bytes"],
                         capture_output=True, text=True, check=True, timeout=10)
    return int(out.stdout)


def run_layout(name: str, public: int, natted: int, args, config: Path, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cli = [sys.executable, "-m", "p2p_diloco.cli"]
    procs: list[subprocess.Popen] = []
    with Topology() as topology:
        try:
            boot = topology.add_public("bootstrap")
            peers = [topology.add_public(f"public{i}") for i in range(public)] + [
                topology.add_home(f"home{i}") for i in range(natted)]
            for host in (boot, *peers):
                topology.limit_rate(host, args.mbit)
            bootstrap = topology.popen(boot, [*cli, "bootstrap", "--host", boot.ip, "--port", "31337"],
                                       stdout=subprocess.PIPE, stderr=open(out / f"{name}-bootstrap.log", "w"),
                                       text=True, env=env)
            procs.append(bootstrap)
            maddr = bootstrap.stdout.readline().strip()
            sent_before = {host.name: tx_bytes(host) for host in (boot, *peers)}
            for host in peers:
                metrics = out / f"{name}-{host.name}.jsonl"
                metrics.unlink(missing_ok=True)
                procs.append(topology.popen(
                    host, [*cli, "peer", "--config", str(config), "--host", host.ip, "--initial-peers", maddr,
                           "--metrics-file", str(metrics), "--max-outer-steps", str(args.outer_steps),
                           "--wait-for-peers", str(len(peers))],
                    stdout=open(out / f"{name}-{host.name}.log", "w"), stderr=subprocess.STDOUT, env=env))
            deadline = time.monotonic() + args.timeout
            while any(p.poll() is None for p in procs[1:]) and time.monotonic() < deadline:
                time.sleep(1)
            sent = {host.name: tx_bytes(host) - sent_before[host.name] for host in (boot, *peers)}
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
    records = {host.name: [r for r in read_metrics(out / f"{name}-{host.name}.jsonl") if r["event"] == "outer_step"]
               for host in peers}
    times = sorted({round(r["time"], 1) for rs in records.values() for r in rs})
    by_step: dict[int, set] = {}
    for rs in records.values():
        for r in rs:
            by_step.setdefault(r["outer_step"], set()).add((r["global_sha256"], r["group_size"]))
    complete = (sorted(by_step) == list(range(1, args.outer_steps + 1))
                and all(len(v) == 1 and next(iter(v))[1] == len(peers) for v in by_step.values()))
    steps = [max(r["outer_step"] for r in rs) for rs in records.values() if rs]
    gaps = [b - a for a, b in zip(times, times[1:]) if b - a > 0.5]  # the peers' records of one step lie within 0.5 s
    return dict(layout=name, mbit=args.mbit, seconds_per_step=statistics.median(gaps) if gaps else None,
                sent_mb_per_step={k: v / 1e6 / max(min(steps, default=1), 1) for k, v in sent.items()},
                every_peer_every_step_one_hash=complete, steps=min(steps, default=0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbit", type=float, default=100.0, help="rate of every link, each direction")
    parser.add_argument("--outer-steps", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=400.0, help="seconds per layout before giving up")
    parser.add_argument("--out", default="bench-out/nat")
    args = parser.parse_args()
    if (why := unavailable()) is not None:
        sys.exit(f"error: {why}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = write_config(out)
    results = [run_layout(name, public, natted, args, config, out) for name, (public, natted) in LAYOUTS.items()]
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\n{args.mbit:g} Mbit/s links, 3 peers, {args.outer_steps} outer steps, model of {MODEL}\n")
    print("| layout | s per outer step | MB sent per outer step: bootstrap | each peer | every peer in every step, one hash |")
    print("|---|---:|---:|---|---|")
    for r in results:
        sent = r["sent_mb_per_step"]
        peers = ", ".join(f"{k} {v:.1f}" for k, v in sent.items() if k != "bootstrap")
        seconds = f"{r['seconds_per_step']:.1f}" if r["seconds_per_step"] is not None else "–"
        print(f"| {r['layout']} | {seconds} | {sent['bootstrap']:.1f} | {peers} | "
              f"{'yes' if r['every_peer_every_step_one_hash'] else 'no'} ({r['steps']} steps) |")


if __name__ == "__main__":
    main()
