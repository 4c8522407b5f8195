"""Quality benchmark: DiLoCo against data-parallel training and a single worker, at equal tokens.

A tiny Llama (hidden 128, 2 layers, vocab 1,024 local BPE, 64-token sequences) is trained on one text
file three ways, from the same initial weights, with the same inner AdamW hyper-parameters (one
:class:`~p2p_diloco.train.inner.InnerTrainer` each):

1. **data-parallel**: M replicas whose gradients are averaged every step. With the mean loss over
   equal-length packed sequences this is exactly one model trained on a global batch of M × B
   (gradient clipping applies to the averaged gradient, as in real data-parallel training), so it
   is run as that one model. Its traffic is *computed*: a ring/butterfly all-reduce of fp32
   gradients sends 2·(M−1)/M·4·num_params bytes per peer per step and receives as many.
2. **DiLoCo** (arXiv 2311.08105): M :class:`~p2p_diloco.train.diloco.DiLoCoPeer` instances in this
   process, one thread each, each with its own hivemind DHT on loopback, averaging pseudo-gradients
   through the project's real all-reduce every H inner steps (outer Nesterov, lr 0.7, momentum 0.9).
   Each peer trains on batches of B in its own data order. Its traffic is *measured*: the tensor
   payload bytes the peers' averagers sent and received.
3. **single worker**: plain AdamW on batches of B for as many steps as each DiLoCo peer takes (so
   1/M of the tokens), and again for M × as many steps (equal tokens).

Data-parallel and DiLoCo process the same number of tokens: DiLoCo runs first, and the others then
take as many steps as its peers did on average. That is K·H, unless a peer cut a round short (it
contributes the inner steps it managed once the fastest peer is ready). All methods follow one lr
schedule over K·H steps (M·K·H for the equal-tokens single worker). The eval loss on the held-out
split is recorded every H inner steps (after every outer step for DiLoCo, taken from θ_global, at
the tokens its groups reported), so all curves can be plotted against tokens. DiLoCo's gap to
data-parallel can be compared with the DiLoCo scaling-laws paper (arXiv 2503.09799): +2.0% loss at
M = 4 for a 35M model.

Wall times are training time only (no evaluation, no DHT start-up) with one torch thread per model;
the M DiLoCo peers share the machine's cores, so its wall time is not a per-peer compute time.

Run (about 13 minutes on 2 CPU cores)::

    python benchmarks/quality.py
    python benchmarks/quality.py --text my.txt --outer-steps 4 --inner-steps 20 --out /tmp/bench

Prints a markdown table and DiLoCo's gap to data-parallel; writes ``eval_loss_vs_tokens.png`` and
``results.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from p2p_diloco.config import Config, config_from_dict, shared_settings
from p2p_diloco.metrics import MetricsWriter
from p2p_diloco.node_runner import setup_logging
from p2p_diloco.swarm.node import start_run_node, visible_maddrs
from p2p_diloco.train.data import TextData, order_seed, tokenizer_sha256
from p2p_diloco.train.diloco import DiLoCoPeer
from p2p_diloco.train.inner import InnerTrainer
from p2p_diloco.train.model import build_model, evaluate_loss, trainable_parameters
from p2p_diloco.train.outer import GlobalModel

logger = logging.getLogger("benchmarks.quality")

DEFAULT_TEXT = str(Path(__file__).resolve().parent.parent / "peers" / "data" / "tinyshakespeare.txt")
LOCAL_BATCH_SIZE = 16  # B, sequences per inner step of one peer
# the Llama sizes these benchmarks train: peers/demo.toml's (0.69M parameters with the 1024-token vocabulary)
# and the WAN benchmarks' 14.7M (58.7 MB in fp32; benchmarks/utilization.py's 100mbit layout)
MODEL_SIZES = {
    "demo": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "intermediate_size": 384},
    "14.7m": {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "intermediate_size": 1536},
}
WARMUP_FRACTION = 0.05  # of each peer's inner steps; the same warmup (in steps) for every method
FP32_BYTES = 4


# ----- configuration ------------------------------------------------------------------------------
def benchmark_config(text_path: str, seed: int, inner_steps_per_outer: int, total_inner_steps: int,
                     model: str = "demo", batch_size: int = LOCAL_BATCH_SIZE) -> Config:
    """The run config shared by all methods: a model of MODEL_SIZES, the text file as corpus."""
    return config_from_dict({
        "run": {"name": "bench-quality", "seed": seed},
        "model": {"name": "llama", **MODEL_SIZES[model], "max_position_embeddings": 128},
        "data": {"source": "files", "paths": [text_path], "tokenizer": "local-bpe", "vocab_size": 1024,
                 "seq_len": 64, "holdout_fraction": 0.05},
        "inner": {"optimizer": "adamw", "lr": 2e-3, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95,
                  "warmup_steps": max(1, round(WARMUP_FRACTION * total_inner_steps)),
                  "total_steps": total_inner_steps, "min_lr_ratio": 0.1, "grad_clip": 1.0,
                  "batch_size": batch_size, "grad_accumulation": 1,
                  "steps_per_outer": inner_steps_per_outer},
        # DiLoCo's Algorithm 1 (fp32, blocking): codecs, error feedback and overlap are what the other
        # benchmarks compare against it; an overlap asked for is Streaming DiLoCo's fixed τ unless a variant
        # says fixed_sync_delay = false
        "outer": {"lr": 0.7, "momentum": 0.9, "codec": "none", "error_feedback": False, "fragments": 1,
                  "sync_delay": 0, "fixed_sync_delay": True, "merge_alpha": 0.0},
        "swarm": {"matchmaking_time": 2.0, "request_timeout": 1.0, "round_wait_timeout": 30.0,
                  "allreduce_timeout": 60.0, "next_chunk_timeout": 10.0, "state_download_timeout": 60.0,
                  "progress_ttl": 60.0},
    })


# ----- results --------------------------------------------------------------------------------------
@dataclass
class LossCurve:
    """Held-out loss at increasing numbers of training tokens (all workers together)."""

    tokens: list[int] = field(default_factory=list)
    eval_losses: list[float] = field(default_factory=list)

    def add(self, tokens: int, eval_loss: float) -> None:
        self.tokens.append(tokens)
        self.eval_losses.append(eval_loss)


@dataclass
class MethodResult:
    name: str
    curve: LossCurve
    tokens_processed: int  # by all workers together
    bytes_per_peer: int  # sent + received by one peer over the whole run
    bytes_source: str  # "measured", "computed" or "none"
    train_seconds: float
    details: dict = field(default_factory=dict)

    @property
    def final_eval_loss(self) -> float:
        return self.curve.eval_losses[-1]


def count_trainable_params(cfg: Config, vocab_size: int) -> int:
    return sum(p.numel() for p in trainable_parameters(build_model(cfg.model, vocab_size, cfg.run.seed)))


def allreduce_bytes_per_peer(num_params: int, num_peers: int, rounds: int) -> int:
    """Bytes one peer sends plus receives in `rounds` ring/butterfly all-reduces of fp32 tensors."""
    sent_per_round = 2 * (num_peers - 1) / num_peers * FP32_BYTES * num_params
    return round(2 * sent_per_round * rounds)


# ----- data-parallel and single worker: one model, one InnerTrainer ------------------------------------
def train_one_model(
    cfg: Config, data: TextData, batches: Iterator[torch.Tensor], num_steps: int, eval_every_steps: int
) -> tuple[LossCurve, float]:
    """Train from the run's initial weights; the eval loss every `eval_every_steps` and the training seconds."""
    model = build_model(cfg.model, data.vocab_size, cfg.run.seed)
    trainer = InnerTrainer(model, cfg.inner, batches)
    curve, train_seconds, tokens = LossCurve(), 0.0, 0
    curve.add(0, evaluate_loss(model, data.heldout))
    while trainer.steps_done < num_steps:
        started = time.perf_counter()
        phase = trainer.run(min(eval_every_steps, num_steps - trainer.steps_done))
        train_seconds += time.perf_counter() - started
        tokens += phase.samples * cfg.data.seq_len
        curve.add(tokens, evaluate_loss(model, data.heldout))
        logger.info("%d/%d steps, %.2fM tokens: eval loss %.4f", trainer.steps_done, num_steps, tokens / 1e6,
                    curve.eval_losses[-1])
    return curve, train_seconds


