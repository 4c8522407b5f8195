"""All-reduce time of S bytes among N peers on rate-limited links, per codec, against the physical limit.

    sudo python benchmarks/allreduce_bandwidth.py   # ~8 min on 2 cores (--no-tcp: ~5); needs root (network namespaces)
    sudo python benchmarks/allreduce_bandwidth.py --mbit 100 --codecs none,fp4-e3m0 --rounds 2 --mbytes 4  # ~25 s
    sudo python benchmarks/allreduce_bandwidth.py --regions us,eu,asia,us --mbit 20 --mbytes 58.7  # the internet

N peer processes (--peers, default 3) each run in a network namespace of their own on one bridge
(tests/netns.py), with their link shaped by `tc tbf` to B Mbit/s in each direction (--mbit, a list:
each rate in turn, re-shaping the same links) by `Topology.limit_rate`, with a token bucket of
--burst-ms (default 2 ms, at least 64 KiB) of the rate: a bucket of 100 ms, which an idle link
refills between rounds and then sends at veth speed, let an all-reduce of a few MB beat the
physical limit. With --regions (one region of tests/emulated_internet.py's per peer, e.g. us,eu,asia,us)
the peers sit on the emulated internet instead: each host's uplink paced to B (one rate only) by the
packet router, which adds each pair's one-way delay (round trips 20–230 ms) and can lose --loss of the
packets; the download is not limited, and the limit below (each peer's sent bytes over its uplink) is
the same.

Each peer starts its DHT node on its namespace address (the first peer is the others' initial
peer) and averages one flat fp32 tensor of S/4 values (--mbytes S in 10^6 bytes, default 16: 4M parameters, values randn · 1e-3) with
`OuterSync.average`, hivemind's butterfly all-reduce with bit-identical results
(p2p_diloco/sync/exact_allreduce.py). For each rate and each codec (--codecs, default all of
p2p_diloco/sync/codecs.py) a fresh OuterSync under its own averager prefix and outer steps runs
--rounds rounds, then shuts down.

Every round starts at one instant on every peer: each peer reports ready through a file under
--out, and this script, once all are ready, names a start time a moment ahead (the namespaces share
the machine's clock). Each round's group is formed as the training loop forms it (--matchmaking
planned, the default): every peer holds the same membership plan of the N peers
(p2p_diloco/sync/membership.py), and the first leader starts the all-reduce once all have joined.
With --matchmaking hivemind the peers have no plan and hivemind's matchmaking gathers them for
matchmaking_time (1.0 s; request_timeout 0.5 s), as in the tables before issue 24. Matchmaking is
not part of the all-reduce time. Per (B, codec) the table gives:

- **all-reduce s**: median over the rounds of (the last peer's end of all-reduce) − (the first
  peer's start of it), where a peer's start is when its averager enters RUNNING_ALLREDUCE (the
  leader has closed the group: matchmaking is over) and its end is when its step returns the
  gathered data (every part reduced and received back). It includes encoding, decoding and summing
  on the CPU, and the begin-allreduce message from the leader to the followers;
- **limit s**: 2(N−1)/N · S_codec / B with S_codec = numel × bytes_per_parameter(codec): each peer
  sends (N−1)/N of its values to their reducers and (N−1)/N of the averaged values back, through
  its own B in each direction; **efficiency** = limit / all-reduce s (1.0 would be a perfect link);
- **split limit s**: the same bound for the split hivemind really made, median over the rounds of
  (the most payload bytes any peer sent, or received) / B. hivemind cuts the tensor into parts of
  512 KiB *after* the codec (131,072 fp32 values, 932,067 values in a 4-bit codec) and gives each
  part whole to one reducer, so with few parts per peer the reducers' shares are unequal and the
  busiest peer moves more than 2(N−1)/N · S_codec;
- **TCP all-to-all s** and **one TCP flow per link s** (unless --no-tcp): once every all-reduce round is
  done, for each rate and codec as many rounds of plain sockets moving the same bytes on the same links
  from a common start (benchmarks/tcp_ceiling.py): each peer sends 2(N−1)/N · S_codec split evenly to
  every other peer at once (the butterfly's traffic), or all of it to the next peer (a ring's: one flow
  per link); the median time to the last byte received, and in parentheses limit / that time. TCP/IP
  and Ethernet headers, the ACKs and the flows' sharing of a link keep it under 1.0; **all-reduce of TCP
  all-to-all** is the TCP all-to-all s / all-reduce s, the share of TCP's own ceiling that the all-reduce
  reaches;
- **CPU busy**: the CPU time that every peer's processes (the peer, its averager, its DHT and p2pd:
  /proc/PID/stat) used from its start of the all-reduce to its end, summed over the peers, over the
  all-reduce s: the cores busy on average, and of them the p2pd daemons' (libp2p's TLS, yamux and the
  copies through its socket). Near the machine's core count, the all-reduce waits on
  the CPU (coding, summing, hashing, TLS and yamux in p2pd), not on the link; the kernel's own
  network work (veth, tbf) is not counted;
- **round s**: median of (the last peer's return from `OuterSync.average`) − (the common start):
  matchmaking, the all-reduce, and the DHT round reports and the audit every peer goes through
  before it commits the mean (p2p_diloco/sync/commit.py, audit.py); **matchmaking s** is the median
  of (the first peer's start of the all-reduce) − (the common start), and **commit s** the rest of
  the round after the all-reduce: these are a round's fixed costs. The table of rounds splits the commit
  as a peer saw it (medians over the peers of `GroupMean.phases`): its wait for the groupmates' reports,
  then its audits and its wait for the other auditors' verdicts;
- **payload MB**: the tensor bytes each peer sent plus received in the round (averager.traffic's
  all-reduce phase: serialized parts only), the mean over peers and rounds, and the peak (the largest of any peer in
  any round); for N peers the ideal is 2 · 2(N−1)/N · S_codec;
- **eth0 MB**: the bytes each peer's interface (tun0 on the emulated internet) sent plus received from the common start to its
  return (everything: TCP/IP, TLS, yamux, protobuf framing, DHT and the round reports), mean and peak;
- **rounds ok**: rounds in which every peer got the full group and the same mean (sha256).

It prints a Markdown table of the medians, then one of every round's phases (matchmaking, all-reduce,
commit, round, CPU busy, and the TCP probes of the same round index), and writes the per-peer, per-round
records (results.json, peer*.jsonl, tcp*.jsonl) and the peers' logs under --out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.tcp_ceiling import PATTERNS, PORT, Sink, probe  # noqa: E402
from tests.emulated_internet import TUN_DEVICE  # noqa: E402

RUN = "allreduce-bench"
MATCHMAKING_TIME_S = 1.0
REQUEST_TIMEOUT_S = 0.5
COMMIT_TIMEOUT_S = 15.0
START_AHEAD_S = 0.3  # how far ahead of "all ready" the common start lies
STARTUP_TIMEOUT_S = 240.0  # torch and bitsandbytes imports and a DHT start on a busy 2-core machine


def limit_seconds(peers: int, sbytes: float, mbit: float) -> float:
    """The physical limit: each peer moves 2(N−1)/N · S through its own link of B in each direction."""
    return 2 * (peers - 1) / peers * sbytes / (mbit * 1e6 / 8)


def allreduce_timeout(plan: dict, phase: dict) -> float:
    """Generous: 4× the limit of fp32 plus 30 s (every peer computes the same value)."""
    return 4 * limit_seconds(plan["peers"], plan["numel"] * 4, phase["mbit"]) + 30.0


def phase_tag(index: int, phase: dict) -> str:
    return f"{index}-{phase['mbit']:g}-{phase['codec']}"


def tcp_probes(plan: dict, index: int) -> list[tuple[str, str, int]]:
    """Phase `index`'s TCP probes, in the order every peer runs them: (barrier name and tag, pattern, round)."""
    if not plan["tcp"]:
        return []
    return [(f"{index}-tcp-{pattern}-{r}", pattern, r) for r in range(plan["rounds"]) for pattern in PATTERNS]


