"""The all-reduce result is the sample-weighted mean and bit-identical on every peer of the group,
exact without a codec and within the codec's stated bound with one."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from p2p_diloco.hashing import tensors_sha256
from p2p_diloco.process_tree import command_name, is_running, kill_tree, start_ticks, wait_gone
from p2p_diloco.sync.codecs import CODECS, bytes_per_parameter
from tests.conftest import REPO

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(180)]

CASE_TIMEOUT_S = 150  # start-up, one round (tests/allreduce_case.py bounds it at 100 s) and shutdown
SHAPES = [torch.Size([300, 77]), torch.Size([1001]), torch.Size([3, 5, 7])]


def largest_bound(codec, tensor: torch.Tensor) -> float:
    """A bound on the codec's error at any element of `tensor`, however the all-reduce cuts it into
    parts and blocks (each element's bound is at most the largest one over the whole tensor)."""
    return CODECS[codec].error_bound(tensor.reshape(-1).float()).max().item()


def still_running(processes: list[list[int]], timeout_s: float) -> list[int]:
    """Those of `processes` ([pid, start time] each) still running after up to `timeout_s`: the same
    process, not a new one that got its PID."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [pid for pid, started in processes if is_running(pid) and start_ticks(pid) == started]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def run_case(codec: str, inputs: list[list[torch.Tensor]], samples: list[int], case_dir) -> dict:
    """One all-reduce among len(inputs) peers in a process of its own (tests/allreduce_case.py): every
    case forks a DHT and an averager process per peer, and after several cases forked from the pytest
    process a DHT start-up hung (1 CI run in 6). That process, and every process below it, is killed
    if it has not finished in time; whatever it started must be gone once it has."""
    torch.save({"inputs": inputs, "samples": samples}, case_dir / "inputs.pt")
    log_path = case_dir / "allreduce_case.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.allreduce_case", codec, str(case_dir)],
                                stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            stdout, _ = proc.communicate(timeout=CASE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            stdout = None
        finally:  # a timeout here, or pytest-timeout's, or Ctrl+C: the whole tree goes
            if proc.poll() is None:
                below = kill_tree(proc.pid)
                proc.wait(10)
                for pid in wait_gone(below, 10):  # each watches its parent and stops by itself; if not:
                    kill_tree(pid)
    log_tail = log_path.read_text()[-4000:]
    assert stdout is not None, f"{codec}: no result within {CASE_TIMEOUT_S} s; log:\n{log_tail}"
    assert proc.returncode == 0, f"{codec}: exited with {proc.returncode}; log:\n{log_tail}"
    result = torch.load(case_dir / "result.pt")
    assert json.loads(stdout.strip().splitlines()[-1])["mean_sha256"] == result["mean_sha256"]
    # its DHT, averager and p2pd processes are gone (torch's shm manager within seconds, by itself)
    left = still_running(result["children"], timeout_s=10)
    for pid in left:
        kill_tree(pid)
    assert not left, f"{codec}: processes left running after the case: {[(p, command_name(p)) for p in left]}"
    return result


@pytest.mark.parametrize("codec", list(CODECS))
def test_weighted_mean_is_bit_identical_on_all_peers(codec, tmp_path):
    peers = 3
    generator = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(s, generator=generator) * 1e-2 for s in SHAPES] for _ in range(peers)]
    samples = [16, 48, 160]
    result = run_case(codec, inputs, samples, tmp_path)

    assert result["errors"] == [None] * peers, result["errors"]
    assert result["mean_sha256"][0] is not None
    # every peer holds the same bytes: the hash of the mean, recomputed here from the tensors
    assert len({tensors_sha256(mean) for mean in result["means"]}) == 1
    assert {tensors_sha256(mean) for mean in result["means"]} == set(result["mean_sha256"])
    assert result["group_size"] == [peers] * peers
    assert result["group_samples"] == [sum(samples)] * peers
    expected = [sum(w * x[j].double() for w, x in zip(samples, inputs)) / sum(samples) for j in range(len(SHAPES))]
    for mean in result["means"]:
        for j, (got, want) in enumerate(zip(mean, expected)):
            assert got.shape == want.shape and got.dtype == torch.float32
            # each sender's part is coded once, and the mean once more on its way back
            coded_inputs = sum(w * largest_bound(codec, x[j]) for w, x in zip(samples, inputs)) / sum(samples)
            bound = 2 * coded_inputs + largest_bound(codec, want)  # the mean moved by ≤ coded_inputs
            error = (got.double() - want).abs().max().item()
            assert error <= bound + 1e-8, (codec, j, error, bound)
    assert all(sent > 0 for sent in result["sent"]) and all(received > 0 for received in result["received"])
    # the parts really travelled in the codec: each peer sent (n-1)/n of its Δ and (n-1)/n of the mean
    numel = sum(shape.numel() for shape in SHAPES)
    sent_per_value = sum(result["sent"]) / (peers * 2 * (peers - 1) / peers * numel)
    assert sent_per_value == pytest.approx(bytes_per_parameter(codec), rel=0.15), codec
