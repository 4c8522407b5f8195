"""p2p_diloco/process_tree.py's reading of /proc: the CPU time of a set of processes (the all-reduce
benchmark's "CPU busy")."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from p2p_diloco.process_tree import cpu_seconds

BUSY_CHILD = "while True: pass"


@pytest.mark.timeout(60)
def test_cpu_seconds_grow_while_a_process_works_and_a_gone_one_counts_nothing():
    child = subprocess.Popen([sys.executable, "-c", BUSY_CHILD])
    try:
        first = cpu_seconds([child.pid])
        deadline = time.monotonic() + 30  # a bound on the wait, not a threshold: one clock tick is enough
        while cpu_seconds([child.pid]) <= first and time.monotonic() < deadline:
            time.sleep(0.05)
        working = cpu_seconds([child.pid])
        assert working > first
        # summed over the processes named: this one, which started the child, has used CPU too
        assert cpu_seconds([os.getpid(), child.pid]) > working
    finally:
        child.kill()
        child.wait(10)
    assert cpu_seconds([child.pid]) == 0.0  # gone (reaped): it counts 0, it does not raise


class StoppedDHT:
    """Stands for a hivemind DHT at shutdown_dht's first call: only whether it was shut down matters here."""

    def __init__(self):
        self.stopped = False

    def shutdown(self) -> None:
        self.stopped = True


@pytest.mark.timeout(60)
def test_a_library_peer_stops_what_it_started_and_nothing_under_its_callers_processes():
    """The caller's child started before the peer (`keep`), and a grandchild that child starts later (its own DHT,
    say), live on; a child that is the peer's own does not."""
    from p2p_diloco.process_tree import descendant_pids, is_running
    from p2p_diloco.stopping import shutdown_dht

    spawns_later = ("import subprocess, sys, time; time.sleep(0.5); "
                    f"subprocess.Popen([sys.executable, '-c', {BUSY_CHILD!r}]); time.sleep(120)")
    callers = subprocess.Popen([sys.executable, "-c", spawns_later])
    keep = set(descendant_pids(os.getpid()))
    ours = subprocess.Popen([sys.executable, "-c", BUSY_CHILD])
    try:
        deadline = time.monotonic() + 30
        while not descendant_pids(callers.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        (grandchild,) = descendant_pids(callers.pid)
        dht = StoppedDHT()
        shutdown_dht(dht, keep=keep)
        assert dht.stopped and ours.wait(10) is not None
        assert callers.poll() is None and is_running(grandchild)
    finally:
        for pid in descendant_pids(callers.pid):
            os.kill(pid, 9)
        callers.kill()
        ours.kill()
        callers.wait(10)
        ours.wait(10)
