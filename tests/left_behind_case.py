"""A peer whose group averaged without it, in a process of its own (tests/test_round_sync.py).

    python -m tests.left_behind_case

Two DHT nodes on 127.0.0.1 with signed progress records, both ready at outer step 3 with the same
state: "me" with a real :class:`OuterSync` (its averager process), "other" a node alone, as a peer
that has already gone into a group of its own. Once "me" has planned its membership (both peers,
and so both of them leaders), the other peer's record moves on to step 4, as after averaging without
"me". It prints the outcome of me's :class:`RoundSync` as one JSON line. It runs in a process of its
own for the reason tests/allreduce_case.py does (an averager forked from the pytest process), and
stops what it started before it exits.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading

import torch

from p2p_diloco import process_tree
from p2p_diloco.node_runner import setup_logging
from p2p_diloco.swarm.node import start_run_node, visible_maddrs
from p2p_diloco.swarm.progress import READY, TRAINING, SwarmProgress
from p2p_diloco.sync.outer_sync import OuterSync
from p2p_diloco.train.round_sync import RoundSync
from tests.allreduce_case import CFG
from tests.swarm_helpers import wait_until

FINGERPRINT = hashlib.sha256(b"settings").hexdigest()
STATE, NEXT = "5" * 64, "6" * 64
PLANNED_S = 60.0  # for "me" to read both records and plan


class Planned(logging.Handler):
    """Set once round_sync logs its membership plan."""

    def __init__(self):
        super().__init__()
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "ready to average" in record.getMessage():
            self.event.set()


def main() -> None:
    setup_logging(verbose=False)
    process_tree.children_exit_with_this_process()
    nodes, progress, sync = [], [], None
    try:
        nodes.append(start_run_node("test", "127.0.0.1", 0))
        nodes.append(start_run_node("test", "127.0.0.1", 0, initial_peers=visible_maddrs(nodes[0].dht)))
        progress = [SwarmProgress(n.dht, "test", 30.0, n.identity.record_subkey, FINGERPRINT) for n in nodes]
        sync = OuterSync(nodes[0].dht, "test", FINGERPRINT, nodes[0].identity.record_subkey, [torch.Size([8])], CFG,
                         state_provider=lambda: ({}, []))
        for p in progress:
            p.publish(3, STATE, TRAINING)  # a peer's phases follow protocol.phases.TRANSITIONS
            p.publish(3, STATE, READY)
        other = nodes[1].dht.peer_id.to_base58()  # records are stored in the background: "me" reads the other's
        wait_until(lambda: other in progress[0].fetch(), PLANNED_S, "the other peer's record", poll_s=0.1)
        planned = Planned()
        logging.getLogger("p2p_diloco.train.round_sync").addHandler(planned)
        me = nodes[0].dht.peer_id.to_base58()
        outcome = {}
        round_sync = RoundSync(progress[0], sync, me, "direct", 30.0, threading.Event())
        thread = threading.Thread(target=lambda: outcome.update(r=round_sync(3, 0, [torch.ones(8)], 4, STATE)))
        thread.start()
        if planned.event.wait(PLANNED_S):
            progress[1].publish(4, NEXT, TRAINING)  # the other peer averaged without this one
        thread.join()
        result = outcome.get("r")
        print(json.dumps(dict(planned=planned.event.is_set(), event=result and result.event,
                              reason=result and result.reason)), flush=True)
    finally:
        children = process_tree.descendant_pids(os.getpid())  # the DHT and averager processes, p2pd
        if sync is not None:
            sync.shutdown()
        for p in progress:
            p.close()
        for node in nodes:
            node.dht.shutdown()
        process_tree.stop_processes(process_tree.without_torch_shm_manager(children))


if __name__ == "__main__":
    main()
