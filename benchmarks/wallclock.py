"""Quality at equal wall-clock: 4 peers on rate-limited links, data-parallel vs DiLoCo vs streaming DiLoCo 4-bit.

    sudo python benchmarks/wallclock.py                     # ~15 min on 2 cores; needs root (network namespaces)
    sudo python benchmarks/wallclock.py --budget 240 --mbit 100 --peers 4 --out bench-out/wallclock
    sudo python benchmarks/wallclock.py --budget 40                        # a smoke run, ~6 min

The number users feel: the same wall-clock budget for every method, and the held-out loss at its end.
For each method, --peers (4) worker processes start, each in its own network namespace on a public
bridge (tests/netns.py), each host's link shaped with `tc tbf` to --mbit (100) Mbit/s in each
direction. A bootstrap node (`python -m p2p_diloco.cli bootstrap`, its own namespace and shaped
link too) is how they find each other. Once every worker has built its data, model and DHT node, the
script gives them one start time; each trains until start + --budget seconds (wall clock, the same
for every method), then saves its final model. Every process runs with one torch thread
(OMP_NUM_THREADS=1): the peers share the machine's cores.

Methods (all from the same initial weights, on the same data, with the same model, batch of 16
sequences per peer per step, inner AdamW and lr schedule; peer i reads the same data order in each):
- **data-parallel**: synchronous data-parallel over the same links. Every step each peer computes the
  gradient of its own batch, the 4 gradients are averaged by this project's exact butterfly all-reduce
  (:class:`~p2p_diloco.sync.outer_sync.OuterSync`, codec "none" = fp32, bit-identical result on
  every peer, commit through the DHT), then every peer clips the mean gradient and takes the same
  AdamW step; the replicas' sha256 is checked by the all-reduce every step. Its averager waits for
  all 4 peers (min and target group size 4: a group forms as soon as the 4th joins, and a round
  without every peer is retried) with short matchmaking (1 s, request timeout 0.5 s) so that
  matchmaking is not the bottleneck; a step in flight at the deadline may finish (a second or two).
- **DiLoCo** (arXiv 2311.08105): :class:`~p2p_diloco.train.diloco.DiLoCoPeer`, as the `peer` command
  runs it: H = --inner-steps (50) inner steps, fp32 all-reduce of the pseudo-gradient, outer Nesterov
  (lr 0.7, momentum 0.9). Its model at the end is θ_global of the peer with the most outer steps (the
  inner steps since the last outer step are not in it).
- **streaming DiLoCo, 4-bit** (arXiv 2501.18512): the same with [outer] codec = "fp4-e3m0",
  error_feedback = true, fragments = 2 (the model has 2 layers, so P ≤ 2), sync_delay = -1 with
  fixed_sync_delay = true (the longest overlap, H/P − 1 inner steps, every time), merge_alpha = 0.5.
- **defaults** and **defaults-fixed-tau-5** (not run unless --methods names them): DiLoCo with the shipped
  [outer] defaults (4-bit with error feedback, α = 0.5, the overlap ending with the first inner step after
  the sync, 10 at most), and the same with the overlap of before, exactly 5 inner steps.
- **defaults-fp32**, **defaults-mask8**, **defaults-2bit** and **defaults-mask2** (not run unless --methods names
  them): the shipped [outer] defaults with another codec, fp32 ("none"), a shared eighth of the values in 4-bit
  ("mask8-e3m0"), 2-bit values ("2bit"), or a shared half of the values in 1 bit ("mask2-1bit", with the outer
  lr = 1.4 and momentum = 0.5 that benchmarks/codec_quality.py measured best for the mask codecs).

The swarm timeouts are the same for all methods (matchmaking 1 s, request timeout 0.5 s); only
data-parallel's averager also has the group size 4. The model and data are benchmarks/quality.py's
(0.69M-parameter Llama, hidden 128, 2 layers, local BPE of 1,024 tokens, 64-token sequences,
peers/data/tinyshakespeare.txt), inner lr 2e-3, warmup 5 %, cosine to 10 % over --total-steps inner
steps. Its default, 4 × --budget, estimates what a DiLoCo peer manages in the budget with 4 peers on
2 otherwise idle cores (a step takes about 0.09 s on one thread; two peers share a core), so that
DiLoCo's schedule ends with the budget. That is an estimate: the script says when the DiLoCo peers'
steps were far from it and which --total-steps to give instead (on a loaded machine they take fewer:
2 steps per second in the smoke run). Data-parallel, which takes far fewer steps, follows the same
schedule over its steps (it stays near the peak lr), as the same job with a per-step all-reduce would.

Per method the script reports the steps each peer took (optimizer steps for data-parallel, inner
steps for DiLoCo), the tokens all peers processed, the held-out loss and perplexity = exp(loss) of
the final model, its perplexity against data-parallel's, the all-reduce payload each peer sent, and
whether every sync had all 4 peers. It prints a Markdown table and writes results.json (and each
worker's log, metrics and final model) under --out. Every process is stopped and every namespace
deleted at the end, also on Ctrl+C or an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import select
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from p2p_diloco.config import OuterConfig  # noqa: E402  (after the path: the repository's package)

# inner steps per second of a DiLoCo peer, 4 peers on 2 idle cores (estimated: ~0.09 s a step on one thread, two
# peers per core, and the syncs)
STEPS_PER_SECOND = 4.0
LOCAL_BATCH_SIZE = 16
SHIPPED_SYNC = {key: getattr(OuterConfig(), key)
                for key in ("codec", "error_feedback", "sync_delay", "fixed_sync_delay", "merge_alpha")}
METHODS = {  # name: [outer] settings (None: data-parallel)
    "dp": None,
    "diloco": {"codec": "none"},
    "streaming-4bit": {"codec": "fp4-e3m0", "error_feedback": True, "fragments": 2, "sync_delay": -1,
                       "fixed_sync_delay": True, "merge_alpha": 0.5},
    # the shipped [outer] defaults of how the sync goes, over quality.py's DiLoCo base; and with the overlap of
    # before issue 24's adaptive τ
    "defaults": SHIPPED_SYNC,
    "defaults-fixed-tau-5": {**SHIPPED_SYNC, "sync_delay": 5, "fixed_sync_delay": True},
    # the shipped sync with another codec: full precision, and an eighth of the values (issue 43's equal wall-clock)
    "defaults-fp32": {**SHIPPED_SYNC, "codec": "none"},
    "defaults-mask8": {**SHIPPED_SYNC, "codec": "mask8-e3m0"},
    # 2 bits a value; and half the values in 1 bit, with the outer step codec_quality.py measured for the masks
    "defaults-2bit": {**SHIPPED_SYNC, "codec": "2bit"},
    "defaults-mask2": {**SHIPPED_SYNC, "codec": "mask2-1bit", "lr": 1.4, "momentum": 0.5},
}
LABELS = {"dp": "data-parallel (all-reduce every step, fp32)", "diloco": "DiLoCo (fp32)",
          "streaming-4bit": "streaming DiLoCo, 4-bit (fp4-e3m0 + error feedback, P=2, τ=H/P−1, α=0.5)",
          "defaults": "the defaults: 4-bit DiLoCo, the overlap ending with the sync (τ ≤ 10), α=0.5",
          "defaults-fixed-tau-5": "4-bit DiLoCo, τ = 5 fixed, α=0.5 (the defaults before)",
          "defaults-fp32": "the defaults with fp32 values (codec none)",
          "defaults-mask8": "the defaults with an eighth of the values in 4-bit (codec mask8-e3m0)",
          "defaults-2bit": "the defaults with 2-bit values (codec 2bit)",
          "defaults-mask2": "the defaults with half the values in 1 bit (codec mask2-1bit), outer lr 1.4, momentum 0.5"}
SWARM = {"matchmaking_time": 1.0, "request_timeout": 0.5, "round_wait_timeout": 30.0, "allreduce_timeout": 30.0,
         "next_chunk_timeout": 5.0, "commit_timeout": 10.0, "progress_ttl": 60.0, "start_wait_timeout": 120.0}
DP_FINISH_GRACE_S = 10.0  # a data-parallel round in flight at the deadline may finish within this
READY_TIMEOUT_S = 300.0  # for the workers to import, load data, build the model and join the swarm
EXIT_TIMEOUT_S = 120.0  # for the workers to leave the swarm and save their models after the deadline


# ----- configuration --------------------------------------------------------------------------------
def method_config(args, method: str):
    from benchmarks.quality import benchmark_config

    cfg = benchmark_config(args.text, args.seed, args.inner_steps, args.total_steps)
    cfg = cfg.replace(run={"name": f"wallclock-{method}"}, swarm=SWARM)
    if METHODS[method]:
        cfg = cfg.replace(outer=METHODS[method])
    return cfg


# ----- worker: one peer, in its namespace -------------------------------------------------------------
def install_stop_handlers(stop: threading.Event) -> None:
    """SIGTERM / SIGINT set `stop`; later ones are ignored (the orchestrator SIGKILLs if it must)."""
    def handle(_signum, _frame):
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)


def wait_for_go(workdir: Path, stop: threading.Event) -> tuple[float, float]:
    """Block until the orchestrator's go file exists; then sleep until its start time. (start, deadline)."""
    go = workdir / "go.json"
    while not go.exists():
        if stop.wait(0.1):
            raise SystemExit("stopped before the start")
    times = json.loads(go.read_text())
    time.sleep(max(0.0, times["start"] - time.time()))
    return times["start"], times["deadline"]


