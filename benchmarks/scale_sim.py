"""Simulated outer step of a DiLoCo swarm of N peers: seconds per step and share of work counted, up to N = 1,000.

    python benchmarks/scale_sim.py --trials 200            # the default grid, a few seconds
    python benchmarks/scale_sim.py --peers 16,64 --groups 8 --fail-p 0.02 --strategies retry
    python benchmarks/scale_sim.py --calibrate measured.json --fit   # simulated vs measured sync_s

Nothing runs on a network: this is a Monte Carlo of a model (numpy only, seeded), with each piece a
small function whose docstring gives its formula. One trial is one outer step:

1. **Compute**: J ~ Poisson(--churn-per-step) peers (at most N-1) joined this step: they download
   the state and train nothing this step. Each of the others runs H inner steps (--inner-steps) of
   --compute-s seconds times a lognormal factor (sigma --compute-spread, median 1), publishes
   "ready" and waits until no live peer is still training, at most --round-wait-s after the first
   ready peer. Later peers miss the step: their work does not count in it (they keep it and bring it
   to the next step, which this model does not follow: it counts as "not counted" here).
2. **Membership** (:func:`membership_s`): one leader list for all; the followers' join requests
   cost one RTT (--latency-s) and the leader handles them one by one (--join-cost-s each). A leader
   that dies before the group is assembled costs --request-timeout-s, then the next leader is asked.
3. **All-reduce**: G >= n: flat butterfly (:func:`butterfly_s`); G < n: the exact relay of
   p2p_diloco.sync.relay in k = ceil(n/G) groups (:func:`relay_s`): every reducer still reduces all
   n inputs of its share (exact for any robust rule), but a sender dials only its group and its
   column, and a part for a reducer outside both is forwarded by a relay, results likewise. A transfer stage costs
   bytes / --bandwidth + streams * --stream-overhead-s + --latency-s, stages run one after another;
   a reducer's CPU is --reduce-s-per-mb-per-sender * MB of its part * senders.
4. **Commit** (:func:`commit_s`): --commit-s + log2(n) * --latency-s (signed reports on the DHT).

**Failures** (--fail-model): `attempt` (default) -- in every sync attempt, each leader asked is dead
with probability --fail-p, and each member of the group dies inside the attempt's all-reduce +
commit with probability --fail-p, at a moment uniform over that window; so P(an attempt of n
members has no failure) = (1 - fail-p)^n, whatever the attempt's length (pessimistic for short ones).
`step` -- every peer dies with probability --fail-p at a moment uniform over the failure-free
step (compute until the round wait ends + sync); a death while training only loses that peer's
work. Dead peers never come back within the step. A death in the all-reduce or commit is handled per --strategies:

* `void` (the old behaviour): the step is void for everyone, after --detect-s from the death
  (hivemind's next_chunk timeout), or --commit-timeout-s after the commit began for a death in it;
* `retry` (what the package does): void as above, then the survivors run membership + all-reduce
  + commit again, --attempts attempts in all; the last one failing means nothing counts;
* `re-reduce`: after --detect-s a new reducer takes over the dead member's part (the survivors
  resend it their inputs for it). A reducer's load is ~S bytes in and out in either shape, so the
  redo costs one all-reduce time (:func:`redo_s`); concurrent deaths are redone in parallel. A death
  in the commit costs --commit-timeout-s. The step completes with all but the dead.

Share counted = (members in the applied mean) / N. A trial's step seconds run from the step's
start to the applied (or voided) mean. Outputs (--out, default bench-out/scale_sim): Markdown
tables on stdout (step seconds mean / p90, share counted, bytes and streams per peer against a flat
butterfly), results.json, and scale_sim.png (if matplotlib is installed).

--calibrate FILE reads measured points [{"peers": 16, "step_s": 41.2, "sync_s": 6.3}, ...] (an
entry may add "group" and "fail_p"; sync_s: seconds from a peer's ready to the applied mean, mean
over peers) and prints them next to the simulation (flat butterfly, strategy retry, fail-p 0 unless
given). With --fit it also fits --stream-overhead-s and --commit-s to the measured sync_s by least
squares (at fail-p 0 the simulated sync_s is affine in both) and prints the refitted simulation.

Limits: one bandwidth for every peer, full duplex, no congestion in the network core; stream
opens are serial; a short group (n not a multiple of k) is treated as balanced; churn joiners'
state downloads take no bandwidth; a member that dies during another's redo counts as a death in
the commit (no second redo); the peers that miss a step are not followed into the next one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import numpy as np

MB = 1e6
STRATEGIES = ("void", "retry", "re-reduce")


@dataclasses.dataclass(frozen=True)
class Params:
    inner_steps: int = 25
    compute_s: float = 1.0
    compute_spread: float = 0.1
    round_wait_s: float = 30.0
    latency_s: float = 0.05
    join_cost_s: float = 0.002
    request_timeout_s: float = 2.0
    model_bytes: float = 2e6
    bandwidth: float = 12.5e6
    stream_overhead_s: float = 0.01
    reduce_s_per_mb_per_sender: float = 0.002
    commit_s: float = 1.0
    detect_s: float = 10.0
    commit_timeout_s: float = 15.0
    attempts: int = 2
    churn_per_step: float = 0.0
    fail_model: str = "attempt"
    host_cores: int = 0  # 0: every peer on a machine of its own; C: all N peers share C cores (a local benchmark)


def membership_s(p: Params, n: int, dead_leaders: int = 0, dead_followers: bool = False) -> float:
    """latency + (n-1) * join_cost + dead_leaders * request_timeout (+ request_timeout if followers died)."""
    return (p.latency_s + max(n - 1, 0) * p.join_cost_s
            + (dead_leaders + bool(dead_followers)) * p.request_timeout_s)


def groups(n: int, g: int) -> tuple[int, int]:
    """k = ceil(n/G) groups, balanced: each of at most ceil(n/k) <= G members."""
    k = math.ceil(n / g)
    return k, math.ceil(n / k)


def stage_s(p: Params, nbytes: float, streams: int) -> float:
    """One transfer stage: nbytes / B + streams * stream_overhead + latency."""
    return nbytes / p.bandwidth + streams * p.stream_overhead_s + p.latency_s


def reduce_cpu_s(p: Params, part_bytes: float, senders: int) -> float:
    """A reducer's CPU: reduce_s_per_mb_per_sender * part MB * senders."""
    return p.reduce_s_per_mb_per_sender * part_bytes / MB * senders


