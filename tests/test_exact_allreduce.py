"""The all-reduce result is the sample-weighted mean and bit-identical on every peer of the group,
exact without a codec and within the codec's stated bound with one. Its parts start on the codec's
block grid; each reducer's mean is the same bits whatever order its senders arrive in and whatever
the CPU's kernel; and each peer learns what the group counted of its input (for error feedback)."""

import asyncio
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES, TensorPartContainer, TensorPartReducer

from p2p_diloco.hashing import tensors_sha256
from p2p_diloco.process_tree import command_name, is_running, kill_tree, start_ticks, wait_gone
from p2p_diloco.sync.codecs import CODECS, bytes_per_parameter
from p2p_diloco.sync.exact_allreduce import (
    CodecCompression, SenderOrderReducer, balanced_part_size_bytes, part_container_settings,
)
from p2p_diloco.sync.robust import weighted_mean
from tests.allreduce_case import START
from tests.conftest import REPO

CASE_TIMEOUT_S = 150  # start-up, one round (tests/allreduce_case.py bounds it at 100 s) and shutdown
SHAPES = [torch.Size([300, 77]), torch.Size([1001]), torch.Size([3, 5, 7])]
# with a tensor of more than one part (the 4-bit codecs cut 932,032 values, int8 516,096)
LARGE_SHAPES = [torch.Size([2_000_003]), torch.Size([300, 77]), torch.Size([1001])]


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


def run_case(run: str, case: dict, case_dir, timeout_s: float = CASE_TIMEOUT_S, faults: str = "") -> dict:
    """All-reduce rounds among a few peers in a process of its own (tests/allreduce_case.py, which
    describes `case` and `run`: a codec, or CODEC:ATTACK): every case forks a DHT and an averager process
    per peer, and after several cases forked from the pytest process a DHT start-up hung (1 CI run in 6).
    That process, and every process below it, is killed if it has not finished in time; whatever it
    started must be gone once it has. `faults` are every peer's (P2P_DILOCO_FAULTS: p2p_diloco/faults.py)."""
    return run_cases([run], case, case_dir, timeout_s, faults)[run]


def run_cases(runs: list[str], case: dict, case_dir, timeout_s: float = CASE_TIMEOUT_S, faults: str = "") -> dict:
    """:func:`run_case` once per run of `runs` (a codec, or CODEC:ATTACK with peer 0 a hostile reducer), among
    the same DHT nodes: the result of each, by run."""
    spec = ",".join(runs)
    torch.save(case, case_dir / "inputs.pt")
    log_path = case_dir / "allreduce_case.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.allreduce_case", spec, str(case_dir)],
                                stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(REPO), "P2P_DILOCO_FAULTS": faults})
        try:
            stdout, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stdout = None
        finally:  # a timeout here, or pytest-timeout's, or Ctrl+C: the whole tree goes
            if proc.poll() is None:
                below = kill_tree(proc.pid)
                proc.wait(10)
                for pid in wait_gone(below, 10):  # each watches its parent and stops by itself; if not:
                    kill_tree(pid)
    log_tail = log_path.read_text()[-4000:]
    assert stdout is not None, f"{spec}: no result within {timeout_s} s; log:\n{log_tail}"
    assert proc.returncode == 0, f"{spec}: exited with {proc.returncode}; log:\n{log_tail}"
    case_result = torch.load(case_dir / "result.pt")
    results = case_result["runs"]
    printed = json.loads(stdout.strip().splitlines()[-1])
    assert list(results) == list(printed) == runs, (list(results), list(printed))
    for name, result in results.items():
        assert [r["mean_sha256"] for r in printed[name]["rounds"]] == [r["mean_sha256"] for r in result["rounds"]]
    # its DHT, averager and p2pd processes are gone (torch's shm manager within seconds, by itself)
    left = still_running(case_result["children"], timeout_s=10)
    for pid in left:
        kill_tree(pid)
    assert not left, f"{spec}: processes left running after the case: {[(p, command_name(p)) for p in left]}"
    return results


