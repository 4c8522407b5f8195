"""The move before a round (p2p_diloco.protocol.decide.next_move): load, wait for the run's state, or train, each
rule with its reason, the records split and the history dated at a time passed in."""

import math

from p2p_diloco.protocol.decide import LOAD, TRAIN, WAIT, next_move
from p2p_diloco.protocol.ledger import ASIDE_S, TrustLedger
from p2p_diloco.protocol.view import KEEPING, READY, TRAINING, PeerProgress

A, B, C = "a" * 64, "b" * 64, "c" * 64
TTL = 100.0  # when the records below expire on the DHT, unless a test says otherwise


def rec(peer, step, phase=TRAINING, sha=A, at=0.0):
    return PeerProgress(peer, step, sha, phase, time=at)


def decide(records, now=0.0, ledger=None, expires=None, **options):
    """The move of peer "me" (its own record among `records`), which knows `records` as a DHT read at `now` left
    them: each expires at TTL, or at `expires[peer]`."""
    ledger = ledger or TrustLedger("me")
    seen = {r.peer_id: (r, math.inf if r.peer_id == "me" else (expires or {}).get(r.peer_id, TTL)) for r in records}
    live, set_aside = ledger.split(seen, now)
    own = seen["me"][0]
    return next_move(live, set_aside, "me", own.outer_step, own.sha256, ledger.history(seen, now), **options)


def test_in_step_with_the_run_it_trains():
    move = decide([rec("me", 3), rec("x", 3)])
    assert (move.action, move.reason) == (TRAIN, "in step with the swarm") and move.declined is None


def test_a_live_peer_one_step_ahead_is_loaded():
    move = decide([rec("me", 3), rec("x", 4, sha=B)])
    assert move.action == LOAD and (move.load.target_step, move.load.target_sha256) == (4, B)
    assert move.load.claims == {"x": (4, B)} and "the swarm is at outer step 4" in move.reason


def test_peers_at_its_step_that_agree_on_another_state_are_followed():
    move = decide([rec("me", 3), rec("x", 3, sha=B), rec("y", 3, sha=B)])
    assert move.action == LOAD and (move.load.target_step, move.load.target_sha256) == (3, B)
    assert "agree on another global state" in move.reason


def test_a_jump_one_identity_claims_is_declined_and_it_trains_with_its_company():
    move = decide([rec("me", 3), rec("y", 3), rec("liar", 6, sha=C)])
    assert move.action == TRAIN and move.declined.claims == {"liar": (6, C)}
    assert "no state above it is trusted enough" in move.reason and "outer step 6" in move.vouch_counts


def test_a_declined_jump_with_nobody_at_its_step_waits_for_the_runs_state():
    alone = decide([rec("me", 2), rec("y", 5, sha=B), rec("z", 5, sha=C), rec("w", 6, sha=A)])
    assert alone.action == WAIT and alone.declined is not None and alone.history.outer_step == 6
    assert alone.reason == "the run is at outer step 6 and no peer served its state"


def test_the_best_vouched_state_is_loaded_when_the_plans_target_is_not_trusted():
    move = decide([rec("me", 0), rec("liar", 9, sha=C), rec("x", 5, sha=B), rec("y", 5, sha=B)])
    assert move.action == LOAD and (move.load.target_step, move.load.target_sha256) == (5, B)
    assert move.load.claims == {"x": (5, B), "y": (5, B)} and "best-vouched state above it: outer step 5" in move.reason


def test_a_former_groupmates_word_settles_a_tie():
    records = [rec("me", 3), rec("x", 5, sha=B), rec("y", 5, sha=C)]  # one voucher each, and one dissent
    move = decide(records, groupmates=frozenset({"y"}))
    assert move.action == LOAD and move.load.target_sha256 == C and "trying its download" not in move.reason


def test_a_tie_nothing_settles_is_tried_by_download_never_waited_on():
    """One honest peer and one liar claim the run's state: a joiner that waited on the tie waited for good, and two
    such joiners averaged together from step 0, a second history (simulation, 4 peers, seeds 9 and 175). It tries
    the download; a claim that nobody serves is struck after two tries (protocol.ledger), and the other wins."""
    records = [rec("me", 3), rec("x", 5, sha=B), rec("y", 5, sha=C)]
    move = decide(records)
    assert move.action == LOAD and "trying its download" in move.reason
    assert (move.load.target_step, move.load.target_sha256) in {(5, B), (5, C)}
    assert decide(records, may_load=False).action == WAIT  # the download failed: it waits, never trains alone
    # a state with more vouchers than dissent is no tie: taken outright
    move = decide(records + [rec("z", 5, sha=B)])
    assert move.load.target_sha256 == B and "trying its download" not in move.reason
    # a tie with this peer's own state's vouchers on its side is no reason to leave it
    assert decide([rec("me", 3), rec("m", 3), rec("x", 5, sha=B), rec("y", 6, sha=C)]).action != LOAD


def test_after_a_failed_load_of_a_trusted_state_it_waits_even_with_company():
    """Two joiners whose download met the run's one peer frozen for 8 s trained on together and averaged from
    step 0 while the run was at 20: a second history (the simulation, 4 peers, seed 25). A trusted state above that
    failed to load is asked for again; company at this step trains on only when nothing above is trusted."""
    behind = decide([rec("me", 3), rec("x", 4, sha=B)], may_load=False)
    assert behind.action == WAIT and behind.history.outer_step == 4
    joiners = decide([rec("me", 0), rec("y", 0), rec("x", 20, sha=B)], may_load=False)  # step 0 vouches for nothing
    assert joiners.action == WAIT and joiners.history.outer_step == 20
    # one identity's claim against this peer's 2 vouchers (one step ahead, or a jump) is no such state: a liar's
    # claim one step ahead of 16 peers held every one of them for two asks, and the run for 70 s (16 peers, seed 36)
    for claim in (rec("x", 4, sha=B), rec("x", 9, sha=B)):
        company = decide([rec("me", 3), rec("y", 3), claim], may_load=False)
        assert company.action == TRAIN and "its load failed" in company.reason


def test_a_keeper_at_its_step_is_no_company_but_a_peer_committing_its_way_there_is():
    keeper_only = [rec("me", 3), rec("k", 3, KEEPING), rec("gone", 4, sha=B)]
    expired = dict(now=TTL + 1, expires={"k": 2 * TTL, "y": 2 * TTL})  # gone's record expired: the run was at 4
    assert decide(keeper_only, **expired).action == WAIT
    committing = keeper_only + [rec("y", 2, READY, sha=C)]
    assert decide(committing, **expired).action == TRAIN


def test_a_run_seen_ahead_before_its_records_expired_is_still_ahead():
    records = [rec("me", 1), rec("x", 4, sha=B)]
    assert decide(records, now=10.0, may_load=False).action == WAIT
    later = decide(records, now=TTL + 1)  # x's record expired: nothing to load, but the run was at 4
    assert later.action == WAIT and later.history.outer_step == 4
    fresh = decide([rec("me", 1)], now=TTL + 1)
    assert fresh.action == TRAIN  # a run with no history: it starts it


def test_a_claim_set_aside_counts_again_after_a_while():
    ledger = TrustLedger("me")
    ledger.set_aside({"x": (4, B)}, now=0.0)
    records = [rec("me", 3), rec("y", 3), rec("x", 4, sha=B)]
    assert decide(records, now=10.0, ledger=ledger).action == TRAIN  # aside: not a target, y is company
    move = decide(records, now=ASIDE_S + 1, ledger=ledger)
    assert move.action == LOAD and move.load.target_step == 4
