"""Shared pieces for the tests: a tiny run config and processes that are always stopped by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2p_diloco.config import Config, config_from_dict
from p2p_diloco.process_tree import descendant_pids, kill_tree, wait_gone

REPO = Path(__file__).resolve().parent.parent

TINY = {
    "run": {"name": "test", "seed": 0},
    "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64,
              "max_position_embeddings": 64},
    "data": {"source": "pydoc", "vocab_size": 300, "seq_len": 32, "max_documents": 24},
    "inner": {"lr": 3e-3, "warmup_steps": 2, "total_steps": 400, "batch_size": 4, "steps_per_outer": 5},
    # DiLoCo's Algorithm 1 exactly, whatever the shipped defaults: tests that need a codec, fragments or
    # overlap ask for them
    "outer": {"lr": 0.7, "momentum": 0.9, "codec": "none", "error_feedback": False, "fragments": 1, "sync_delay": 0,
              "merge_alpha": 0.0},
    "swarm": {"matchmaking_time": 2.0, "request_timeout": 1.0, "round_wait_timeout": 20.0,
              "allreduce_timeout": 30.0, "next_chunk_timeout": 5.0, "commit_timeout": 10.0, "state_download_timeout": 30.0,
              "progress_ttl": 30.0},
}


def tiny_config(**sections) -> Config:
    raw = {name: dict(values) for name, values in TINY.items()}
    for name, values in sections.items():
        raw[name].update(values)
    return config_from_dict(raw)


def write_toml(path: Path, raw: dict) -> Path:
    lines = []
    for section, values in raw.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if isinstance(value, bool):
                lines.append(f"{key} = {str(value).lower()}")
            else:
                lines.append(f"{key} = {value!r}" if not isinstance(value, str) else f'{key} = "{value}"')
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory, monkeypatch):
    """Tokenizers are cached per test session, not in the user's home."""
    monkeypatch.setenv("P2P_DILOCO_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


class Processes:
    """Starts `p2p-diloco` processes and guarantees each is stopped (by PID) when the test ends."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []
        self.orphans: list[int] = []  # children of killed processes, stopped again at the end

    def start(self, name: str, *args: str, env: dict | None = None, module: str = "p2p_diloco.cli",
              netns: str | None = None, new_session: bool = False) -> subprocess.Popen:
        """`python -m module *args` (the `p2p-diloco` command unless told otherwise), logging to name.log;
        inside network namespace `netns` if given (`ip netns exec` execs it: the PID is still Python's).
        With `new_session` it leads a process group of its own, as under a service manager or a shell,
        which a test can signal (os.killpg) without hitting pytest."""
        log = open(self.log_dir / f"{name}.log", "a")
        inside = ["ip", "netns", "exec", netns] if netns else []
        proc = subprocess.Popen(
            [*inside, sys.executable, "-m", module, *args],
            stdout=subprocess.PIPE if name.startswith("bootstrap") else log,
            # the repository on the path: `tests.hostile` runs from the test's own directory
            stderr=log, text=True, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, cwd=self.log_dir,
            start_new_session=new_session,
        )
        proc.name = name
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()

    def stop_all(self) -> None:
        # the bootstrap nodes last, as a user stops a swarm: a leaving peer waits up to 6 s for the run's keeper to
        # hold its last step (train/checkpointing.py HANDOVER_S), and a keeping bootstrap node stopped with it
        # never does (the NAT keeper test's teardown spent those 6 s)
        nodes = [proc for proc in self.procs if proc.name.startswith("bootstrap")]
        for group in ([proc for proc in self.procs if proc not in nodes], nodes):
            for proc in group:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGCONT)  # a frozen process cannot handle SIGTERM
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 20
            for proc in group:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.kill(proc)
        # torch's shared-memory manager frees a dead peer's /dev/shm segments within seconds: let it
        for pid in wait_gone(self.orphans, 10):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def kill(self, proc: subprocess.Popen, children: bool = True) -> None:
        """SIGKILL a process and (unless `children` is False) its descendants: its DHT and averager
        processes and p2pd, as :func:`kill_tree` does. Descendants still alive when the test ends
        are killed then."""
        if children:
            self.orphans.extend(kill_tree(proc.pid))
        else:
            self.orphans.extend(descendants(proc.pid))
            proc.kill()
        proc.wait(10)
        proc.killed = True


descendants = descendant_pids


@pytest.fixture
def processes(tmp_path):
    procs = Processes(tmp_path)
    yield procs
    procs.stop_all()


def read_first_line(proc: subprocess.Popen, timeout_s: float = 60.0) -> str:
    import selectors

    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if selector.select(timeout=1.0):
            line = proc.stdout.readline().strip()
            if line:
                return line
        assert proc.poll() is None, f"{proc.name} exited with {proc.returncode}"
    raise TimeoutError(f"{proc.name} printed nothing within {timeout_s} s")