@pytest.fixture(scope="module")
def every_codec_case(tmp_path_factory) -> dict:
    """One round of 3 peers in every codec, among the same DHT nodes: its inputs, samples and results."""
    peers = 3
    generator = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(s, generator=generator) * 1e-2 for s in SHAPES] for _ in range(peers)]
    samples = [16, 48, 160]
    # planned, as a swarm of peers that can dial each other plans its rounds (p2p_diloco.sync.membership): the
    # leader starts once its members joined, where hivemind's matchmaking gathers for matchmaking_time (2 s a codec)
    round_ = {"inputs": inputs, "starts": [START] * peers, "leaders": [0, 1, 2]}
    results = run_cases(list(CODECS), {"rounds": [round_], "samples": samples},
                        tmp_path_factory.mktemp("every_codec"), timeout_s=CASE_TIMEOUT_S + 30 * len(CODECS))
    return {"inputs": inputs, "samples": samples, "results": results}


@pytest.mark.swarm
@pytest.mark.timeout(CASE_TIMEOUT_S + 30 * len(CODECS) + 30)
@pytest.mark.parametrize("codec", list(CODECS))
def test_weighted_mean_is_bit_identical_on_all_peers(codec, every_codec_case):
    peers, inputs, samples = 3, every_codec_case["inputs"], every_codec_case["samples"]
    case = every_codec_case["results"][codec]
    result = {**case, **case["rounds"][0]}

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
    # which values the round's codec sent: every value for a dense codec; for a mask codec the same mask on every
    # peer, one value in `stride`, and the mean holds nothing elsewhere (what the outer step must not step on)
    stride = getattr(CODECS[codec], "stride", 1)
    if stride == 1:
        assert result["carried"] == [None] * peers
    else:
        assert len({tensors_sha256([c.to(torch.uint8) for c in carried]) for carried in result["carried"]}) == 1
        carried = result["carried"][0]
        assert sum(int(c.sum()) for c in carried) == pytest.approx(sum(s.numel() for s in SHAPES) / stride, rel=0.01)
        for mean in result["means"]:
            assert all(not bool(m[~c].any()) for m, c in zip(mean, carried))
    assert all(sent > 0 for sent in result["sent"]) and all(received > 0 for received in result["received"])
    # the parts really travelled in the codec: each peer sent (n-1)/n of its Δ and (n-1)/n of the mean
    numel = sum(shape.numel() for shape in SHAPES)
    sent_per_value = sum(result["sent"]) / (peers * 2 * (peers - 1) / peers * numel)
    assert sent_per_value == pytest.approx(bytes_per_parameter(codec), rel=0.15), codec


@pytest.mark.swarm
@pytest.mark.timeout(180)
def test_a_round_matched_ahead_of_a_delta_waits_for_it_and_ends_when_it_is_abandoned(tmp_path):
    """train/match_ahead.py: a peer asks for its group before its Δ is taken. Its group forms and waits for the
    Δ; the mean is the same bits on every peer and the same weighted mean as a round without the lead. A round
    whose every member abandons its Δ (the peers stop) ends with no tensor moved, not at a timeout."""
    peers, codec = 3, "fp4-e3m0"
    generator = torch.Generator().manual_seed(1)
    inputs = [[torch.randn(s, generator=generator) * 1e-2 for s in SHAPES] for _ in range(peers)]
    samples = [16, 48, 160]
    late = {"inputs": inputs, "starts": [START] * peers, "leaders": [0, 1, 2], "hand_over": [1.5, None, 0.5]}
    abandoned = {**late, "hand_over": ["abandon"] * peers, "outer_step": 7}
    case = run_case(codec, {"rounds": [late, abandoned], "samples": samples}, tmp_path)
    matched, gone = case["rounds"]

    assert matched["errors"] == [None] * peers, matched["errors"]
    assert len(set(matched["mean_sha256"])) == 1 and matched["group_size"] == [peers] * peers
    expected = [sum(w * x[j].double() for w, x in zip(samples, inputs)) / sum(samples) for j in range(len(SHAPES))]
    for j, want in enumerate(expected):
        coded_inputs = sum(w * largest_bound(codec, x[j]) for w, x in zip(samples, inputs)) / sum(samples)
        error = (matched["means"][0][j].double() - want).abs().max().item()
        assert error <= 2 * coded_inputs + largest_bound(codec, want) + 1e-8, (j, error)
    # the group formed before peer 0 handed its Δ over: the others waited for it, not for the group
    assert all(set(phases) == {"match", "late", "allreduce", "commit", "audit"} for phases in matched["phases"])
    assert matched["phases"][0]["late"] > 0
    assert all("stopped before its pseudo-gradient was taken" in error for error in gone["errors"]), gone["errors"]