def start_timer(at: float, event: threading.Event) -> None:
    """Set `event` at wall-clock time `at` (a daemon thread: it never holds the process back)."""
    timer = threading.Timer(max(0.0, at - time.time()), event.set)
    timer.daemon = True
    timer.start()


def worker_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="wallclock.py _worker")
    parser.add_argument("--method", required=True, choices=list(METHODS))
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--initial-peer", required=True)
    parser.add_argument("--peers", type=int, required=True)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args(argv)

    import torch

    from p2p_diloco.config import config_from_dict, shared_settings
    from p2p_diloco.logs import setup_logging
    from p2p_diloco.process_tree import children_exit_with_this_process
    from p2p_diloco.stopping import shutdown_dht
    from p2p_diloco.swarm.node import start_run_node
    from p2p_diloco.train.data import TextData, order_seed, tokenizer_sha256
    from p2p_diloco.train.model import build_model

    setup_logging(verbose=False)
    torch.set_num_threads(1)
    workdir = Path(args.workdir)
    stop = threading.Event()
    install_stop_handlers(stop)
    cfg = config_from_dict(json.loads((workdir / "config.json").read_text()))
    data = TextData(cfg.data)
    settings = shared_settings(cfg, tokenizer_sha256(data.tokenizer))
    model = build_model(cfg.model, data.vocab_size, cfg.run.seed, cfg.data.seq_len)
    seed = order_seed(cfg.run.seed, f"wallclock-{args.index}")  # peer i's data order, the same for every method
    children_exit_with_this_process()
    node = start_run_node(cfg.run.name, args.host, 0, initial_peers=[args.initial_peer])
    try:
        run = run_data_parallel_peer if args.method == "dp" else run_diloco_peer
        result, final_params = run(args, cfg, data, model, seed, node, settings, workdir, stop)
        torch.save([t.detach().clone() for t in final_params], workdir / f"model-{args.index}.pt")
        (workdir / f"result-{args.index}.json").write_text(json.dumps(result, indent=2))
    finally:
        shutdown_dht(node.dht)


