"""The round's decisions from the records a peer read: load or train, wait for a state, average or not.

Each is a pure function of the records (:mod:`p2p_diloco.protocol.view`), this peer's own state and what it
remembers of the run; each returns a decision with its reason.

* :func:`plan_round`, before a round (DiLoCo's loop, :mod:`p2p_diloco.train.diloco`):
  * some live peer is at a later outer step: load the state (this peer is behind);
  * a peer's round toward this peer's step runs or commits: train (the vote at this step waits for it);
  * peers at this step agree on another state (most records; ties: the larger sha256): load it;
  * else train.
* :func:`behind_alone`: the run is ahead and nobody to average with is at this step: wait for the run's
  state, never train alone (:mod:`p2p_diloco.train.catch_up`).
* :func:`keeps_work`, on a load: whether the peer's unsynced inner steps move onto the loaded state or are dropped.
* :func:`plan_averaging`, once the groupmates are ready: average with the peers at this step, apply this
  peer's own Δ when no other peer of the run is live, or skip the round while others are at other steps.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Optional

from p2p_diloco.protocol.view import (
    LOADING, UNREACHABLE, PeerProgress, RunHistory, averaging_peers, on_its_way_to,
)


@dataclass(frozen=True)
class RoundPlan:
    """What this peer does next, derived from the progress records alone."""

    action: str  # "train", or "load" (download a newer or the agreed state first)
    reason: str
    target_step: int
    target_sha256: Optional[str] = None
    # for "load": the peers whose records claim the target state, and that claim
    claims: Optional[dict[str, tuple[int, str]]] = None


def agreed_sha256(records: dict[str, PeerProgress], outer_step: int) -> Optional[str]:
    """The θ_global most peers at `outer_step` hold (ties: the larger sha256), or None."""
    counts = Counter(r.sha256 for r in records.values() if r.outer_step == outer_step)
    if not counts:
        return None
    return max(counts, key=lambda sha: (counts[sha], sha))


def plan_round(records: dict[str, PeerProgress], my_step: int, my_sha256: str) -> RoundPlan:
    records = {pid: r for pid, r in records.items() if r.phase != LOADING}  # they hold no agreed state yet
    others = {pid: r for pid, r in records.items() if r.sha256 != my_sha256 or r.outer_step != my_step}
    frontier = max((r.outer_step for r in others.values()), default=my_step)
    if frontier > my_step:
        return _load(records, frontier, f"the swarm is at outer step {frontier}, this peer at {my_step}")
    if any(on_its_way_to(r, my_step) for r in records.values()):
        # the vote at this step waits for them: the groupmates of the round this peer just applied land here
        # with its state, and a claim of another state at this step (a hostile one) must not win the vote
        # while their new records are not read yet (in CI, two peers outvoted so loaded a stranger's state)
        return RoundPlan("train", "peers are still on their way to this step (ready or committing at the one before)",
                         my_step)
    agreed = agreed_sha256(records, my_step)
    if agreed is not None and agreed != my_sha256:
        return _load(records, my_step, f"peers at outer step {my_step} agree on another global state")
    return RoundPlan("train", "in step with the swarm", my_step)


def _load(records: dict[str, PeerProgress], step: int, reason: str) -> RoundPlan:
    sha = agreed_sha256(records, step)
    claims = {pid: (r.outer_step, r.sha256) for pid, r in records.items() if r.outer_step == step and r.sha256 == sha}
    return RoundPlan("load", reason, step, sha, claims)


@dataclass(frozen=True)
class AveragingPlan:
    """Whether and how this peer averages at its outer step, once its groupmates are ready."""

    action: str  # "average" with the peers at this step, "alone" (the swarm is empty), or "skip" this round
    needs_assistant: bool = False  # nobody at this step can reduce: only an assistant can (sync/assistant.py)
    reason: str = ""


def plan_averaging(records: dict[str, PeerProgress], outer_step: int, peer_id: str, reachability: str,
                   history: Optional[RunHistory] = None) -> AveragingPlan:
    """Decide from the progress records how this peer averages toward `outer_step + 1`.

    It never steps alone while other peers are live: a peer behind will load this peer's state and
    average with it next round (this peer keeps its inner steps in the meantime). Nor while the run's
    `history` (:meth:`~p2p_diloco.protocol.ledger.TrustLedger.history`) is at a later step: the records it
    counts may hide the run's peers (set aside, or their records missed), and a step alone would start a second
    history. When every peer at this step is unreachable, nobody of them can reduce: the round needs an
    assistant, a reachable node that reduces for them.
    """
    others = averaging_peers(records, peer_id)
    own = records.get(peer_id)
    if own is not None and own.outer_step == outer_step and agreed_sha256(records, outer_step) == own.sha256:
        # a peer at this step whose state lost the vote loads this one's (plan_round), and is no groupmate (the
        # round's members start from one state: membership.ready_at); one that never does is a liar, which kept a
        # lone honest peer failing to find a group for good (the simulation, 3 peers, seeds 69 and 128)
        others = [r for r in others if r.outer_step != outer_step or r.sha256 == own.sha256]
    groupmates = [r for r in others if r.outer_step == outer_step]
    if not groupmates:
        if history is not None and history.outer_step > outer_step:
            return AveragingPlan("skip", reason=f"no other peer is at outer step {outer_step} and the run was seen at "
                                                f"outer step {history.outer_step}: not stepping alone")
        if others:
            steps = ", ".join(str(step) for step in sorted({r.outer_step for r in others}))
            return AveragingPlan("skip", reason=f"no other peer is at outer step {outer_step} while {len(others)} "
                                                f"live peer(s) are at outer step(s) {steps}: not stepping alone")
        return AveragingPlan("alone", reason="no other peer is in the swarm")
    nobody_reduces = reachability == UNREACHABLE and all(r.reachability == UNREACHABLE for r in groupmates)
    return AveragingPlan("average", needs_assistant=nobody_reduces)


def behind_alone(own_step: int, history: Optional[RunHistory], records: Mapping[str, PeerProgress],
                 peer_id: str) -> bool:
    """Whether the run is ahead of `own_step` (by the records this peer has seen) while no other live peer
    (`records`, this one's own left out) that trains is at that step: this peer then has nobody to average
    with but itself, and must not train. A keeper at that step does not count: it never averages. A peer
    ready or committing at the step before does: its round may bring it here (this peer's groupmates, read a
    moment after the step they took together, before their new records are stored)."""
    if history is None or history.outer_step <= own_step:
        return False
    return not any(record.outer_step == own_step or on_its_way_to(record, own_step)
                   for record in averaging_peers(records, peer_id))


def keeps_work(own_step: int, target_step: int, work_sent: bool) -> bool:
    """Whether a peer that loads the state at `target_step` keeps its unsynced inner steps, rebased onto the
    loaded θ_global (θ_local ← θ_global' − Δ: its pseudo-gradient Δ = θ_global − θ_local is the same), instead of
    dropping them with its old state.

    It keeps them when none of them went into a failed round that this peer had reported complete (`work_sent`,
    :class:`~p2p_diloco.sync.outer_sync.RoundFailed` ``reported``: another member may have committed that round
    with them, so the loaded state may hold them already, and a kept Δ would count twice; a round reported
    incomplete, a group left behind while it matched included, is committed by nobody: every member waits for every
    groupmate's complete report, :mod:`p2p_diloco.sync.commit`), and the state is at its own step (a vote it lost)
    or the next (a round it missed: left behind, late, or a joiner whose first inner steps the run's step
    overtook). Its Δ is then at most one outer step stale,
    the delay that Streaming DiLoCo's overlapped outer step already applies to every Δ (arXiv 2501.18512, §2.2,
    τ > 0). A longer jump drops them: a Δ from several outer steps back points where the run no longer is.
    Dropped, they were 97 % of the samples the simulation's loads lost (16 peers, 20 seeds)."""
    return not work_sent and own_step <= target_step <= own_step + 1
