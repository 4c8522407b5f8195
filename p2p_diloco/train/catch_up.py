"""A peer behind the run that can get no state waits for one, bounded; it never starts a second history.

Volunteers come and go, and a run can be left by all its peers for a while. A newcomer that then
trained from its freshly initialised weights would take outer steps 1, 2, 3 ... alone, under the
run's name and step numbers, with other hashes: a second history of the run, whose work is thrown
away as soon as a peer with the real state returns, or which silently restarts the run if none does
(issue 21: a newcomer a few seconds after the run's 2 peers left took steps 1–3 alone).

So a peer that sees the run ahead of its own step (a record at a later outer step, of a peer live or
gone, read while the DHT held it and remembered after it expired:
:meth:`~p2p_diloco.swarm.progress.SwarmProgress.history`) and
has no live peer at its own step to average with (a keeper there is none: it never averages) does
not train: it tries again to load the run's state from peers (and from the run's checkpoint store,
where it has one), every few seconds, for at most ``swarm.state_wait_timeout``; then it stops with
one line that says what it saw and what to do (:class:`NoStateSource`, exit status 5). Training from
scratch is for a run with no history.

Records are signed but anyone can write one: a single identity that claims a later outer step
makes the first peer of a new run wait and stop the same way, from the moment a peer reads it, even
once it has expired. That costs a run its start, never its state; it is listed in docs/security.md.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from p2p_diloco.protocol.view import RunHistory

logger = logging.getLogger(__name__)

POLL_S = 5.0  # between two attempts at the run's state while waiting


class NoStateSource(RuntimeError):
    """The run is ahead of this peer and nothing served its state within ``swarm.state_wait_timeout``."""


class CatchUpWait:
    """How long this peer has been behind with no state source, and the bound on it (see the module's
    docstring)."""

    def __init__(self, run_name: str, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.run_name = run_name
        self.timeout_s = timeout_s
        self.clock = clock
        self.waiting_since: Optional[float] = None

    def reset(self) -> None:
        """This peer has a state source again (it trains with peers at its step, or loaded the run's state)."""
        self.waiting_since = None

    def wait(self, own_step: int, history: RunHistory, store: str = "") -> None:
        """One more wait for the run's state: logs the first; raises :class:`NoStateSource` once the waits
        have lasted ``timeout_s``. `store` names the run's checkpoint store, if it has one (for the line)."""
        now = self.clock()
        if self.waiting_since is None:
            self.waiting_since = now
            logger.warning("the run %r is at outer step %d and this peer at %d, but nothing served the run's state: "
                           "not training (it would start a second history of the run); trying again for up to "
                           "%.0f s", self.run_name, history.outer_step, own_step, self.timeout_s)
        if now - self.waiting_since >= self.timeout_s:
            raise NoStateSource(
                f"the run {self.run_name!r} is at outer step {history.outer_step} ({history.peers} peer record(s), "
                f"the newest {history.age_s:.0f} s old) and this peer at {own_step}, but "
                + (f"neither a peer nor the checkpoint store {store} served" if store else
                   "no peer served (and no checkpoint store is configured: swarm.checkpoint_store)")
                + f" the run's state within {self.timeout_s:.0f} s. Not training from outer step {own_step}: that "
                f"would start a second history of the run. Start again once a peer of the run is up, or name a "
                f"checkpoint store that holds the run's state.")