def run_data_parallel(
    cfg: Config, data: TextData, num_peers: int, num_steps: int, eval_every_steps: int
) -> MethodResult:
    global_batch_size = num_peers * cfg.inner.batch_size
    batches = data.peer_batches(global_batch_size, order_seed(cfg.run.seed, "bench-data-parallel"))
    curve, seconds = train_one_model(cfg, data, batches, num_steps, eval_every_steps)
    num_params = count_trainable_params(cfg, data.vocab_size)
    return MethodResult(
        f"data-parallel, M={num_peers} (one model, global batch {global_batch_size})", curve, curve.tokens[-1],
        allreduce_bytes_per_peer(num_params, num_peers, rounds=num_steps), "computed", seconds,
        {"steps": num_steps, "global_batch_size": global_batch_size, "num_params": num_params},
    )


def run_single_worker(cfg: Config, data: TextData, num_steps: int, eval_every_steps: int, label: str) -> MethodResult:
    batches = data.peer_batches(cfg.inner.batch_size, order_seed(cfg.run.seed, "bench-single"))
    curve, seconds = train_one_model(cfg, data, batches, num_steps, eval_every_steps)
    return MethodResult(f"single worker, batch {cfg.inner.batch_size}, {label}", curve, curve.tokens[-1],
                        0, "none", seconds, {"steps": num_steps})