def part_starts(container: TensorPartContainer, tensor: int | None = None) -> list[int]:
    """Where each part of the container (of `tensor`, if given) starts, in values from its tensor's
    start (parts are views), in order."""
    return sorted(part.storage_offset() for parts in container._input_parts_by_peer for part, info in parts
                  if tensor is None or info.key == tensor)


@pytest.mark.parametrize("codec", list(CODECS))
def test_parts_start_on_the_codec_block_grid(codec):
    """hivemind's TensorPartContainer, as the runner builds it: every part starts on the codec's block grid
    (hivemind alone cuts the 4-bit codecs' parts at 932,067 values), and is as large as the grid allows."""
    # the first tensor spans several of hivemind's parts in every codec (a mask codec's part holds 7.5M values)
    per_part = int(DEFAULT_PART_SIZE_BYTES / (4 * CodecCompression(CODECS[codec]).estimate_compression_ratio(None)))
    tensors = [torch.zeros(max(s.numel(), 2 * per_part + 3) if i == 0 else s) for i, s in enumerate(LARGE_SHAPES)]
    container = TensorPartContainer(tensors, [1.0, 1.0, 1.0], **part_container_settings(CODECS[codec]))
    starts = part_starts(container)
    blocksize = CODECS[codec].blocksize
    assert container.num_parts_by_tensor[0] > 1 and all(start % blocksize == 0 for start in starts), starts
    hivemind = TensorPartContainer(tensors, [1.0, 1.0, 1.0], compression=CodecCompression(CODECS[codec]))
    second, hivemind_second = part_starts(container, tensor=0)[1], part_starts(hivemind, tensor=0)[1]
    assert hivemind_second - blocksize < second <= hivemind_second  # as large as the grid allows
    if blocksize > 1:
        assert not all(start % blocksize == 0 for start in part_starts(hivemind))
    container.finalize(), hivemind.finalize()


@pytest.mark.parametrize("codec", list(CODECS))
def test_parts_are_balanced_between_reducers(codec):
    """hivemind gives each 512 KiB part whole to one reducer: the demo model's 688,768 values in 4 bits are one
    part, which one of 3 reducers averaged alone. Parts of balanced_part_size_bytes give each of them its share
    of the values, to within 5 %, and still start on the codec's grid."""
    for numel in (688_768, 4_000_000):
        tensors = [torch.zeros(numel)]
        size = balanced_part_size_bytes(CODECS[codec], numel, reducers=3)
        container = TensorPartContainer(tensors, [1.0, 1.0, 1.0], **part_container_settings(CODECS[codec], size))
        shares = [sum(part.numel() for part, _ in parts) for parts in container._input_parts_by_peer]
        assert max(shares) <= 1.05 * numel / 3, (numel, shares)
        assert all(start % CODECS[codec].blocksize == 0 for start in part_starts(container))
        container.finalize()
    hivemind = TensorPartContainer([torch.zeros(688_768)], [1.0, 1.0, 1.0], **part_container_settings(CODECS[codec]))
    if CODECS[codec].name in ("nf4", "fp4-bnb", "fp4-e3m0"):
        assert hivemind.num_parts_by_peer.count(0) == 2  # one reducer for the whole model
    hivemind.finalize()


def reduce_parts(reducer_type, parts: list[list[torch.Tensor]], weights: list[float], order: list[int]):
    """Each part's mean from a reducer of `reducer_type`, the senders' parts registered in `order`."""
    async def run():
        reducer = reducer_type([part.shape for part in parts[0]], len(parts))
        means = []
        for k in range(len(parts[0])):
            tasks = [asyncio.create_task(reducer.accumulate_part(s, k, parts[s][k], weight=weights[s])) for s in order]
            results = await asyncio.gather(*tasks)  # tasks start, and register their part, in creation order
            assert all(r is results[0] for r in results)
            means.append(results[0].clone())
        reducer.finalize()
        return means

    return asyncio.run(run())