def butterfly_s(p: Params, n: int) -> float:
    """Flat butterfly: 2 S (n-1)/n / B + (n-1) * overhead + latency + CPU(S/n, n senders); 0 alone."""
    if n <= 1:
        return 0.0
    s = p.model_bytes
    return 2 * s * (n - 1) / n / p.bandwidth + (n - 1) * p.stream_overhead_s + p.latency_s + reduce_cpu_s(p, s / n, n)


def relayed_share(n: int, g: int) -> float:
    """The share of (sender, reducer) pairs that share neither group nor column: their parts cross two links."""
    k, g = groups(n, g)
    return (1 - 1 / k) * (1 - 1 / g)


def relay_s(p: Params, n: int, g: int) -> float:
    """Exact relay in k groups of g (p2p_diloco.sync.relay), as the flat butterfly but over (g-1)+(k-1)
    streams, with the relayed share r of the parts forwarded once more each way: inputs
    S (n-1)/n + S r, one more latency for the second hop, CPU(S/n, n senders), outputs as much again."""
    if g >= n:
        return butterfly_s(p, n)
    s = p.model_bytes
    one_way = s * (n - 1) / n + s * relayed_share(n, g)
    return (stage_s(p, one_way, streams(n, g)) + p.latency_s + reduce_cpu_s(p, s / n, n)
            + stage_s(p, one_way, 0) + p.latency_s)


def allreduce_s(p: Params, n: int, g: int) -> float:
    """butterfly_s if G >= n, else relay_s."""
    return butterfly_s(p, n) if g >= n else relay_s(p, n, g)


def redo_s(p: Params, n: int, g: int) -> float:
    """re-reduce: one new reducer takes the dead member's part. It receives ~S bytes (n-1 inputs of S/n, or the
    relay's slice and sub-slice traffic) and sends as much back, the load of any member: one allreduce_s."""
    return allreduce_s(p, n, g)


