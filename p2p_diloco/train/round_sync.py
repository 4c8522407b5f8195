"""The sync of one outer step: wait for the peers at the step, decide with whom to average, average.

Step 4 of the DiLoCo loop (:mod:`p2p_diloco.train.diloco`; DiLoCo, arXiv 2311.08105, Alg. 1 line 11).
It reads the swarm's progress records (:mod:`p2p_diloco.swarm.progress`), waits at most
``swarm.round_wait_timeout`` for the peers at this step that still train or load, and then either
averages with them (:class:`~p2p_diloco.sync.outer_sync.OuterSync`) in the group its membership plan
names (:mod:`p2p_diloco.sync.membership`), applies this peer's own Δ when no other peer of the run is
live, or gives up the round with the reason and the metrics event that say why.

It runs in a background thread while inner steps go on when ``outer.sync_delay`` τ > 0
(Streaming DiLoCo's overlap, arXiv 2501.18512), so it touches no training state: what it needs is
passed in, and what it decided is returned.

**A peer the group left behind catches up at once.** Until its all-reduce begins, a peer that is
matching reads once a second whether the peers at its step went on without it, and then skips the
round (``round_skipped``) instead of waiting out the leaders' windows.

**A failure costs the failed peer, not the step.** When a member dies mid-round, the round is void
for the group (a reducer's parts are lost, or its commit report never comes). Every survivor then
averages the same pseudo-gradient again, with a fresh attempt token, in a group planned among the
members of the failed attempt's plan, without those that no longer answer on the network (a peer that
became ready meanwhile was not in that round: the retry does not wait for it), up to
``swarm.round_attempts`` attempts in all. Every survivor sees the same void round
(:mod:`p2p_diloco.sync.commit`), so every survivor tries again.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from p2p_diloco.protocol.membership import Membership, plan_membership, quorum_of
from p2p_diloco.protocol.plans import plan_averaging, plan_round
from p2p_diloco.protocol.trust import moved_past
from p2p_diloco.protocol.view import PeerProgress, dialable, ready_at, round_closing, went_on_without
from p2p_diloco.swarm.progress import SwarmProgress
from p2p_diloco.sync.outer_sync import (
    GroupMean, LeftBehind, NoGroup, OuterSync, PendingDelta, RoundFailed, WhileForming,
)

logger = logging.getLogger(__name__)

ROUND_STOPPED = "round_stopped"  # the metrics event of a round this peer left because it is stopping

ASSISTANT_HINT = ("; every peer at this step is unreachable, so only an assistant can reduce for them: a reachable "
                  "bootstrap node (not started with --no-assist) or a reachable peer")


@dataclass
class SyncOutcome:
    """How the sync of one outer step ended: the group's mean, or why nothing is applied."""

    result: Optional[GroupMean] = None
    event: Optional[str] = None  # the metrics event of a round that applied nothing: round_failed, round_skipped, ...
    reason: str = ""
    failed_attempts: list[str] = field(default_factory=list)  # why each earlier attempt at the step's round failed
    # a failed round that this peer had reported complete: a groupmate may have committed a mean holding its Δ
    # (RoundFailed.reported), so a state loaded next may hold it (protocol.plans.keeps_work)
    delta_may_be_committed: bool = False


