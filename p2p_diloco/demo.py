"""`p2p-diloco demo`: a whole swarm on one machine, offline, through the real CLI.

Starts a bootstrap node and N `p2p-diloco peer` processes on 127.0.0.1, waits until each has taken
the requested number of outer steps, stops every process it started, then evaluates the initial model
and the final θ_global on held-out text and writes ``summary.json`` and ``loss.png``. The peers
measure θ_global on the same held-out sequences every ``eval.every`` outer steps while they train
(their ``eval`` metrics records): the plot draws those measurements, and no line where none was taken.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from p2p_diloco.logs import log_to_stderr
from p2p_diloco.manifest import shipped_manifest_dir
from p2p_diloco.metrics import read_metrics
from p2p_diloco.train.utilization import compute_utilization

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = shipped_manifest_dir() / "demo.toml"  # peers/demo.toml of a checkout, or as installed


def cli_command(*args: str) -> list[str]:
    """The `p2p-diloco` command line, run with this interpreter (works without the entry point on PATH)."""
    return [sys.executable, "-m", "p2p_diloco.cli", *args]


def stop_process(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM, wait, then SIGKILL: never leave a process (or its p2pd daemon) behind."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def start_bootstrap(log_dir: Path, timeout_s: float = 60.0, *extra: str, log_name: str = "bootstrap.log"
                    ) -> tuple[subprocess.Popen, str]:
    """A bootstrap node on a free loopback port (`extra`: more `bootstrap` options); returns the process and
    its first multiaddr."""
    err = open(log_dir / log_name, "w")
    proc = subprocess.Popen(
        cli_command("bootstrap", "--host", "127.0.0.1", "--port", "0", *extra),
        stdout=subprocess.PIPE, stderr=err, text=True,
    )
    deadline = time.monotonic() + timeout_s
    import selectors

    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    while time.monotonic() < deadline:
        if selector.select(timeout=1.0):
            line = proc.stdout.readline().strip()
            if line.startswith("/"):
                return proc, line
        if proc.poll() is not None:
            break
    stop_process(proc)
    raise RuntimeError(f"the bootstrap node did not print its address within {timeout_s:.0f} s; see {err.name}")


def start_peer(
    config: Path, maddr: str, out_dir: Path, index: int, max_outer_steps: int, wait_for_peers: int = 1
) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    log = open(out_dir / f"peer-{index}.log", "w")
    return subprocess.Popen(
        cli_command(
            "peer", "--config", str(config), "--host", "127.0.0.1", "--initial-peers", maddr,
            "--metrics-file", str(out_dir / f"peer-{index}.metrics.jsonl"),
            "--checkpoint-dir", str(out_dir / f"peer-{index}"),
            "--max-outer-steps", str(max_outer_steps), "--wait-for-peers", str(wait_for_peers),
        ),
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )


def say(text: str) -> None:
    """One line of what the demo does, on stdout with its progress (`demo: ...`)."""
    print(f"demo: {text}", flush=True)


def joined(metrics_files: list[Path]) -> int:
    """How many peers have written their `join` record: they have met the swarm and built the model."""
    return sum(path.exists() and any(r["event"] == "join" for r in read_metrics(path)) for path in metrics_files)


def wait_for_joins(procs: list[subprocess.Popen], metrics_files: list[Path], deadline: float) -> bool:
    """Until every peer has joined (True), or one has exited or the deadline passed (False)."""
    while time.monotonic() < deadline:
        if joined(metrics_files) == len(metrics_files):
            return True
        if any(p.poll() is not None for p in procs):
            return False
        time.sleep(0.5)
    return False


def format_duration(seconds: float) -> str:
    return f"{int(seconds) // 60}m{int(seconds) % 60:02d}s" if seconds >= 60 else f"{seconds:.0f} s"


def final_lines(out_dir: Path, summary: dict, plot: Path) -> list[str]:
    """The demo's last words: what the swarm did, and where to look (summary.json holds the rest)."""
    steps = max((p["final_outer_step"] for p in summary["peers"]), default=0)
    loss = f"held-out loss {summary['initial_eval_loss']:.3f} -> " + (
        f"{summary['final_eval_loss']:.3f}" if summary["final_eval_loss"] is not None else "none (no checkpoint)")
    same = "the same θ_global on every peer" if summary["all_final_hashes_equal"] else "peers hold DIFFERENT θ_global"
    return [f"{steps} outer steps in {format_duration(summary['wall_seconds'])}; {loss}; {same}",
            f"summary: {out_dir / 'summary.json'}",
            f"plot:    {plot}",
            f"logs:    {out_dir / 'bootstrap.log'}, {out_dir / 'peer-*.log'} (metrics: peer-*.metrics.jsonl)"]


def wait_all(procs: list[subprocess.Popen], deadline: float, progress: Optional["DemoProgress"] = None) -> bool:
    while time.monotonic() < deadline:
        if progress is not None:
            progress.update()
        if all(p.poll() is not None for p in procs):
            return True
        time.sleep(1.0)
    return False


