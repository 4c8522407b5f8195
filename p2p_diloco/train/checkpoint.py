"""Checkpoints at outer-step boundaries, written atomically: a crash mid-save leaves the old one intact.

Beside ``checkpoint.pt``, a peer also keeps what the checkpoint's tensors do not say, so that
``p2p-diloco export`` can turn them into a model: ``model/``, the model's transformers config and
the run's tokenizer (a ``save_pretrained`` folder without weights), the run's name and the
fingerprint of its settings.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

EXPORT_RUN_FILE = "p2p_diloco_run.json"  # in the export assets: {"run_name": ..., "fingerprint": ...}


class CheckpointMismatch(ValueError):
    """The checkpoint was trained with other run settings than the config a peer starts with."""


def checkpoint_path(directory: str | os.PathLike) -> Path:
    return Path(directory) / "checkpoint.pt"


def export_assets_path(directory: str | os.PathLike) -> Path:
    """The folder beside the checkpoint with the model's config and the tokenizer (:func:`save_export_assets`)."""
    return Path(directory) / "model"


def save_checkpoint(directory: str | os.PathLike, state: dict) -> Path:
    """torch.save to a temporary file in the same directory, fsync, then rename over the old one."""
    path = checkpoint_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_checkpoint(directory: str | os.PathLike) -> Optional[dict]:
    path = checkpoint_path(directory)
    if not path.exists():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a foreign or damaged file: say so and start without it
        logger.warning("ignoring unreadable checkpoint %s: %s", path, e)
        return None


def check_checkpoint_settings(directory: str | os.PathLike, fingerprint: str,
                              state: Optional[dict] = None) -> None:
    """CheckpointMismatch (one line) unless the checkpoint in `directory`, if any, was trained with the
    settings whose fingerprint is `fingerprint` (:func:`p2p_diloco.config.settings_fingerprint`).

    `state` is the checkpoint when the caller has loaded it; otherwise only its small fields are read
    (torch.load with ``mmap``: the tensors stay on disk). A checkpoint from before fingerprints were
    kept, or an unreadable one (which :func:`load_checkpoint` ignores), passes.
    """
    if state is None:
        path = checkpoint_path(directory)
        if not path.exists():
            return
        try:
            state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except Exception:  # load_checkpoint says why, and starts without it
            return
    saved = state.get("fingerprint") if isinstance(state, dict) else None
    if saved is not None and saved != fingerprint:
        raise CheckpointMismatch(
            f"the checkpoint in {directory} was trained with other run settings (fingerprint {saved[:12]}, this "
            f"config's {fingerprint[:12]}): start with the config it was made with, or use another checkpoint "
            "directory")


def save_export_assets(directory: str | os.PathLike, model_config, tokenizer, run_name: str,
                       fingerprint: Optional[str] = None) -> Path:
    """Write the model's transformers config, the tokenizer, the run's name and its settings fingerprint
    (:func:`p2p_diloco.config.settings_fingerprint`) to ``directory/model``.

    They are written to a temporary folder that then replaces the old one: a crash never leaves a
    half-written folder (at worst, between the two renames, none, which the peer's next start writes).
    The temporary folders that a crashed process left are removed first (the peer that runs from this
    directory holds it alone).
    """
    path = export_assets_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = (path.with_name(f".{path.name}.{what}{os.getpid()}") for what in ("tmp", "old"))
    for leftover in [*path.parent.glob(f".{path.name}.tmp*"), *path.parent.glob(f".{path.name}.old*")]:
        shutil.rmtree(leftover, ignore_errors=True)
    model_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / EXPORT_RUN_FILE).write_text(json.dumps({"run_name": run_name, "fingerprint": fingerprint}) + "\n")
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
    return path
