"""What a person sees of a peer: its progress display, and its metrics as TensorBoard scalars."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from p2p_diloco.metrics import TENSORBOARD_MISSING, MetricsWriter, read_metrics
from p2p_diloco.train.display import InnerProgress


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run_round(display: InnerProgress, clock: Clock, steps: int, seconds_per_step: float = 2.0) -> None:
    for i in range(steps):
        clock.now += seconds_per_step
        display.step(loss=5.0 - 0.1 * i, tokens=1024)


def test_without_a_terminal_a_log_line_every_interval(caplog):
    clock = Clock()
    display = InnerProgress(io.StringIO(), tty=False, interval_s=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="p2p_diloco.train.display"):
        display.start_round(outer_step=3, total_steps=25, done=2)
        run_round(display, clock, 10)  # 20 s: a line after 10 s and after 20 s
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "outer step 4: inner step 7/25, loss 4.800, 512 tokens/s, sync in ~36 s",
        "outer step 4: inner step 12/25, loss 4.550, 512 tokens/s, sync in ~26 s",
    ]
    assert display.stream.getvalue() == ""  # no bar without a terminal
    display.close()


def test_on_a_terminal_a_bar_toward_the_sync():
    clock, out = Clock(), io.StringIO()
    display = InnerProgress(out, tty=True, clock=clock)
    display.start_round(outer_step=3, total_steps=25, done=2)
    run_round(display, clock, 10)
    display._bar.refresh()
    shown = out.getvalue()
    assert "outer step 4: 12/25" in shown and "loss 4.550" in shown and "tok/s" in shown and "sync in" in shown
    display.syncing()
    display._bar.refresh()
    assert "outer step 4: syncing" in out.getvalue()
    run_round(display, clock, 3)  # overlapped with the sync: they belong to the next round, not to this bar
    assert display._bar.n == 12 and "outer step 4: syncing, 3 inner steps meanwhile" in out.getvalue()
    display.start_round(outer_step=4, total_steps=25)  # the next round: a new bar
    assert display._bar.n == 0
    display.close()
    assert display._bar is None


def test_metrics_also_go_to_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(tmp_path / "metrics.jsonl", "peer-a", tensorboard_dir=str(tmp_path / "tb"))
    writer.write("join", outer_step=0, from_checkpoint=False, data_position=0)
    for step, loss in ((1, 5.5), (2, 4.25)):
        writer.write("outer_step", outer_step=step, loss=loss, group_size=3, global_sha256="ab" * 32,
                     bytes_sent=1000 * step, lr=float("nan"))
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"outer_step/loss", "outer_step/group_size", "outer_step/bytes_sent", "join/data_position"} <= scalars
    assert not {"outer_step/global_sha256", "join/from_checkpoint", "outer_step/lr"} & scalars  # not numbers
    assert [(e.step, e.value) for e in events.Scalars("outer_step/loss")] == [(1, 5.5), (2, 4.25)]
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 3  # the JSON lines are unchanged


def test_tensorboard_missing_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed
    with pytest.raises(ValueError) as err:
        MetricsWriter(None, "peer-a", tensorboard_dir=str(tmp_path / "tb"))
    assert str(err.value) == TENSORBOARD_MISSING


def test_the_demo_describes_the_swarm_by_its_slowest_peer():
    from p2p_diloco.demo import describe_swarm_progress

    record = lambda step, loss, t: dict(outer_step=step, loss=loss, time=t)  # noqa: E731
    assert describe_swarm_progress([[], []], 16) == "demo: outer step 0/16"
    steps = [[record(1, 6.0, 1.0), record(2, 5.5, 3.0)], [record(1, 6.1, 2.0)], [record(1, 6.2, 1.5)]]
    assert describe_swarm_progress(steps, 16) == "demo: outer step 1/16 (peers at 1-2), loss 5.500"
