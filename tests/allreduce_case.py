"""One real all-reduce among a few peers, in a process of its own (tests/test_exact_allreduce.py).

    python -m tests.allreduce_case CODEC CASE_DIR

reads ``CASE_DIR/inputs.pt`` (``{"inputs": one list of tensors per peer, "samples": one int per peer}``),
starts one DHT node and one :class:`OuterSync` in `CODEC` per peer on 127.0.0.1, averages once, and
writes ``CASE_DIR/result.pt``: each peer's mean (or the error it raised), group size and samples, and
the bytes its averager sent and received. It prints the same, less the tensors, as one JSON line.

The test asserts on the result; this process only averages. Each case runs here rather than in the
pytest process because every case forks a DHT and an averager process per peer, and after several
cases forked from one long-lived process a DHT start-up hung. This process stops everything it
started before it exits, and its children exit with it if it is killed (the test kills it on timeout).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

from p2p_diloco import process_tree
from p2p_diloco.config import SwarmConfig
from p2p_diloco.hashing import tensors_sha256
from p2p_diloco.swarm.node import start_run_node, visible_maddrs
from p2p_diloco.sync.outer_sync import OuterSync

# about the timeouts of the tests' tiny run (tests/conftest.py): one round is over, or failed, within ~80 s
CFG = SwarmConfig(matchmaking_time=2.0, request_timeout=1.0, allreduce_timeout=30.0, next_chunk_timeout=10.0,
                  commit_timeout=10.0)
ROUND_WAIT_S = 100.0
START = "5" * 64  # the sha256 of the global state every peer starts from


def average_once(codec: str, inputs: list[list[torch.Tensor]], samples: list[int]) -> dict:
    shapes = [t.shape for t in inputs[0]]
    dhts, syncs = [], []
    peers = len(inputs)
    results: list = [None] * peers
    errors: list = [None] * peers
    try:
        for _ in range(peers):
            first = visible_maddrs(dhts[0]) if dhts else ()
            node = start_run_node("exact", "127.0.0.1", 0, initial_peers=first)
            dhts.append(node.dht)
            syncs.append(OuterSync(node.dht, "exact", "f" * 64, node.identity.record_subkey, shapes, CFG,
                                   state_provider=lambda: ({}, []), codec=codec))

        def average(i: int) -> None:
            try:
                results[i] = syncs[i].average(inputs[i], samples[i], outer_step=0, global_sha256=START)
            except Exception as e:  # reported to the test
                errors[i] = repr(e)

        threads = [threading.Thread(target=average, args=(i,), daemon=True) for i in range(peers)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + ROUND_WAIT_S
        for i, t in enumerate(threads):
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                errors[i] = f"no result within {ROUND_WAIT_S} s"
        traffic = [(s.averager.traffic.sent, s.averager.traffic.received) for s in syncs]
    finally:
        # the DHT and averager processes, p2pd, torch's shared-memory manager
        children = process_tree.descendant_pids(os.getpid())
        for s in syncs:
            s.shutdown()
        for d in dhts:
            d.shutdown()
        # what shutdown left running; torch's shm manager exits by itself once its clients are gone
        process_tree.stop_processes(process_tree.without_torch_shm_manager(children))
    return {
        "codec": codec,
        "peers": peers,
        "means": [r.mean if r is not None else None for r in results],
        "mean_sha256": [tensors_sha256(r.mean) if r is not None else None for r in results],
        "group_size": [r.group_size if r is not None else None for r in results],
        "group_samples": [r.group_samples if r is not None else None for r in results],
        "errors": errors,
        "sent": [sent for sent, _ in traffic],
        "received": [received for _, received in traffic],
        # [pid, start time]: a PID alone may be a new process's by the time the test looks
        "children": [[pid, process_tree.start_ticks(pid)] for pid in children],
    }


def main() -> None:
    codec, case_dir = sys.argv[1], Path(sys.argv[2])
    # killed (on timeout), this process takes its DHT, averager and p2pd processes with it
    process_tree.children_exit_with_this_process()
    case = torch.load(case_dir / "inputs.pt")
    result = average_once(codec, case["inputs"], case["samples"])
    torch.save(result, case_dir / "result.pt")
    print(json.dumps({key: value for key, value in result.items() if key != "means"}), flush=True)


if __name__ == "__main__":
    main()