def starts(plan: dict) -> list[tuple[int, str, str]]:
    """Every common start, in the order every peer goes through them: (phase, barrier name, what runs).
    Every phase's all-reduce rounds come first, then every phase's TCP probes: fp32 rounds at 20 Mbit/s
    right after the probes took 10.5–12.4 s, against 9.6–11.0 s without them."""
    phases = range(len(plan["phases"]))
    rounds = [(p, f"{p}-{r}", "all-reduce rounds") for p in phases for r in range(plan["rounds"])]
    return rounds + [(p, name, "TCP probes") for p in phases for name, _, _ in tcp_probes(plan, p)]


# ---------------------------------------------------------------------------------------------
# the peer process (--worker): one DHT node, one OuterSync per phase, rounds on the common start


def _iface_bytes(device: str) -> tuple[int, int]:
    """(tx, rx) bytes of `device`, this namespace's link (eth0 on the bridge, tun0 on the emulated internet)."""
    stats = Path("/sys/class/net") / device / "statistics"
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def _barrier(sync_dir: Path, name: str, index: int, timeout_s: float) -> float:
    """Report ready for `name` and wait for the coordinator's start time; return it."""
    (sync_dir / f"ready-{name}-{index}").touch()
    go = sync_dir / f"go-{name}"
    deadline = time.monotonic() + timeout_s
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no start for {name} within {timeout_s:.0f} s")
        time.sleep(0.005)
    return float(go.read_text())