# ----- DiLoCo: real peers, real DHTs, real all-reduce, in threads ----------------------------------------
class GlobalModelHistory(MetricsWriter):
    """A peer's metrics writer that, once it watches the peer's θ_global, also keeps a copy of it whenever the
    peer's outer step changes (one peer's is enough: every peer holds the same θ_global, and K copies of a 14.7M
    model take 1.2 GB).

    DiLoCoPeer writes an ``outer_step`` (or ``state_loaded``) record right after it changes θ_global,
    in its own thread: the copy is exact, and evaluating it later keeps evaluation out of the run.
    """

    def __init__(self, peer_id: str):
        super().__init__(None, peer_id)
        self.global_model: GlobalModel | None = None  # set by watch(), once the peer exists, on one peer
        self.records: list[dict] = []
        self.snapshots: dict[int, list[torch.Tensor]] = {}

    def watch(self, global_model: GlobalModel) -> None:
        self.global_model = global_model

    def write(self, event: str, **fields) -> dict:
        record = super().write(event, **fields)
        self.records.append(record)
        if self.global_model is not None and event in ("outer_step", "state_loaded"):
            self.snapshots[fields["outer_step"]] = [p.clone() for p in self.global_model.params]
        return record

    def outer_step_records(self) -> list[dict]:
        return [r for r in self.records if r["event"] == "outer_step"]


def start_swarm(run_name: str, num_peers: int) -> list:
    """One DHT node (and identity) per peer on loopback; every node after the first joins through the first."""
    nodes = [start_run_node(run_name, "127.0.0.1", 0)]
    try:
        for _ in range(num_peers - 1):
            nodes.append(start_run_node(run_name, "127.0.0.1", 0, initial_peers=visible_maddrs(nodes[0].dht)))
    except BaseException:
        shutdown_swarm(nodes)
        raise
    return nodes


def shutdown_swarm(nodes: Sequence) -> None:
    for node in nodes:
        node.dht.shutdown()


