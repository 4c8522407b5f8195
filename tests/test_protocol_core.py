"""The protocol core's phases, predicates and trust ledger (p2p_diloco/protocol), each rule with time passed in."""

import math

import pytest

from p2p_diloco.protocol.ledger import ASIDE_S, STRIKE_S, STRUCK_IN_HISTORY_S, TrustLedger, merge_seen
from p2p_diloco.protocol.phases import TRANSITIONS, IllegalTransition, Phase, check_transition
from p2p_diloco.protocol.membership import has_quorum, quorum_of
from p2p_diloco.protocol.plans import keeps_work, plan_averaging
from p2p_diloco.protocol.view import (
    COMMITTING, DIRECT, KEEPING, LOADING, READY, TRAINING, PeerProgress, RunHistory, averages, averaging_peers,
    busy_toward, committing_toward, keepers, on_its_way_to, own_vouchers, ready_at, round_closing,
    went_on_without,
)
from p2p_diloco.swarm.records import ProgressValue

A, B = "a" * 64, "b" * 64


def rec(peer, step, phase=TRAINING, sha=A, at=0.0):
    return PeerProgress(peer, step, sha, phase, time=at)


def test_a_round_moves_through_its_phases_and_nothing_else():
    phases = [None, TRAINING, READY, READY, COMMITTING, TRAINING, READY, TRAINING, READY, LOADING, TRAINING, READY,
              COMMITTING, LOADING, TRAINING, "left"]
    for old, new in zip(phases, phases[1:]):
        check_transition(old, new)
    for old, new in [(None, READY), (LOADING, READY), (KEEPING, TRAINING), ("left", TRAINING),
                     (TRAINING, COMMITTING), (COMMITTING, READY), (LOADING, COMMITTING)]:
        with pytest.raises(IllegalTransition, match="cannot move"):
            check_transition(old, new)


def test_the_records_schema_allows_exactly_the_phases():
    allowed = set(ProgressValue.__fields__["phase"].type_.__args__)
    assert allowed == {p.value for p in Phase} and set(TRANSITIONS) - {None} == set(Phase)


def test_a_peer_ready_or_committing_at_the_step_before_is_on_its_way_and_busy():
    # the commit window is a phase of its own: READY at 3 is a round in flight, COMMITTING at 3 one agreed
    assert committing_toward(rec("x", 3, COMMITTING), 4) and not committing_toward(rec("x", 3, READY), 4)
    assert on_its_way_to(rec("x", 3, READY), 4) and on_its_way_to(rec("x", 3, COMMITTING), 4)
    assert not on_its_way_to(rec("x", 3, TRAINING), 4) and not on_its_way_to(rec("x", 2, COMMITTING), 4)
    records = {"me": rec("me", 4, READY), "x": rec("x", 3, READY), "y": rec("y", 4, LOADING),
               "z": rec("z", 4, TRAINING), "k": rec("k", 4, KEEPING), "w": rec("w", 5, TRAINING),
               "c": rec("c", 3, COMMITTING)}
    assert busy_toward(records, 4, "me") == {"x": READY, "y": LOADING, "z": TRAINING, "c": COMMITTING}
    other_state = {**records, "z": rec("z", 4, TRAINING, sha=B)}  # it cannot be in this peer's round
    assert busy_toward(other_state, 4, "me", A) == {"x": READY, "y": LOADING, "c": COMMITTING}
    assert {r.peer_id for r in averaging_peers(records, "me")} == {"x", "y", "z", "w", "c"}  # a keeper never averages
    assert own_vouchers(records, "me", 4, A) == {"me", "x", "z", "k", "c"}  # loading vouches for nothing
    assert [r.peer_id for r in keepers(records, "me")] == ["k"] and not averages(records["k"])
    assert set(ready_at(records, 4)) == {"me"} and set(ready_at(records, 3, B)) == set()