def reducer_inputs(senders: int = 4) -> tuple[list[list[torch.Tensor]], list[float]]:
    """Parts of several scales, the same bits on every CPU (torch.randn is not: its kernel is vectorized)."""
    generator = np.random.default_rng(1)
    parts = [[torch.from_numpy((generator.standard_normal(n) * 10.0 ** -s).astype(np.float32)) for n in (1000, 64, 333)]
             for s in range(senders)]
    return parts, [16.0, 48.0, 160.0, 3.0][:senders]


def test_reducer_mean_is_the_same_bits_whatever_order_the_senders_arrive_in():
    parts, weights = reducer_inputs()
    first, second = [0, 1, 2, 3], [3, 1, 0, 2]
    ours = [reduce_parts(SenderOrderReducer, parts, weights, order) for order in (first, second)]
    for a, b, k in zip(*ours, range(3)):
        assert tensors_sha256([a]) == tensors_sha256([b])
        assert torch.equal(a, weighted_mean([p[k] for p in parts], weights))
    hivemind = [reduce_parts(TensorPartReducer, parts, weights, order) for order in (first, second)]
    assert tensors_sha256(hivemind[0]) != tensors_sha256(hivemind[1])  # what the reducer replaced
    # and it is the weighted mean, up to float32 rounding
    for mean, k in zip(ours[0], range(3)):
        exact = sum(w * p[k].double() for w, p in zip(weights, parts)) / sum(weights)
        assert torch.allclose(mean.double(), exact, rtol=1e-6, atol=1e-7)  # the terms are below 1


def test_a_sender_whose_handler_is_cancelled_costs_the_others_nothing():
    """The senders of a part share its result. The handler of one is cancelled while it waits (its
    stream closed: the groupmate died or gave up), and the others, this peer's own parts included,
    still get the part, with the input it sent counted. hivemind's plain await cancelled the shared
    result with it, and a survivor waited for its own part until allreduce_timeout."""
    parts, weights = reducer_inputs(3)

    async def run():
        reducer = SenderOrderReducer([part.shape for part in parts[0]], 3)
        waiting = [asyncio.create_task(reducer.accumulate_part(s, 0, parts[s][0], weight=weights[s])) for s in (0, 1)]
        await asyncio.sleep(0)  # both have registered their part, and wait for sender 2's
        waiting[1].cancel()
        last = asyncio.create_task(reducer.accumulate_part(2, 0, parts[2][0], weight=weights[2]))
        results = await asyncio.wait_for(asyncio.gather(waiting[0], last), 30)
        reducer.finalize()
        return results

    for result in asyncio.run(run()):
        assert torch.equal(result, weighted_mean([p[0] for p in parts], weights))


REDUCER_HASH = """
import sys
sys.path.insert(0, {repo!r})
import torch
from hivemind.averaging.partition import TensorPartReducer
from tests.test_exact_allreduce import reduce_parts, reducer_inputs
from p2p_diloco.hashing import tensors_sha256
from p2p_diloco.sync.exact_allreduce import SenderOrderReducer
parts, weights = reducer_inputs()
for reducer in (SenderOrderReducer, TensorPartReducer):
    print(reducer.__name__, tensors_sha256(reduce_parts(reducer, parts, weights, [0, 1, 2, 3])))
print(torch.backends.cpu.get_cpu_capability())
"""


@pytest.mark.timeout(120)
def test_reducer_mean_is_the_same_bits_on_every_cpu_kernel():
    """ATen picks a kernel for the CPU (AVX-512, AVX2, or default where neither is available, as on an
    old x86 or under ATEN_CPU_CAPABILITY=default); the reducer's mean must not depend on it."""
    def hashes_under(capability: str | None):
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        if capability is not None:
            env["ATEN_CPU_CAPABILITY"] = capability
        run = subprocess.run([sys.executable, "-c", REDUCER_HASH.format(repo=str(REPO))], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=100)
        assert run.returncode == 0, run.stderr[-3000:]
        *hashes, kernel = run.stdout.split("\n")[:3]
        return dict(line.split() for line in hashes), kernel

    capabilities = (None, "default")
    with ThreadPoolExecutor(len(capabilities)) as pool:  # the two processes at once
        outputs = dict(zip(capabilities, pool.map(hashes_under, capabilities)))
    (best, best_kernel), (default, default_kernel) = outputs[None], outputs["default"]
    assert default_kernel == "DEFAULT"
    assert best["SenderOrderReducer"] == default["SenderOrderReducer"]
    if best_kernel != "DEFAULT":  # hivemind's running sum: a fused multiply-add on AVX2 and AVX-512 only
        assert best["TensorPartReducer"] != default["TensorPartReducer"], best_kernel