def describe_swarm_progress(steps_by_peer: list[list[dict]], outer_steps: int) -> str:
    """``demo: outer step 3/16 (peers at 3-4), loss 5.830``: the slowest peer's outer steps, the
    spread, and the newest outer step's mean training loss."""
    done = [records[-1]["outer_step"] if records else 0 for records in steps_by_peer]
    text = f"demo: outer step {min(done)}/{outer_steps}"
    if max(done) != min(done):
        text += f" (peers at {min(done)}-{max(done)})"
    newest = max((records[-1] for records in steps_by_peer if records), key=lambda r: r["time"], default=None)
    if newest is not None:
        text += f", loss {newest['loss']:.3f}"
    return text


class DemoProgress:
    """The swarm's progress while the demo runs, from the peers' metrics files: a bar on a terminal,
    otherwise a line whenever it changes (at most every `interval_s`)."""

    def __init__(self, metrics_files: list[Path], outer_steps: int, stream=None, interval_s: float = 5.0):
        self.metrics_files, self.outer_steps, self.interval_s = metrics_files, outer_steps, interval_s
        self.stream = stream or sys.stdout
        self._bar = None
        if self.stream.isatty():
            from p2p_diloco.train.display import terminal_bar

            self._bar = terminal_bar(self.stream, total=outer_steps, desc="demo: outer steps", unit="step")
        self._shown, self._next = "", 0.0

    def update(self, final: bool = False) -> None:
        steps = [[r for r in read_metrics(path) if r["event"] == "outer_step"] if path.exists() else []
                 for path in self.metrics_files]
        text = describe_swarm_progress(steps, self.outer_steps)
        if self._bar is not None:
            done = min((records[-1]["outer_step"] if records else 0) for records in steps)
            self._bar.update(done - self._bar.n)
            self._bar.set_postfix_str(text.split(", ", 1)[1] if ", " in text else "")
        elif text != self._shown and (final or time.monotonic() >= self._next):
            print(text, file=self.stream, flush=True)
            self._shown, self._next = text, time.monotonic() + self.interval_s

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def evaluate(config_path: Path, checkpoint_dirs: list[Path], sequences: Optional[int] = None
             ) -> tuple[float, Optional[float]]:
    """Held-out loss of the initial model and of the final θ_global (from the newest checkpoint), on the first
    `sequences` held-out sequences (None: all of them)."""
    from p2p_diloco.config import load_config
    from p2p_diloco.export import load_global_parameters
    from p2p_diloco.train.checkpoint import load_checkpoint
    from p2p_diloco.train.data import TextData
    from p2p_diloco.train.model import build_run_model, evaluate_loss

    cfg = load_config(config_path)
    data = TextData(cfg.data, cfg.model.revision)
    heldout = data.heldout[:sequences]
    model = build_run_model(cfg, data.tokenizer)  # as the peers built it
    initial = evaluate_loss(model, heldout)
    checkpoints = [c for c in (load_checkpoint(d) for d in checkpoint_dirs) if c is not None]
    if not checkpoints:
        return initial, None
    newest = max(checkpoints, key=lambda c: c["outer_step"])
    load_global_parameters(model, newest["global_state"], f"run config {str(config_path)!r}")
    return initial, evaluate_loss(model, heldout)


def mean_utilization(steps: list[dict]) -> Optional[float]:
    """Inner seconds over wall seconds across a peer's outer steps (p2p_diloco.train.utilization)."""
    inner = sum(r["inner_seconds"] for r in steps)
    wall = inner + sum(r["blocked_seconds"] for r in steps)
    return compute_utilization(inner, wall) if wall > 0 else None


def peer_records(out_dir: Path, index: int, event: Optional[str] = None) -> list[dict]:
    """Peer `index`'s metrics records (of one `event`, if given); none if it wrote no file."""
    path = out_dir / f"peer-{index}.metrics.jsonl"
    records = read_metrics(path) if path.exists() else []
    return [r for r in records if event is None or r["event"] == event]


def heldout_measurements(out_dir: Path, num_peers: int) -> list[dict]:
    """The held-out losses of θ_global the peers measured while they trained (their ``eval`` records), one per
    outer step: the median over the peers that measured it (they hold the same θ_global, so they agree up
    to rounding)."""
    by_step: dict[int, list[float]] = {}
    for i in range(num_peers):
        for r in peer_records(out_dir, i, "eval"):
            by_step.setdefault(r["outer_step"], []).append(r["eval_loss"])
    return [dict(outer_step=step, eval_loss=statistics.median(losses), peers=len(losses))
            for step, losses in sorted(by_step.items())]


def summarize(out_dir: Path, num_peers: int, initial: float, final: Optional[float], wall_s: float,
              eval_sequences: Optional[int] = None) -> dict:
    peers = []
    total_sent = 0
    for i in range(num_peers):
        records = peer_records(out_dir, i)
        steps = [r for r in records if r["event"] == "outer_step"]
        total_sent += steps[-1]["bytes_sent"] if steps else 0
        peers.append(dict(
            peer_id=records[0]["peer_id"] if records else None,
            outer_steps=len(steps),
            final_outer_step=steps[-1]["outer_step"] if steps else 0,
            final_global_sha256=steps[-1]["global_sha256"] if steps else None,
            final_loss=steps[-1]["loss"] if steps else None,
            compute_utilization=mean_utilization(steps),
        ))
    return dict(
        peers=peers,
        all_final_hashes_equal=len({p["final_global_sha256"] for p in peers}) == 1,
        initial_eval_loss=initial,
        final_eval_loss=final,
        # the first eval.sequences of the held-out split (all of it if it is smaller): before, during and after
        eval_sequences=eval_sequences,
        heldout_evaluations=heldout_measurements(out_dir, num_peers),
        total_bytes_sent=total_sent,
        wall_seconds=wall_s,
    )