def bytes_out(p: Params, n: int, g: int) -> float:
    """Bytes a peer sends: flat 2 S (n-1)/n; relay 2 S ((n-1)/n + r), r = :func:`relayed_share`."""
    s = p.model_bytes
    if g >= n:
        return 2 * s * (n - 1) / n
    return 2 * s * ((n - 1) / n + relayed_share(n, g))


def streams(n: int, g: int) -> int:
    """Peers a peer dials: flat n-1; relay (g-1) + (k-1) (the fallbacks of a short column left out)."""
    if g >= n:
        return n - 1
    k, g = groups(n, g)
    return g - 1 + k - 1


def commit_s(p: Params, n: int) -> float:
    """commit_s + log2(n) * latency."""
    return p.commit_s + math.log2(max(n, 1)) * p.latency_s


def sync_s(p: Params, n: int, g: int) -> float:
    """Failure-free sync: membership_s + allreduce_s + commit_s."""
    return membership_s(p, n) + allreduce_s(p, n, g) + commit_s(p, n)


def sync_attempt(p: Params, g: int, strategy: str, start: float, death: np.ndarray, last: bool,
                 rng: np.random.Generator | None = None, fail_p: float = 0.0):
    """One membership + all-reduce + commit among len(death) members, in leader-list order. `step` model: `death`
    holds their absolute death times (inf: lives). `attempt` model (rng given): the values are ignored; each leader
    asked is dead w.p. fail_p, and each member of the group dies w.p. fail_p at a uniform moment of its all-reduce +
    commit. Returns (end, members counted, survivors' death times for a retry, or None: the step is over)."""
    m = len(death)
    if m <= 1:
        return start, m, None
    base = membership_s(p, m)
    t, i = start, 0
    if rng is None:
        while i < m - 1 and death[i] < t + base:  # the leader died before the group was assembled
            t, i = t + p.request_timeout_s, i + 1
        m_end = t + membership_s(p, m, 0, bool((death[i:] < t + base).any()))
        d = death[death >= m_end]
    else:
        while i < m - 1 and rng.random() < fail_p:
            t, i = t + p.request_timeout_s, i + 1
        m_end, n = t + base, m - i
        window = allreduce_s(p, n, g) + commit_s(p, n)
        d = np.where(rng.random(n) < fail_p, m_end + rng.random(n) * window, np.inf)
    n = len(d)
    if n <= 1:
        return m_end, n, None
    ar_end = m_end + allreduce_s(p, n, g)
    c = commit_s(p, n)
    in_ar = d < ar_end
    if strategy == "re-reduce":
        done = max(ar_end, float((d[in_ar] + p.detect_s).max()) + redo_s(p, n - int(in_ar.sum()), g)) \
            if in_ar.any() else ar_end
        in_commit = (d >= ar_end) & (d < done + c)
        end = done + (p.commit_timeout_s if in_commit.any() else c)
        return end, n - int(in_ar.sum()) - int(in_commit.sum()), None
    if in_ar.any():
        end = float(d[in_ar].min()) + p.detect_s
    elif (d < ar_end + c).any():
        end = ar_end + p.commit_timeout_s
    else:
        return ar_end + c, n, None
    if strategy == "void" or last:
        return end, 0, None
    return end, 0, d[d >= end]


def one_step(p: Params, rng: np.random.Generator, n: int, g: int, strategy: str, fail_p: float):
    """One outer step of n peers. Returns (step seconds, share of the n counted, mean seconds ready -> end)."""
    joiners = min(int(rng.poisson(p.churn_per_step)), n - 1) if p.churn_per_step > 0 else 0
    trainers = n - joiners
    work = p.inner_steps * p.compute_s * rng.lognormal(0.0, p.compute_spread, trainers)
    by_step = p.fail_model == "step"
    if by_step:
        horizon = min(float(work.max()), float(work.min()) + p.round_wait_s) + sync_s(p, trainers, g)
        death = np.where(rng.random(trainers) < fail_p, rng.random(trainers) * horizon, np.inf)
    else:
        death = np.full(trainers, np.inf)
    ready, death = work[death > work], death[death > work]  # a peer dead while training is waited for by none
    if len(ready) == 0:
        return float(work.max()), 0.0, 0.0
    t0 = min(float(ready.max()), float(ready.min()) + p.round_wait_s)
    keep = (ready <= t0) & (death > t0)  # late peers miss the step; some die while waiting
    ready, death, start = ready[keep], death[keep], t0
    end, counted = start, len(ready)
    for attempt in range(p.attempts):
        end, counted, survivors = sync_attempt(p, g, strategy, start, death, attempt == p.attempts - 1,
                                               None if by_step else rng, fail_p)
        if survivors is None:
            break
        death, start = survivors, end
    return end, counted / n, end - float(ready.mean()) if len(ready) else 0.0