def test_the_fastest_peer_closes_the_round_and_a_group_that_went_on_is_seen():
    assert not round_closing({"me": rec("me", 4)}, 4, "me")
    assert round_closing({"me": rec("me", 4), "x": rec("x", 4, READY)}, 4, "me")
    assert round_closing({"me": rec("me", 4), "x": rec("x", 5)}, 4, "me")
    gone_on = {"me": rec("me", 4, READY), "x": rec("x", 5)}
    assert went_on_without(gone_on, 4, "me")
    assert not went_on_without({**gone_on, "y": rec("y", 4, READY)}, 4, "me")  # a liar ahead changes nothing
    # a peer committing at the step closed the round, and is not there to average with once others went on
    assert round_closing({"me": rec("me", 4), "x": rec("x", 4, COMMITTING)}, 4, "me")
    committed = {"me": rec("me", 4, READY), "x": rec("x", 4, COMMITTING), "w": rec("w", 5)}
    assert went_on_without(committed, 4, "me") and not went_on_without({**committed, "x": rec("x", 4, READY)}, 4, "me")
    assert set(ready_at(committed, 4)) == {"me", "x"}  # planned in: a late peer forms no second group beside it
    # three of a round's planned members left behind by the rest: each sees the two others still ready, and the
    # count says the group went on (the simulation, 16 peers, seed 39); a liar outside the plan counts for nothing
    planned = ["me", "a", "b", "c", "d", "e"]
    behind = {"me": rec("me", 4, READY), "a": rec("a", 4, READY), "b": rec("b", 4, READY),
              "c": rec("c", 5), "d": rec("d", 5), "e": rec("e", 5, READY)}
    assert went_on_without(behind, 4, "me", planned)
    assert not went_on_without({**behind, "c": rec("c", 4, READY)}, 4, "me", planned)  # 2 past, 3 at the step
    liar = {"me": rec("me", 4, READY), "a": rec("a", 4, READY), "liar": rec("liar", 9)}
    assert not went_on_without(liar, 4, "me", ["me", "a"]) and not went_on_without(liar, 4, "me")


def test_a_record_seen_once_stands_until_it_expires_or_is_replaced():
    seen = merge_seen({}, [(rec("x", 3, at=1.0), 100.0)], now=0.0)
    seen = merge_seen(seen, [], now=50.0)  # a read that missed it
    assert seen["x"][0].outer_step == 3
    seen = merge_seen(seen, [(rec("x", 4, at=2.0), 100.0), (rec("y", 1, at=0.5), 60.0)], now=50.0)
    assert seen["x"][0].outer_step == 4
    assert set(merge_seen(seen, [], now=70.0)) == {"x"}  # y expired at 60


def test_the_ledger_sets_claims_aside_until_their_author_moves_on_or_the_state_is_served():
    ledger = TrustLedger("me")
    seen = {"me": (rec("me", 3), math.inf), "x": (rec("x", 4, sha=B), 100.0)}
    assert ledger.set_aside({"me": (3, A), "x": (4, B)}, now=0.0) == ["x"]  # never its own
    records, aside = ledger.split(seen, now=10.0)
    assert set(records) == {"me"} and set(aside) == {"x"}
    ledger.served(4, B)
    assert set(ledger.split(seen, now=10.0)[0]) == {"me", "x"}
    ledger.set_aside({"x": (4, B)}, now=0.0)
    same_step = {**seen, "x": (rec("x", 4, sha=A), 100.0)}  # another state at the same step: still aside
    assert set(ledger.split(same_step, now=10.0)[0]) == {"me"}
    assert set(ledger.split(same_step, now=ASIDE_S + 1)[0]) == {"me", "x"}  # asked again after a while
    ledger.set_aside({"x": (4, B)}, now=0.0)
    moved = {**seen, "x": (rec("x", 5, sha=A), 100.0)}
    assert set(ledger.split(moved, now=10.0)[0]) == {"me", "x"} and "x" not in ledger.unverified
    assert set(ledger.split(moved, now=200.0)[0]) == {"me"}  # x's record expired at 100


def test_an_identity_whose_claims_nobody_served_twice_counts_nowhere_ahead_until_it_serves():
    """A liar that claims the run's next step at every step: each new step's claim counted again (its author moved
    on), and every peer skipped the round and failed a download, step after step (the simulation's
    `liar_following_the_run`). Two unserved claims in a row strike it for STRIKE_S: above this peer's step its
    records count in no plan; at or below, they still do. The run's history still counts them: left out, a peer
    alone stepped alone beside an honest peer struck for a freeze (the simulation, 3 peers x 200 seeds)."""
    ledger = TrustLedger("me")
    seen = {"me": (rec("me", 3), math.inf), "x": (rec("x", 4, sha=B), 1000.0)}
    ledger.set_aside({"x": (4, B)}, now=0.0, unserved=True)
    assert not ledger.struck("x", 1.0)
    seen["x"] = (rec("x", 5, sha=A), 1000.0)  # it moved on: the aside is over, and its next claim counts
    assert "x" in ledger.split(seen, now=2.0)[0] and ledger.history(seen, 2.0).outer_step == 5
    ledger.set_aside({"x": (5, A)}, now=2.0, unserved=True)  # nobody served that one either
    seen["x"] = (rec("x", 6, sha=B), 1000.0)
    records, aside = ledger.split(seen, now=3.0)
    assert ledger.struck("x", 3.0) and set(records) == {"me"} and set(aside) == {"x"}
    assert ledger.history(seen, 3.0).outer_step == 6
    seen["x"] = (rec("x", 3, sha=A), 1000.0)  # at this peer's step it is a peer like any other
    assert "x" in ledger.split(seen, now=3.0)[0]
    seen["x"] = (rec("x", 6, sha=B), 1000.0)
    assert "x" in ledger.split(seen, now=2.0 + STRIKE_S + 1)[0]  # asked again after a while
    ledger.served(6, B, donor="x")  # it served a state: forgiven
    assert not ledger.struck("x", 4.0)


