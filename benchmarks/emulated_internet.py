"""The sync over home uplinks (issue 43): 4 peers of the 14.7M model over us/eu/asia, through the emulated internet.

    sudo .venv/bin/python benchmarks/emulated_internet.py                       # 4 peers, 3 outer steps, 20 Mbit/s
    sudo .venv/bin/python benchmarks/emulated_internet.py --peers 8 --mbit 10 --loss 0.01 --outer-steps 5

A bootstrap node and --peers `p2p-diloco peer` processes, each host in a network namespace of the emulated
internet (tests/emulated_internet.py: a TUN device per host, one router process adding each pair's delay,
round trips 20-230 ms, every uplink a token bucket of --mbit). The peers take turns over the regions (peer0
us, peer1 eu, peer2 asia, peer3 us, ...), the bootstrap node is in us. The run config is
benchmarks/utilization.py's 100mbit one: peers/demo.toml with the 14.7M-parameter model (hidden 512,
4 layers), batch 4 x 64 tokens, H = 20, and the shipped [outer] defaults (the sync a new user gets). The
peers start together (--wait-for-peers), take --outer-steps outer steps and exit.

Per peer it prints:
- compute utilization: Σ inner seconds / Σ wall seconds of outer steps 2..K (the first also holds the
  start-up), and the median of each record's own;
- a round's sync (the median over steps 2..K of the sum of its sync_phases: waiting for the groupmates,
  matchmaking, a late member's Δ, the all-reduce, the reports and commit, the audit) against the link's
  limit for its bytes: what the router saw the peer send during that round, at --mbit;
- the all-reduce's share of the link: the bytes its metrics count for the round's all-reduce
  (``bytes_by_phase``'s, or all of bytes_sent's increment where the metrics do not break them down) at
  --mbit, over the all-reduce phase's seconds;
- the router's bytes against the metrics' per peer, sent and received (TCP/UDP payload, each TCP byte once:
  retransmissions apart; whole run), and the router's bytes per round;
and how late the router wrote packets out (its CPU share: a late router is extra delay), and its drops.
A round's router bytes are the router's counts read every --sample seconds, taken at the records' times.
It also writes results.json, the run config, the peers' metrics and logs, and the router's counters under
--out. On 2 cores the 4 peers' inner steps share the CPUs: the utilization here is bounded by the CPU,
not only by the links (see docs/benchmarks.md). Needs root, `ip` and /dev/net/tun.
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.utilization import (  # noqa: E402
    CLI, ENV, PHASES, Processes, analyse, count_parameters, layout_base, read_address, write_toml,
)
from p2p_diloco.metrics import read_metrics  # noqa: E402
from tests.emulated_internet import REGIONS, Internet, Site, unavailable  # noqa: E402

BOOTSTRAP_PORT = "31337"


def run_config(out: Path) -> Path:
    raw = layout_base("100mbit")  # the 14.7M model, batch 4, H = 20
    raw["run"]["name"] = "internet"
    raw["swarm"].pop("initial_peers", None)  # the peers get the bootstrap node's address on the command line
    return write_toml(raw, out / "run.toml")


def sample_counters(internet: Internet, samples: list) -> None:
    counted = internet.counters()
    samples.append((time.time(), {name: (c.sent_payload, c.received_payload) for name, c in counted.items()}))


def router_at(samples: list, name: str, when: float) -> tuple[int, int]:
    """The router's (sent, received) payload of host `name` at the last sample before `when`."""
    index = bisect.bisect_right([t for t, _ in samples], when) - 1
    return samples[index][1][name] if index >= 0 else (0, 0)


