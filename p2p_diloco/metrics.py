"""Per-peer metrics as JSON lines: one record per event (join, state_loaded, outer_step, exit, ...)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Appends one JSON object per line and flushes it, so a crash loses at most the line being written."""

    def __init__(self, path: str | os.PathLike | None, peer_id: str):
        self.peer_id = peer_id
        self._file = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1)

    def write(self, event: str, **fields: Any) -> dict:
        record = {"event": event, "peer_id": self.peer_id, **fields, "time": time.time()}
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All complete records of a metrics file (a torn last line from a crash is skipped)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