class RoundSync:
    """The sync of a round toward outer step t + 1, for the peer `peer_id` (:meth:`__call__`), and whether
    another peer has closed the round already (:meth:`round_is_closing`). With error feedback (`sync`
    made with ``record_sent``) a group's mean comes with what the group counted of this peer's part."""

    def __init__(self, progress: SwarmProgress, sync: OuterSync, peer_id: str, reachability_mode: str,
                 round_wait_timeout: float, stop_event: threading.Event, attempts: int = 1):
        self.attempts = attempts  # swarm.round_attempts
        self.progress = progress
        self.sync = sync
        self.peer_id = peer_id
        self.reachability_mode = reachability_mode
        self.round_wait_timeout = round_wait_timeout
        self.stop_event = stop_event
        self._attempts_at: tuple[int, int] = (-1, 0)  # (outer step, attempts made at it so far, in all its rounds)

    def __call__(self, step: int, fragment: int, to_send: Union[list[torch.Tensor], PendingDelta], samples: int,
                 global_sha256: str) -> SyncOutcome:
        """The group's mean of what this peer sends for `fragment` at outer step `step` (its Δ, with error
        feedback plus the residual it owes), among the peers that hold the θ_global `global_sha256`.
        `to_send` may still be pending (:mod:`p2p_diloco.train.match_ahead`): the round is matched meanwhile.

        Never raises for the swarm's sake: a DHT node that is gone (its process stopped with the peer's,
        as a service manager stops every process of a unit at once) ends the round like any failure."""
        try:
            outcome = self._sync(step, fragment, to_send, samples, global_sha256)
            if outcome.result is not None:  # the group agreed on its mean: this peer commits it (its own phase)
                self.progress.committing(step, global_sha256, samples)
            return outcome
        except ConnectionError as e:  # swarm.node's DHT calls fail so once the DHT process is gone
            if self.stop_event.is_set():
                return SyncOutcome(event=ROUND_STOPPED, reason=f"this peer is stopping ({e})")
            return SyncOutcome(event="round_failed", reason=f"this peer's DHT node failed: {e}")

    def _sync(self, step: int, fragment: int, to_send: Union[list[torch.Tensor], PendingDelta], samples: int,
              global_sha256: str) -> SyncOutcome:
        to_send = to_send if isinstance(to_send, PendingDelta) else PendingDelta(to_send)
        began = time.monotonic()
        records = self.progress.wait_for_groupmates(step, self.round_wait_timeout, self.stop_event,
                                                    sha256=global_sha256)
        waited_s = round(time.monotonic() - began, 4)
        if self.stop_event.is_set():
            return SyncOutcome(event=ROUND_STOPPED, reason="this peer is stopping")
        if moved_past(records, self.peer_id, step, global_sha256):
            return SyncOutcome(event="round_skipped",
                               reason=f"the swarm moved past outer step {step} while this peer trained; catching up")
        vote = plan_round(records, step, global_sha256)
        # the peers at this step hold another state: a round from this one forks the run (a claim past the step that
        # moved_past does not trust is no reason to skip: one liar's jump ended 16 peers' rounds, simulation seed 28)
        if vote.action == "load" and vote.target_step == step:
            return SyncOutcome(event="round_skipped", reason=f"{vote.reason}; catching up")
        plan = plan_averaging(records, step, self.peer_id, self.reachability_mode, self.progress.history())
        if plan.action == "skip":
            return SyncOutcome(event="round_skipped", reason=plan.reason)
        if plan.action == "alone":
            return self._alone(to_send, samples)
        failed: list[str] = []
        reported = False  # whether an attempt that failed had been reported complete (RoundFailed.reported)
        membership = None
        for attempt in range(1, self.attempts + 1):
            membership = plan_membership(records, step, global_sha256, self.peer_id, self.reachability_mode,
                                         self._next_attempt_at(step),
                                         among=None if membership is None else membership.members)
            if membership is not None:
                self.progress.asking(step, global_sha256, membership.leaders[0])
                logger.info("outer step %d: %d peer(s) ready to average; leader %s", step + 1, membership.expected,
                            " then ".join(leader[-8:] for leader in membership.leaders))
            try:
                planned = membership  # this attempt's: the left-behind check counts its members
                result = self.sync.average(to_send, samples, step, global_sha256, fragment, stop=self.stop_event,
                                           membership=membership,
                                           watch=lambda: self._while_forming(step, global_sha256, planned))
                result.attempt = attempt
                result.phases = dict(wait=waited_s, **result.phases)
                return SyncOutcome(result, failed_attempts=failed)
            except LeftBehind:
                # its Δ may have travelled all the same (hivemind looks at a cancel only once its matchmaking returns,
                # so a group matched an instant before the cancel runs its all-reduce with this peer's parts: seen
                # under a busy core, "Can't set_result to a future that is CANCELLED"), but no groupmate commits that
                # round: this peer reported it incomplete (RoundFailed.reported), so its work is kept on a load
                return SyncOutcome(event="round_skipped", reason=f"the peers at outer step {step} averaged without "
                                                                 f"this peer while it was matching; catching up",
                                   failed_attempts=failed, delta_may_be_committed=reported)
            except RoundFailed as e:  # with what the user can do about it, where there is something
                reported = reported or e.reported
                if isinstance(e, NoGroup) and membership is not None:  # a crashed member's READY record stands
                    silent = self.progress.drop_silent(records, [m for m in membership.members if m != self.peer_id])
                    if silent:
                        logger.warning("outer step %d: no group formed; planned member(s) %s do not answer on the "
                                       "network (crashed or left): not planned with again until they write a record",
                                       step + 1, ", ".join(peer[-8:] for peer in silent))
                if not e.tensors_touched or attempt == self.attempts or self.stop_event.is_set():
                    reason = str(e) + (ASSISTANT_HINT if plan.needs_assistant else "")
                    return SyncOutcome(event="round_failed", reason=reason, failed_attempts=failed,
                                       delta_may_be_committed=reported)
                failed.append(str(e))
                records = self._answering(self.progress.fetch(), step)
                if moved_past(records, self.peer_id, step, global_sha256):  # the others applied it: catch up instead
                    return SyncOutcome(event="round_skipped", reason=f"attempt {attempt} failed ({e}) while the swarm "
                                                                     f"moved past outer step {step}; catching up",
                                       failed_attempts=failed, delta_may_be_committed=reported)
                logger.warning("outer step %d: attempt %d of %d failed (%s); averaging again with the %d peers ready "
                               "at the step that still answer", step + 1, attempt, self.attempts, e,
                               len(ready_at(records, step)))

    def _alone(self, to_send: PendingDelta, samples: int) -> SyncOutcome:
        """This peer's own Δ as the step's mean (no other peer of the run is live), once it is handed over."""
        deadline = time.monotonic() + self.round_wait_timeout
        while not to_send.wait(0.1) and not self.stop_event.is_set() and time.monotonic() < deadline:
            pass
        if to_send.tensors is None and self.stop_event.is_set():
            return SyncOutcome(event=ROUND_STOPPED, reason="this peer stopped before its pseudo-gradient was taken")
        if to_send.tensors is None:
            return SyncOutcome(event="round_failed", reason="this peer's pseudo-gradient did not come in time")
        return SyncOutcome(GroupMean(to_send.tensors, 1, samples, {self.peer_id: "alone"}))

    def _next_attempt_at(self, step: int) -> int:
        """How many attempts this peer has made at averaging for `step`, this one included, over all the
        rounds it tried at the step: the plan's order of leaders changes with it. Peers that failed the same
        rounds together count alike (every member of a void round sees it void)."""
        at, made = self._attempts_at
        self._attempts_at = (step, made + 1 if at == step else 1)
        return self._attempts_at[1]

    def _while_forming(self, step: int, global_sha256: str, membership: Optional[Membership]) -> WhileForming:
        """What the records say while this peer's group forms. Left behind: the peers at `step` averaged without
        this peer, more of the members it planned its round with past the step than still ready or training at it
        (:func:`~p2p_diloco.protocol.view.went_on_without`; a peer that arrives at a step as its group starts, a
        joiner that just loaded the state, plans a membership whose members are already averaging: without this it
        waited out every leader's window, 3 × 3 × ``matchmaking_time``, before it caught up). And the quorum its
        group needs if this peer leads it (:func:`~p2p_diloco.protocol.membership.quorum_of`)."""
        records = self.progress.fetch()
        among = None if membership is None else membership.members
        quorum = frozenset() if membership is None else quorum_of(membership.members, records, step, global_sha256)
        return WhileForming(went_on_without(records, step, self.peer_id, among), quorum)

    def _answering(self, records: dict[str, PeerProgress], step: int) -> dict[str, PeerProgress]:
        """The records, less those of peers ready at `step` that no longer answer on the network (the
        peers a failed attempt lost); all of them when this peer cannot ask."""
        if self.progress.answering is None:
            return records
        ready = [pid for pid in dialable(ready_at(records, step)) if pid != self.peer_id]
        answering = self.progress.answering(ready) if ready else set()
        return {pid: r for pid, r in records.items() if pid not in ready or pid in answering}

    def round_is_closing(self, step: int) -> bool:
        """Whether another peer is ready at this step, or past it: the fastest peer ends the round for all."""
        return round_closing(self.progress.fetch(), step, self.peer_id)