def run(args, out: Path, config: Path, sites: list[Site]) -> tuple[dict, list]:
    """Start the bootstrap node and the peers inside the internet, sample the router until the peers exit."""
    samples: list = []
    peers, bootstrap = Processes(), Processes()
    with Internet(sites, loss=args.loss, workdir=out / "router") as internet:
        try:
            boot = internet.hosts["bootstrap"]
            proc = bootstrap.start(
                internet.command(boot, [*CLI, "bootstrap", "--host", boot.ip, "--port", BOOTSTRAP_PORT]),
                stdout=subprocess.PIPE, stderr=open(out / "bootstrap.log", "w"), text=True, env=ENV)
            maddr = read_address(proc, out / "bootstrap.log")
            started = time.monotonic()
            for site in sites[1:]:
                host = internet.hosts[site.name]
                peers.start(internet.command(host, [
                    *CLI, "peer", "--config", str(config), "--host", host.ip, "--initial-peers", maddr,
                    "--metrics-file", str(out / f"{site.name}.jsonl"), "--max-outer-steps", str(args.outer_steps),
                    "--wait-for-peers", str(args.peers)]),
                    stdout=open(out / f"{site.name}.log", "w"), stderr=subprocess.STDOUT, env=ENV)
            while any(p.poll() is None for p in peers.procs) and time.monotonic() - started < args.timeout:
                peers.note_descendants()
                sample_counters(internet, samples)
                time.sleep(args.sample)
            sample_counters(internet, samples)
            finished = all(p.poll() is not None for p in peers.procs)
        finally:
            left = peers.stop() + bootstrap.stop()
    (out / "router" / "samples.json").write_text(json.dumps(samples))
    return dict(wall_seconds=round(time.monotonic() - started, 1), finished_in_time=finished,
                exit_codes=[p.returncode for p in peers.procs], left_behind=left), samples


def allreduce_bytes(record: dict) -> int:
    """The bytes the peer sent in all-reduces so far: the all-reduce phase's where the metrics break them down
    (``bytes_by_phase``), else all it counted."""
    return record.get("bytes_by_phase", {}).get("allreduce", {}).get("sent", record["bytes_sent"])


def per_peer(out: Path, name: str, samples: list, mbit: float) -> dict:
    """The link's numbers of one peer, from its metrics and the router's samples."""
    bytes_per_s = mbit * 1e6 / 8
    steps = [r for r in read_metrics(out / f"{name}.jsonl") if r["event"] == "outer_step"]
    rounds = []
    for before, record in zip(steps, steps[1:]):  # steps 2..K, each against the one before
        sent = record["bytes_sent"] - before["bytes_sent"]
        allreduce_sent = allreduce_bytes(record) - allreduce_bytes(before)
        router_sent = router_at(samples, name, record["time"])[0] - router_at(samples, name, before["time"])[0]
        phases = record.get("sync_phases") or {}
        sync = sum(phases.get(phase, 0.0) for phase in PHASES)
        allreduce = phases.get("allreduce", 0.0)
        rounds.append(dict(sync_s=sync, metrics_sent=sent, router_sent=router_sent,
                           limit_s=router_sent / bytes_per_s,
                           allreduce_share=allreduce_sent / bytes_per_s / allreduce if allreduce > 0 else None))
    last = [r for r in read_metrics(out / f"{name}.jsonl") if "bytes_sent" in r]
    metrics_total = (last[-1]["bytes_sent"], last[-1]["bytes_received"]) if last else (0, 0)
    median = lambda key: statistics.median(r[key] for r in rounds if r[key] is not None) if rounds else None  # noqa: E731
    return dict(rounds=rounds, sync_s=median("sync_s"), limit_s=median("limit_s"),
                metrics_sent_per_round=median("metrics_sent"), router_sent_per_round=median("router_sent"),
                allreduce_share=median("allreduce_share"), metrics_total=metrics_total,
                router_total=samples[-1][1][name] if samples else (0, 0))