def heldout_curve(summary: dict) -> list[tuple[int, float]]:
    """(outer step, held-out loss) of each measurement of the run: the initial model at step 0, the peers'
    measurements while they trained, and the final θ_global where the peers did not measure it."""
    points = {0: summary["initial_eval_loss"]}
    points.update((e["outer_step"], e["eval_loss"]) for e in summary["heldout_evaluations"])
    if summary["final_eval_loss"] is not None:
        points.setdefault(max(p["final_outer_step"] for p in summary["peers"]), summary["final_eval_loss"])
    return sorted(points.items())


def plot_losses(out_dir: Path, num_peers: int, summary: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i in range(num_peers):
        steps = peer_records(out_dir, i, "outer_step")
        ax.plot([r["outer_step"] for r in steps], [r["loss"] for r in steps], marker="o", label=f"peer {i} (train)")
    curve = heldout_curve(summary)  # a line only between measurements
    sequences = f", {summary['eval_sequences']} sequences" if summary.get("eval_sequences") else ""
    ax.plot([s for s, _ in curve], [loss for _, loss in curve], "k-", marker="s",
            label=f"held-out, θ_global{sequences}")
    ax.set_xlabel("outer step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title("p2p-diloco demo")
    ax.legend()
    fig.tight_layout()
    path = out_dir / "loss.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_demo(num_peers: int, outer_steps: int, config_path: Optional[str], out: str, timeout_s: float) -> int:
    log_to_stderr(verbose=False)
    config = Path(config_path) if config_path else DEFAULT_CONFIG
    from p2p_diloco.config import ConfigError, load_config
    from p2p_diloco.exit_codes import EXIT_USAGE, fail
    from p2p_diloco.train.data import DataError, TextData

    if not config.exists():
        return fail(f"no run config at {config}; pass --config peers/demo.toml from a clone", EXIT_USAGE)
    try:  # one line, as `peer` says it, rather than the same error from each peer
        data_config = load_config(config).data
        say(f"building the tokenizer and data of {config} (cached for the next runs)")
        TextData(data_config)  # train and cache the tokenizer once, before the peers need it
    except (ConfigError, DataError) as e:
        return fail(str(e), EXIT_USAGE)

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in list(out_dir.glob("peer-*.metrics.jsonl")) + list(out_dir.glob("peer-*/checkpoint.pt")):
        stale.unlink()  # a previous demo's files would be resumed from or mixed into the summary
    started = time.monotonic()
    say("starting the bootstrap node")
    bootstrap, maddr = start_bootstrap(out_dir)
    peers: list[subprocess.Popen] = []
    metrics_files = [out_dir / f"peer-{i}.metrics.jsonl" for i in range(num_peers)]
    finished = False
    try:
        say(f"bootstrap node at {maddr}; starting {num_peers} peers (logs: {out_dir / 'peer-*.log'})")
        # the peers start together and wait for each other, so that none takes its first steps alone
        peers = [start_peer(config, maddr, out_dir, i, outer_steps, num_peers) for i in range(num_peers)]
        say(f"waiting for the {num_peers} peers to start, meet and build the model")
        if not wait_for_joins(peers, metrics_files, started + timeout_s):
            logger.error("not every peer joined (one exited, or --timeout passed); stopping them")
        else:
            say(f"{num_peers} peers joined after {format_duration(time.monotonic() - started)}; "
                f"training {outer_steps} outer steps")
            progress = DemoProgress(metrics_files, outer_steps)
            finished = wait_all(peers, started + timeout_s, progress)
            progress.update(final=True)
            progress.close()
            if not finished:
                logger.error("peers did not finish within %d s; stopping them", timeout_s)
    finally:
        for proc in peers:
            stop_process(proc)
        stop_process(bootstrap)
    wall_s = time.monotonic() - started
    failed = [i for i, p in enumerate(peers) if p.returncode != 0]
    say("evaluating θ_global on held-out text")
    # on the held-out sequences the peers measure (eval.sequences), so that the plot draws one measure
    sequences = load_config(config).eval.sequences
    initial, final = evaluate(config, [out_dir / f"peer-{i}" for i in range(num_peers)], sequences)
    summary = summarize(out_dir, num_peers, initial, final, wall_s, sequences)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plot = plot_losses(out_dir, num_peers, summary)
    for line in final_lines(out_dir, summary, plot):
        say(line)
    if failed or not finished:
        print(f"error: peers {failed} exited with an error; see {out_dir}/peer-*.log", file=sys.stderr)
        return 1
    return 0