def run_data_parallel_peer(args, cfg, data, model, seed, node, settings, workdir, stop):
    """Synchronous data-parallel: per step, this peer's gradient, the group's exact mean, one AdamW step."""
    import torch

    from p2p_diloco.hashing import tensors_sha256
    from p2p_diloco.sync import outer_sync
    from p2p_diloco.sync.outer_sync import OuterSync, RoundFailed
    from p2p_diloco.train.inner import make_inner_optimizer, make_inner_scheduler
    from p2p_diloco.train.model import trainable_parameters

    # every round waits for all peers and starts as soon as the last one joins (hivemind's min and target
    # group size): synchronous data-parallel, and no matchmaking wait once the group is complete
    timeouts = outer_sync.averager_timeouts
    outer_sync.averager_timeouts = lambda s: {**timeouts(s), "min_group_size": args.peers,
                                              "target_group_size": args.peers}
    params = trainable_parameters(model)
    from p2p_diloco.config import settings_fingerprint

    sync = OuterSync(node.dht, cfg.run.name, settings_fingerprint(settings), node.identity.record_subkey,
                     [p.shape for p in params], cfg.swarm, state_provider=lambda: ({}, []), codec="none")
    optimizer = make_inner_optimizer(params, cfg.inner, torch.device("cpu"))
    scheduler = make_inner_scheduler(optimizer, cfg.inner)
    batches = data.peer_batches(cfg.inner.batch_size, seed)
    hard_stop = threading.Event()  # cancels a round still in flight well after the deadline
    stop_watch = threading.Thread(target=lambda: hard_stop.set() if stop.wait() else None, daemon=True)
    stop_watch.start()
    steps = failed = 0
    group_sizes, step_seconds, compute_seconds, allreduce_seconds = [], [], [], []
    sha = tensors_sha256(params)
    (workdir / f"ready-{args.index}").touch()
    try:
        start, deadline = wait_for_go(workdir, stop)
        start_timer(deadline + DP_FINISH_GRACE_S, hard_stop)
        model.train()
        while time.time() < deadline and not stop.is_set():
            began = time.time()
            batch = next(batches)
            model(input_ids=batch, labels=batch).loss.backward()
            grads = [p.grad for p in params]
            compute_seconds.append(time.time() - began)
            mean = None
            while mean is None and not hard_stop.is_set():
                reduce_began = time.time()
                try:
                    result = sync.average(grads, len(batch), outer_step=steps, global_sha256=sha, stop=hard_stop)
                except RoundFailed as e:
                    failed += time.time() < deadline  # not the round cancelled because the others had stopped
                    print(f"step {steps}: round failed ({e}); retrying", flush=True)
                    if time.time() >= deadline:
                        break  # the others have stopped: this step is not taken
                    continue
                mean = result.mean
                group_sizes.append(result.group_size)
                allreduce_seconds.append(time.time() - reduce_began)
            if mean is None:
                optimizer.zero_grad(set_to_none=True)
                break
            for p, g in zip(params, mean):
                p.grad.copy_(g)
            if cfg.inner.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.inner.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
            sha = tensors_sha256(params)
            step_seconds.append(time.time() - began)
        train_seconds = time.time() - start
    finally:
        hard_stop.set()
        stop.set()
        sync.shutdown()
    traffic = sync.averager.traffic
    return dict(method=args.method, index=args.index, steps=steps, samples=steps * cfg.inner.batch_size,
                sha256=sha, progress=steps, train_seconds=train_seconds, rounds_failed=failed,
                syncs=len(group_sizes), syncs_with_all_peers=sum(g == args.peers for g in group_sizes),
                median_step_seconds=statistics.median(step_seconds) if step_seconds else None,
                median_allreduce_seconds=statistics.median(allreduce_seconds) if allreduce_seconds else None,
                median_gradient_seconds=statistics.median(compute_seconds) if compute_seconds else None,
                bytes_sent=traffic.sent, bytes_received=traffic.received), params


