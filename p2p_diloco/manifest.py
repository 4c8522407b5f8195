"""Run manifests, and where a peer that joined one keeps its state.

A run manifest is one run config file (TOML) that a volunteer can join with nothing else: besides
the settings every peer must share, it names the run (``run.name``, the run's id on the DHT) and its
bootstrap nodes (``swarm.initial_peers``). ``p2p-diloco join NAME`` finds ``NAME`` as a path, or as
one of the manifests this project ships: ``peers/NAME.toml`` of a source checkout, or, installed from
a wheel, ``<prefix>/share/p2p-diloco/peers/NAME.toml``.

A joined peer keeps what makes a restart a continuation in one *state directory*, by default
``$XDG_DATA_HOME/p2p-diloco/<run name>`` (``~/.local/share/...``): its identity key (the same peer
ID, hence the same data shard and the same place in the swarm), its checkpoint (θ_global, the inner
optimizer, where its data stream was) and its metrics. A lock file keeps a second peer from using
the same directory at the same time.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import IO

CHECKOUT = Path(__file__).resolve().parent.parent  # a source checkout (or an editable install) has peers/ here
INSTALLED_MANIFESTS = Path("share", "p2p-diloco", "peers")  # under an install prefix: pyproject's data-files


class ManifestError(ValueError):
    """A manifest cannot be found, or a state directory cannot be used; one line for the user."""


def manifest_dirs() -> list[Path]:
    """Where the manifests this project ships may be, in the order they are looked in: the source
    checkout's peers/, then where pip installed them (the distribution's RECORD), then share/p2p-diloco/peers
    of this interpreter's default and user install schemes."""
    dirs = [CHECKOUT / "peers"] if (CHECKOUT / "pyproject.toml").is_file() else []
    try:
        dist = importlib.metadata.distribution("p2p-diloco")
        dirs += [Path(dist.locate_file(f)).parent.resolve() for f in dist.files or ()
                 if f.suffix == ".toml" and f.parent.as_posix().endswith(INSTALLED_MANIFESTS.as_posix())]
    except importlib.metadata.PackageNotFoundError:
        pass
    for scheme in (sysconfig.get_default_scheme(), sysconfig.get_preferred_scheme("user")):
        dirs.append(Path(sysconfig.get_path("data", scheme)) / INSTALLED_MANIFESTS)
    return list(dict.fromkeys(dirs))


def shipped_manifest_dir() -> Path:
    """The first of :func:`manifest_dirs` that holds manifests (else the first of them, for messages)."""
    dirs = manifest_dirs()
    return next((d for d in dirs if d.is_dir() and any(d.glob("*.toml"))), dirs[0])


def shipped_manifests() -> list[str]:
    """The names `join` accepts without a path (the run files in peers/)."""
    return sorted(p.stem for p in shipped_manifest_dir().glob("*.toml"))


def find_manifest(name_or_path: str) -> Path:
    """The manifest file: `name_or_path` itself if it is a file, else the shipped ``peers/<name>.toml``
    (`name_or_path` without a folder, with or without ``.toml``)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    if "/" not in name_or_path:
        shipped = shipped_manifest_dir() / f"{name_or_path.removesuffix('.toml')}.toml"
        if shipped.is_file():
            return shipped
    names = ", ".join(shipped_manifests()) or f"none (no peers/ beside the package, nor {INSTALLED_MANIFESTS} " \
                                               f"where it is installed)"
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
    """Create `path` if needed and lock it with flock, released when the last process holding it exits.

    hivemind's forked children inherit the locked descriptor, so after a SIGKILL of the peer the lock
    is released when they exit too: about a second later, when their watchdog sees the parent gone
    (:func:`p2p_diloco.process_tree.children_exit_with_this_process`).
    """
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
