"""Helpers for tests that run real `p2p-diloco` processes and read their metrics files."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from p2p_diloco.metrics import read_metrics
from tests.conftest import TINY, Processes, read_first_line, tiny_config, write_toml
from tests.netns import Host

LOOPBACK = Host("loopback", namespace=None, ip="127.0.0.1", link="lo")


def start_bootstrap(processes: Processes, host: Host = LOOPBACK, *extra: str) -> str:
    proc = processes.start("bootstrap", "bootstrap", "--host", host.ip, "--port", "0", *extra, netns=host.namespace)
    maddr = read_first_line(proc)
    assert maddr.startswith(f"/ip4/{host.ip}/tcp/") and "/p2p/" in maddr, maddr
    return maddr


@contextmanager
def progress_pair(fingerprint: str, ttl: float = 30.0) -> Iterator[tuple[list, list]]:
    """Two real DHT nodes of run "test" on 127.0.0.1, the second bootstrapped from the first, each with its
    SwarmProgress (records signed by its identity, a `ttl` s TTL); yields (nodes, progress) and shuts both down."""
    from p2p_diloco.swarm.node import start_run_node, visible_maddrs
    from p2p_diloco.swarm.progress import SwarmProgress

    nodes, progress = [], []
    try:
        nodes.append(start_run_node("test", "127.0.0.1", 0))
        nodes.append(start_run_node("test", "127.0.0.1", 0, initial_peers=visible_maddrs(nodes[0].dht)))
        progress = [SwarmProgress(n.dht, "test", ttl, n.identity.record_subkey, fingerprint) for n in nodes]
        yield nodes, progress
    finally:
        for p in progress:
            p.close()
        for node in nodes:
            node.dht.shutdown()


def tiny_config_file(directory: Path, **sections) -> Path:
    raw = {name: dict(values) for name, values in TINY.items()}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    directory.mkdir(parents=True, exist_ok=True)
    return write_toml(directory / "run.toml", raw)


def save_pretrained_folder(folder: Path, seed: int) -> Path:
    """A tiny model of TINY's sizes, initialised with `seed`, and the run's local tokenizer, saved with
    save_pretrained: a pretrained model to start a run from (``model.pretrained = folder``)."""
    from p2p_diloco.train.data import TextData
    from p2p_diloco.train.model import build_model

    cfg = tiny_config()
    data = TextData(cfg.data)
    build_model(cfg.model, data.vocab_size, seed, cfg.data.seq_len).save_pretrained(folder)
    data.tokenizer.save_pretrained(folder)
    return folder


def pretrained_sections(folder: Path) -> dict:
    """The config sections that start a run from the model saved in `folder`, with its own tokenizer."""
    return {"model": {"pretrained": str(folder)}, "data": {"tokenizer": str(folder)}}


def start_peer(processes: Processes, name: str, config: Path, maddr: str, *extra: str, faults: str = "",
               host: Host = LOOPBACK, new_session: bool = False, attack: str = "") -> Path:
    """A `p2p-diloco peer` on `host` (loopback, or a network namespace's address); returns its metrics file.
    `new_session`: see :meth:`Processes.start`. With `attack`, the peer is tests/hostile_peer.py's, which
    alters what it sends that way."""
    metrics = processes.log_dir / f"{name}.jsonl"
    launcher = dict(module="tests.hostile_peer", prefix=("--attack", attack, "--")) if attack else \
        dict(module="p2p_diloco.cli", prefix=("peer",))
    processes.start(name, *launcher["prefix"], "--config", str(config), "--host", host.ip, "--initial-peers", maddr,
                    "--metrics-file", str(metrics), *extra, env={"P2P_DILOCO_FAULTS": faults} if faults else None,
                    module=launcher["module"], netns=host.namespace, new_session=new_session)
    return metrics


def last_step(metrics: Path) -> int:
    records = outer_steps(metrics)
    return records[-1]["outer_step"] if records else 0


def assert_consistent(metrics_files: list[Path]) -> None:
    """Every outer step that any peer recorded has one θ_global, and no loss is NaN."""
    for step, hashes in hashes_by_step(metrics_files).items():
        assert len(hashes) == 1, f"peers disagree after outer step {step}: {hashes}"
    for path in metrics_files:
        for record in outer_steps(path):
            assert record["loss"] == record["loss"], f"NaN loss in {record}"


def events(metrics: Path, event: str) -> list[dict]:
    """The records of one kind (``outer_step``, ``eval``, ``join``, ...) in a peer's metrics file."""
    return [r for r in read_metrics(metrics) if r["event"] == event] if metrics.exists() else []


def outer_steps(metrics: Path) -> list[dict]:
    return events(metrics, "outer_step")


def timeline(metrics: Path) -> str:
    """A peer's rounds in one line for a failed assertion: each outer step with its group size, and every
    round that went another way (skipped, failed, a state loaded or refused) with its step."""
    rounds = [r for r in read_metrics(metrics) if r["event"].startswith(("outer_step", "round_", "state_"))] \
        if metrics.exists() else []
    return " ".join(f"{r['event']}@{r['outer_step']}" + (f"x{r['group_size']}" if r["event"] == "outer_step" else "")
                    for r in rounds)


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.2) -> None:
    """Until `condition()` holds, asked every `poll_s` (a wait ends at most that long after its event; 0.5 s cost the
    suite's swarm tests ~0.15 s a wait more), at most `timeout_s`: TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(poll_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def hashes_by_step(metrics_files: list[Path]) -> dict[int, set[str]]:
    by_step: dict[int, set[str]] = defaultdict(set)
    for path in metrics_files:
        for record in outer_steps(path):
            by_step[record["outer_step"]].add(record["global_sha256"])
    return by_step


FAST_TIMEOUTS = {"next_chunk_timeout": 3.0, "round_wait_timeout": 15.0, "progress_ttl": 12.0}
# P2P_DILOCO_FAULTS for the peers of a swarm that only has to keep stepping while the test starts other processes
# (strangers, joiners, `status`): 0.1 s of sleep per inner step, 1 s per outer step of the tiny run. At full speed
# the tiny run's rounds (all-reduce, audits, records) keep its peers busy: 3 peers took 45 outer steps and 30 CPU
# seconds in 20 s, 1.5 of CI's 2 cores, and the processes the test waited for started that much slower; idling,
# 15 outer steps and 12 CPU seconds
IDLING = "inner_step_delay=0.1"


def swarm(processes: Processes, tmp_path: Path, n: int, faults_by_peer: dict | None = None, **sections):
    """A bootstrap node and n peers on the tiny config with short timeouts; returns (maddr, config, metrics files).

    The peers start together as a user starts them (``--wait-for-peers n``): none takes its first outer steps
    alone while the others still import torch, which on a loaded machine left a slow peer loading states that
    were stale by the time they arrived (CI, stop 40)."""
    sections["swarm"] = {**FAST_TIMEOUTS, **sections.get("swarm", {})}
    config = tiny_config_file(tmp_path, inner={"steps_per_outer": 10}, **sections)
    maddr = start_bootstrap(processes)
    faults_by_peer = faults_by_peer or {}
    metrics = [start_peer(processes, f"peer{i}", config, maddr, "--wait-for-peers", str(n),
                          faults=faults_by_peer.get(i, "")) for i in range(n)]
    return maddr, config, metrics


def proc(processes: Processes, name: str):
    return next(p for p in processes.procs if p.name == name)


def wait_for_steps(metrics: list[Path], count: int, timeout_s: float = 240) -> None:
    wait_until(lambda: all(last_step(m) >= count for m in metrics), timeout_s, f"outer step {count} on all peers")


def peer_id_of(metrics: Path) -> str:
    return read_metrics(metrics)[0]["peer_id"]