def run_diloco_peer(args, cfg, data, model, seed, node, settings, workdir, stop):
    """A DiLoCoPeer, as the `peer` command runs it, stopped at the deadline; returns θ_global."""
    from p2p_diloco.metrics import MetricsWriter, read_metrics
    from p2p_diloco.train.diloco import DiLoCoPeer

    metrics_path = workdir / f"metrics-{args.index}.jsonl"
    metrics = MetricsWriter(metrics_path, node.dht.peer_id.to_base58())
    peer = DiLoCoPeer(cfg, model, data.for_peer(cfg.inner.batch_size, seed), node, settings, metrics, stop_event=stop)
    install_stop_handlers(stop)  # again: nothing that started since may keep SIGINT from us
    (workdir / f"ready-{args.index}").touch()
    start, deadline = wait_for_go(workdir, stop)
    start_timer(deadline, stop)
    peer.run(wait_for_peers=args.peers)
    train_seconds = time.time() - start
    metrics.close()
    records = read_metrics(metrics_path)
    outer = [r for r in records if r["event"] == "outer_step"]
    traffic = peer.sync.averager.traffic
    return dict(method=args.method, index=args.index, steps=peer.inner.steps_done,
                samples=peer.inner.steps_done * cfg.inner.batch_size, sha256=peer.sha256,
                outer_step=peer.global_model.outer_step, progress=peer.global_model.outer_step,
                train_seconds=train_seconds, syncs=len(outer),
                syncs_with_all_peers=sum(r["group_size"] == args.peers for r in outer),
                # not counted: the round cancelled at the deadline
                rounds_failed=sum(r["event"] in ("round_failed", "round_skipped")
                                  and not r.get("reason", "").startswith("cancelled") for r in records),
                state_downloads=sum(r["event"] == "state_loaded" for r in records),
                bytes_sent=traffic.sent, bytes_received=traffic.received), peer.global_model.params


