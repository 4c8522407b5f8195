"""The run's global state in a checkpoint store named by a URL, for when no peer is up to serve it.

The store is a directory (a path, or ``file://``) or anything that fsspec knows: ``s3://bucket/run``,
``gs://...``, ``hf://datasets/org/repo`` (a Hugging Face repository), ``memory://`` in tests. A peer
with ``swarm.checkpoint_store`` writes the global state there every ``swarm.checkpoint_every`` outer
steps, and a peer that finds the run ahead of it and no peer to download its state from starts from
the newest state there (:mod:`p2p_diloco.train.catch_up`).

Layout, under the URL::

    states/<sha256>.pt        torch.save of {"outer_step", "sha256", "inner_steps", "tensors"}
    steps/<outer step>.json   its manifest: {"outer_step", "sha256", "inner_steps", "file", "bytes",
                              "run", "fingerprint", "time"}

**Atomic by order, checked whole.** Object stores have no rename, so nothing relies on one: the
state's file is written first, its manifest last, and a reader takes the newest manifest whose file
has the manifest's size, loads, holds tensors of the expected shapes and hashes to the manifest's
sha256 (:func:`p2p_diloco.hashing.tensors_sha256`, the hash every peer publishes). A write cut short
leaves a file without a manifest, or a manifest that does not parse, or a file that does not hash:
each is skipped, and the state before it is used. A manifest of another run or other settings is
skipped too. Old states are not deleted: a store keeps the run's history (the host prunes it).
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import fsspec
import torch

from p2p_diloco.sync.state_transfer import StateExpectation, state_problem

logger = logging.getLogger(__name__)

MANIFEST_DIR, STATE_DIR = "steps", "states"


class StoreError(RuntimeError):
    """The store cannot be read or written (its URL, credentials, network)."""


@dataclass(frozen=True)
class StoredState:
    outer_step: int
    sha256: str
    inner_steps: int
    tensors: list[torch.Tensor]  # θ_global, then the outer momentum
    source: str  # where it was read: the store's URL and the state's file


class StateStore:
    """A run's checkpoint store at `url` (see the module's docstring), for the run `run_name` whose
    settings have the fingerprint `fingerprint`."""

    def __init__(self, url: str, run_name: str, fingerprint: str):
        self.url = url.rstrip("/")
        self.run_name = run_name
        self.fingerprint = fingerprint
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url)
        except (ImportError, ValueError) as e:  # an unknown protocol, or its package is not installed
            raise StoreError(f"checkpoint store {url!r}: {e}") from e

    def _path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def write(self, outer_step: int, sha256: str, inner_steps: int, tensors: Sequence[torch.Tensor]) -> str:
        """Store a global state (the state's file, then its manifest); returns the manifest's path.
        StoreError if the store cannot be written."""
        buffer = io.BytesIO()
        torch.save({"outer_step": outer_step, "sha256": sha256, "inner_steps": inner_steps,
                    "tensors": [t.detach().to("cpu", torch.float32).contiguous() for t in tensors]}, buffer)
        data = buffer.getvalue()
        state_file = f"{STATE_DIR}/{sha256}.pt"
        manifest = dict(outer_step=outer_step, sha256=sha256, inner_steps=inner_steps, file=state_file,
                        bytes=len(data), run=self.run_name, fingerprint=self.fingerprint, time=time.time())
        manifest_path = self._path(MANIFEST_DIR, f"{outer_step:012d}.json")
        try:
            self.fs.makedirs(self._path(STATE_DIR), exist_ok=True)
            self.fs.makedirs(self._path(MANIFEST_DIR), exist_ok=True)
            self.fs.pipe_file(self._path(state_file), data)
            self.fs.pipe_file(manifest_path, (json.dumps(manifest) + "\n").encode())
        except Exception as e:
            raise StoreError(f"checkpoint store {self.url}: could not write outer step {outer_step}: {e!r}") from e
        return manifest_path

    def manifests(self) -> list[dict]:
        """The manifests of this run and settings, newest outer step first (unreadable ones skipped)."""
        try:
            names = sorted(self.fs.ls(self._path(MANIFEST_DIR), detail=False), reverse=True)
        except FileNotFoundError:
            return []
        except Exception as e:
            raise StoreError(f"checkpoint store {self.url}: could not list its states: {e!r}") from e
        found = []
        for name in names:
            if not name.endswith(".json"):
                continue
            try:
                manifest = json.loads(self.fs.cat_file(name))
                if (manifest.get("run"), manifest.get("fingerprint")) != (self.run_name, self.fingerprint):
                    continue
                if not (isinstance(manifest.get("outer_step"), int) and isinstance(manifest.get("sha256"), str)
                        and isinstance(manifest.get("bytes"), int) and isinstance(manifest.get("file"), str)):
                    continue
            except Exception as e:  # cut short, or not ours
                logger.warning("checkpoint store %s: skipping the manifest %s: %r", self.url, name, e)
                continue
            found.append(manifest)
        return found

    def newest(self, param_shapes: Sequence[tuple[int, ...]], above_step: int = -1) -> Optional[StoredState]:
        """The newest state in the store above `above_step` that is whole: its file has the manifest's size,
        loads, holds θ_global and the momentum in `param_shapes`, and hashes to the manifest's sha256.
        None if there is none. StoreError if the store cannot be read."""
        for manifest in self.manifests():
            if manifest["outer_step"] <= above_step:
                break
            state, problem = self._load(manifest, param_shapes)
            if state is not None:
                return state
            logger.warning("checkpoint store %s: skipping outer step %d: %s", self.url, manifest["outer_step"], problem)
        return None

    def _load(self, manifest: dict, param_shapes: Sequence[tuple[int, ...]]) -> tuple[Optional[StoredState], str]:
        path = self._path(manifest["file"])
        try:
            data = self.fs.cat_file(path)
        except Exception as e:
            return None, f"its file {manifest['file']} cannot be read ({e!r})"
        if len(data) != manifest["bytes"]:
            return None, f"its file holds {len(data)} bytes, the manifest says {manifest['bytes']} (a write cut short)"
        try:
            saved = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            metadata = {key: saved[key] for key in ("outer_step", "sha256", "inner_steps")}
            tensors = saved["tensors"]
        except Exception as e:
            return None, f"its file does not load ({e!r})"
        # the checks of a downloaded state: count, dtype, shape, finiteness, its hash, the manifest's step and hash
        expected = StateExpectation(tuple(tuple(s) for s in param_shapes), manifest["outer_step"], manifest["sha256"])
        problem = state_problem(metadata, tensors if isinstance(tensors, list) else [], expected)
        if problem is not None:
            return None, problem.detail
        inner_steps = metadata["inner_steps"]
        return StoredState(manifest["outer_step"], manifest["sha256"], inner_steps, tensors,
                           f"{self.url}/{manifest['file']}"), ""


class StoreWriter:
    """Writes a peer's global state to its store every `every` outer steps, in a thread of its own: a
    write of a large model to a remote store does not hold up training. One write at a time; a step
    that comes due while the last write still runs is skipped (the next one is written)."""

    def __init__(self, store: StateStore, every: int, on_written: Callable[[int], None] = lambda step: None):
        self.store = store
        self.every = every
        self.on_written = on_written  # called with the outer step of each state written
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="state-store")
        self._pending: Optional[concurrent.futures.Future] = None

    def after_step(self, outer_step: int, sha256: str, inner_steps: int,
                   snapshot: Callable[[], list[torch.Tensor]]) -> bool:
        """Write the state of `outer_step` if it is due (`snapshot` gives a copy of its tensors); True if a
        write began."""
        if outer_step % self.every:
            return False
        if self._pending is not None and not self._pending.done():
            logger.warning("checkpoint store %s: the write of an earlier outer step still runs; outer step %d is "
                           "not written", self.store.url, outer_step)
            return False
        self._pending = self._executor.submit(self._write, outer_step, sha256, inner_steps, snapshot())
        return True

    def _write(self, outer_step: int, sha256: str, inner_steps: int, tensors: list[torch.Tensor]) -> None:
        try:
            path = self.store.write(outer_step, sha256, inner_steps, tensors)
            logger.info("checkpoint store: wrote outer step %d (%s) to %s", outer_step, sha256[:12], path)
            self.on_written(outer_step)
        except StoreError as e:  # the next due step tries again; training goes on
            logger.warning("%s", e)

    def close(self, timeout: float) -> None:
        """Let a write in progress finish, for at most `timeout` seconds."""
        if self._pending is not None:
            try:
                self._pending.result(timeout)
            except concurrent.futures.TimeoutError:
                logger.warning("checkpoint store %s: a write still runs after %.0f s; leaving without it",
                               self.store.url, timeout)
        self._executor.shutdown(wait=False)
