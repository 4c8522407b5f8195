"""What others and the user see of a peer: its status record and the progress of its inner steps.

The DiLoCo loop (:mod:`p2p_diloco.train.diloco`) says what happens (a round starts, an inner step
ends, the sync runs, a state is loading, the peer leaves); this turns it into the signed status
record that ``p2p-diloco status`` reads (:class:`~p2p_diloco.swarm.status.StatusPublisher`) and, when
the peer has one, the progress display (:class:`~p2p_diloco.train.display.InnerProgress`). Neither
decides anything about averaging: the progress records that do are the loop's.
"""

from __future__ import annotations

from typing import Any

from p2p_diloco.swarm import status as peer_status
from p2p_diloco.swarm.status import StatusPublisher


class PeerView:
    """The status record and the optional `display` of one peer; `tokens_per_sample` is ``data.seq_len``."""

    def __init__(self, status: StatusPublisher, display: Any = None, tokens_per_sample: int = 1,
                 idle_phase: str = peer_status.TRAINING):
        self.status = status
        self.display = display
        self.tokens_per_sample = tokens_per_sample
        self.idle_phase = idle_phase  # between rounds: training, or a keeper's keeping (it never trains)
        self.samples = 0  # in the outer steps this peer applied with its group
        self.rounds = 0  # of those, the ones averaged with others
        self.counted_samples: int | None = None  # of `samples`, what its groups' rule counted, once reported
        self._traffic_seen = 0  # the all-reduce bytes counted in an earlier outer step

    def joined(self, **fields: Any) -> None:
        """The first record (outer step, inner steps, data shard): stored before the progress record, so a
        peer that sees this one's progress record sees its settings too."""
        self.status.publish(wait=True, **fields)

    def round_started(self, outer_step: int, steps_per_sync: int, done: int) -> None:
        if self.display is not None:
            self.display.start_round(outer_step, steps_per_sync, done=done)

    def inner_step(self, step_loss: float, samples: int, **status_fields: Any) -> None:
        """One inner step ended with `step_loss` over `samples`; `status_fields` (inner steps, samples/s, the
        recent loss) refresh the status record without a DHT store (:meth:`StatusPublisher.update`)."""
        if self.display is not None:
            self.display.step(step_loss, samples * self.tokens_per_sample)
        self.status.update(**status_fields)

    def applied(self, samples: int, group_size: int, traffic_total: int, utilization: float,
                counted_samples: int | None = None) -> None:
        """An outer step applied: its samples and group size, the bytes since the last one (`traffic_total`
        counts them all, sent and received, in every phase: :mod:`p2p_diloco.traffic`) and the compute utilization since the last
        one; stored with the next record the loop publishes. `counted_samples`: what the group's rule
        counted of `samples` (:attr:`GroupMean.counted_samples <p2p_diloco.sync.outer_sync.GroupMean>`), shown
        beside them; a record says none while no round reported it."""
        self.samples += samples
        self.rounds += group_size > 1
        if counted_samples is not None:
            self.counted_samples = (self.counted_samples or 0) + counted_samples
        sync_bytes, self._traffic_seen = traffic_total - self._traffic_seen, traffic_total
        self.status.update(samples=self.samples, counted_samples=self.counted_samples, rounds=self.rounds,
                           group_size=group_size, sync_bytes=sync_bytes,
                           utilization=min(max(utilization, 0.0), 1.0), rounds_not_applied=0)

    def not_applied(self, rounds_in_a_row: int) -> None:
        self.status.update(rounds_not_applied=rounds_in_a_row)

    def evaluated(self, outer_step: int, loss: float | None) -> None:
        """The held-out loss of θ_global at `outer_step` (p2p_diloco.train.heldout), stored at once."""
        self.status.publish(eval_step=outer_step, eval_loss=loss)

    def syncing(self) -> None:
        self.status.publish(phase=peer_status.SYNCING)
        if self.display is not None:
            self.display.syncing()

    def training(self, **fields: Any) -> None:
        """Training toward the next outer step; a keeper keeping the run's state."""
        self.status.publish(phase=self.idle_phase, **fields)

    def loading(self) -> None:
        self.status.publish(phase=peer_status.LOADING)

    def left(self) -> None:
        self.status.publish(phase=peer_status.LEFT)

    def close(self) -> None:
        if self.display is not None:
            self.display.close()
        self.status.close()