# ----- orchestrator ---------------------------------------------------------------------------------
def read_first_line(proc: subprocess.Popen, timeout: float) -> str:
    """The first stdout line of `proc` (the bootstrap's multiaddr), or an error if none comes in time."""
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"the bootstrap node printed no address (exit code {proc.poll()})")
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 1)
            if not chunk:
                raise RuntimeError("the bootstrap node closed its output before printing an address")
            line += chunk
    return line.decode().strip()


def log_tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def stop_all(procs: list[subprocess.Popen], timeout: float) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def namespace_pids(namespaces: list[str]) -> list[int]:
    pids = []
    for namespace in namespaces:
        out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=10,
                             check=False)
        pids += [int(p) for p in out.stdout.split()]
    return pids


def sweep_namespaces(namespaces: list[str]) -> list[str]:
    """Stop whatever still runs inside this topology's namespaces (a worker's p2pd, a daemon); returns them."""
    from p2p_diloco.process_tree import command_name, stop_processes, wait_gone

    # torch's shared-memory manager exits by itself about 2 s after its clients: give everything 5 s
    left = wait_gone(namespace_pids(namespaces), 5.0)
    names = [f"{pid} {command_name(pid)}" for pid in left]
    stop_processes(left, grace_s=0.0)
    return names


def log_file(logs: list, path: Path):
    log = open(path, "w")  # noqa: SIM115 - a child process writes it; closed by run_method
    logs.append(log)
    return log