def run_peers_in_threads(peers: Sequence[DiLoCoPeer], max_outer_steps: int, stop: threading.Event) -> float:
    """Run every peer until θ_global reaches `max_outer_steps`; the wall seconds it took. Re-raises a peer's error."""
    errors: list[BaseException] = []

    def run_peer(peer: DiLoCoPeer) -> None:
        torch.set_num_threads(1)  # M peers share the cores: one intra-op thread each
        try:
            peer.run(max_outer_steps=max_outer_steps)
        except BaseException as e:
            errors.append(e)
            stop.set()  # the other peers leave too instead of waiting for this one

    threads = [threading.Thread(target=run_peer, args=(p,), name=f"peer-{i}") for i, p in enumerate(peers)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()
    except BaseException:  # Ctrl+C: the peers leave the swarm before the caller stops the DHTs
        stop.set()
        for thread in threads:
            thread.join()
        raise
    if errors:
        raise errors[0]
    return time.perf_counter() - started


def tokens_by_outer_step(histories: Sequence[GlobalModelHistory], seq_len: int) -> dict[int, int]:
    """Tokens averaged into θ_global up to each outer step: the groups' samples, summed over the steps.

    A peer may contribute fewer than H inner steps to a round (it stops once the round is closing),
    so the count comes from the samples each group reported, not from K·H.
    """
    group_samples: dict[int, int] = {}
    for history in histories:
        for record in history.outer_step_records():
            step = record["outer_step"]
            group_samples[step] = max(group_samples.get(step, 0), record["group_samples"])
    tokens, total = {}, 0
    for step in sorted(group_samples):
        total += group_samples[step] * seq_len
        tokens[step] = total
    return tokens


def evaluate_snapshots(
    cfg: Config, data: TextData, snapshots: dict[int, list[torch.Tensor]], tokens_at_step: dict[int, int]
) -> LossCurve:
    """Held-out loss of the initial model and of every θ_global snapshot."""
    model = build_model(cfg.model, data.vocab_size, cfg.run.seed)
    curve = LossCurve()
    curve.add(0, evaluate_loss(model, data.heldout))
    params = trainable_parameters(model)
    for outer_step in sorted(set(snapshots) & set(tokens_at_step)):
        with torch.no_grad():
            for param, value in zip(params, snapshots[outer_step]):
                param.copy_(value)
        curve.add(tokens_at_step[outer_step], evaluate_loss(model, data.heldout))
    return curve


def swarm_consistency(histories: Sequence[GlobalModelHistory], num_peers: int) -> dict:
    """Whether every outer step was taken by the whole group and left the same θ_global on every peer."""
    sha_by_step: dict[int, set[str]] = {}
    group_sizes = []
    for history in histories:
        for record in history.outer_step_records():
            sha_by_step.setdefault(record["outer_step"], set()).add(record["global_sha256"])
            group_sizes.append(record["group_size"])
    return {
        "rounds_with_full_group": sum(size == num_peers for size in group_sizes),
        "rounds_recorded": len(group_sizes),
        "identical_global_model_every_step": all(len(shas) == 1 for shas in sha_by_step.values()),
        "state_downloads": sum(r["event"] == "state_loaded" for h in histories for r in h.records),
        "rounds_failed": sum(r["event"] == "round_failed" for h in histories for r in h.records),
    }


def run_diloco(cfg: Config, data: TextData, num_peers: int, outer_steps: int,
               batch_sizes: Sequence[int] = (), prepare: Callable[[int, DiLoCoPeer], None] | None = None,
               ) -> MethodResult:
    """`num_peers` DiLoCoPeers in threads until θ_global reaches `outer_steps`. Peer i trains batches of
    `batch_sizes[i]` sequences (default: the config's; a larger one stands for a faster peer or an island, as
    it claims the samples it trained), and `prepare(i, peer)` runs on each peer before any starts (a benchmark
    makes one hostile there)."""
    gc.collect()  # the last run's peers, in reference cycles, go before this run's are made (GBs at 14.7M)
    nodes = start_swarm(cfg.run.name, num_peers)
    settings = shared_settings(cfg, tokenizer_sha256(data.tokenizer))
    stop = threading.Event()
    try:
        peers, histories = [], []
        for index, node in enumerate(nodes):
            model = build_model(cfg.model, data.vocab_size, cfg.run.seed)
            seed = order_seed(cfg.run.seed, f"bench-{index}")
            history = GlobalModelHistory(node.dht.peer_id.to_base58())
            batch_size = batch_sizes[index] if index < len(batch_sizes) else cfg.inner.batch_size
            peer = DiLoCoPeer(cfg, model, data.for_peer(batch_size, seed), node, settings, metrics=history,
                              stop_event=stop)
            if index == 0:  # the others' copies would be the same bits (swarm_consistency checks their hashes)
                history.watch(peer.global_model)
            if prepare is not None:
                prepare(index, peer)
            peers.append(peer)
            histories.append(history)
        # hivemind's averager sets SIGINT to "ignore" when it starts: restore Ctrl+C for this script
        signal.signal(signal.SIGINT, signal.default_int_handler)
        train_seconds = run_peers_in_threads(peers, outer_steps, stop)
    finally:
        shutdown_swarm(nodes)

    snapshots = histories[0].snapshots
    last_snapshot = snapshots[max(snapshots)]
    assert all(map(torch.equal, last_snapshot, peers[0].global_model.params)), "the last snapshot is not θ_global"
    curve = evaluate_snapshots(cfg, data, snapshots, tokens_by_outer_step(histories, cfg.data.seq_len))
    traffic = [p.sync.averager.traffic for p in peers]
    bytes_per_peer = [t.sent + t.received for t in traffic]
    inner_steps = [p.inner.steps_done for p in peers]
    return MethodResult(
        f"DiLoCo, M={num_peers}, H={cfg.inner.steps_per_outer} (batch {cfg.inner.batch_size} per peer)", curve,
        sum(inner_steps) * cfg.inner.batch_size * cfg.data.seq_len,
        round(sum(bytes_per_peer) / num_peers), "measured", train_seconds,
        {
            "outer_steps": outer_steps,
            "inner_steps_per_peer": inner_steps,
            "bytes_per_peer": bytes_per_peer,
            # τ run: the mean of the inner steps that ran beside each sync, before its merge (outer.sync_delay)
            "overlap_steps": statistics.mean([r.get("overlap_steps", 0) for h in histories
                                              for r in h.outer_step_records()] or [0]),
            # what the groups counted: samples weighed into each mean (outer.claim_cap), the median over rounds
            "group_samples": statistics.median([r["group_samples"] for h in histories
                                                for r in h.outer_step_records()] or [0]),
            **swarm_consistency(histories, num_peers),
        },
    )


# ----- report -------------------------------------------------------------------------------------------
def format_bytes(num_bytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"


def markdown_table(results: Sequence[MethodResult]) -> str:
    lines = [
        "| method | tokens | eval loss | perplexity | bytes communicated per peer | wall time (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        traffic = "0" if r.bytes_source == "none" else f"{format_bytes(r.bytes_per_peer)} ({r.bytes_source})"
        lines.append(
            f"| {r.name} | {r.tokens_processed / 1e6:.2f}M | {r.final_eval_loss:.4f} "
            f"| {math.exp(r.final_eval_loss):.2f} | {traffic} | {r.train_seconds:.0f} |"
        )
    return "\n".join(lines)


def percent_gap(loss: float, reference_loss: float) -> float:
    return 100.0 * (loss - reference_loss) / reference_loss


def plot_curves(results: Sequence[MethodResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        ax.plot([t / 1e6 for t in r.curve.tokens], r.curve.eval_losses, marker=".", label=r.name)
    ax.set_xlabel("training tokens, all workers (millions)")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_summary(results: Sequence[MethodResult], num_peers: int) -> float:
    """The table and the checks; returns DiLoCo's eval-loss gap to data-parallel in percent.

    `results` in the order main() runs them: DiLoCo, data-parallel, single worker (same steps), ...
    """
    diloco, data_parallel = results[0], results[1]
    gap_percent = percent_gap(diloco.final_eval_loss, data_parallel.final_eval_loss)
    computed_diloco_bytes = allreduce_bytes_per_peer(
        data_parallel.details["num_params"], num_peers, rounds=diloco.details["outer_steps"]
    )
    print()
    print(markdown_table(results))
    print()
    print(f"DiLoCo vs data-parallel at equal tokens: eval loss {gap_percent:+.2f}% "
          f"(Charles et al., arXiv 2503.09799: +2.0% at M = 4 for a 35M model)")
    print(f"DiLoCo traffic: {diloco.bytes_per_peer / computed_diloco_bytes:.3f}× the computed all-reduce bytes of "
          f"its {diloco.details['outer_steps']} rounds; data-parallel "
          f"{data_parallel.bytes_per_peer / diloco.bytes_per_peer:.0f}× more")
    print(f"DiLoCo swarm: {diloco.details['rounds_with_full_group']} of {diloco.details['rounds_recorded']} "
          f"peer-rounds in a group of all {num_peers} peers; θ_global identical on every peer after every outer "
          f"step: {diloco.details['identical_global_model_every_step']}")
    same_steps_single = results[2]
    print(f"DiLoCo vs the single worker with the same inner steps per worker: eval loss "
          f"{percent_gap(diloco.final_eval_loss, same_steps_single.final_eval_loss):+.2f}%")
    if abs(diloco.tokens_processed - data_parallel.tokens_processed) >= data_parallel.tokens_processed / 100:
        print(f"warning: DiLoCo processed {diloco.tokens_processed} tokens, data-parallel "
              f"{data_parallel.tokens_processed}: more than 1% apart")
    return gap_percent


def save_outputs(
    out: Path, args: argparse.Namespace, cfg: Config, results: Sequence[MethodResult], gap_percent: float
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    num_params = results[1].details["num_params"]
    plot_curves(results, out / "eval_loss_vs_tokens.png",
                f"{num_params / 1e6:.2f}M-parameter Llama on {Path(args.text).name}")
    summary = {
        "args": vars(args),
        "config": dataclasses.asdict(cfg),
        "diloco_vs_data_parallel_loss_gap_percent": gap_percent,
        "results": [
            {**dataclasses.asdict(r), "final_eval_loss": r.final_eval_loss,
             "perplexity": math.exp(r.final_eval_loss)}
            for r in results
        ],
    }
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    print(f"wrote {out / 'results.json'} and {out / 'eval_loss_vs_tokens.png'}")


# ----- main ---------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, out="bench-out")
    add_model_arguments(parser)
    parser.add_argument("--skip-equal-tokens-single", action="store_true",
                        help="do not train the single worker for M× the steps (saves about 30%% of the run time)")
    return checked_run_arguments(parser)


def add_run_arguments(parser: argparse.ArgumentParser, out: str) -> None:
    """The options of a DiLoCo run that every quality benchmark shares."""
    parser.add_argument("--text", default=DEFAULT_TEXT, help="text file to train and evaluate on")
    parser.add_argument("--out", default=out, help="directory for results.json (and plots)")
    parser.add_argument("--outer-steps", type=int, default=14, help="K, DiLoCo outer steps")
    parser.add_argument("--inner-steps", type=int, default=50, help="H, inner steps per outer step")
    parser.add_argument("--peers", type=int, default=4, help="M, DiLoCo peers and data-parallel replicas")
    parser.add_argument("--seed", type=int, default=0, help="run seed: initial weights and data orders")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and the batch of a quality benchmark that trains the same config in every method."""
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="demo",
                        help="demo: peers/demo.toml's 0.69M Llama; 14.7m: the WAN benchmarks' (hidden 512, 4 layers)")
    parser.add_argument("--batch-size", type=_at_least_one, default=LOCAL_BATCH_SIZE,
                        help="B, sequences per inner step of a peer")


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def checked_run_arguments(parser: argparse.ArgumentParser) -> argparse.Namespace:
    args = parser.parse_args()
    for name in ("outer_steps", "inner_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.peers < 2:
        parser.error("--peers must be at least 2: DiLoCo needs a group to average with")
    return args


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    setup_logging(verbose=False)
    # one thread per model for every method: on 2 cores a 2-thread batch-64 step measured 2.4× slower
    torch.set_num_threads(1)
    # every method shares one lr schedule over K·H inner steps (M·K·H for the equal-tokens single worker)
    nominal_steps_per_peer = args.outer_steps * args.inner_steps
    cfg = benchmark_config(args.text, args.seed, args.inner_steps, nominal_steps_per_peer, args.model, args.batch_size)
    data = TextData(cfg.data)

    logger.info("DiLoCo: %d peers, %d outer steps of up to %d inner steps", args.peers, args.outer_steps,
                args.inner_steps)
    diloco = run_diloco(cfg, data, args.peers, args.outer_steps)
    # equal tokens: the others take as many steps as DiLoCo's peers did (K·H each unless rounds closed early)
    diloco_inner_steps = sum(diloco.details["inner_steps_per_peer"])
    steps_per_worker = round(diloco_inner_steps / args.peers)
    results = [diloco]
    logger.info("data-parallel: %d steps", steps_per_worker)
    results.append(run_data_parallel(cfg, data, args.peers, steps_per_worker, args.inner_steps))
    logger.info("single worker: %d steps", steps_per_worker)
    same_steps_label = f"same steps (1/{args.peers} tokens)"
    results.append(run_single_worker(cfg, data, steps_per_worker, args.inner_steps, same_steps_label))
    if not args.skip_equal_tokens_single:
        logger.info("single worker, equal tokens: %d steps", diloco_inner_steps)
        long_cfg = cfg.replace(inner={"total_steps": args.peers * nominal_steps_per_peer})
        results.append(run_single_worker(long_cfg, data, diloco_inner_steps, args.inner_steps, "equal tokens"))
    gap_percent = print_summary(results, args.peers)
    save_outputs(Path(args.out), args, cfg, results, gap_percent)
    print(f"benchmark wall time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
