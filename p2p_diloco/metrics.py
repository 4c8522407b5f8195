"""Per-peer metrics as JSON lines: one record per event (join, state_loaded, outer_step, exit, ...),
and optionally the same numbers as TensorBoard scalars."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Optional

TENSORBOARD_MISSING = "--tensorboard needs the tensorboard package: pip install 'p2p-diloco[tensorboard]'"

# Every event a peer writes, in about the order a run meets them: `--metrics-file`'s help lists these, README's
# Metrics section describes each, and MetricsWriter refuses any other (a new event is added here first).
EVENTS = (
    "join", "reachability", "state_loaded", "state_load_failed", "state_refused", "outer_step", "attempt_failed",
    "round_failed", "round_skipped", "round_rejected", "round_stopped", "excluded", "exit",
)


class MetricsWriter:
    """Appends one JSON object per line and flushes it, so a crash loses at most the line being written.

    With `tensorboard_dir`, each record's numbers (not booleans, not NaN) are also TensorBoard
    scalars named ``<event>/<field>`` (``outer_step/loss``), at the record's outer step (or, for a
    record without one, at the count of records written), flushed with every record. Raises
    ValueError (one line) when the tensorboard package is missing.
    """

    def __init__(self, path: str | os.PathLike | None, peer_id: str, tensorboard_dir: Optional[str] = None):
        self.peer_id = peer_id
        self._file = None
        self._tensorboard = _summary_writer(tensorboard_dir) if tensorboard_dir else None
        self._records = 0
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1)

    def write(self, event: str, **fields: Any) -> dict:
        if event not in EVENTS:
            raise ValueError(f"metrics event {event!r} is not in p2p_diloco.metrics.EVENTS: add it there and to "
                             f"README's Metrics section")
        record = {"event": event, "peer_id": self.peer_id, **fields, "time": time.time()}
        self._records += 1
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._tensorboard is not None:
            step = fields.get("outer_step", self._records)
            for name, value in fields.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self._tensorboard.add_scalar(f"{event}/{name}", value, global_step=step, walltime=record["time"])
            self._tensorboard.flush()
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


def _summary_writer(directory: str):
    try:
        import tensorboard  # noqa: F401  (torch's SummaryWriter needs it, and says so less clearly)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError(TENSORBOARD_MISSING) from None
    return SummaryWriter(log_dir=directory)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All complete records of a metrics file (a torn last line from a crash is skipped)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
