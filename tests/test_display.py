"""What a person sees of a peer: its progress display, and its metrics as TensorBoard and Weights & Biases
scalars."""

from __future__ import annotations

import fcntl
import io
import logging
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
import tty

import pytest

from p2p_diloco.metrics import TENSORBOARD_MISSING, WANDB_MISSING, MetricsWriter, read_metrics
from p2p_diloco.train.display import InnerProgress
from tests.conftest import REPO
from tests.wandb_files import offline_wandb, wandb_history, wandb_processes


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


def test_metrics_also_go_to_tensorboard_and_wandb(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for name, value in offline_wandb(tmp_path / "wandb-files").items():
        monkeypatch.setenv(name, value)
    writer = MetricsWriter(tmp_path / "metrics.jsonl", "peer-abcdefgh", tensorboard_dir=str(tmp_path / "tb"),
                           wandb_project="p2p-diloco-test", wandb_group="test")
    try:
        assert wandb_processes()  # wandb's service runs while the writer is open ...
        writer.write("join", outer_step=0, from_checkpoint=False, data_position=0)
        for step, loss in ((1, 5.5), (2, 4.25)):
            writer.write("outer_step", outer_step=step, loss=loss, group_size=3, global_sha256="ab" * 32,
                         bytes_sent=1000 * step, lr=float("nan"))
    finally:
        writer.close()
    assert wandb_processes() == []  # ... and not a moment after it is closed

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"outer_step/loss", "outer_step/group_size", "outer_step/bytes_sent", "join/data_position"} <= scalars
    assert not {"outer_step/global_sha256", "join/from_checkpoint", "outer_step/lr"} & scalars  # not numbers
    assert [(e.step, e.value) for e in events.Scalars("outer_step/loss")] == [(1, 5.5), (2, 4.25)]
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 3  # the JSON lines are unchanged

    (run_dir,) = (tmp_path / "wandb-files" / "wandb").glob("offline-run-*")
    logged = [{k: v for k, v in row.items() if not k.startswith("_")} for row in wandb_history(run_dir)]
    tensorboard = {}  # the same numbers at the same steps, row by row
    for tag in scalars:
        for event in events.Scalars(tag):
            tensorboard.setdefault(event.step, {"step": event.step})[tag] = event.value
    assert logged == [tensorboard[0], tensorboard[1], tensorboard[2]]


@pytest.mark.parametrize("module, flags, message", [
    ("tensorboard", dict(tensorboard_dir="tb"), TENSORBOARD_MISSING),
    ("wandb", dict(wandb_project="p"), WANDB_MISSING),
])
def test_a_missing_logger_package_is_a_one_line_error(monkeypatch, module, flags, message):
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    with pytest.raises(ValueError) as err:
        MetricsWriter(None, "peer-a", **flags)
    assert str(err.value) == message


def test_wandb_without_a_login_is_a_one_line_error(tmp_path, monkeypatch):
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "HOME"):
        monkeypatch.setenv(name, str(tmp_path))  # no netrc, no settings file with a key
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError) as err:
        MetricsWriter(None, "peer-a", wandb_project="p")
    assert str(err.value).startswith("--wandb p: cannot start a Weights & Biases run: No API key configured")
    assert "WANDB_MODE=offline" in str(err.value) and "\n" not in str(err.value)
    assert wandb_processes() == []


def test_the_demo_describes_the_swarm_by_its_slowest_peer():
    from p2p_diloco.demo import describe_swarm_progress

    record = lambda step, loss, t: dict(outer_step=step, loss=loss, time=t)  # noqa: E731
    assert describe_swarm_progress([[], []], 16) == "demo: outer step 0/16"
    steps = [[record(1, 6.0, 1.0), record(2, 5.5, 3.0)], [record(1, 6.1, 2.0)], [record(1, 6.2, 1.5)]]
    assert describe_swarm_progress(steps, 16) == "demo: outer step 1/16 (peers at 1-2), loss 5.500"


PTY_SCRIPT = '''
import logging, multiprocessing
from hivemind.utils.logging import get_logger
from p2p_diloco.logs import flush_child_logs
from p2p_diloco.node_runner import setup_logging
from p2p_diloco.train.display import InnerProgress

setup_logging(verbose=False)
context = multiprocessing.get_context("fork")
bar_shown = context.Event()

def child():  # as hivemind's DHT and averager: forked before training starts, it logs while the bar is shown
    bar_shown.wait(60)
    for i in range(5):
        logging.getLogger("p2p_diloco.sync.exact_allreduce").info("all-reduce started: child line %d", i)
        get_logger("hivemind.averaging.averager").info("hivemind chatter %d", i)
        get_logger("hivemind.averaging.averager").warning("hivemind warning %d", i)

proc = context.Process(target=child)
proc.start()
display = InnerProgress()  # on stdout, the terminal
display.start_round(0, 10_000)
display.step(loss=4.0, tokens=100)
bar_shown.set()
steps = 0
while proc.is_alive() or steps < 50:
    display.step(loss=4.0, tokens=100)
    steps += 1
    if steps % 20 == 0:
        logging.getLogger("p2p_diloco").info("parent line %d", steps)
    proc.join(0.01)
flush_child_logs()
display.close()
'''

LOG_LINE_START = re.compile(rb"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")


def run_in_pty(code: str, timeout_s: float = 120.0) -> bytes:
    """What `code` writes to a real terminal (a pty, 120x30, no newline translation), stdout and stderr both."""
    master, slave = pty.openpty()
    tty.setraw(slave)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=slave, stdout=slave, stderr=slave,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    os.close(slave)
    output = b""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every process holding the terminal has closed it
                    break
                if not chunk:
                    break
                output += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=max(deadline - time.monotonic(), 1)) == 0, output.decode(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return output


@pytest.mark.timeout(180)
def test_on_a_terminal_every_log_line_starts_at_column_0_also_a_forked_processes():
    """The lines of a forked process (hivemind's averager and DHT run in such) and hivemind's own, while a
    progress bar is shown: each starts at column 0 and ends before anything else is written, in our format."""
    output = run_in_pty(PTY_SCRIPT)
    text = output.decode(errors="replace")
    assert "outer step 1: " in text  # the bar was shown
    starts = [m.start() for m in LOG_LINE_START.finditer(output)]
    lines = [output[start:output.index(b"\n", start)].decode() for start in starts]
    assert sum("child line" in line for line in lines) == 5 and sum("parent line" in line for line in lines) >= 2
    for start, line in zip(starts, lines):
        assert start == 0 or output[start - 1:start] in (b"\r", b"\n"), (line, output[start - 80:start])
        assert "\r" not in line and "outer step" not in line, line  # nothing was written over it
    hivemind_lines = [line for line in lines if "hivemind" in line]
    assert len(hivemind_lines) == 5 and all(" WARN hivemind.averaging.averager: hivemind warning " in line
                                            for line in hivemind_lines), hivemind_lines  # its INFO only with -v
    assert "[INFO]" not in text and "[WARN]" not in text  # hivemind's own format
