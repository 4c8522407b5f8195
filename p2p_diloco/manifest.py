"""Run manifests, and where a peer that joined one keeps its state.

A run manifest is one run config file (TOML) that a volunteer can join with nothing else: besides
the settings every peer must share, it names the run (``run.name``, the run's id on the DHT) and its
bootstrap nodes (``swarm.initial_peers``). ``p2p-diloco join NAME`` finds ``NAME`` as a path, or as
``peers/NAME.toml`` beside the package (the manifests this project ships).

A joined peer keeps what makes a restart a continuation in one *state directory*, by default
``$XDG_DATA_HOME/p2p-diloco/<run name>`` (``~/.local/share/...``): its identity key (the same peer
ID, hence the same data shard and the same place in the swarm), its checkpoint (θ_global, the inner
optimizer, where its data stream was) and its metrics. A lock file keeps a second peer from using
the same directory at the same time.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO

SHIPPED_MANIFESTS = Path(__file__).resolve().parent.parent / "peers"


class ManifestError(ValueError):
    """A manifest cannot be found, or a state directory cannot be used; one line for the user."""


def shipped_manifests() -> list[str]:
    """The names `join` accepts without a path (the run files in peers/)."""
    return sorted(p.stem for p in SHIPPED_MANIFESTS.glob("*.toml")) if SHIPPED_MANIFESTS.is_dir() else []


def find_manifest(name_or_path: str) -> Path:
    """The manifest file: `name_or_path` itself if it is a file, else ``peers/<name>.toml``."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    if "/" not in name_or_path and not name_or_path.endswith(".toml"):
        shipped = SHIPPED_MANIFESTS / f"{name_or_path}.toml"
        if shipped.is_file():
            return shipped
    names = ", ".join(shipped_manifests()) or "none (peers/ is not beside the package)"
    raise ManifestError(f"no run manifest {name_or_path!r}: give the path of a run file, or one of: {names}")


def default_state_dir(run_name: str) -> Path:
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "p2p-diloco" / run_name


@dataclass
class StateDir:
    """A joined peer's state directory, locked for as long as the peer runs (:func:`lock_state_dir`)."""

    path: Path
    lock: IO

    @property
    def identity_path(self) -> Path:
        return self.path / "identity.key"

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / "checkpoint"

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.jsonl"


def lock_state_dir(path: str | os.PathLike) -> StateDir:
    """Create `path` if needed and lock it (released when the process exits, even on SIGKILL)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        lock = open(path / "lock", "w")
    except OSError as e:
        raise ManifestError(f"--state-dir {str(path)!r} cannot be used: {e.strerror}") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise ManifestError(f"another peer already runs from {str(path)!r}; give this one its own --state-dir "
                            f"(two peers of a run on one machine need two)") from None
    return StateDir(path, lock)
