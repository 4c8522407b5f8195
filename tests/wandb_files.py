"""What an offline Weights & Biases run leaves: its local files, read without wandb's server, and its processes."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from p2p_diloco.process_tree import descendant_pids


def offline_wandb(directory: Path) -> dict[str, str]:
    """The environment that makes wandb log offline into `directory` (its runs: `directory`/wandb/offline-run-*),
    and keep its settings and caches there too."""
    folders = {name: str(directory) for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")}
    return {**folders, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def wandb_records(run_dir: Path) -> list:
    """The protobuf Records of an offline wandb run's ``run-*.wandb`` file: wandb's header (7 bytes), then
    LevelDB's log format (32 KiB blocks of records: crc32, length, type, then a part of a Record)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = next(run_dir.glob("run-*.wandb")).read_bytes()
    assert data.startswith(b":W&B"), data[:7]
    records, position, pending, block = [], 7, b"", 32 * 1024
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a record header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last part of one
            records.append(Record.FromString(pending))
            pending = b""
    return records


def wandb_history(run_dir: Path) -> list[dict]:
    """The rows an offline wandb run logged, in order, by scalar name."""
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for record in wandb_records(run_dir) if record.WhichOneof("record_type") == "history"]


def wandb_runs(run_dir: Path) -> list[tuple[str, str]]:
    """The (project, group) an offline wandb run says it belongs to."""
    return [(record.run.project, record.run.run_group) for record in wandb_records(run_dir)
            if record.WhichOneof("record_type") == "run"]


def wandb_processes() -> list[int]:
    """wandb's service processes (wandb-core, and its system monitor) below this test process."""
    def name(pid: int) -> str:
        try:
            with open(f"/proc/{pid}/comm") as comm:
                return comm.read().strip()
        except OSError:  # gone meanwhile
            return ""
    return [pid for pid in descendant_pids(os.getpid()) if name(pid).startswith("wandb")]
