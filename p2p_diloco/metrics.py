"""Per-peer metrics as JSON lines: one record per event (join, state_loaded, outer_step, exit, ...),
and optionally the same numbers as scalars in TensorBoard and in Weights & Biases.

Each scalar logger is a :class:`ScalarSink`: it gets the record's numbers, named ``<event>/<field>``
(``outer_step/loss``), at the record's step, so both show the same numbers at the same x.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Optional, Protocol

TENSORBOARD_MISSING = "--tensorboard needs the tensorboard package: pip install 'p2p-diloco[tensorboard]'"
WANDB_MISSING = "--wandb needs the wandb package: pip install 'p2p-diloco[wandb]'"


class ScalarSink(Protocol):
    """Where a record's numbers go besides the JSON lines; each sink saves what it got before write returns."""

    def write(self, scalars: dict[str, float], step: int, walltime: float) -> None: ...

    def close(self) -> None: ...

# Every event a peer writes, in about the order a run meets them: `--metrics-file`'s help lists these, README's
# Metrics section describes each, and MetricsWriter refuses any other (a new event is added here first).
EVENTS = (
    "join", "reachability", "state_loaded", "state_load_failed", "state_refused", "outer_step", "attempt_failed",
    "round_failed", "round_skipped", "round_clipped", "round_rejected", "round_stopped", "excluded", "eval", "exit",
)


class MetricsWriter:
    """Appends one JSON object per line and flushes it, so a crash loses at most the line being written.

    With `tensorboard_dir` and/or `wandb_project`, each record's numbers (not booleans, not NaN) are also
    scalars named ``<event>/<field>`` (``outer_step/loss``), at the record's outer step (or, for a record
    without one, at the count of records written), flushed with every record: TensorBoard event files
    in that directory, and a Weights & Biases run of that project (:class:`WandbSink`; `wandb_group`
    groups the peers of one run). Raises ValueError (one line) when a logger's package is missing or
    it cannot start.
    """

    def __init__(self, path: str | os.PathLike | None, peer_id: str, tensorboard_dir: Optional[str] = None,
                 wandb_project: Optional[str] = None, wandb_group: Optional[str] = None):
        self.peer_id = peer_id
        self._file = None
        self._sinks: list[ScalarSink] = []
        self._records = 0
        try:
            if tensorboard_dir:
                self._sinks.append(TensorBoardSink(tensorboard_dir))
            if wandb_project:
                self._sinks.append(WandbSink(wandb_project, wandb_group, peer_id))
        except ValueError:
            self.close()
            raise
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
        if self._sinks:
            scalars = {f"{event}/{name}": float(value) for name, value in fields.items()
                       if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)}
            step = fields.get("outer_step", self._records)
            for sink in self._sinks:
                sink.write(scalars, step, record["time"])
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for sink in self._sinks:
            sink.close()
        self._sinks = []


class TensorBoardSink:
    """TensorBoard event files in a directory (torch's SummaryWriter; it runs a writer thread)."""

    def __init__(self, directory: str):
        try:
            import tensorboard  # noqa: F401  (torch's SummaryWriter needs it, and says so less clearly)
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ValueError(TENSORBOARD_MISSING) from None
        self._writer = SummaryWriter(log_dir=directory)

    def write(self, scalars: dict[str, float], step: int, walltime: float) -> None:
        for name, value in scalars.items():
            self._writer.add_scalar(name, value, global_step=step, walltime=walltime)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A Weights & Biases run of `project`, named after the peer and grouped by `group` (the run's name).

    wandb's own step counts calls; the record's step is logged as the scalar ``step``, which every other
    scalar is plotted against (``define_metric``), as TensorBoard's global_step. The login and mode come
    from wandb's usual settings (``wandb login``, WANDB_API_KEY, WANDB_MODE=offline, WANDB_DIR). Closing
    finishes the run and stops wandb's service process (wandb-core), which would otherwise outlive it.
    """

    def __init__(self, project: str, group: Optional[str], peer_id: str):
        try:
            import wandb
        except ImportError:
            raise ValueError(WANDB_MISSING) from None
        self._wandb = wandb
        try:
            self._run = wandb.init(project=project, group=group, name=f"{group or 'peer'}-{peer_id[-8:]}",
                                   config={"peer_id": peer_id}, reinit="create_new",
                                   settings=wandb.Settings(console="off"))  # the peer's terminal stays its own
        except Exception as e:  # not logged in, no network to the server, a bad project name: wandb's own types
            wandb.teardown()
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"--wandb {project}: cannot start a Weights & Biases run: {reason} "
                             f"(WANDB_MODE=offline logs to local files instead)") from None
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def write(self, scalars: dict[str, float], step: int, walltime: float) -> None:
        self._run.log({"step": step, **scalars})

    def close(self) -> None:
        self._run.finish()
        self._wandb.teardown()


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All complete records of a metrics file (a torn last line from a crash is skipped)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
