"""Real all-reduce rounds among a few peers, in a process of its own (tests/test_exact_allreduce.py).

    python -m tests.allreduce_case RUN[,RUN...] CASE_DIR

where each RUN is a codec, or CODEC:ATTACK for a run in which peer 0 is a hostile reducer (below),

reads ``CASE_DIR/inputs.pt``: ``{"rounds": [{"inputs": one list of tensors per peer, "starts": the
θ_global sha256 each peer names, "leaders": optional, the round's membership plan as peer indices in
order, ``"dead"`` for a peer ID that no node holds, "members": optional, the peer indices the plan names
(all of them if absent), "delays": optional, the seconds each peer waits before it averages,
"relay_group": optional, every peer's ``swarm.relay_group_size`` (0 if absent: a flat round),
"hand_over": optional, per peer None (its Δ is there when it asks for a group), a number of seconds (the
round is matched ahead of its Δ, handed over that long after), or ``"abandon"`` (it stops instead, 0.5 s
after: :class:`~p2p_diloco.sync.outer_sync.PendingDelta`),
"outer_step": optional, the step the peers average toward the next of (the round's index if absent)}, ...],
"samples": one int per peer,
"error_feedback": bool, "aggregation": optional, the reducers' rule (``outer.aggregation``, with its
defaults; DiLoCo's "mean" if absent), "assistant": optional, true for peers that all average as clients
(nobody can dial them) and an assistant on a DHT node of its own that reduces for them in every round
(:mod:`p2p_diloco.sync.assistant`), as a bootstrap node does}``. It
starts one DHT node per peer on 127.0.0.1 and, for each RUN in turn, one :class:`OuterSync` in its
codec per peer, which averages once per round, as the training loop does: a round that fails leaves
its Δ owed to the next one, and with error feedback each peer sends Δ + e and commits what the group
counted of it (:class:`~p2p_diloco.train.error_feedback.ErrorFeedback`). Peers that name different
starts all fail their round after the all-reduce. It writes ``CASE_DIR/result.pt``: ``{"runs": by
RUN, per round each peer's mean (or the error it raised), group size and samples, what it sent and
what the group counted of it; each peer's final residual; the all-reduce bytes each averager sent and received, and its bytes by phase;
each peer's ID, the digests of what travelled in its agreed rounds (:mod:`p2p_diloco.sync.audit`) and
the peers it bans at the end, "children": every process the case started}``. It prints the runs', less
their tensors, as one JSON line. In a run ``CODEC:ATTACK``, peer 0 is a hostile reducer: its averager
process forks under tests/hostile_peer.py's patch for ATTACK (``garbage-reducer``,
``equivocating-reducer``, ``misquoting-reducer`` or ``tampering-relay``), its groupmates' without it.

The test asserts on the result; this process only averages. Each case runs here rather than in the
pytest process because every case forks a DHT and an averager process per peer, and after several
cases forked from one long-lived process a DHT start-up hung. This process stops everything it
started before it exits, and its children exit with it if it is killed (the test kills it on timeout).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from p2p_diloco import process_tree
from p2p_diloco.config import SwarmConfig
from p2p_diloco.hashing import tensors_sha256
from p2p_diloco.node_runner import setup_logging
from p2p_diloco.swarm.node import start_run_node, visible_maddrs
from p2p_diloco.swarm.records import AssistanceRequest
from p2p_diloco.sync.assistant import Assistant
from p2p_diloco.sync.audit import ReducerAudit
from p2p_diloco.sync.exact_allreduce import ExactAllReduceRunner
from p2p_diloco.protocol.membership import Membership
from p2p_diloco.sync.outer_sync import OuterSync, PendingDelta, RoundFailed
from p2p_diloco.sync.robust import AggregationRule
from p2p_diloco.train.error_feedback import ErrorFeedback

# about the timeouts of the tests' tiny run (tests/conftest.py): one round is over, or failed, within ~80 s
CFG = SwarmConfig(matchmaking_time=2.0, request_timeout=1.0, allreduce_timeout=30.0, next_chunk_timeout=10.0,
                  commit_timeout=10.0)
ROUND_WAIT_S = 100.0
START = "5" * 64  # the sha256 of the global state every peer starts from


@contextlib.contextmanager
def hostile_reducer(attack: Optional[str]):
    """tests/hostile_peer.py's patch for reducer `attack` (none if None) while the averager process that
    is created under it forks; the project's methods are restored after."""
    patched = [(ExactAllReduceRunner, "_encode_averaged"), (ExactAllReduceRunner, "_accumulate_parts_streaming"),
               (ExactAllReduceRunner, "rpc_relay_part"), (ReducerAudit, "served_inputs")]  # hostile_peer's seams
    honest = {(cls, name): cls.__dict__[name] for cls, name in patched}
    if attack is not None:
        from tests.hostile_peer import PATCHES
        PATCHES[attack](attack)
    try:
        yield
    finally:
        for (cls, name), method in honest.items():
            setattr(cls, name, method)


