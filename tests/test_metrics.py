"""The metrics events: one list (p2p_diloco.metrics.EVENTS) that the writer enforces, `--metrics-file`'s help
shows, README describes, and that holds every event name the peer's code writes."""

import re

import pytest
from click.testing import CliRunner

from p2p_diloco.cli import main
from p2p_diloco.metrics import EVENTS, MetricsWriter
from tests.conftest import REPO


def test_the_writer_refuses_an_event_not_in_the_list(tmp_path):
    writer = MetricsWriter(tmp_path / "m.jsonl", "QmPeer")
    writer.write("exit", outer_step=3)
    with pytest.raises(ValueError, match="'outer_steps' is not in p2p_diloco.metrics.EVENTS"):
        writer.write("outer_steps", outer_step=3)
    writer.close()
    assert (tmp_path / "m.jsonl").read_text().count("\n") == 1


def test_every_event_the_code_writes_is_in_the_list():
    written = set()
    for path in (REPO / "p2p_diloco").rglob("*.py"):
        text = path.read_text()
        written |= set(re.findall(r'metrics\.write\(\s*"(\w+)"', text))
        written |= set(re.findall(r'SyncOutcome\(event="(\w+)"', text))
        written |= set(re.findall(r'= "(\w+)"  # the metrics event', text))
    assert {"join", "outer_step", "round_failed", "round_stopped", "state_refused"} <= written  # the scan finds them
    assert written <= set(EVENTS), written - set(EVENTS)


@pytest.mark.parametrize("command", ["peer", "join"])
def test_the_metrics_file_help_lists_every_event(command):
    result = CliRunner().invoke(main, [command, "--help"], terminal_width=200)
    assert result.exit_code == 0
    help_text = " ".join(result.output.split())
    assert f"the events: {', '.join(EVENTS)} (README.md, Metrics)" in help_text


def test_readme_describes_every_event():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Metrics"):readme.index("\n## ", readme.index("## Metrics") + 1)]
    assert [event for event in EVENTS if f"`{event}`" not in section] == []