def run_method(method: str, args, out: Path) -> dict:
    from tests.netns import Topology

    workdir = out / method
    workdir.mkdir(parents=True, exist_ok=True)
    for old in [*workdir.glob("*.json"), *workdir.glob("*.jsonl"), *workdir.glob("ready-*"),
                *workdir.glob("model-*.pt")]:
        old.unlink()
    cfg = method_config(args, method)
    (workdir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    procs: list[subprocess.Popen] = []
    logs = []  # the processes' log files, closed at the end
    with Topology() as topology:
        try:
            boot = topology.add_public("bootstrap")
            hosts = [topology.add_public(f"peer{i}") for i in range(args.peers)]
            for host in (boot, *hosts):
                topology.limit_rate(host, args.mbit)
            bootstrap = topology.popen(
                boot, [sys.executable, "-m", "p2p_diloco.cli", "bootstrap", "--host", boot.ip, "--port", "31337"],
                stdout=subprocess.PIPE, stderr=log_file(logs, workdir / "bootstrap.log"), env=env)
            procs.append(bootstrap)
            maddr = read_first_line(bootstrap, timeout=120)
            for i, host in enumerate(hosts):
                procs.append(topology.popen(
                    host, [sys.executable, str(Path(__file__).resolve()), "_worker", "--method", method,
                           "--index", str(i), "--host", host.ip, "--initial-peer", maddr, "--peers", str(args.peers),
                           "--workdir", str(workdir)],
                    stdout=log_file(logs, workdir / f"peer-{i}.log"), stderr=subprocess.STDOUT, env=env))
            setup_began = time.monotonic()
            while not all((workdir / f"ready-{i}").exists() for i in range(args.peers)):
                for i, proc in enumerate(procs[1:]):
                    if proc.poll() is not None:
                        raise RuntimeError(f"worker {i} exited before it was ready: "
                                           f"{log_tail(workdir / f'peer-{i}.log')}")
                if time.monotonic() - setup_began > READY_TIMEOUT_S:
                    raise RuntimeError(f"the workers were not ready within {READY_TIMEOUT_S:.0f} s")
                time.sleep(0.2)
            start = time.time() + 1.0
            (workdir / "go.json").write_text(json.dumps(dict(start=start, deadline=start + args.budget)))
            print(f"{method}: {args.peers} peers ready after {time.monotonic() - setup_began:.0f} s; "
                  f"training for {args.budget:g} s", flush=True)
            exit_by = time.monotonic() + 1.0 + args.budget + EXIT_TIMEOUT_S
            while any(p.poll() is None for p in procs[1:]) and time.monotonic() < exit_by:
                time.sleep(0.5)
            stragglers = [i for i, p in enumerate(procs[1:]) if p.poll() is None]
            exit_seconds = time.time() - (start + args.budget)
        finally:
            stop_all(procs, timeout=30)
            swept = sweep_namespaces(topology.namespaces)
            for log in logs:
                log.close()
    if swept:
        print(f"{method}: stopped leftover process(es) in the namespaces: {', '.join(swept)}", flush=True)
    results = []
    for i in range(args.peers):
        path = workdir / f"result-{i}.json"
        if not path.exists():
            raise RuntimeError(f"worker {i} wrote no result (exit code {procs[i + 1].returncode}): "
                               f"{log_tail(workdir / f'peer-{i}.log')}")
        results.append(json.loads(path.read_text()))
    return dict(method=method, label=LABELS[method], outer=METHODS[method], peers=results,
                stragglers_stopped=stragglers, seconds_to_exit_after_deadline=exit_seconds)


def evaluate(summary: dict, args, data, out: Path) -> None:
    """Held-out loss of the final model: the peer with the most progress (outer steps, or DP steps)."""
    import torch

    from p2p_diloco.train.model import build_model, evaluate_loss, trainable_parameters

    peers = summary["peers"]
    best = max(peers, key=lambda r: (r["progress"], -r["index"]))
    cfg = method_config(args, summary["method"])
    model = build_model(cfg.model, data.vocab_size, cfg.run.seed, cfg.data.seq_len)
    with torch.no_grad():
        for param, value in zip(trainable_parameters(model), torch.load(out / summary["method"] /
                                                                        f"model-{best['index']}.pt")):
            param.copy_(value)
    loss = evaluate_loss(model, data.heldout)
    steps = [r["steps"] for r in peers]
    summary.update(
        evaluated_peer=best["index"], eval_loss=loss, perplexity=math.exp(loss), steps_per_peer=steps,
        tokens=sum(r["samples"] for r in peers) * cfg.data.seq_len,
        final_models_identical=len({r["sha256"] for r in peers}) == 1,
        syncs=[r["syncs"] for r in peers], syncs_with_all_peers=[r["syncs_with_all_peers"] for r in peers],
        mb_sent_per_peer=statistics.mean(r["bytes_sent"] for r in peers) / 1e6,
    )


def markdown_table(summaries: list[dict]) -> str:
    dp = next((s for s in summaries if s["method"] == "dp" and "perplexity" in s), None)
    lines = [("| method | steps per peer | tokens | eval loss | perplexity | vs data-parallel perplexity | "
              "syncs (with all peers) | all-reduce MB sent per peer |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summaries:
        if "perplexity" not in s:
            lines.append(f"| {s['label']} | failed: {s.get('error', '?')} | | | | | | |")
            continue
        lo, hi = min(s["steps_per_peer"]), max(s["steps_per_peer"])
        steps = f"{lo}" if lo == hi else f"{lo}–{hi}"
        versus = ("–" if dp is None or s is dp
                  else f"{100 * (s['perplexity'] - dp['perplexity']) / dp['perplexity']:+.1f}%")
        syncs = f"{min(s['syncs'])} ({min(s['syncs_with_all_peers'])})"
        lines.append(f"| {s['label']} | {steps} | {s['tokens'] / 1e6:.2f}M | {s['eval_loss']:.4f} | "
                     f"{s['perplexity']:.2f} | {versus} | {syncs} | {s['mb_sent_per_peer']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        worker_main(sys.argv[2:])
        return
    from benchmarks.quality import DEFAULT_TEXT

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=240.0, help="seconds of training per method (wall clock)")
    parser.add_argument("--mbit", type=float, default=100.0, help="rate of every link, each direction")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--methods", default="dp,diloco,streaming-4bit", help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--inner-steps", type=int, default=50, help="H, DiLoCo's inner steps per outer step")
    parser.add_argument("--total-steps", type=int, default=None,
                        help=f"steps of the lr schedule (default: budget × {STEPS_PER_SECOND:g}, what a DiLoCo peer "
                             f"manages in the budget)")
    parser.add_argument("--text", default=DEFAULT_TEXT, help="text file to train and evaluate on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-out/wallclock")
    args = parser.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if unknown := [m for m in methods if m not in METHODS]:
        parser.error(f"unknown method(s) {', '.join(unknown)}; valid: {', '.join(METHODS)}")
    if args.peers < 2 or args.budget <= 0:
        parser.error("--peers must be at least 2 and --budget positive")
    if args.total_steps is None:
        args.total_steps = max(args.inner_steps, round(args.budget * STEPS_PER_SECOND))
    from tests.netns import unavailable

    if (why := unavailable()) is not None:
        sys.exit(f"error: {why}")

    import torch

    from p2p_diloco.node_runner import setup_logging
    from p2p_diloco.train.data import TextData
    from p2p_diloco.train.model import build_model, evaluate_loss

    setup_logging(verbose=False)
    torch.set_num_threads(1)
    began = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = method_config(args, "dp")
    data = TextData(cfg.data)  # also trains and caches the tokenizer once, before the workers load it
    initial_loss = evaluate_loss(build_model(cfg.model, data.vocab_size, cfg.run.seed, cfg.data.seq_len), data.heldout)
    summaries = []
    for method in methods:
        try:
            summary = run_method(method, args, out)
            evaluate(summary, args, data, out)
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            print(f"{method}: failed: {e}", flush=True)
            summary = dict(method=method, label=LABELS[method], error=str(e))
        summaries.append(summary)
        (out / "results.json").write_text(json.dumps(dict(args=vars(args), initial_eval_loss=initial_loss,
                                                          results=summaries), indent=2))
    print(f"\n{args.peers} peers on {args.mbit:g} Mbit/s links, {args.budget:g} s of training each, "
          f"{cfg.model.hidden_size}-wide {cfg.model.num_layers}-layer Llama, batch {cfg.inner.batch_size} per peer, "
          f"lr schedule over {args.total_steps} steps, H = {args.inner_steps}; initial eval loss {initial_loss:.4f}\n")
    print(markdown_table(summaries))
    print()
    for s in summaries:
        if "perplexity" not in s:
            continue
        dp = s["peers"][0] if s["method"] == "dp" else None
        extra = (f"median {dp['median_step_seconds']:.2f} s per step: gradient {dp['median_gradient_seconds']:.2f} s, "
                 f"all-reduce with matchmaking and commit {dp['median_allreduce_seconds']:.2f} s; "
                 if dp and dp["median_step_seconds"] else "")
        print(f"- {s['label']}: {extra}final models identical on all peers: {s['final_models_identical']}; "
              f"evaluated peer {s['evaluated_peer']}; failed rounds {sum(r['rounds_failed'] for r in s['peers'])}; "
              f"peers left {s['seconds_to_exit_after_deadline']:.0f} s after the deadline")
    diloco = next((s for s in summaries if s["method"] == "diloco" and "perplexity" in s), None)
    if diloco is not None:
        mean_steps = statistics.mean(diloco["steps_per_peer"])
        if not 0.8 <= mean_steps / args.total_steps <= 1.25:
            print(f"\nnote: the DiLoCo peers took {mean_steps:.0f} inner steps on average, the lr schedule is "
                  f"{args.total_steps} steps long: to end the schedule with the budget on this machine, rerun with "
                  f"--total-steps {round(mean_steps)}")
    print(f"\nwrote {out / 'results.json'}; benchmark wall time {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
