"""Helpers for tests that run real `p2p-diloco` processes and read their metrics files."""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

from p2p_diloco.metrics import read_metrics
from tests.conftest import TINY, Processes, read_first_line, write_toml


def start_bootstrap(processes: Processes) -> str:
    proc = processes.start("bootstrap", "bootstrap", "--host", "127.0.0.1", "--port", "0")
    maddr = read_first_line(proc)
    assert maddr.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in maddr, maddr
    return maddr


def tiny_config_file(directory: Path, **sections) -> Path:
    raw = {name: dict(values) for name, values in TINY.items()}
    for name, values in sections.items():
        raw[name].update(values)
    return write_toml(directory / "run.toml", raw)


def start_peer(processes: Processes, name: str, config: Path, maddr: str, *extra: str, faults: str = "") -> Path:
    metrics = processes.log_dir / f"{name}.jsonl"
    processes.start(name, "peer", "--config", str(config), "--host", "127.0.0.1", "--initial-peers", maddr,
                    "--metrics-file", str(metrics), *extra, env={"P2P_DILOCO_FAULTS": faults} if faults else None)
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


def outer_steps(metrics: Path) -> list[dict]:
    return [r for r in read_metrics(metrics) if r["event"] == "outer_step"] if metrics.exists() else []


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.5) -> None:
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
