"""A peer's phase in the round protocol, and the transitions between phases.

A peer says where it is in a progress record (:mod:`p2p_diloco.swarm.progress`); every other peer plans
its rounds from those records (:mod:`p2p_diloco.protocol.view`). The phase is one of :class:`Phase`, and
a peer moves from one to the next only along :data:`TRANSITIONS`: its one publisher
(:meth:`p2p_diloco.swarm.progress.SwarmProgress.publish`) refuses any other move, so a reader can trust
that a record's phase is one the protocol allows after the last.

::

    (start) ──► TRAINING ──announce──► READY ──agreed──► COMMITTING ──applied──► TRAINING at t + 1
                                        │  ▲
                                        └──┘ planned: the same record, naming the leader it asks first
                  │  ▲                     │                  │
                  │  ├──failed or skipped──┘                  │
                  │  ├──voided by the update check────────────┘
                  │  │
                  └─► LOADING (a newer or the agreed state; also from READY and COMMITTING after a round that
                              applied nothing; back to TRAINING, at its own state if the load failed)
    (start) ──► KEEPING  (the run's keeper: it follows the run and serves its state, never trains)
    any phase ──► LEFT
"""

from __future__ import annotations

from enum import Enum
from typing import Optional


class Phase(str, Enum):
    """Where a peer is in the round toward its next outer step (the values are the records' strings)."""

    TRAINING = "training"  # inner steps toward outer step t + 1 from its state at t
    READY = "ready"  # it announced its pseudo-gradient for t + 1, and its round's sync runs
    # its group agreed on the round's mean (the reports matched, every reducer passed its audit): it applies it
    # (the update check, its overlap steps) and says TRAINING at t + 1 next
    COMMITTING = "committing"
    LOADING = "loading"  # it downloads the run's state at t (its sha256 is not that state's yet)
    KEEPING = "keeping"  # the run's keeper: it holds the state at t and serves it, never trains
    LEFT = "left"  # its last word


TRANSITIONS: dict[Optional[Phase], frozenset[Phase]] = {
    None: frozenset({Phase.TRAINING, Phase.KEEPING, Phase.LEFT}),
    Phase.TRAINING: frozenset({Phase.TRAINING, Phase.READY, Phase.LOADING, Phase.LEFT}),
    # READY again: the same record with the leader it asks first (its membership plan)
    Phase.READY: frozenset({Phase.TRAINING, Phase.READY, Phase.COMMITTING, Phase.LOADING, Phase.LEFT}),
    Phase.COMMITTING: frozenset({Phase.TRAINING, Phase.LOADING, Phase.LEFT}),  # LOADING: after a void round
    Phase.LOADING: frozenset({Phase.TRAINING, Phase.LOADING, Phase.LEFT}),
    Phase.KEEPING: frozenset({Phase.KEEPING, Phase.LEFT}),
    Phase.LEFT: frozenset({Phase.LEFT}),
}


class IllegalTransition(ValueError):
    """A peer tried to publish a phase that does not follow its last one (a bug, never a peer's input)."""


def check_transition(old: Optional[str], new: str) -> Phase:
    """`new` as a :class:`Phase`, if a peer whose last published phase is `old` (None: none yet) may move to
    it; else :class:`IllegalTransition`."""
    before = None if old is None else Phase(old)
    after = Phase(new)
    if after not in TRANSITIONS[before]:
        allowed = ", ".join(sorted(p.value for p in TRANSITIONS[before]))
        raise IllegalTransition(f"a peer in phase {old!r} cannot move to {new!r} (allowed: {allowed})")
    return after
