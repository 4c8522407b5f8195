"""What a person watching a peer sees between two outer steps: the inner steps toward the next sync.

Between two outer steps a peer may compute for minutes (H = 500 inner steps of a 150M model). On a
terminal a progress bar shows the round's inner steps, the mean loss so far, tokens per second and
the time left until the sync (tqdm's remaining-time estimate); log lines written meanwhile appear
above the bar, not through it. When stdout is not a terminal (a log file, a pipe, systemd) a log line
every ``interval_s`` seconds says the same.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
import time
from typing import Callable, Optional, TextIO

logger = logging.getLogger(__name__)


class InnerProgress:
    """The DiLoCo loop calls :meth:`start_round` when a round's inner steps begin, :meth:`step` after
    each, :meth:`syncing` when they are done and the sync runs, :meth:`close` when the peer leaves."""

    def __init__(self, stream: Optional[TextIO] = None, tty: Optional[bool] = None, interval_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.interval_s = interval_s
        self.clock = clock
        self._bar = None
        self._redirect: Optional[contextlib.ExitStack] = None
        self._next_log = clock() + interval_s
        self.outer_step = 0
        self.total = self.done = 0
        self.steps_while_syncing: Optional[int] = None  # None until the round's sync starts
        self._loss_sum, self._losses, self._tokens, self._started = 0.0, 0, 0, clock()

    # ----- what the loop reports --------------------------------------------------------------
    def start_round(self, outer_step: int, total_steps: int, done: int = 0) -> None:
        """Inner steps toward outer step `outer_step + 1`: `total_steps` of them, `done` already run
        (during the last sync)."""
        self.outer_step, self.total, self.done = outer_step, total_steps, done
        self.steps_while_syncing = None
        self._loss_sum, self._losses, self._tokens, self._started = 0.0, 0, 0, self.clock()
        if self.tty:
            self._open_bar()

    def step(self, loss: float, tokens: int) -> None:
        if self.steps_while_syncing is not None:  # overlapped with the sync: they count toward the next round
            self.steps_while_syncing += 1
            if self._bar is not None:
                self._bar.set_description_str(self._syncing_text(), refresh=True)
            return
        self.done += 1
        self._loss_sum += loss
        self._losses += 1
        self._tokens += tokens
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(), refresh=False)
            self._bar.update(1)
        elif not self.tty and self.clock() >= self._next_log:
            self._next_log = self.clock() + self.interval_s
            logger.info("%s", self.describe())

    def syncing(self) -> None:
        self.steps_while_syncing = 0
        if self._bar is not None:
            self._bar.set_description_str(self._syncing_text())

    def _syncing_text(self) -> str:
        ahead = f", {self.steps_while_syncing} inner steps meanwhile" if self.steps_while_syncing else ""
        return f"outer step {self.outer_step + 1}: syncing{ahead}"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._redirect is not None:
            self._redirect.close()
            self._redirect = None

    # ----- what is shown ----------------------------------------------------------------------
    @property
    def mean_loss(self) -> Optional[float]:
        return self._loss_sum / self._losses if self._losses else None

    @property
    def tokens_per_s(self) -> float:
        elapsed = self.clock() - self._started
        return self._tokens / elapsed if elapsed > 0 else 0.0

    def seconds_to_sync(self) -> Optional[float]:
        """The remaining steps at the pace of this round's steps so far."""
        if not self._losses:
            return None
        per_step = (self.clock() - self._started) / self._losses
        return max(self.total - self.done, 0) * per_step

    def describe(self) -> str:
        """``outer step 4: inner step 12/25, loss 4.102, 3,400 tokens/s, sync in ~40 s``."""
        parts = [f"outer step {self.outer_step + 1}: inner step {self.done}/{self.total}"]
        if self.mean_loss is not None:
            parts.append(f"loss {self.mean_loss:.3f}")
        parts.append(f"{self.tokens_per_s:,.0f} tokens/s")
        eta = self.seconds_to_sync()
        if eta is not None:
            parts.append(f"sync in ~{eta:.0f} s")
        return ", ".join(parts)

    def _postfix(self) -> str:
        loss = "-" if self.mean_loss is None else f"{self.mean_loss:.3f}"
        return f"loss {loss}, {self.tokens_per_s:,.0f} tok/s"

    def _open_bar(self) -> None:
        from tqdm.contrib.logging import logging_redirect_tqdm

        if self._bar is not None:
            self._bar.close()
        if self._redirect is None:  # log lines go above the bar while one is shown
            self._redirect = contextlib.ExitStack()
            self._redirect.enter_context(logging_redirect_tqdm())
        self._bar = terminal_bar(self.stream, total=self.total, initial=self.done,
                                 desc=f"outer step {self.outer_step + 1}", unit="step", leave=False,
                                 bar_format="{desc}: {n_fmt}/{total_fmt} |{bar}|{postfix} [sync in {remaining}]")


def terminal_bar(stream: TextIO, **options):
    """A tqdm bar on `stream`, a terminal. tqdm hides its bar on a terminal that reports no size (a pty
    that nobody sized, as some container runtimes give): 100 columns by 30 rows are assumed there."""
    from tqdm import tqdm

    size = shutil.get_terminal_size((0, 0))
    sized = size.columns > 0 and size.lines > 0
    return tqdm(file=stream, dynamic_ncols=sized, ncols=None if sized else 100, nrows=None if sized else 30,
                **options)