@pytest.mark.swarm
@pytest.mark.timeout(420)
# fp4-e3m0 alone: what is checked here (what the runner records as counted, the residual, the void and
# the failed rounds) is the same code for every block codec, which only passes it its encode/decode and
# its block size (part_container_settings). int8's round trips are checked in test_codecs.py, its part
# grid in test_parts_start_on_the_codec_block_grid, its real all-reduce in
# test_weighted_mean_is_bit_identical_on_all_peers, and its error feedback with the runner's part cutter
# over many rounds in tests/test_error_feedback.py (simulated): a second real swarm here for int8
# (~26 s on 2 cores) checked no other logic.
@pytest.mark.parametrize("codec", ["fp4-e3m0"])
def test_error_feedback_counts_what_really_left(codec, tmp_path):
    """Three peers with error feedback, three rounds through the real all-reduce, the second void for
    everyone (one peer names another θ_global). Each agreed round reports, for each peer, what the
    group counted of its Δ + e: on each part (cut as the runner cuts it) the codec's round trip of what
    it sent, the parts it reduced itself included (:func:`assert_counted_is_the_round_trip`). And nothing is lost:
    Σ counted + e_T = Σ Δ, the void round's Δ included (it stays in θ_local and goes into the next).
    A round that fails for another reason (a loaded machine) is checked the same way: its Δ is owed."""
    peers, samples = 3, [16, 48, 160]
    generator = torch.Generator().manual_seed(0)
    rounds = [{"inputs": [[torch.randn(s, generator=generator) * 1e-2 for s in LARGE_SHAPES] for _ in range(peers)],
               "starts": [START] * peers} for _ in range(3)]
    rounds[1]["starts"][0] = "6" * 64
    result = run_case(codec, {"rounds": rounds, "samples": samples, "error_feedback": True}, tmp_path,
                      timeout_s=400)
    assert all(e is not None for e in result["rounds"][1]["errors"]), result["rounds"][1]["errors"]
    agreed = [r for r in result["rounds"] if r["errors"] == [None] * peers]
    assert agreed, [r["errors"] for r in result["rounds"]]  # the first and last, unless the machine was too slow
    for round_ in agreed:
        assert_counted_is_the_round_trip(round_, CODECS[codec])

    for peer in range(peers):
        owed = result["owed"][peer]
        for j in range(len(LARGE_SHAPES)):
            deltas = sum(r["inputs"][peer][j].double() for r in rounds)
            counted = sum(r["counted"][peer][j].double() for r in result["rounds"] if r["errors"][peer] is None)
            kept = result["residuals"][peer][j].double() + (owed[j].double() if owed is not None else 0)
            lost = (deltas - counted - kept).abs().max().item()
            assert lost <= 1e-8, (codec, peer, j, lost)


def assert_counted_is_the_round_trip(round_: dict, codec) -> None:
    """What the group counted of each peer's input in an agreed round (tests/allreduce_case.py's
    ``counted``) is, on each part as the runner cuts it, the codec's round trip of what the peer sent:
    on the parts it reduced itself too, which a reducer aggregates decoded like everyone's."""
    for peer, (sent, counted) in enumerate(zip(round_["to_send"], round_["counted"])):
        for k, (part, got) in enumerate(zip(cut_parts(sent, codec), cut_parts(counted, codec))):
            assert torch.equal(got, codec.decode(codec.encode(part.contiguous()), part.numel())), (codec.name, peer, k)


def cut_parts(tensors: list[torch.Tensor], codec) -> list[torch.Tensor]:
    """`tensors` cut into parts as the runner cuts them (hivemind's TensorPartContainer, one peer)."""
    container = TensorPartContainer(tensors, [1.0], **part_container_settings(codec))
    parts = [part for part, _ in container._input_parts_by_peer[0]]
    container.finalize()
    return parts


