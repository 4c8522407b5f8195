"""An island peer's inner steps and its outer step's added cost: 1 rank against several, under torchrun.

    python benchmarks/island.py                                   # the demo config, 1 and 2 ranks, CPU
    python benchmarks/island.py --config big.toml --ranks 1 2 4 --steps 20
    python benchmarks/island.py --device cuda --ranks 1 2 4 8     # on a machine with GPUs

For each rank count R it runs ``torchrun --nproc-per-node R`` over this script's worker, in a network
namespace with only a loopback (tests/netns.py: torchrun's rendezvous store listens on every
interface), on the CPU by default with ``--threads`` CPU threads in all, split evenly between the ranks.
R = 1 is a single-process peer (no torch.distributed); R > 1 runs the island's own code
(p2p_diloco.train.island): rank 0 drives, the others follow its commands, DDP or with ``--shard``
FSDP2. Each worker builds the run's model and data as a peer does, takes ``--warmup`` inner steps, then
times ``--steps`` more, and then the outer step's island work: rank 0 pushing θ_local whole to the other
ranks (what follows an outer step with one fragment, or a loaded state), and, sharded, gathering it
(what precedes Δ and a checkpoint).

Prints a Markdown table: seconds per inner step, the peer's samples per second (all ranks), and the
push and gather in milliseconds. Writes ``results.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RUN_TIMEOUT_S = 900


def worker(args) -> None:
    """One rank (or the single process, R = 1): inner steps as a peer takes them, timed on rank 0."""
    import torch

    from p2p_diloco.config import load_config
    from p2p_diloco.node_runner import _prepare_training, _shards
    from p2p_diloco.train.inner import InnerTrainer
    from p2p_diloco.train.island import Island, IslandLead, follow, island_size

    cfg = load_config(args.config)
    if args.shard:
        cfg = cfg.replace(compute={"shard": True})
    peer_id = "QmBenchmarkIslandPeer"
    island = Island(args.device, args.shard) if island_size() > 1 or args.island else None
    device = island.device if island else torch.device("cuda" if args.device == "cuda" else "cpu")
    model, _, data, micro = _prepare_training(cfg, peer_id, device, _shards(island))
    if island is not None and not island.is_lead:
        trainer = InnerTrainer(model, cfg.inner, iter(()), cfg.compute, micro, island, island.prepare_model(model))
        follow(island, model, trainer, data)
        island.close()
        return
    lead = IslandLead(island, model, island.prepare_model(model)) if island else None
    trainer = InnerTrainer(model, cfg.inner, iter(()), cfg.compute, micro, island, lead and lead.forward_model)
    stream = data.open(0, None)
    trainer.batches = lead.open_stream(stream, 0, None) if lead else stream

    def step() -> int:
        if lead:
            lead.before_step()
        return trainer.step()[1]

    def synced() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(args.warmup):
        step()
    synced()
    start, samples = time.perf_counter(), 0
    for _ in range(args.steps):
        samples += step()
    synced()
    seconds = time.perf_counter() - start
    push_s, gather_s = [], []
    if lead:
        for _ in range(3):
            lead.changed(trainer.steps_done)
            t = time.perf_counter()
            lead.push()
            synced()
            push_s.append(time.perf_counter() - t)
            step()  # the shards moved on: the next pull gathers them
            synced()
            t = time.perf_counter()
            lead.pull()
            gather_s.append(time.perf_counter() - t)
        island.stop_others("benchmark done")
        island.close()
    parameters = sum(p.numel() for p in model.parameters())
    print("RESULT " + json.dumps(dict(
        ranks=island.world_size if island else 1, shard=bool(island and island.shard), device=str(device),
        parameters=parameters, steps=args.steps, s_per_step=seconds / args.steps, samples_per_s=samples / seconds,
        push_ms=1000 * statistics.median(push_s) if push_s else None,
        gather_ms=1000 * statistics.median(gather_s) if island and island.shard else None)), flush=True)


def run_ranks(args, ranks: int, host, topology, out: Path) -> dict:
    """torchrun over the worker with `ranks` processes inside the namespace; the result rank 0 printed."""
    threads = max(1, args.threads // ranks)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               str(Path(__file__).resolve()), "--worker", "--config", str(args.config), "--device", args.device,
               "--steps", str(args.steps), "--warmup", str(args.warmup), *(["--shard"] if args.shard else [])]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(threads))
    log = out / f"ranks{ranks}{'-shard' if args.shard else ''}.log"
    with open(log, "w") as err:
        done = subprocess.run(topology.command(host, command), stdout=subprocess.PIPE, stderr=err, text=True,
                              env=env, timeout=RUN_TIMEOUT_S)
    results = [json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not results:
        raise RuntimeError(f"{ranks} rank(s) failed (exit {done.returncode}); see {log}")
    return dict(results[0], threads_per_rank=threads)


def table(rows: list[dict]) -> str:
    lines = ["| ranks | model | threads/rank | s/inner step | samples/s | push ms | gather ms |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    def ms(value) -> str:
        return "-" if value is None else f"{value:.1f}"

    for r in rows:
        mode = "single process" if r["ranks"] == 1 else ("FSDP2" if r["shard"] else "DDP")
        lines.append(f"| {r['ranks']} | {mode}, {r['parameters'] / 1e6:.1f}M on {r['device']} | {r['threads_per_rank']} | "
                     f"{r['s_per_step']:.3f} | {r['samples_per_s']:.1f} | {ms(r['push_ms'])} | {ms(r['gather_ms'])} |")
    return "\n".join(lines)


def main() -> None:
    from p2p_diloco.demo import DEFAULT_CONFIG

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="run config (default: peers/demo.toml)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="rank counts to compare")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shard", action="store_true", help="FSDP2 instead of DDP for R > 1")
    parser.add_argument("--steps", type=int, default=30, help="timed inner steps")
    parser.add_argument("--warmup", type=int, default=3, help="inner steps before timing")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="CPU threads in all, split evenly between the ranks")
    parser.add_argument("--out", type=Path, default=REPO / "bench-out" / "island")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    # a worker of one rank through the island's code anyway (NCCL and FSDP2 on a machine of one GPU)
    parser.add_argument("--island", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    from benchmarks.churn import prepare_tokenizer
    from tests.netns import Topology, unavailable

    why_not = unavailable()
    if why_not:
        sys.exit(f"this benchmark runs torchrun in a network namespace: {why_not}")
    args.out.mkdir(parents=True, exist_ok=True)
    prepare_tokenizer(args.config)  # trained once, before the ranks read it
    rows = []
    with Topology() as topology:
        host = topology.add_loopback("island")
        for ranks in args.ranks:
            print(f"{ranks} rank(s)...", file=sys.stderr, flush=True)
            rows.append(run_ranks(args, ranks, host, topology, args.out))
    (args.out / "results.json").write_text(json.dumps(rows, indent=2))
    print(table(rows))


if __name__ == "__main__":
    main()