def test_a_peer_never_averages_alone_while_the_run_was_seen_ahead():
    """Its records may hide the run (set aside, or missed by a read): the run's history still says where it is."""
    alone = {"me": rec("me", 4, READY)}
    assert plan_averaging(alone, 4, "me", DIRECT, history=None).action == "alone"
    assert plan_averaging(alone, 4, "me", DIRECT, history=RunHistory(4, 1, 0.0)).action == "alone"
    plan = plan_averaging(alone, 4, "me", DIRECT, history=RunHistory(9, 2, 3.0))
    assert plan.action == "skip" and "seen at outer step 9" in plan.reason


def test_refused_states_and_distrusted_peers_count_nowhere_but_history_outlives_expiry():
    ledger = TrustLedger("me")
    seen = {"x": (rec("x", 7, sha=B, at=100.0), 50.0), "y": (rec("y", 5, at=90.0), 500.0),
            "z": (rec("z", 9, LOADING, at=100.0), 500.0)}
    history = ledger.history(seen, wall_now=130.0)  # x's record expired: the run was seen at 7 all the same
    assert (history.outer_step, history.peers, history.age_s) == (7, 1, 30.0)
    ledger.refuse(B)
    assert ledger.history(seen, wall_now=130.0).outer_step == 5
    ledger.refuse(peers=["y", "me"])
    assert ledger.history(seen, wall_now=130.0) is None and "me" not in ledger.distrusted


def test_a_claim_nobody_served_once_still_counts_and_is_asked_for_again():
    """Set aside at the first unserved ask, a frozen donor's claim left its joiners training together: a second
    history (the simulation, 4 peers, seed 25). One unserved ask is a strike, no more."""
    ledger = TrustLedger("me")
    seen = {"me": (rec("me", 0), math.inf), "x": (rec("x", 20, sha=B), 1000.0)}
    assert ledger.set_aside({"x": (20, B)}, now=0.0, unserved=True) == []  # nothing set aside yet
    assert "x" in ledger.split(seen, now=1.0)[0] and not ledger.struck("x", 1.0)
    assert ledger.set_aside({"x": (20, B)}, now=6.0, unserved=True) == ["x"]  # the second: struck
    assert "x" in ledger.split(seen, now=7.0)[1]
    ledger.served(20, B, donor="y")  # another donor served the state it claimed: it told the truth
    assert not ledger.struck("x", 8.0) and "x" in ledger.split(seen, now=8.0)[0]


def test_a_struck_live_identity_leaves_the_history_after_the_grace_and_a_gone_one_never():
    """A liar claiming the step after a lone peer's held it back for good (the simulation, 3 peers, seed 166). A
    struck identity whose record stays live leaves the run's history after `history_grace_s` (at least the records'
    TTL: a crashed peer's record has expired by then); a gone peer's claim stays in it (catch_up: a run whose peers
    all left waits for them)."""
    ledger = TrustLedger("me", history_grace_s=STRUCK_IN_HISTORY_S)
    seen = {"me": (rec("me", 6), math.inf), "liar": (rec("liar", 7, sha=B), math.inf),
            "gone": (rec("gone", 5, sha=B), 30.0)}
    for now in (0.0, 5.0):
        ledger.set_aside({"liar": (7, B)}, now=now, unserved=True)
    assert ledger.history(seen, wall_now=5.0 + STRUCK_IN_HISTORY_S - 1).outer_step == 7  # a freeze: still waited on
    assert ledger.history(seen, wall_now=5.0 + STRUCK_IN_HISTORY_S).outer_step == 5  # the liar is out of it
    ledger.set_aside({"gone": (5, B)}, now=10.0, unserved=True)
    ledger.set_aside({"gone": (5, B)}, now=15.0, unserved=True)
    assert ledger.history(seen, wall_now=200.0).outer_step == 5  # expired: a gone peer's claim stays


