"""Inner steps that a user's own training loop runs: the driver's step source for :class:`p2p_diloco.DiLoCo`.

The driver (:class:`~p2p_diloco.train.diloco.DiLoCoPeer`) asks its step source for one inner step at a time
(``inner.step() -> (loss, samples)``). The CLI's source is :class:`~p2p_diloco.train.inner.InnerTrainer`, which
computes the step itself; this one hands the model to the user's thread instead and waits until that thread
says it took a step (``DiLoCo.step``). The two threads take turns, never run together:

* while the user's thread computes an inner step, the driver waits inside :meth:`UserLoop.step`;
* while the driver works between two inner steps (it plans a round, loads the run's state, applies an outer
  step to the model's parameters), the user's thread waits inside :meth:`UserLoop.took_step`.

So the driver changes the model's parameters only between two of the user's steps, exactly where the CLI's
driver does, and the rest of the round (the sync, in its own thread) is the same for both. A turn costs two
condition-variable hand-offs (benchmarks/library_step.py measures it).
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

TURN_POLL_S = 0.1  # how often a waiting side looks whether the other has stopped (a stop event, an error)


class LoopEnded(Exception):
    """The user's loop is over (the ``with`` block exited, or the driver is stopping): no more inner steps."""


class DriverStopped(RuntimeError):
    """The driver has ended: the user's loop cannot hand it another inner step."""


class UserLoop:
    """The step source of a peer whose inner steps the user's loop runs (see the module).

    `optimizer` is the user's inner optimizer: a checkpoint keeps its state, as it keeps the CLI's AdamW.
    The inner steps' learning-rate schedule is the user's own: :meth:`fast_forward_schedule` (after a joiner
    loads the run's state) moves only the count of inner steps, which ``DiLoCo.inner_steps`` shows.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, stop_event: threading.Event):
        self.optimizer = optimizer
        self.device = next(model.parameters()).device
        self.micro_batch_size = 1  # a held-out evaluation's batch (the library runs none)
        self.batches = None  # the user's loop reads its own data
        self.steps_done = 0
        self._stop = stop_event
        self._turn = threading.Condition()
        self._users_turn = False
        self._report: tuple[Optional[float], int] = (None, 0)
        self._ended: Optional[str] = None  # why the driver ended, once it has

    @property
    def lr(self) -> float:
        """The learning rate of the optimizer's first parameter group, as the user's schedule left it."""
        return float(self.optimizer.param_groups[0]["lr"])

    def fast_forward_schedule(self, steps: int) -> None:
        """A loaded state's count of inner steps, never back (the user's schedule is the user's own)."""
        self.steps_done = max(self.steps_done, int(steps))

    # ----- the driver's side -------------------------------------------------------------------------
    def step(self) -> tuple[Optional[float], int]:
        """Hand the model to the user's loop and wait for its next inner step: its (loss, samples). Raises
        LoopEnded when the loop ends first (the stop event is set)."""
        with self._turn:
            self._users_turn = True
            self._turn.notify_all()
            while self._users_turn:
                if self._stop.is_set():
                    raise LoopEnded("the training loop has left the swarm")
                self._turn.wait(TURN_POLL_S)
            loss, samples = self._report
        self.steps_done += 1
        return loss, samples

    def ended(self, reason: str) -> None:
        """The driver has stopped (`reason`): a waiting or later :meth:`took_step` raises DriverStopped."""
        with self._turn:
            self._ended = reason
            self._turn.notify_all()

    # ----- the user's side ---------------------------------------------------------------------------
    def wait_for_turn(self) -> None:
        """Wait until the driver asks for an inner step (raises DriverStopped if it ends first)."""
        with self._turn:
            while not self._users_turn:
                if self._ended is not None:
                    raise DriverStopped(self._ended)
                self._turn.wait(TURN_POLL_S)

    def took_step(self, samples: int, loss: Optional[float]) -> None:
        """The user's loop took one inner step over `samples` samples: hand the model back to the driver and
        wait until it asks for the next one (an outer step, a load or a sync may run meanwhile)."""
        with self._turn:
            if not self._users_turn:  # the driver ended, or is not waiting for a step yet
                if self._ended is not None:
                    raise DriverStopped(self._ended)
                raise RuntimeError("DiLoCo.step() called before the peer joined: use it inside `with DiLoCo(...)`")
            self._report = (loss, samples)
            self._users_turn = False
            self._turn.notify_all()
        self.wait_for_turn()
