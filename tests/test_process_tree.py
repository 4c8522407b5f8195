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
