"""The move a member of the run makes before a round, from what it knows: load a state, wait for one, or train.

One function, :func:`next_move`, decides it for the real peer (:class:`p2p_diloco.train.diloco.DiLoCoPeer`),
the run's keeper (:class:`p2p_diloco.train.keeper.Keeper`, which acts on a load only: it never trains) and the
simulated peer (:mod:`p2p_diloco.protocol.simulation.peer`). The rules, in order, each with its reason:

1. the round plan says load (:func:`~p2p_diloco.protocol.plans.plan_round`: a live peer is at a later step, or
   the peers at this step agree on another state): **load** it, if the records trust it enough. A state one step
   ahead or at this step is checked once downloaded; a jump is taken on the records' word only
   (:func:`~p2p_diloco.protocol.trust.choose_target`), and when the plan's target is not trusted, the
   best-vouched trusted state above this peer's step is loaded instead. A jump that none is trusted for is
   declined: its claims are set aside (:class:`~p2p_diloco.protocol.ledger.TrustLedger`) and the next rules decide;
2. the run is ahead and no peer that averages is at this step (:func:`~p2p_diloco.protocol.plans.behind_alone`),
   or the load of a state above it that the records vouch for (as many as for its own, and more than dispute it:
   one liar's claim one step ahead of 16 peers is no such state) just failed: **wait** for the run's state and ask
   again, never train alone, nor average with the peers at this step: either would start a second history of
   the run (:mod:`p2p_diloco.train.catch_up`; two joiners whose download met the run's one peer frozen for 8 s
   averaged from step 0 while the run was at step 20: simulation, 4 peers, seed 25). A claim that nobody serves
   twice is struck (:class:`~p2p_diloco.protocol.ledger.TrustLedger`), and no longer makes the plan load;
3. else **train** from its own state.

A load that fails (nobody served the state, or it failed the state check) leaves the peer at its own state; it
asks again with `may_load` False, and rules 2 and 3 decide on the same records, with the history as the failure
left it (a refused donor's records no longer count in it).

Nothing here reads the DHT or a clock: what time changes (which claims are set aside, which records have
expired, how old the run's history is) is in the records and the history passed in, which the caller split
and dated at its `now` (:meth:`TrustLedger.split`, :meth:`TrustLedger.history`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from p2p_diloco.protocol.plans import RoundPlan, behind_alone, plan_round
from p2p_diloco.protocol.trust import choose_target
from p2p_diloco.protocol.view import Records, RunHistory, vouchers

LOAD, WAIT, TRAIN = "load", "wait", "train"


@dataclass(frozen=True)
class Move:
    """What a member of the run does before its next round, and why (see the module)."""

    action: str  # LOAD the state `load` targets, WAIT for the run's state, or TRAIN from its own
    reason: str
    load: Optional[RoundPlan] = None  # LOAD: the state (target step and sha256) and the records that claim it
    # a jump this peer does not take on so few vouchers: the plan it declines (its claims are set aside), and
    # the account of the vouchers counted (choose_target)
    declined: Optional[RoundPlan] = None
    vouch_counts: str = ""
    history: Optional[RunHistory] = None  # WAIT: the latest step it has seen the run at, ahead of its own


def next_move(records: Records, set_aside: Records, peer_id: str, outer_step: int, sha256: str,
              history: Optional[RunHistory], groupmates: frozenset[str] = frozenset(),
              may_load: bool = True) -> Move:
    """The move of this peer (`peer_id`, whose global state is `sha256` at `outer_step`) before its next round.

    `records` are the live records it counts, its own included, and `set_aside` the live ones whose claims it set
    aside (:meth:`~p2p_diloco.protocol.ledger.TrustLedger.split`); `history` the latest step it has seen the run
    at (:meth:`~p2p_diloco.protocol.ledger.TrustLedger.history`); `groupmates` the identities it has averaged
    with and still trusts, whose word on a jump counts first. `may_load` False: its load just failed, and only
    waiting or training remain."""
    plan = plan_round(records, outer_step, sha256)
    declined, counts = None, ""
    if plan.action == LOAD and may_load:
        trusted, counts = trusted_load(plan, records, set_aside, peer_id, outer_step, sha256, groupmates)
        if trusted is not None:
            return Move(LOAD, trusted.reason, load=trusted)
        tied, _ = trusted_load(plan, records, set_aside, peer_id, outer_step, sha256, groupmates, break_ties=True)
        if tied is not None:  # waiting would wait for good, training would fork the run: the download decides
            return Move(LOAD, f"{tied.reason}; as many records dispute it as vouch for it ({counts}): trying its "
                              f"download (claims that nobody serves are struck)", load=tied)
        declined = plan
    if behind_alone(outer_step, history, records, peer_id) or (
            not may_load and plan.action == LOAD and history is not None and history.outer_step > outer_step
            and trusted_load(plan, records, set_aside, peer_id, outer_step, sha256, groupmates, by_count=True)[0]
            is not None):
        # the same words as ever: the metrics of a load from the checkpoint store give them as its reason
        return Move(WAIT, f"the run is at outer step {history.outer_step} and no peer served its state",
                    declined=declined, vouch_counts=counts, history=history)
    if plan.action == LOAD:
        why = "its load failed" if declined is None else "no state above it is trusted enough to load"
        return Move(TRAIN, f"{plan.reason}, but {why}: training on from outer step {outer_step}", declined=declined,
                    vouch_counts=counts)
    return Move(TRAIN, plan.reason)


def trusted_load(plan: RoundPlan, records: Records, set_aside: Records, peer_id: str, outer_step: int, sha256: str,
                 groupmates: frozenset[str], break_ties: bool = False,
                 by_count: bool = False) -> tuple[Optional[RoundPlan], str]:
    """The load `plan` asks for, or one of the best-vouched state above this peer's step, if the records trust it
    (:func:`~p2p_diloco.protocol.trust.choose_target`); None if no state above is trusted. A state at this peer's
    own step is the plan's vote, and needs no more. With it, the account of the vouchers counted ("" for none)."""
    if plan.target_step <= outer_step:
        return plan, ""
    target, counts = choose_target(records, peer_id, outer_step, sha256, (plan.target_step, plan.target_sha256),
                                   groupmates, set_aside, break_ties, by_count)
    if target is None:
        return None, counts
    if target == (plan.target_step, plan.target_sha256):
        return plan, counts
    claims = {peer: target for peer in vouchers(records, *target)}
    return dataclasses.replace(plan, target_step=target[0], target_sha256=target[1], claims=claims,
                               reason=f"{plan.reason}; the best-vouched state above it: outer step {target[0]}"), counts