def average_rounds(runs: list[str], case: dict) -> dict:
    """The case's rounds once per run of `runs` (a codec, or CODEC:ATTACK: peer 0 a hostile reducer), among
    the same DHT nodes (one per peer, and the assistant's): each run's averagers are started, average every
    round and are shut down before the next run's, so that a case of several runs pays for the nodes' start
    once. The result of each run by run, and every process the case started."""
    peers = len(case["samples"]) + bool(case.get("assistant"))
    nodes, children, results = [], {}, {}
    try:
        for _ in range(peers):
            first = visible_maddrs(nodes[0].dht) if nodes else ()
            nodes.append(start_run_node("exact", "127.0.0.1", 0, initial_peers=first))
        node_pids = set(process_tree.descendant_pids(os.getpid()))  # the DHT processes and their p2pd
        for run in runs:
            codec, _, attack = run.partition(":")
            results[run] = average_in(codec, nodes, case, attack or None, node_pids, children)
    finally:
        # the DHT processes and p2pd, torch's shared-memory manager (the runs' averagers are stopped already)
        running = process_tree.descendant_pids(os.getpid())
        children.update(started(running))
        for node in nodes:
            node.dht.shutdown()
        # what shutdown left running; torch's shm manager exits by itself once its clients are gone
        process_tree.stop_processes(process_tree.without_torch_shm_manager(running))
    # [pid, start time]: a PID alone may be a new process's by the time the test looks
    return {"runs": results, "children": [list(item) for item in children.items()]}


def started(pids: list[int]) -> dict[int, Optional[int]]:
    """Each of `pids` with its start time (:func:`~p2p_diloco.process_tree.start_ticks`)."""
    return {pid: process_tree.start_ticks(pid) for pid in pids}


def average_in(codec: str, nodes: list, case: dict, hostile: Optional[str], node_pids: set[int],
               children: dict[int, Optional[int]]) -> dict:
    """The case's rounds in `codec`, with an averager per node of `nodes` (the last one an assistant's if the
    case has one); its processes (those not in `node_pids`) are added to `children` and stopped before
    this returns."""
    rounds, samples, error_feedback = case["rounds"], case["samples"], case.get("error_feedback", False)
    rule = AggregationRule(case.get("aggregation", "mean"))
    shapes = [t.shape for t in rounds[0]["inputs"][0]]
    indices = list(range(len(shapes)))
    syncs = []
    assistant = None
    peers = len(samples)
    feedback = [ErrorFeedback(shapes) if error_feedback else None for _ in range(peers)]
    owed: list = [None] * peers  # each peer's Δ of rounds that applied nothing: it stays in θ_local
    outcomes = []
    try:
        for i, node in enumerate(nodes[:peers]):
            with hostile_reducer(hostile if i == 0 else None):
                syncs.append(OuterSync(node.dht, "exact", "f" * 64, node.identity.record_subkey, shapes, CFG,
                                       state_provider=lambda: ({}, []), client_mode=bool(case.get("assistant")),
                                       codec=codec, aggregation=rule, record_sent=error_feedback))
        counted_before = [s.averager.traffic.by_phase() for s in syncs]  # a DHT node's counters outlive a run
        if case.get("assistant"):
            assistant = Assistant(nodes[peers].dht, assistance_request(shapes, codec, rule))
        for step, round_ in enumerate(rounds):
            outcomes.append(average_round(syncs, feedback, owed, indices, round_, samples, step, assistant))
        traffic = [{phase: {way: count - before[phase][way] for way, count in counts.items()}
                    for phase, counts in s.averager.traffic.by_phase().items()} for s, before in zip(syncs, counted_before)]
        banned = [s.averager.banned_peers() for s in syncs]
    finally:
        averagers = started([pid for pid in process_tree.descendant_pids(os.getpid()) if pid not in node_pids])
        children.update(averagers)
        for s in syncs:
            s.shutdown()
        if assistant is not None:
            assistant.close()
        process_tree.stop_processes(process_tree.without_torch_shm_manager(list(averagers)))
    return {
        "codec": codec,
        "peers": peers,
        "rounds": outcomes,
        "residuals": [ef.residual if ef is not None else None for ef in feedback],
        "owed": owed,  # each peer's Δ of its last rounds, if they applied nothing
        "sent": [phases["allreduce"]["sent"] for phases in traffic],  # the all-reduce's
        "received": [phases["allreduce"]["received"] for phases in traffic],
        "by_phase": traffic,  # p2p_diloco.traffic's, every phase
        "peer_ids": [node.dht.peer_id.to_base58() for node in nodes],
        "banned": banned,
    }


def assistance_request(shapes: list, codec: str, rule: AggregationRule) -> AssistanceRequest:
    """What the case's peers would ask of a bootstrap node: its assistant joins their groups."""
    return AssistanceRequest(run="exact", fingerprint="f" * 64, shapes=[list(shape) for shape in shapes],
                             matchmaking_time=CFG.matchmaking_time, request_timeout=CFG.request_timeout,
                             allreduce_timeout=CFG.allreduce_timeout, next_chunk_timeout=CFG.next_chunk_timeout,
                             codec=codec, aggregation=rule.name, clip_factor=rule.clip_factor,
                             clip_iterations=rule.clip_iterations, trim_fraction=rule.trim_fraction,
                             claim_cap=rule.claim_cap, norm_clip=rule.norm_clip, drop_opposed=rule.drop_opposed,
                             time=time.time())


