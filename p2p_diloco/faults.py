"""Fault injection for the fault tests and the churn benchmark, off unless P2P_DILOCO_FAULTS is set.

The faults themselves are real (the tests SIGKILL, SIGSTOP or SIGTERM the process); these knobs only
widen the window of a phase so that a test can hit it reliably, or make a peer slow:

  P2P_DILOCO_FAULTS="inner_step_delay=0.2,allreduce_delay=4,allreduce_delay_round=2,serve_state_delay=4"

* ``inner_step_delay``: seconds slept after every inner step (a slow volunteer);
* ``allreduce_delay``: seconds this peer, as a reducer, waits before replying with averaged parts,
  in its ``allreduce_delay_round``-th all-reduce only (default: the first), so that its groupmates
  sit mid all-reduce waiting on it; "fault injection: pausing mid all-reduce" is logged first;
* ``allreduce_send_delay``: seconds this peer, as a sender, waits after it sent its first part to a
  reducer, in the same round (for a peer that reduces nothing: an unreachable client);
* ``join_answer_delay``: seconds this peer, as a planned leader, holds its acceptance of a join request
  before it answers (and holds its matchmaking lock meanwhile), as a member whose event loop stalls
  sees a prompt answer;
* ``serve_state_delay``: seconds a donor pauses after it sent the first part of its state to a
  joiner, so that a kill lands mid-transfer ("fault injection: pausing mid state transfer" is
  logged first).
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)

KNOWN = ("inner_step_delay", "allreduce_delay", "allreduce_send_delay", "allreduce_delay_round", "serve_state_delay",
         "join_answer_delay")


def _parse(spec: str) -> dict[str, float]:
    faults = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, value = item.partition("=")
        if name not in KNOWN:
            raise ValueError(f"P2P_DILOCO_FAULTS: unknown fault {name!r}; known: {', '.join(KNOWN)}")
        faults[name] = float(value)
    return faults


ACTIVE = _parse(os.environ.get("P2P_DILOCO_FAULTS", ""))


def allreduce_pause_s(round_index: int, role: str = "reducer") -> float:
    """The pause to inject into this process's `round_index`-th all-reduce (1-based) as a "reducer" or a
    "sender", or 0."""
    if round_index != int(ACTIVE.get("allreduce_delay_round", 1)):
        return 0.0
    return ACTIVE.get("allreduce_delay" if role == "reducer" else "allreduce_send_delay", 0.0)


def after_inner_step() -> None:
    if "inner_step_delay" in ACTIVE:
        time.sleep(ACTIVE["inner_step_delay"])


def join_answer_pause_s() -> float:
    """The pause a planned leader takes before it answers a join request it accepts, or 0."""
    return ACTIVE.get("join_answer_delay", 0.0)


def serve_state_pause_s() -> float:
    """The pause a donor takes mid-transfer, or 0."""
    pause = ACTIVE.get("serve_state_delay", 0.0)
    if pause:
        logger.warning("fault injection: pausing mid state transfer for %.1f s", pause)
    return pause
