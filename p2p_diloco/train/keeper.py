"""The run's keeper: a member of the run that follows its state step by step, serves it, and never trains.

A bootstrap node started with ``--keep RUN.toml`` (:func:`p2p_diloco.node_runner.run_bootstrap`) runs one. It
decides as every peer does (:func:`p2p_diloco.protocol.decide.next_move`) and loads the state a move targets with
the same checks (:mod:`p2p_diloco.train.state_loading`), so which state it keeps is decided by the peers' records,
never by the node; it acts on a load only. Its progress record says KEEPING: it vouches for the state it holds, and
nobody waits for it or averages with it (:func:`p2p_diloco.protocol.view.averages`). It serves its state to
joiners as any donor does, takes the state an unreachable peer pushes to it (nobody can dial such a peer to
download it), writes the state to the run's checkpoint store every ``swarm.checkpoint_every`` outer steps, and
evaluates θ_global on the held-out sequences as peers do (docs/design.md, "The run's keeper").
"""

from __future__ import annotations

from typing import Optional

from p2p_diloco.protocol.decide import LOAD
from p2p_diloco.protocol.plans import RoundPlan
from p2p_diloco.protocol.view import KEEPING
from p2p_diloco.sync.state_transfer import GlobalState, StateExpectation
from p2p_diloco.train.checkpointing import KEEP_POLL_S
from p2p_diloco.train.member import RunMember


class Keeper(RunMember):
    """The run's keeper (see the module); constructed as any :class:`~p2p_diloco.train.member.RunMember`."""

    idle_phase = KEEPING
    takes_pushed_states = True

    def keep(self) -> None:
        """Keep the run's state until stopped, as its keeper: follow the run step by step (each state it loads
        is one the run's records vouch for, checked as any peer checks it: train/state_check.py), serve it to
        joiners like any donor, and write it to the checkpoint store every ``swarm.checkpoint_every`` outer
        steps. Its progress record says KEEPING: it vouches for the state it holds, nobody waits for it or
        averages with it, and it never trains."""
        try:
            self._join()
            while not self._stopping():
                records = self.progress.fetch()
                move = self._next_move(records)  # only a load concerns a keeper: it never trains
                if move.action == LOAD and self._load_from_peers(move.load, records):
                    self._store_step()
                    self._evaluate_global()
                self.stop_event.wait(KEEP_POLL_S)
        finally:
            self._leave()

    def _say_loading(self, plan: RoundPlan) -> None:
        """Nobody waits for a keeper: its record keeps the state it holds until the new one is checked."""
        self.progress.publish(self.global_model.outer_step, self.sha256, KEEPING)

    def _pushed_state(self, expected: StateExpectation) -> Optional[GlobalState]:
        """The state an unreachable peer pushed, if it is `expected`: taken first, as one more donor's offer."""
        return self.sync.averager.take_pushed_state(expected)
