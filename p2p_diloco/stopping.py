"""How a node stops cleanly (bootstrap, peer, status, env): SIGINT and SIGTERM set an event that the node
waits on, the DHT stops together with every process the node started, and the interpreter exits without
its final garbage collections."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Iterable

from p2p_diloco.logs import flush_child_logs

logger = logging.getLogger("p2p_diloco")


def install_stop_handlers(why: str = "") -> threading.Event:
    """SIGINT and SIGTERM set the returned event, logging `why` a signal may have come; a second signal
    exits at once. Signals are counted, not the event: a peer that is already leaving for another reason
    (an error; the event is set as it leaves) still leaves cleanly on the first signal (torchrun sends it
    to an island's rank 0 as a dead rank's collective fails there)."""
    stop = threading.Event()
    received: list[int] = []

    def handle(signum, _frame):
        if received:
            os._exit(128 + signum)
        received.append(signum)
        logger.info("received %s: leaving the swarm%s", signal.Signals(signum).name, why)
        stop.set()

    signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGTERM, handle)
    return stop


def shutdown_dht(dht, keep: Iterable[int] = ()) -> None:
    """Stop the DHT (and with it p2pd), then make sure no process this node started is left running: every
    process under this one but torch's shared-memory manager, `keep` (those that ran before the node started: a
    library peer's caller may have processes of its own) and whatever runs under those now. A library peer's
    caller whose own child started a DHT of its own after this node did had that DHT killed by this node's close
    (tests/test_library.py: the late peer's "the DHT process is gone", once in 20 runs beside a busy core)."""
    from p2p_diloco.process_tree import descendant_pids, stop_processes, without_torch_shm_manager

    kept = set(keep)
    for pid in list(kept):
        kept.update(descendant_pids(pid))
    children = [pid for pid in without_torch_shm_manager(descendant_pids(os.getpid())) if pid not in kept]
    dht.shutdown()
    stop_processes(children)
    flush_child_logs()  # their last lines, on a terminal (p2p_diloco.logs)


def skip_final_garbage_collection() -> None:
    """Let the interpreter exit without its final garbage collections over every object that torch,
    transformers and hivemind have made: they took 2-3 s after a peer had already stopped (more on a
    loaded machine), while a leaving peer must be gone within seconds. Files and sockets are closed by
    then; the operating system frees the memory."""
    import gc

    gc.freeze()
