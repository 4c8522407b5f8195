"""Checkpoints at outer-step boundaries, written atomically: a crash mid-save leaves the old one intact."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)


def checkpoint_path(directory: str | os.PathLike) -> Path:
    return Path(directory) / "checkpoint.pt"


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