class _StepWatch:
    """Wraps the averager's `step` to catch its StepControl, and notes when this peer's all-reduce
    began (stage RUNNING_ALLREDUCE: the group is formed) and when the step finished, and the CPU time
    this peer's processes (this one, its averager, its DHT and p2pd) used in between."""

    POLL_S = 0.002

    def __init__(self, averager):
        self.control = None
        original = averager.step

        def step(*args, **kwargs):
            self.control = original(*args, **kwargs)
            return self.control

        averager.step = step  # only this process calls it; the averager process is not touched

    def start(self) -> dict:
        from p2p_diloco import process_tree

        self.control, marks, stop = None, {}, threading.Event()
        pids = [os.getpid(), *process_tree.descendant_pids(os.getpid())]
        daemons = [pid for pid in pids if process_tree.command_name(pid) == "p2pd"]

        def cpu_now() -> tuple[float, float]:  # this peer's processes', and of them p2pd's
            return process_tree.cpu_seconds(pids), process_tree.cpu_seconds(daemons)

        def watch():
            while not stop.is_set():
                control = self.control
                if control is not None:
                    now = time.time()
                    if "began" not in marks and control.began_allreduce:
                        marks["began"] = now
                        marks["cpu_began"] = cpu_now()
                    if control.done():
                        marks["done"] = now
                        if "cpu_began" in marks:
                            (every, p2pd), (every_began, p2pd_began) = cpu_now(), marks.pop("cpu_began")
                            marks["cpu_s"], marks["p2pd_cpu_s"] = every - every_began, p2pd - p2pd_began
                        return
                time.sleep(self.POLL_S)

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        marks["_stop"], marks["_thread"] = stop, thread
        return marks

    @staticmethod
    def finish(marks: dict) -> dict:
        marks.pop("_stop").set()
        marks.pop("_thread").join(1.0)
        return marks


def _profile_averagers(out: Path, index: int) -> None:
    """Profile the event-loop thread of each averager this peer starts (cProfile, what the asyncio loop
    runs: hivemind's matchmaking and all-reduce, the p2p messages, our reducer and ledger; not the
    executor threads, where the codecs and the digests of the parts run), written to
    averager-<peer>-<pid>.prof under --out when the averager shuts down."""
    import cProfile

    from p2p_diloco.sync.exact_allreduce import ExactMeanAverager

    serve = ExactMeanAverager._run_internal

    def profiled(averager) -> None:
        profiler = cProfile.Profile()
        profiler.enable()
        try:
            serve(averager)
        finally:
            profiler.disable()
            profiler.dump_stats(out / f"averager-{index}-{os.getpid()}.prof")

    ExactMeanAverager._run_internal = profiled