def on_shared_host(p: Params, n: int) -> Params:
    """With --host-cores C, all n peers share C cores (as in benchmarks/scale.py on one machine): every CPU cost
    (compute, each stream's handling, a reducer's work, the commit's DHT work, a join request) is stretched by
    max(1, n / C); transfers are loopback's. Without it, `p` as it is."""
    crowd = max(1.0, n / p.host_cores) if p.host_cores else 1.0
    return dataclasses.replace(p, compute_s=p.compute_s * crowd, stream_overhead_s=p.stream_overhead_s * crowd,
                               reduce_s_per_mb_per_sender=p.reduce_s_per_mb_per_sender * crowd,
                               commit_s=p.commit_s * crowd, join_cost_s=p.join_cost_s * crowd)


def simulate(p: Params, n: int, g: int, strategy: str, fail_p: float, trials: int, seed: int) -> dict:
    """`trials` steps with a generator seeded by (seed, n, g, fail_p): the strategies share their draws."""
    p = on_shared_host(p, n)
    rng = np.random.default_rng([seed, n, g, round(fail_p * 1e6)])
    r = np.array([one_step(p, rng, n, g, strategy, fail_p) for _ in range(trials)])
    return dict(peers=n, group=g, shape="flat" if g >= n else f"G={g}", strategy=strategy, fail_p=fail_p,
                step_s_mean=float(r[:, 0].mean()), step_s_p90=float(np.percentile(r[:, 0], 90)),
                share_mean=float(r[:, 1].mean()), sync_s_mean=float(r[:, 2].mean()))


def run_grid(p: Params, args) -> list[dict]:
    rows = []
    for n in args.peers:
        for g in [n] + [g for g in args.groups if g < n]:
            for fp in args.fail_p:
                for strategy in (["any"] if fp == 0 else args.strategies):
                    rows.append(simulate(p, n, g, "retry" if strategy == "any" else strategy, fp, args.trials,
                                         args.seed) | {"strategy": strategy})
    return rows


def table(rows: list[dict], cell) -> str:
    cols = list(dict.fromkeys((r["fail_p"], r["strategy"]) for r in rows))
    lines = ["| N | shape | " + " | ".join(f"p={fp:g} {s}" for fp, s in cols) + " |",
             "|---:|---|" + "---:|" * len(cols)]
    for key in dict.fromkeys((r["peers"], r["shape"]) for r in rows):
        by = {(r["fail_p"], r["strategy"]): r for r in rows if (r["peers"], r["shape"]) == key}
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cell(by[c]) if c in by else "" for c in cols) + " |")
    return "\n".join(lines)


