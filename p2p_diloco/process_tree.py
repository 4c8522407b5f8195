"""Finding and stopping the processes a node started: hivemind's DHT and averager processes and p2pd.

hivemind stops its own children on a clean shutdown, but not always in time: `DHT.shutdown` and
`DecentralizedAverager.shutdown` fall back to `Process.terminate()` after a grace period and do not
wait for the result, and a DHT process that is terminated that way leaves its p2pd daemon running.
A node that leaves must leave nothing behind, so it snapshots its descendants before shutting down
and makes sure each of them is gone afterwards (:func:`stop_processes`).

A node that is SIGKILLed (the OOM killer, a volunteer's `kill -9`) cannot do that, and hivemind's
children have no parent-death signal: the DHT process would go on answering as a DHT node and the
averager process would go on joining groups for a peer that no longer exists.
:func:`children_exit_with_this_process` makes every multiprocessing child watch its parent and,
when the parent is gone, stop its own children (p2pd) and exit.

A stop meant for the node must reach its main process alone: Ctrl+C and `kill -- -PGID` signal the
whole process group, and a DHT process or p2pd that died of it left the main process waiting for
answers that never came, too late to publish its last records. So each child leaves its parent's
process group (p2pd, started by the DHT process, goes with it) and stops only when its parent says
so, when the parent is gone, or on a SIGTERM of its own, and then takes its children along. torch's
shared-memory manager ignores both signals: it exits once its clients are gone.

Linux only (reads /proc); elsewhere nothing is found and nothing is watched.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import signal
import threading
import time
from collections import defaultdict
from pathlib import Path

logger = logging.getLogger(__name__)

#: the command name of torch's shared-memory manager (truncated to 15 characters by the kernel)
TORCH_SHM_MANAGER = "torch_shm_manag"


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state, ppid, ...), or None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_ticks(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (field 22 of /proc/PID/stat), or None if it
    is gone: a PID with the same start ticks is the same process, not a later reuse of the PID."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields is not None else None


def cpu_seconds(pids) -> float:
    """The CPU time (user and system, fields 14 and 15 of /proc/PID/stat) that the processes `pids` have
    used so far, summed over them and all their threads; a process that is gone counts 0."""
    ticks = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def command_name(pid: int) -> str:
    """The process's command name (at most 15 characters, as the kernel keeps it), or "" if it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def descendant_pids(pid: int) -> list[int]:
    """Every live process below `pid` in the process tree, children before grandchildren."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        fields = _stat_fields(int(entry)) if entry.isdigit() else None
        if fields is not None:
            children[int(fields[1])].append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        below = children.get(frontier.pop(0), [])
        found += below
        frontier += below
    return found


def is_running(pid: int) -> bool:
    """True if `pid` exists and is not a zombie (an exited process whose parent has not reaped it)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def without_torch_shm_manager(pids: list[int]) -> list[int]:
    """`pids` less torch's shared-memory manager (started by hivemind's shared tensors): once its
    clients are gone it unlinks their /dev/shm segments and exits by itself, about 2 s later; stopped
    earlier, it would leave the segments behind."""
    return [pid for pid in pids if command_name(pid) != TORCH_SHM_MANAGER]


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Wait up to `timeout_s` for `pids` to exit by themselves; returns those still running."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = [pid for pid in pids if is_running(pid)]
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(0.05)


def stop_processes(pids: list[int], grace_s: float = 3.0) -> None:
    """Give `pids` `grace_s` seconds to exit, then SIGTERM the rest, then SIGKILL what still runs."""
    running = wait_gone(pids, grace_s)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not running:
            return
        logger.warning("stopping %d child process(es) (%s) with %s", len(running), ", ".join(map(str, running)),
                       sig.name)
        for pid in running:
            try:
                os.kill(pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        running = wait_gone(running, 2.0)


def kill_tree(pid: int) -> list[int]:
    """SIGKILL a process and every process below it, as a crash of the whole tree would, and return
    the descendants it had (snapshotted first). torch's shared-memory manager is spared (see
    :func:`without_torch_shm_manager`): use :func:`wait_gone` on the returned PIDs to see the whole
    tree gone.
    """
    below = descendant_pids(pid)
    for target in [pid, *without_torch_shm_manager(below)]:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return below


PARENT_CHECK_PERIOD_S = 1.0
_watching = False


def _exit_with_children(code: int) -> None:
    stop_processes(descendant_pids(os.getpid()), grace_s=0.0)
    os._exit(code)


def _child_of_this_process(_registry_key: object) -> None:
    """Runs in each forked multiprocessing child: out of the parent's process group, SIGINT ignored (a
    Ctrl+C is the parent's to handle), SIGTERM ends it with its children (no orphaned p2pd), and a
    thread ends it likewise once its parent is gone."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, _frame: _exit_with_children(128 + signum))
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_PERIOD_S)
        logger.warning("parent process %d is gone: stopping this process (%d) and its children", parent, os.getpid())
        _exit_with_children(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _start_torch_shm_manager() -> None:
    """Start torch's shared-memory manager now (hivemind's shared tensors start it otherwise) with SIGINT
    and SIGTERM ignored, which it keeps through exec: a service manager's stop signals every process
    of the unit at once, and a manager dead of it made this process abort (std::terminate) when it
    freed its next shared tensor. The manager exits by itself once its clients are gone."""
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers: torch starts it when first needed, as before
    import torch
    import torch.multiprocessing

    strategy = torch.multiprocessing.get_sharing_strategy()
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        torch.multiprocessing.set_sharing_strategy("file_system")  # hivemind's: the one that needs the manager
        torch.empty(1).share_memory_()
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _RegistryKey:
    """multiprocessing keeps after-fork hooks in a weak dictionary: this object keeps ours alive."""


_registry_key = _RegistryKey()


def children_exit_with_this_process() -> None:
    """Make every multiprocessing child forked from now on exit (and stop its children) when this
    process dies, however it dies, and keep signals to this process's group from reaching them (see
    the module docstring). Call it once, before hivemind starts its processes."""
    global _watching
    if _watching or not os.path.isdir("/proc"):
        return
    multiprocessing.util.register_after_fork(_registry_key, _child_of_this_process)
    _start_torch_shm_manager()
    _watching = True