def run_worker(args) -> None:
    import torch

    from p2p_diloco import process_tree
    from p2p_diloco.config import SwarmConfig
    from p2p_diloco.hashing import tensors_sha256
    from p2p_diloco.swarm.node import start_run_node, visible_maddrs
    from p2p_diloco.sync.codecs import CODECS, bytes_per_parameter
    from p2p_diloco.protocol.membership import MAX_LEADERS, Membership, leader_rank
    from p2p_diloco.sync.outer_sync import OuterSync, RoundFailed

    process_tree.children_exit_with_this_process()  # killed, it takes its DHT, averager and p2pd along
    out = Path(args.out)
    plan = json.loads((out / "plan.json").read_text())
    sync_dir, index, numel = out / "barrier", args.worker, plan["numel"]
    records = out / f"peer{index}.jsonl"
    # bitsandbytes is imported on first use, which takes seconds: here, before the averagers fork
    for codec in {phase["codec"] for phase in plan["phases"]}:
        CODECS[codec].decode(CODECS[codec].encode(torch.ones(256)), 256)
    node = start_run_node(RUN, args.ip, 0, initial_peers=args.initial_peers or ())
    if index == 0:
        print(" ".join(visible_maddrs(node.dht)), flush=True)
    (sync_dir / f"peer-id-{index}").write_text(node.dht.peer_id.to_base58())  # for the membership plans
    (sync_dir / f"ip-{index}").write_text(args.ip)  # for the TCP probes
    sink = Sink(args.ip)
    if plan["profile_averagers"]:
        _profile_averagers(out, index)

    def membership(outer_step: int, global_sha256: str):
        """The round's plan, as every peer computes it (planned matchmaking), or None (hivemind's)."""
        if not plan["planned"]:
            return None
        members = sorted((sync_dir / f"peer-id-{i}").read_text() for i in range(plan["peers"]))
        leaders = sorted(members, key=lambda pid: leader_rank(outer_step, global_sha256, pid))[:MAX_LEADERS]
        return Membership(tuple(leaders), tuple(members))
    sync = None
    try:
        for p, phase in enumerate(plan["phases"]):
            tag = phase_tag(p, phase)
            cfg = SwarmConfig(matchmaking_time=MATCHMAKING_TIME_S, request_timeout=REQUEST_TIMEOUT_S,
                              allreduce_timeout=allreduce_timeout(plan, phase), next_chunk_timeout=30.0,
                              commit_timeout=COMMIT_TIMEOUT_S)
            # its own averager prefix and outer steps: rounds of different phases never meet
            fingerprint = hashlib.sha256(f"{RUN} {tag}".encode()).hexdigest()
            sync = OuterSync(node.dht, RUN, fingerprint, node.identity.record_subkey, [torch.Size([numel])], cfg,
                             state_provider=lambda: ({}, []), codec=phase["codec"])
            watch = _StepWatch(sync.averager)
            global_sha256 = hashlib.sha256(tag.encode()).hexdigest()
            for r in range(plan["rounds"]):
                generator = torch.Generator().manual_seed(1_000_000 * p + 1000 * r + index)
                delta = torch.randn(numel, generator=generator) * 1e-3
                start = _barrier(sync_dir, f"{p}-{r}", index, STARTUP_TIMEOUT_S + 4 * cfg.allreduce_timeout)
                time.sleep(max(0.0, start - time.time()))
                allreduce0 = sync.averager.traffic.by_phase()["allreduce"]  # the all-reduce's alone: its payload
                tx0, rx0 = _iface_bytes(plan["iface"])
                marks = watch.start()
                called = time.time()
                mean, group_size, error, phases = None, None, None, None
                try:
                    result = sync.average([delta], samples=index + 1, outer_step=1000 * p + r,
                                          global_sha256=global_sha256,
                                          membership=membership(1000 * p + r, global_sha256))
                    mean, group_size, phases = result.mean, result.group_size, result.phases
                except RoundFailed as e:
                    error = str(e)
                returned = time.time()
                marks = watch.finish(marks)
                tx1, rx1 = _iface_bytes(plan["iface"])
                record = dict(peer=index, phase=p, mbit=phase["mbit"], codec=phase["codec"], round=r, start=start,
                              called=called, began=marks.get("began"), done=marks.get("done"), returned=returned,
                              cpu_s=marks.get("cpu_s"), p2pd_cpu_s=marks.get("p2pd_cpu_s"),
                              group_size=group_size, error=error, phases=phases,
                              mean_sha256=tensors_sha256(mean) if mean is not None else None,
                              **{way: count - allreduce0[way]
                                 for way, count in sync.averager.traffic.by_phase()["allreduce"].items()},
                              iface_tx=tx1 - tx0, iface_rx=rx1 - rx0)
                with open(records, "a") as f:
                    f.write(json.dumps(record) + "\n")
            sync.shutdown()
            sync = None
        addresses = [((sync_dir / f"ip-{i}").read_text(), PORT) for i in range(plan["peers"])]  # written by now
        for p, phase in enumerate(plan["phases"]):  # after every all-reduce (see `starts`)
            for name, pattern, r in tcp_probes(plan, p):
                timeout = allreduce_timeout(plan, phase)
                start = _barrier(sync_dir, name, index, STARTUP_TIMEOUT_S + 4 * timeout)
                result = probe(sink, pattern, index, addresses, numel * bytes_per_parameter(phase["codec"]), name,
                               start, timeout)
                with open(out / f"tcp{index}.jsonl", "a") as f:
                    f.write(json.dumps(dict(peer=index, phase=p, round=r, **result)) + "\n")
        _barrier(sync_dir, "end", index, 600.0)  # nobody leaves (peer 0 is the DHT's entry) before all are done
    finally:
        children = process_tree.descendant_pids(os.getpid())
        sink.close()
        if sync is not None:
            sync.shutdown()
        node.dht.shutdown()
        process_tree.stop_processes(process_tree.without_torch_shm_manager(children))


# ---------------------------------------------------------------------------------------------
# the coordinator: namespaces, rates, barriers, and the table


