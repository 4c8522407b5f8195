"""The sync of one outer step: wait for the peers at the step, decide with whom to average, average.

Step 4 of the DiLoCo loop (:mod:`p2p_diloco.train.diloco`; DiLoCo, arXiv 2311.08105, Alg. 1 line 11).
It reads the swarm's progress records (:mod:`p2p_diloco.swarm.progress`), waits at most
``swarm.round_wait_timeout`` for the peers at this step that still train or load, and then either
averages with them (:class:`~p2p_diloco.sync.outer_sync.OuterSync`), applies this peer's own Δ when no
other peer of the run is live, or gives up the round with the reason and the metrics event that
say why. It runs in a background thread while inner steps go on when ``outer.sync_delay`` τ > 0
(Streaming DiLoCo's overlap, arXiv 2501.18512), so it touches no training state: what it needs is
passed in, and what it decided is returned.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

import torch

from p2p_diloco.swarm.progress import READY, SwarmProgress, plan_averaging
from p2p_diloco.sync.outer_sync import GroupMean, OuterSync, RoundFailed

ROUND_STOPPED = "round_stopped"  # the metrics event of a round this peer left because it is stopping

ASSISTANT_HINT = ("; every peer at this step is unreachable, so only an assistant can reduce for them: a reachable "
                  "bootstrap node (not started with --no-assist) or a reachable peer")


@dataclass
class SyncOutcome:
    """How the sync of one outer step ended: the group's mean, or why nothing is applied."""

    result: Optional[GroupMean] = None
    event: Optional[str] = None  # the metrics event of a round that applied nothing: round_failed, round_skipped, ...
    reason: str = ""


class RoundSync:
    """The sync of a round toward outer step t + 1, for the peer `peer_id` (:meth:`__call__`), and whether
    another peer has closed the round already (:meth:`round_is_closing`). With error feedback (`sync`
    made with ``record_sent``) a group's mean comes with what the group counted of this peer's part."""

    def __init__(self, progress: SwarmProgress, sync: OuterSync, peer_id: str, reachability_mode: str,
                 round_wait_timeout: float, stop_event: threading.Event):
        self.progress = progress
        self.sync = sync
        self.peer_id = peer_id
        self.reachability_mode = reachability_mode
        self.round_wait_timeout = round_wait_timeout
        self.stop_event = stop_event

    def __call__(self, step: int, fragment: int, to_send: list[torch.Tensor], samples: int,
                 global_sha256: str) -> SyncOutcome:
        """The group's mean of what this peer sends for `fragment` at outer step `step` (its Δ, with error
        feedback plus the residual it owes), among the peers that hold the θ_global `global_sha256`.

        Never raises for the swarm's sake: a DHT node that is gone (its process stopped with the peer's,
        as a service manager stops every process of a unit at once) ends the round like any failure."""
        try:
            return self._sync(step, fragment, to_send, samples, global_sha256)
        except ConnectionError as e:  # swarm.node's DHT calls fail so once the DHT process is gone
            if self.stop_event.is_set():
                return SyncOutcome(event=ROUND_STOPPED, reason=f"this peer is stopping ({e})")
            return SyncOutcome(event="round_failed", reason=f"this peer's DHT node failed: {e}")

    def _sync(self, step: int, fragment: int, to_send: list[torch.Tensor], samples: int,
              global_sha256: str) -> SyncOutcome:
        records = self.progress.wait_for_groupmates(step, self.round_wait_timeout, self.stop_event)
        if self.stop_event.is_set():
            return SyncOutcome(event=ROUND_STOPPED, reason="this peer is stopping")
        if any(r.outer_step > step for r in records.values()):
            return SyncOutcome(event="round_skipped",
                               reason=f"the swarm moved past outer step {step} while this peer trained; catching up")
        plan = plan_averaging(records, step, self.peer_id, self.reachability_mode)
        if plan.action == "skip":
            return SyncOutcome(event="round_skipped", reason=plan.reason)
        if plan.action == "alone":
            return SyncOutcome(GroupMean(to_send, 1, samples, {self.peer_id: "alone"}))
        try:
            return SyncOutcome(self.sync.average(to_send, samples, step, global_sha256, fragment, stop=self.stop_event))
        except RoundFailed as e:  # with what the user can do about it, where there is something
            return SyncOutcome(event="round_failed", reason=str(e) + (ASSISTANT_HINT if plan.needs_assistant else ""))

    def round_is_closing(self, step: int) -> bool:
        """Whether another peer is ready at this step, or past it: the fastest peer ends the round for all."""
        return any(
            r.peer_id != self.peer_id and (r.outer_step > step or (r.outer_step == step and r.phase == READY))
            for r in self.progress.fetch().values()
        )
