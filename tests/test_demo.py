"""`p2p-diloco demo`, the README's main command, end to end on a small setting: the summary, the held-out
losses the peers measured while they trained, and the plot."""

import json
import subprocess
import sys

import pytest

from tests.conftest import TINY, write_toml

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(400)]


def test_demo_writes_summary_and_plot(tmp_path):
    raw = {name: dict(values) for name, values in TINY.items()}
    raw["inner"]["steps_per_outer"] = 10
    raw["eval"] = {"every": 1, "sequences": 8}  # the peers measure θ_global after each outer step
    config = write_toml(tmp_path / "run.toml", raw)
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "p2p_diloco.cli", "demo", "--peers", "2", "--outer-steps", "3",
         "--config", str(config), "--out", str(out), "--timeout", "300"],
        capture_output=True, text=True, timeout=380,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    progress = [line for line in lines if line.startswith("demo: outer step")]
    assert progress[-1].startswith("demo: outer step 3/3, loss ")  # the swarm's progress, shown while it ran
    # a line per phase before the progress: nobody watches 0/3 without knowing why
    phases = ["demo: building the tokenizer and data of", "demo: starting the bootstrap node",
              "demo: bootstrap node at /ip4/127.0.0.1/", "demo: waiting for the 2 peers to start",
              "demo: 2 peers joined after", "demo: outer step", "demo: evaluating θ_global"]
    found = [next(i for i, line in enumerate(lines) if line.startswith(phase)) for phase in phases]
    assert found == sorted(found), lines
    # and a short summary with the files' paths, not summary.json
    end = lines[-4:]
    assert end[0].startswith("demo: 3 outer steps in ") and "held-out loss " in end[0], end
    assert "the same θ_global on every peer" in end[0]
    assert end[1:] == [f"demo: summary: {out / 'summary.json'}", f"demo: plot:    {out / 'loss.png'}",
                       f"demo: logs:    {out / 'bootstrap.log'}, {out / 'peer-*.log'} (metrics: peer-*.metrics.jsonl)"]
    assert '"peers"' not in result.stdout, lines  # summary.json is not printed
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["peers"]) == 2
    for peer in summary["peers"]:
        assert peer["peer_id"].startswith("Qm")  # an RSA identity: it also signs the peer's DHT records
        assert peer["final_outer_step"] == 3 and peer["outer_steps"] >= 1
        assert peer["final_loss"] is not None
        assert 0 < peer["compute_utilization"] <= 1
    assert summary["all_final_hashes_equal"]
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert f"held-out loss {summary['initial_eval_loss']:.3f} -> {summary['final_eval_loss']:.3f}" in end[0]
    # each outer step's θ_global was measured by a peer that applied it, on the demo's own 8 sequences: the
    # last measurement is the final θ_global's loss (θ_global, not a peer's θ_local), up to rounding
    measured = summary["heldout_evaluations"]
    assert [e["outer_step"] for e in measured] == [1, 2, 3] and summary["eval_sequences"] == 8
    assert abs(measured[-1]["eval_loss"] - summary["final_eval_loss"]) < 1e-4, (measured, summary)
    assert summary["total_bytes_sent"] > 0 and summary["wall_seconds"] > 0
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