def average_round(syncs: list[OuterSync], feedback: list, owed: list, indices: list[int], round_: dict,
                  samples: list[int], step: int, assistant: Optional[Assistant] = None) -> dict:
    """One round toward outer step `step` + 1, each peer in a thread of its own, as the training loop runs
    it, and the assistant's (if any) in another."""
    peers = len(syncs)
    step = round_.get("outer_step", step)
    for sync in syncs:
        sync.cfg = dataclasses.replace(CFG, relay_group_size=round_.get("relay_group", 0))
    results: list = [None] * peers
    errors: list = [None] * peers
    to_send: list = [None] * peers

    def average(i: int) -> None:
        delta = round_["inputs"][i]
        if owed[i] is not None:
            delta = [d + o for d, o in zip(delta, owed[i])]
        ef = feedback[i]
        to_send[i] = ef.compensate(indices, delta) if ef is not None else delta
        time.sleep(round_.get("delays", [0.0] * peers)[i])
        try:
            results[i] = syncs[i].average(pending(to_send[i], round_.get("hand_over", [None] * peers)[i]), samples[i],
                                          outer_step=step, global_sha256=round_["starts"][i],
                                          membership=planned(syncs, round_.get("leaders"), round_.get("members")))
        except RoundFailed as e:  # reported to the test; the Δ stays owed
            owed[i], errors[i] = delta, repr(e)
            return
        except Exception as e:
            errors[i] = repr(e)
            return
        owed[i] = None
        if ef is not None:
            ef.commit(indices, to_send[i], results[i].sent)

    threads = [threading.Thread(target=average, args=(i,), daemon=True) for i in range(peers)]
    if assistant is not None:
        threads.append(threading.Thread(target=assistant.reduce_round, args=(step, round_["starts"][0], peers),
                                        daemon=True))
    for t in threads:
        t.start()
    deadline = time.monotonic() + ROUND_WAIT_S
    for i, t in enumerate(threads):
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            raise TimeoutError(f"peer {i}: no result within {ROUND_WAIT_S} s in round {step}")
    digests = [s.averager.round_digests(r.tokens[s.peer_id], timeout=10) if r is not None else None
               for s, r in zip(syncs, results)]
    return {
        "digests": [dataclasses.asdict(d) if d is not None else None for d in digests],
        "means": [r.mean if r is not None else None for r in results],
        "mean_sha256": [tensors_sha256(r.mean) if r is not None else None for r in results],
        "group_size": [r.group_size if r is not None else None for r in results],
        "group_samples": [r.group_samples if r is not None else None for r in results],
        "errors": errors,
        "to_send": to_send,
        "counted": [r.sent if r is not None else None for r in results],
        "carried": [r.carried if r is not None else None for r in results],
        "phases": [r.phases if r is not None else None for r in results],
    }


def pending(to_send: list, hand_over) -> "list | PendingDelta":
    """`to_send` as a peer's inner loop gives it to a round: at once (`hand_over` None), or to a round that
    begins without it, handed over `hand_over` seconds later or abandoned (``"abandon"``) after 0.5 s."""
    if hand_over is None:
        return to_send
    delta = PendingDelta()
    if hand_over == "abandon":
        threading.Timer(0.5, delta.abandon).start()
    else:
        threading.Timer(hand_over, delta.hand_over, args=(to_send,)).start()
    return delta


DEAD_PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # a well-formed peer ID that no node here holds


def planned(syncs: list[OuterSync], leaders: Optional[list], members: Optional[list] = None) -> Optional[Membership]:
    """The membership plan `leaders` names (peer indices, or "dead"), with the peers `members` (indices;
    every peer of the case if None)."""
    if leaders is None:
        return None
    members = range(len(syncs)) if members is None else members
    return Membership(tuple(DEAD_PEER if leader == "dead" else syncs[leader].peer_id for leader in leaders),
                      members=tuple(sorted(syncs[i].peer_id for i in members)))


def summary(result: dict) -> dict:
    """`result` less its tensors, for the JSON line."""
    tensors = ("means", "to_send", "counted", "carried")
    return {**{k: v for k, v in result.items() if k not in ("rounds", "residuals", "owed")},
            "rounds": [{k: v for k, v in r.items() if k not in tensors} for r in result["rounds"]]}


def main() -> None:
    runs, case_dir = sys.argv[1].split(","), Path(sys.argv[2])
    setup_logging(verbose=False)  # the peers' lines, as a peer logs them: the test shows them when a case fails
    # killed (on timeout), this process takes its DHT, averager and p2pd processes with it
    process_tree.children_exit_with_this_process()
    case = torch.load(case_dir / "inputs.pt")
    results = average_rounds(runs, case)
    torch.save(results, case_dir / "result.pt")
    print(json.dumps({run: summary(result) for run, result in results["runs"].items()}), flush=True)


if __name__ == "__main__":
    main()