@pytest.mark.swarm
@pytest.mark.timeout(2 * CASE_TIMEOUT_S + 30)
def test_a_round_through_relays_gives_every_peer_the_bytes_of_a_flat_round(tmp_path):
    """Groups for size (p2p_diloco.sync.relay): 5 peers average the same pseudo-gradients with the same
    weights twice from the same step, once flat and once in groups of 2 (3 groups; some parts cross two
    links), and every peer ends both rounds with the same bytes."""
    peers = 5
    generator = torch.Generator().manual_seed(3)
    shapes = [torch.Size([1000])] * 15  # one part each, three for every reducer (hivemind cuts by tensor)
    inputs = [[torch.randn(s, generator=generator) * 1e-2 for s in shapes] for _ in range(peers)]
    round_ = {"inputs": inputs, "starts": [START] * peers, "leaders": [0, 1, 2], "outer_step": 0}
    case = run_case("fp4-e3m0", {"rounds": [{**round_, "relay_group": 0}, {**round_, "relay_group": 2}],
                                 "samples": [16, 48, 160, 32, 64]}, tmp_path, timeout_s=2 * CASE_TIMEOUT_S)
    flat, relayed = case["rounds"]
    for result in (flat, relayed):
        assert result["errors"] == [None] * peers, result["errors"]
        assert result["group_size"] == [peers] * peers
        assert len(set(result["mean_sha256"])) == 1
    assert relayed["mean_sha256"] == flat["mean_sha256"]
    for got, want in zip(relayed["means"][0], flat["means"][0]):
        assert torch.equal(got, want)
    # the second round's parts did go through relays, the first's did not: in 3 groups of at most 2,
    # each peer reaches directly only the others of its group and column
    assert not any(digests["relayed"] for digests in flat["digests"])
    assert all(digests["relayed"] for digests in relayed["digests"]), relayed["digests"]


@pytest.mark.swarm
@pytest.mark.timeout(CASE_TIMEOUT_S + 30)
def test_an_assistant_reduces_for_peers_nobody_can_dial_and_counts_no_part_of_its_own(tmp_path):
    """A bootstrap node's assistant (p2p_diloco.sync.assistant) is hivemind's auxiliary member: it reduces
    and sends nothing. hivemind 1.1.12 made it a sender of its zeros with weight 0, which a robust rule
    counts: in a group of one peer and the assistant the reduction divided by zero (the claims' median
    was 0), and in a group of three the zeros lowered the median norm. Here, under CenteredClip, a lone
    peer's round with the assistant gives back its own Δ, and three peers sending 1, 2 and 3 everywhere
    (norms within twice the median, each within the radius of the median, 2) get their weighted mean, 2,
    exactly; with the zeros counted, 3 was clipped to the norm of 2 and they got 5/3."""
    generator = torch.Generator().manual_seed(3)
    lone = [torch.randn(s, generator=generator) * 1e-2 for s in SHAPES]
    cases = {
        "lone": {"rounds": [{"inputs": [lone], "starts": [START]}], "samples": [40]},
        "three": {"rounds": [{"inputs": [[torch.full(s, float(v)) for s in SHAPES] for v in (1, 2, 3)],
                              "starts": [START] * 3}], "samples": [40, 40, 40]},
    }

    def run(name: str) -> dict:
        (case_dir := tmp_path / name).mkdir()
        return run_case("none", {**cases[name], "aggregation": "centered-clip", "assistant": True}, case_dir)

    with ThreadPoolExecutor(len(cases)) as pool:  # the two processes at once
        results = dict(zip(cases, pool.map(run, cases)))
    (alone,), (three,) = results["lone"]["rounds"], results["three"]["rounds"]
    assert alone["errors"] == [None] and alone["group_size"] == [1], alone["errors"]
    assert all(torch.equal(mean, sent) for mean, sent in zip(alone["means"][0], lone))
    assert three["errors"] == [None] * 3 and three["group_size"] == [3] * 3, three["errors"]
    assert three["group_samples"] == [120] * 3
    assert all(torch.equal(mean, torch.full(s, 2.0)) for means in three["means"] for mean, s in zip(means, SHAPES))