def bytes_table(p: Params, rows: list[dict]) -> str:
    lines = ["| N | shape | groups k x g | streams/peer | MB out/peer | x flat | all-reduce s | sync s |",
             "|---:|---|---|---:|---:|---:|---:|---:|"]
    for n, g in dict.fromkeys((r["peers"], r["group"]) for r in rows):
        k, gg = groups(n, g) if g < n else (1, n)
        lines.append(f"| {n} | {'flat' if g >= n else f'G={g}'} | {k} x {gg} | {streams(n, g)} | "
                     f"{bytes_out(p, n, g) / MB:.2f} | {bytes_out(p, n, g) / max(bytes_out(p, n, n), 1):.2f} | "
                     f"{allreduce_s(p, n, g):.2f} | {sync_s(p, n, g):.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    base = [r for r in rows if r["fail_p"] == min(r["fail_p"] for r in rows)]
    for shape in dict.fromkeys(("flat" if r["group"] >= r["peers"] else r["group"]) for r in base):
        pts = [r for r in base if (r["group"] >= r["peers"] if shape == "flat" else r["group"] == shape
                                   and r["group"] < r["peers"])]
        a1.plot([r["peers"] for r in pts], [r["step_s_mean"] for r in pts], "o-",
                label="flat" if shape == "flat" else f"G={shape}")
    a1.set(xscale="log", xlabel="peers N", ylabel="seconds per outer step (mean)",
           title=f"step time, fail-p {base[0]['fail_p']:g}")
    a1.legend()
    top = max(r["fail_p"] for r in rows)
    for color, strategy in enumerate(dict.fromkeys(r["strategy"] for r in rows if r["fail_p"] == top)):
        for shape, style in (("flat", "-"), ("G=32", "--")):
            pts = [r for r in rows if r["fail_p"] == top and r["strategy"] == strategy and r["shape"] == shape]
            if pts:
                a2.plot([r["peers"] for r in pts], [100 * r["share_mean"] for r in pts], "o" + style,
                        color=f"C{color}", label=f"{strategy} {shape}")
    a2.set(xscale="log", xlabel="peers N", ylabel="% of peers' work counted", title=f"share counted, fail-p {top:g}")
    a2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def calibrate(p: Params, args) -> dict:
    points = json.loads(Path(args.calibrate).read_text())

    def sim(q: Params) -> list[dict]:
        return [simulate(q, pt["peers"], pt.get("group", pt["peers"]), "retry", pt.get("fail_p", 0.0),
                         args.trials, args.seed) for pt in points]

    out = {"points": points, "simulated": sim(p)}
    fitted = None
    if args.fit and len({pt["peers"] for pt in points}) >= 2:
        zero = sim(dataclasses.replace(p, stream_overhead_s=0.0, commit_s=0.0))
        a = np.array([[streams(pt["peers"], pt.get("group", pt["peers"])), 1.0] for pt in points])
        y = np.array([pt["sync_s"] - z["sync_s_mean"] for pt, z in zip(points, zero)])
        (ov, cs), *_ = np.linalg.lstsq(a, y, rcond=None)
        if ov < 0 or cs < 0:  # keep both non-negative: fit the other one alone
            if ov < 0:
                ov, cs = 0.0, max(float(y.mean()), 0.0)
            else:
                ov, cs = max(float(a[:, 0] @ y / (a[:, 0] @ a[:, 0])), 0.0), 0.0
        fitted = dataclasses.replace(p, stream_overhead_s=max(float(ov), 0.0), commit_s=max(float(cs), 0.0))
        out |= {"fit": {"stream_overhead_s": fitted.stream_overhead_s, "commit_s": fitted.commit_s},
                "simulated_fit": sim(fitted)}
    lines = ["| N | shape | step s measured | step s sim | sync s measured | sync s sim |"
             + (" sync s sim (fit) |" if fitted else ""),
             "|---:|---|---:|---:|---:|---:|" + ("---:|" if fitted else "")]
    for i, (pt, s) in enumerate(zip(points, out["simulated"])):
        lines.append(f"| {pt['peers']} | {s['shape']} | {pt.get('step_s', float('nan')):.1f} | "
                     f"{s['step_s_mean']:.1f} | {pt.get('sync_s', float('nan')):.2f} | {s['sync_s_mean']:.2f} |"
                     + (f" {out['simulated_fit'][i]['sync_s_mean']:.2f} |" if fitted else ""))
    print("\n".join(lines))
    if fitted:
        print(f"\nfit: --stream-overhead-s {fitted.stream_overhead_s:.4f} --commit-s {fitted.commit_s:.3f}")
    return out


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Params()
    ap.add_argument("--peers", type=ints, default=[2, 4, 8, 16, 24, 64, 256, 1000], help="swarm sizes N (comma list)")
    ap.add_argument("--groups", type=ints, default=[8, 16, 32, 64],
                    help="relay group sizes G, each used where G < N; flat (G = N) is always run")
    ap.add_argument("--strategies", type=lambda s: s.split(","), default=list(STRATEGIES),
                    help="failure handling: void, retry, re-reduce (comma list; at fail-p 0 they coincide)")
    ap.add_argument("--fail-p", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.01],
                    help="probability that a peer dies, per attempt or per step (see --fail-model); comma list")
    ap.add_argument("--fail-model", choices=("attempt", "step"), default=d.fail_model,
                    help="attempt: each member dies within each sync attempt w.p. fail-p; step: once per step, "
                         "at a uniform moment of compute + sync")
    ap.add_argument("--trials", type=int, default=200, help="Monte Carlo steps per point")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--inner-steps", type=int, default=d.inner_steps, help="H, inner steps per outer step")
    ap.add_argument("--compute-s", type=float, default=d.compute_s, help="seconds per inner step (median peer)")
    ap.add_argument("--compute-spread", type=float, default=d.compute_spread,
                    help="sigma of the lognormal factor on each peer's compute time")
    ap.add_argument("--round-wait-s", type=float, default=d.round_wait_s,
                    help="longest wait for slower peers after the first is ready (swarm.round_wait_timeout)")
    ap.add_argument("--latency-s", type=float, default=d.latency_s, help="round-trip time between two peers")
    ap.add_argument("--join-cost-s", type=float, default=d.join_cost_s, help="leader's serial cost per join request")
    ap.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s,
                    help="time to give up on a dead leader or a dead joiner (swarm.request_timeout)")
    ap.add_argument("--model-bytes", type=float, default=d.model_bytes, help="S, bytes of one peer's compressed input")
    ap.add_argument("--bandwidth", type=float, default=d.bandwidth, help="B, bytes/s per peer each way")
    ap.add_argument("--stream-overhead-s", type=float, default=d.stream_overhead_s,
                    help="seconds per stream a peer opens (serial)")
    ap.add_argument("--reduce-s-per-mb-per-sender", type=float, default=d.reduce_s_per_mb_per_sender,
                    help="reducer CPU seconds per MB of its part per sender")
    ap.add_argument("--commit-s", type=float, default=d.commit_s, help="commit: reports on the DHT, fixed part")
    ap.add_argument("--detect-s", type=float, default=d.detect_s,
                    help="time to notice a member died in the all-reduce (swarm.next_chunk_timeout)")
    ap.add_argument("--commit-timeout-s", type=float, default=d.commit_timeout_s,
                    help="time to give up on a missing commit report (swarm.commit_timeout)")
    ap.add_argument("--attempts", type=int, default=d.attempts, help="sync attempts per step for retry")
    ap.add_argument("--host-cores", type=int, default=d.host_cores,
                    help="0: each peer on its own machine; C: all N peers share C cores, every CPU cost stretched "
                         "by N/C (to check the model against benchmarks/scale.py on one machine)")
    ap.add_argument("--churn-per-step", type=float, default=d.churn_per_step,
                    help="expected joiners per step (Poisson); they load state and count nothing this step")
    ap.add_argument("--calibrate", metavar="FILE", help="JSON list of measured points; print simulated vs measured")
    ap.add_argument("--fit", action="store_true", help="with --calibrate: least-squares fit of "
                    "--stream-overhead-s and --commit-s to the measured sync_s")
    ap.add_argument("--out", type=Path, default=Path("bench-out/scale_sim"),
                    help="folder for results.json and the plot")
    args = ap.parse_args()
    p = Params(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Params)})
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"params": dataclasses.asdict(p), "trials": args.trials, "seed": args.seed}
    if args.calibrate:
        result["calibration"] = calibrate(p, args)
        (args.out / "calibration.json").write_text(json.dumps(result, indent=1))
        return
    rows = run_grid(p, args)
    print(f"## Seconds per outer step, mean / p90 ({args.trials} steps per cell, fail model {p.fail_model})\n")
    print(table(rows, lambda r: f"{r['step_s_mean']:.1f} / {r['step_s_p90']:.1f}"))
    print("\n## Share of the N peers' work counted in the step, mean\n")
    print(table(rows, lambda r: f"{100 * r['share_mean']:.1f} %"))
    print("\n## Traffic per peer per step (failure-free), against a flat butterfly\n")
    print(bytes_table(p, rows))
    result["rows"] = rows
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out / 'results.json'}" + (f" and {args.out / 'scale_sim.png'}"
                                                    if plot(rows, args.out / "scale_sim.png") else ""))


if __name__ == "__main__":
    main()