def table(sites: list[Site], analysis: dict, links: dict) -> str:
    rows = ["| peer | region | utilization after step 1 (median per step) | sync s per round | link's limit s for "
            "its bytes (router) | sync / limit | all-reduce's share of the link | MB sent per round: metrics / "
            "router | MB sent, whole run: metrics / router | MB received, whole run: metrics / router |",
            "|---|---|---|---:|---:|---:|---:|---|---|---|"]
    fmt = lambda value, spec: "–" if value is None else format(value, spec)  # noqa: E731
    for site in sites[1:]:
        util, link = analysis["peers"][site.name], links[site.name]
        ratio = link["sync_s"] / link["limit_s"] if link["sync_s"] and link["limit_s"] else None
        per_round = (f"{fmt(link['metrics_sent_per_round'] and link['metrics_sent_per_round'] / 1e6, '.1f')} / "
                     f"{fmt(link['router_sent_per_round'] and link['router_sent_per_round'] / 1e6, '.1f')}")
        (m_sent, m_received), (r_sent, r_received) = link["metrics_total"], link["router_total"]
        rows.append(
            f"| {site.name} | {site.region} | {fmt(util['utilization_after_first'], '.2f')} "
            f"({fmt(util['median_record_utilization'], '.2f')}) | {fmt(link['sync_s'], '.1f')} | "
            f"{fmt(link['limit_s'], '.1f')} | {fmt(ratio, '.2f')} | {fmt(link['allreduce_share'], '.2f')} | "
            f"{per_round} | {m_sent / 1e6:.1f} / {r_sent / 1e6:.1f} | {m_received / 1e6:.1f} / {r_received / 1e6:.1f} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--outer-steps", type=int, default=3, help="K, outer steps each peer takes (>= 2)")
    parser.add_argument("--mbit", type=float, default=20.0, help="every host's uplink, Mbit/s")
    parser.add_argument("--loss", type=float, default=0.0, help="share of packets lost on the way")
    parser.add_argument("--sample", type=float, default=1.0, help="seconds between reads of the router's counters")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before the peers are stopped")
    parser.add_argument("--out", default="bench-out/emulated_internet")
    args = parser.parse_args()
    if args.peers < 2 or args.outer_steps < 2 or args.mbit <= 0 or not 0 <= args.loss < 1:
        parser.error("--peers and --outer-steps must be >= 2, --mbit positive, --loss in [0, 1)")
    if why := unavailable():
        sys.exit(f"error: {why}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("peer*.jsonl"):
        old.unlink()
    config = run_config(out)
    parameters = count_parameters(config)  # also trains the tokenizer once, before the peers
    sites = [Site("bootstrap", "us", args.mbit)] + [
        Site(f"peer{i}", REGIONS[i % len(REGIONS)], args.mbit) for i in range(args.peers)]
    print(f"{args.peers} peers, {parameters / 1e6:.1f}M parameters, {args.outer_steps} outer steps, "
          f"{args.mbit:g} Mbit/s uplinks, loss {args.loss:g} ...", file=sys.stderr)
    began = time.monotonic()
    outcome, samples = run(args, out, config, sites)
    analysis = analyse(out, args.peers, args.outer_steps, 1)
    links = {site.name: per_peer(out, site.name, samples, args.mbit) for site in sites[1:]}
    (out / "results.json").write_text(json.dumps(dict(args=vars(args), parameters=parameters, run=outcome,
                                                      analysis=analysis, links=links), indent=2))
    agreement = "yes" if analysis["every_peer_every_step_full_group_one_hash"] else "no"
    print(f"\n{args.peers} peers of the {parameters / 1e6:.1f}M model (H = 20, the shipped [outer] defaults) over "
          f"{', '.join(f'{s.name} {s.region}' for s in sites[1:])}; {args.mbit:g} Mbit/s uplinks, loss {args.loss:g}; "
          f"{args.outer_steps} outer steps in {outcome['wall_seconds']:.0f} s; every step one hash with every peer: "
          f"{agreement} ({analysis['steps_recorded']} steps recorded"
          + "".join(f", {k} ×{v}" for k, v in sorted(analysis["other_events"].items())) + ")\n")
    print(table(sites, analysis, links))
    router = json.loads((out / "router" / "stats.json").read_text())
    print(f"\nthe router wrote packets out {router['late_ms_mean']:.2f} ms late on average ({router['late_ms_max']:.1f} ms "
          f"at most); packets its uplink queues dropped: "
          + ", ".join(f"{name} {c['dropped']}" for name, c in router["hosts"].items())
          + "; MB sent again (TCP retransmissions, not in the table): "
          + ", ".join(f"{name} {c['sent_retransmitted'] / 1e6:.2f}" for name, c in router["hosts"].items())
          + f"; lost: {sum(c['lost'] for c in router['hosts'].values())}; to no host: {router['unroutable']}")
    print(f"\nwrote {out / 'results.json'}; benchmark wall time {time.monotonic() - began:.0f} s")
    if outcome["left_behind"]:
        print(f"warning: processes left behind: {outcome['left_behind']}", file=sys.stderr)
    return 0 if outcome["finished_in_time"] else 1


if __name__ == "__main__":
    sys.exit(main())