def test_a_silent_peer_counts_in_no_plan_until_it_writes_again():
    """A crashed member's READY record stood until it expired, and every round planned with it failed to form for
    60 s (the simulation, 3 peers, seed 156): a peer that does not answer counts nowhere until its next record."""
    ledger = TrustLedger("me")
    seen = {"me": (rec("me", 26, READY), math.inf), "x": (rec("x", 26, READY, at=5.0), 60.0)}
    ledger.found_silent({"x": seen["x"][0], "me": seen["me"][0]}, ["x", "me"])  # never itself
    records, aside = ledger.split(seen, now=10.0)
    assert set(records) == {"me"} and not aside
    assert ledger.history(seen, wall_now=10.0).outer_step == 26  # the run's history still has it
    seen["x"] = (rec("x", 26, TRAINING, at=20.0), 80.0)  # it wrote again: it is back
    assert set(ledger.split(seen, now=21.0)[0]) == {"me", "x"}


def test_a_peer_at_this_step_whose_state_lost_the_vote_is_no_groupmate():
    """A liar at a lone peer's step with another state, which the vote gives to the lone peer's: planned as a
    groupmate it never came, and the lone peer failed every round for good (the simulation, 3 peers, seed 128)."""
    lone = {"me": rec("me", 26, READY, sha=B), "liar": rec("liar", 26, READY, sha=A)}  # B > A: the vote is B's
    assert plan_averaging(lone, 26, "me", DIRECT).action == "alone"
    mates = {**lone, "y": rec("y", 26, READY, sha=B)}
    assert plan_averaging(mates, 26, "me", DIRECT).action == "average"
    behind = {**lone, "z": rec("z", 25, TRAINING, sha=A)}  # a peer behind still keeps it from stepping alone
    assert plan_averaging(behind, 26, "me", DIRECT).action == "skip"


def test_a_former_groupmates_word_counts_first_until_it_is_distrusted():
    ledger = TrustLedger("me")
    ledger.averaged_with(["x", "y", "me"])  # a round's members, this peer among them
    assert ledger.trusted_word() == {"x", "y"}
    ledger.refuse(peers=["y"])  # it served a refused state, or the averager banned it
    assert ledger.trusted_word() == {"x"}
    ledger.averaged_with(["y"])  # meeting it again earns nothing back
    assert ledger.trusted_word() == {"x"}


def test_a_load_keeps_the_work_of_a_missed_round_or_a_lost_vote_and_nothing_a_state_may_hold():
    assert keeps_work(4, 5, work_sent=False)  # a round it missed: its Δ is one outer step stale
    assert keeps_work(4, 4, work_sent=False)  # the vote at its step went to another state
    assert not keeps_work(4, 5, work_sent=True)  # its Δ travelled in a failed round: the state may hold it
    assert not keeps_work(4, 7, work_sent=False)  # a jump: a Δ from three outer steps back is dropped


def test_a_leader_runs_only_with_more_than_half_of_its_plan():
    """Two halves of a plan that each met a leader of their own committed two states at one step (the simulation,
    4 peers, seeds 105, 133, 138, 150): a minority group disbands."""
    assert has_quorum(3, 4) and has_quorum(2, 3) and has_quorum(2, 2)
    assert not has_quorum(2, 4) and not has_quorum(8, 16) and has_quorum(9, 16)
    assert not has_quorum(1, 1)  # hivemind's min_group_size: a leader alone disbands
    assert has_quorum(2, 0)  # a plan that counts nobody (no plan travelled): whoever came


def test_the_quorum_counts_the_peers_read_ready_at_the_step_since_the_plan():
    """A plan made before the others' READY records were read (seed 73 of 16 peers: a partition healed meanwhile)
    must not let its 3 members pass for a quorum beside 9 others ready at the step."""
    planned = ("p1", "p2", "p3", "p4", "p5")
    records = {f"q{i}": rec(f"q{i}", 2, READY) for i in range(9)}
    records.update(late=rec("late", 2, COMMITTING), other=rec("other", 2, READY, sha=B), behind=rec("behind", 1, READY),
                   training=rec("training", 2, TRAINING), p1=rec("p1", 2, READY))
    quorum = quorum_of(planned, records, 2, A)
    assert quorum == set(planned) | {f"q{i}" for i in range(9)} | {"late"}  # not another state, step or phase
    assert not has_quorum(3, len(quorum)) and has_quorum(3, len(quorum_of(planned, {}, 2, A)))