def _wait_ready(sync_dir: Path, name: str, procs, peers: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all((sync_dir / f"ready-{name}-{i}").exists() for i in range(peers)):
        dead = [i for i, proc in enumerate(procs) if proc.poll() is not None]
        if dead:
            raise RuntimeError(f"peer(s) {dead} exited before {name}; see their logs under {sync_dir.parent}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"not every peer was ready for {name} within {timeout_s:.0f} s")
        time.sleep(0.01)


def _go(sync_dir: Path, name: str) -> None:
    tmp = sync_dir / f".go-{name}"
    tmp.write_text(repr(time.time() + START_AHEAD_S))
    tmp.rename(sync_dir / f"go-{name}")  # atomic: a peer never reads a half-written time


def _stop(procs) -> None:
    from p2p_diloco.process_tree import kill_tree, wait_gone

    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the peer's `finally` stops its DHT, averager and p2pd
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            below = kill_tree(proc.pid)
            proc.wait(10)
            for pid in wait_gone(below, 10):
                kill_tree(pid)


def _read_records(paths) -> list[dict]:
    return [json.loads(line) for path in paths if path.exists() for line in path.read_text().splitlines()
            if line.strip()]


def network(args, peers: int):
    """The peers' namespaces (a context manager), their hosts, and how to shape their links to a rate (None
    on the emulated internet, whose uplinks are set when it is made)."""
    if not args.regions:
        from tests.netns import Topology
        topology = Topology()
        try:
            hosts = [topology.add_public(f"peer{i}") for i in range(peers)]
        except BaseException:
            topology.close()
            raise
        return topology, hosts, lambda host, mbit: topology.limit_rate(host, mbit, args.burst_ms)
    from tests.emulated_internet import Internet, Site
    internet = Internet([Site(f"peer{i}", region, args.rates[0]) for i, region in enumerate(args.regions)],
                        loss=args.loss)
    return internet, [internet.hosts[f"peer{i}"] for i in range(peers)], None


def _log_router(out: Path, start: str, internet) -> None:
    """Append the router's counters per host, as `start` begins, to out/router.jsonl (drops, SYNs dropped)."""
    from dataclasses import asdict
    counters = {host: asdict(c) for host, c in internet.counters().items()}
    with open(out / "router.jsonl", "a") as f:
        f.write(json.dumps(dict(start=start, time=time.time(), hosts=counters)) + "\n")


def run(args, plan: dict, out: Path) -> tuple[list[dict], list[dict]]:
    """Every peer's all-reduce records and TCP probe records."""
    sync_dir = out / "barrier"
    sync_dir.mkdir(parents=True, exist_ok=True)
    for path in [*sync_dir.iterdir(), *out.glob("peer*.jsonl"), *out.glob("tcp*.jsonl"), *out.glob("router.jsonl")]:
        path.unlink()
    (out / "plan.json").write_text(json.dumps(plan, indent=2))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    me = [sys.executable, str(Path(__file__).resolve()), "--out", str(out)]
    procs: list[subprocess.Popen] = []
    namespaces, hosts, shape = network(args, plan["peers"])
    with namespaces as topology:
        try:
            first = topology.popen(hosts[0], [*me, "--worker", "0", "--ip", hosts[0].ip], stdout=subprocess.PIPE,
                                   stderr=open(out / "peer0.log", "w"), text=True, env=env)
            procs.append(first)
            ready, _, _ = select.select([first.stdout], [], [], STARTUP_TIMEOUT_S)
            maddrs = first.stdout.readline().split() if ready else []
            if not maddrs:
                raise RuntimeError(f"peer 0 did not start its DHT; see {out / 'peer0.log'}")
            for i, host in enumerate(hosts[1:], start=1):
                procs.append(topology.popen(host, [*me, "--worker", str(i), "--ip", host.ip, "--initial-peers", *maddrs],
                                            stdout=subprocess.DEVNULL, stderr=open(out / f"peer{i}.log", "w"), env=env))
            shaped, announced = None, None
            for p, name, what in starts(plan):
                phase = plan["phases"][p]
                if (p, what) != announced:
                    print(f"{phase['mbit']:g} Mbit/s, {phase['codec']}: {plan['rounds']} {what}", file=sys.stderr,
                          flush=True)
                    announced = (p, what)
                timeout = STARTUP_TIMEOUT_S + 4 * allreduce_timeout(plan, phase) + COMMIT_TIMEOUT_S
                _wait_ready(sync_dir, name, procs, plan["peers"], timeout)
                if phase["mbit"] != shaped and shape:  # only now: every peer is done with the last rate
                    for host in hosts:
                        shape(host, phase["mbit"])
                    shaped = phase["mbit"]
                if shape is None:  # the emulated internet: its router's counters as each round begins
                    _log_router(out, name, topology)
                _go(sync_dir, name)
            _wait_ready(sync_dir, "end", procs, plan["peers"], 4 * allreduce_timeout(plan, plan["phases"][-1]) + 60)
            if shape is None:
                _log_router(out, "end", topology)
            _go(sync_dir, "end")
            deadline = time.monotonic() + 60  # each peer shuts down by itself; _stop below ends the rest
            while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            _stop(procs)
    peers = range(plan["peers"])
    return _read_records(out / f"peer{i}.jsonl" for i in peers), _read_records(out / f"tcp{i}.jsonl" for i in peers)


def tcp_round_seconds(plan: dict, tcp_records: list[dict], index: int) -> dict[str, list[Optional[float]]]:
    """Per pattern and round of phase `index`, (the last byte any peer received) − (the common start), or
    None where not every peer's flows ended."""
    seconds = {}
    for pattern in PATTERNS:
        seconds[pattern] = []
        for r in range(plan["rounds"]):
            got = [x for x in tcp_records if x["phase"] == index and x["round"] == r and x["pattern"] == pattern]
            seconds[pattern].append(max(x["end"] for x in got) - got[0]["start"] if len(got) == plan["peers"] else None)
    return seconds


def summarize(plan: dict, records: list[dict], tcp_records: list[dict]) -> list[dict]:
    from p2p_diloco.sync.codecs import bytes_per_parameter

    peers, numel = plan["peers"], plan["numel"]
    rows = []
    for p, phase in enumerate(plan["phases"]):
        per_round = []
        for r in range(plan["rounds"]):
            got = [x for x in records if x["phase"] == p and x["round"] == r]
            ok = (len(got) == peers and all(x["error"] is None and x["group_size"] == peers for x in got)
                  and len({x["mean_sha256"] for x in got}) == 1 and all(x["began"] and x["done"] for x in got))
            if not ok:
                continue
            allreduce_s = max(x["done"] for x in got) - min(x["began"] for x in got)
            per_round.append(dict(
                round=r, allreduce_s=allreduce_s,
                round_s=max(x["returned"] for x in got) - got[0]["start"],
                matchmaking_s=min(x["began"] for x in got) - got[0]["start"],
                payload=[x["sent"] + x["received"] for x in got],
                split_limit_s=max(max(x["sent"], x["received"]) for x in got) / (phase["mbit"] * 1e6 / 8),
                iface=[x["iface_tx"] + x["iface_rx"] for x in got],
                cpu_cores=sum(x["cpu_s"] for x in got) / allreduce_s,
                p2pd_cpu_cores=sum(x["p2pd_cpu_s"] for x in got) / allreduce_s,
                # this peer's wait for the groupmates' reports, and its audits and the other auditors' verdicts
                reports_s=statistics.median(x["phases"]["commit"] for x in got),
                audit_s=statistics.median(x["phases"]["audit"] for x in got),
            ))
        bpp = bytes_per_parameter(phase["codec"])
        s_codec = numel * bpp
        limit = limit_seconds(peers, s_codec, phase["mbit"])
        payload = [b for x in per_round for b in x["payload"]]
        iface = [b for x in per_round for b in x["iface"]]
        def median(key: str, rounds=per_round):
            return statistics.median(x[key] for x in rounds) if rounds else None

        allreduce = median("allreduce_s")
        tcp_each_round = tcp_round_seconds(plan, tcp_records, p)
        tcp = {k: statistics.median(done) if (done := [t for t in v if t is not None]) else None
               for k, v in tcp_each_round.items()}
        for x in per_round:
            x["commit_s"] = x["round_s"] - x["matchmaking_s"] - x["allreduce_s"]
        rows.append(dict(
            mbit=phase["mbit"], codec=phase["codec"], peers=peers, numel=numel, bytes_per_parameter=bpp,
            s_codec_bytes=s_codec, limit_s=limit, allreduce_s=allreduce, round_s=median("round_s"),
            matchmaking_s=median("matchmaking_s"), commit_s=median("commit_s"),
            efficiency=limit / allreduce if allreduce else None,
            tcp_s=tcp, tcp_efficiency={k: limit / v if v else None for k, v in tcp.items()},
            of_tcp=tcp["all-to-all"] / allreduce if allreduce and tcp["all-to-all"] else None,
            split_limit_s=median("split_limit_s"), cpu_cores=median("cpu_cores"),
            p2pd_cpu_cores=median("p2pd_cpu_cores"),
            allreduce_s_each_round=[x["allreduce_s"] for x in per_round],
            per_round=[{k: v for k, v in x.items() if k in ROUND_PHASES} for x in per_round],
            tcp_s_each_round=tcp_each_round,
            ideal_payload_bytes_per_peer=2 * 2 * (peers - 1) / peers * s_codec,
            payload_bytes_per_peer_mean=statistics.mean(payload) if payload else None,
            payload_bytes_per_peer_peak=max(payload, default=None),
            iface_bytes_per_peer_mean=statistics.mean(iface) if iface else None,
            iface_bytes_per_peer_peak=max(iface, default=None),
            rounds_ok=len(per_round), rounds=plan["rounds"],
        ))
    return rows


ROUND_PHASES = ("round", "matchmaking_s", "allreduce_s", "commit_s", "reports_s", "audit_s", "round_s", "cpu_cores",
                "p2pd_cpu_cores")


def num(value, fmt: str) -> str:
    return format(value, fmt) if value is not None else "–"


def print_rounds(rows: list[dict]) -> None:
    """Each round's phases, where the medians of the first table come from; a round that was not full, or
    gave the peers different means, is listed as failed."""
    print("\n| Mbit/s | codec | round | matchmaking s | all-reduce s | commit s (a peer's reports, audit) | round s | "
          "CPU busy, p2pd's | " + " | ".join(f"{pattern} TCP s" for pattern in PATTERNS) + " |")
    print("|---:|---|---:|---:|---:|---|---:|---|" + "---:|" * len(PATTERNS))
    for row in rows:
        done = {x["round"]: x for x in row["per_round"]}
        for r in range(row["rounds"]):
            tcp = " | ".join(num(row["tcp_s_each_round"][pattern][r], ".2f") for pattern in PATTERNS)
            x = done.get(r)
            phases = ("failed | – | – | – | –" if x is None else
                      f"{x['matchmaking_s']:.2f} | {x['allreduce_s']:.2f} | {x['commit_s']:.2f} ({x['reports_s']:.2f}, "
                      f"{x['audit_s']:.2f}) | {x['round_s']:.2f} | "
                      f"{x['cpu_cores']:.2f}, {x['p2pd_cpu_cores']:.2f}")
            print(f"| {row['mbit']:g} | {row['codec']} | {r} | {phases} | {tcp} |")


def print_table(plan: dict, rows: list[dict]) -> None:
    def mb(value):
        return num(value / 1e6 if value is not None else None, ".2f")

    where = (f"on the emulated internet ({', '.join(plan['regions'])}; uplinks only; loss {plan['loss']:g})"
             if plan["regions"] else "on a bridge")
    print(f"\n{plan['peers']} peers {where}, S = {plan['numel'] * 4 / 1e6:g} MB fp32 ({plan['numel']:,} parameters), "
          f"{plan['rounds']} rounds each, {'planned' if plan['planned'] else 'hivemind'} matchmaking; medians over "
          f"the rounds; MB = 10^6 bytes, sent + received per peer per round\n")
    print("| Mbit/s | codec | S_codec MB | limit s | all-reduce s | efficiency | split limit s | "
          "TCP all-to-all s (of limit) | one TCP flow per link s (of limit) | all-reduce of TCP all-to-all | "
          f"CPU busy (of {os.cpu_count()} cores), p2pd's | round s | matchmaking s | commit s | "
          f"payload MB mean / peak (ideal) | {plan['iface']} MB mean / peak | rounds ok |")
    print("|---:|---|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---|---|---:|")
    for r in rows:
        print(f"| {r['mbit']:g} | {r['codec']} | {r['s_codec_bytes'] / 1e6:.2f} | {r['limit_s']:.2f} | "
              f"{num(r['allreduce_s'], '.2f')} | {num(r['efficiency'], '.2f')} | {num(r['split_limit_s'], '.2f')} | "
              + " | ".join(f"{num(r['tcp_s'][k], '.2f')} ({num(r['tcp_efficiency'][k], '.2f')})" for k in PATTERNS)
              + f" | {num(r['of_tcp'], '.2f')} | "
              f"{num(r['cpu_cores'], '.2f')}, {num(r['p2pd_cpu_cores'], '.2f')} | "
              f"{num(r['round_s'], '.2f')} | {num(r['matchmaking_s'], '.2f')} | {num(r['commit_s'], '.2f')} | "
              f"{mb(r['payload_bytes_per_peer_mean'])} / {mb(r['payload_bytes_per_peer_peak'])} "
              f"({mb(r['ideal_payload_bytes_per_peer'])}) | "
              f"{mb(r['iface_bytes_per_peer_mean'])} / {mb(r['iface_bytes_per_peer_peak'])} | "
              f"{r['rounds_ok']}/{r['rounds']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbit", default="20,100,1000", help="link rates in Mbit/s, comma-separated (each direction)")
    parser.add_argument("--codecs", default="all", help="comma-separated codec names, or 'all'")
    parser.add_argument("--peers", type=int, help="N, peers in the all-reduce (at least 2; default 3, or one per "
                                                   "--regions)")
    parser.add_argument("--mbytes", type=float, default=16.0, help="S: fp32 size of the averaged tensor, in 10^6 bytes")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per rate and codec")
    parser.add_argument("--burst-ms", type=float, default=2.0, help="tbf bucket, in ms of the rate (at least 64 KiB)")
    parser.add_argument("--no-tcp", dest="tcp", action="store_false",
                        help="skip the rounds of plain TCP moving each rate and codec's bytes after the all-reduces "
                             "(benchmarks/tcp_ceiling.py: the ceiling of an all-reduce over TCP on these links)")
    parser.add_argument("--profile-averagers", action="store_true",
                        help="profile each averager's event-loop thread (cProfile; averager-<peer>-<pid>.prof under "
                             "--out, read with python -m pstats): it slows what it measures")
    parser.add_argument("--matchmaking", choices=("planned", "hivemind"), default="planned",
                        help="how each round's group forms: from the membership plan, as the training loop does "
                             "(default), or by hivemind's matchmaking for matchmaking_time")
    parser.add_argument("--regions", default="",
                        help="comma-separated, one per peer (us, eu, asia): the peers on the emulated internet, "
                             "with these regions' round trips and --mbit (one rate) as every uplink")
    parser.add_argument("--loss", type=float, default=0.0, help="with --regions: the share of packets lost")
    parser.add_argument("--out", default="bench-out/allreduce-bandwidth")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ip", help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:  # SIGTERM from the coordinator: run the worker's `finally`
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        return run_worker(args)

    from p2p_diloco.sync.codecs import CODECS
    from tests.netns import unavailable

    codecs = list(CODECS) if args.codecs == "all" else [c.strip() for c in args.codecs.split(",") if c.strip()]
    unknown = [c for c in codecs if c not in CODECS]
    if unknown:
        parser.error(f"unknown codec(s) {', '.join(unknown)}; valid: {', '.join(CODECS)}")
    try:
        rates = [float(x) for x in args.mbit.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--mbit {args.mbit!r}: expected numbers separated by commas")
    args.rates = rates
    args.regions = [r.strip() for r in args.regions.split(",") if r.strip()]
    if args.peers is None:
        args.peers = len(args.regions) or 3
    if not rates or min(rates) <= 0 or args.peers < 2 or args.rounds < 1 or args.mbytes <= 0 or args.burst_ms <= 0:
        parser.error("need rates > 0, --peers >= 2, --rounds >= 1, --mbytes > 0 and --burst-ms > 0")
    if args.regions:
        from tests.emulated_internet import REGIONS, unavailable  # noqa: F811: namespaces and TUN devices
        if len(args.regions) != args.peers:
            parser.error(f"--regions names {len(args.regions)} regions for --peers {args.peers}: one per peer")
        if unknown := sorted(set(args.regions) - set(REGIONS)):
            parser.error(f"--regions: unknown {', '.join(unknown)}; valid: {', '.join(REGIONS)}")
        if len(rates) != 1:
            parser.error("--regions takes one --mbit rate: the emulated internet's uplinks are set when it is made")
        if not 0.0 <= args.loss < 1.0:
            parser.error("--loss must be in [0, 1)")
    elif args.loss:
        parser.error("--loss needs --regions (the bridge's links lose nothing)")
    if (why := unavailable()) is not None:
        sys.exit(f"error: network namespaces{' and TUN devices' if args.regions else ''} are unavailable: {why}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = dict(peers=args.peers, numel=int(args.mbytes * 1e6 / 4), rounds=args.rounds,
                matchmaking_time=MATCHMAKING_TIME_S, request_timeout=REQUEST_TIMEOUT_S, burst_ms=args.burst_ms,
                planned=args.matchmaking == "planned", tcp=args.tcp, regions=args.regions, loss=args.loss,
                iface=TUN_DEVICE if args.regions else "eth0", profile_averagers=args.profile_averagers,
                phases=[dict(mbit=rate, codec=codec) for rate in rates for codec in codecs])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("error: stopped (SIGTERM)"))  # `finally` stops the peers
    began = time.monotonic()
    records, tcp_records = run(args, plan, out)
    rows = summarize(plan, records, tcp_records)
    (out / "results.json").write_text(json.dumps(dict(plan=plan, rows=rows, records=records, tcp_records=tcp_records),
                                                 indent=2))
    print_table(plan, rows)
    print_rounds(rows)
    print(f"\n{time.monotonic() - began:.0f} s in all; records under {out}")
    if any(r["rounds_ok"] == 0 for r in rows):
        sys.exit("error: some rate and codec had no complete round; see the peers' logs")


if __name__ == "__main__":
    main()
