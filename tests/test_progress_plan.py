"""How a peer decides, from the progress records alone, to train or to load the agreed state."""

from dataclasses import replace

import pytest

from p2p_diloco.swarm.identity import Identity
from p2p_diloco.protocol.plans import agreed_sha256, plan_averaging, plan_round
from p2p_diloco.protocol.ledger import merge_seen
from p2p_diloco.protocol.view import dialable
from p2p_diloco.swarm.liveness import SilentPeers
from p2p_diloco.swarm.progress import LEFT, LOADING, READY, TRAINING, PeerProgress, parse_progress
from p2p_diloco.swarm.reachability import DIRECT, UNREACHABLE
from p2p_diloco.sync.assistant import RoundsToAssist, step_needing_help


def rec(peer, step, sha, phase=TRAINING):
    return PeerProgress(peer, step, sha, phase)


def test_in_step_peer_trains():
    records = {p: rec(p, 3, "aa") for p in "abc"}
    assert plan_round(records, 3, "aa").action == "train"


def test_behind_peer_loads_the_frontier():
    records = {"a": rec("a", 5, "ff"), "b": rec("b", 5, "ff"), "me": rec("me", 2, "00")}
    plan = plan_round(records, 2, "00")
    assert (plan.action, plan.target_step, plan.target_sha256) == ("load", 5, "ff")


def test_minority_state_at_the_same_step_loads_the_majority():
    records = {"a": rec("a", 4, "bb"), "b": rec("b", 4, "bb", READY), "me": rec("me", 4, "cc")}
    plan = plan_round(records, 4, "cc")
    assert (plan.action, plan.target_sha256) == ("load", "bb")
    assert plan_round(records, 4, "bb").action == "train"


def test_ties_are_broken_the_same_way_everywhere():
    records = {"a": rec("a", 1, "11"), "b": rec("b", 1, "22")}
    assert agreed_sha256(records, 1) == "22"
    assert plan_round(records, 1, "11").action == "load"
    assert plan_round(records, 1, "22").action == "train"


def test_no_vote_at_this_step_while_a_peer_is_committing_its_way_here():
    # "me" just took step 4 with "a", whose new record is not read yet; a stranger claims another state at 4
    records = {"a": rec("a", 3, "aa", READY), "stranger": rec("stranger", 4, "ff"), "me": rec("me", 4, "cc")}
    assert plan_round(records, 4, "cc").action == "train"
    records["a"] = rec("a", 4, "cc")  # it landed: two against one
    assert plan_round(records, 4, "cc").action == "train"
    assert plan_round(records, 4, "ff").action == "load"


def test_alone_trains():
    assert plan_round({}, 0, "x").action == "train"


def test_a_loading_peer_neither_sets_the_frontier_nor_votes():
    # "c" and "e" announced they are downloading a state; the sha256 they publish is not that state's
    records = {"a": rec("a", 7, "aa"), "b": rec("b", 7, "aa", READY), "c": rec("c", 7, "ff", LOADING),
               "e": rec("e", 7, "ff", LOADING), "d": rec("d", 9, "99", LOADING)}
    assert plan_round(records, 7, "aa").action == "train"


def test_a_load_plan_names_the_records_that_vouch_for_its_target():
    records = {"a": rec("a", 5, "ff"), "b": rec("b", 5, "ff"), "c": rec("c", 5, "ee"), "me": rec("me", 2, "00")}
    plan = plan_round(records, 2, "00")
    assert plan.claims == {"a": (5, "ff"), "b": (5, "ff")}


FINGERPRINT = "f" * 64
GOOD = dict(outer_step=3, sha256="ab" * 32, phase="training", samples=12, time=1.0, fingerprint=FINGERPRINT,
            reachability="direct", leader="")


def test_a_signed_record_speaks_for_its_signer_only():
    identity = Identity.load_or_create(None)
    record = parse_progress(identity.record_subkey, dict(GOOD), FINGERPRINT)
    assert record.peer_id == identity.peer_id and record.outer_step == 3


@pytest.mark.parametrize("change", [
    {"outer_step": "9"}, {"outer_step": -1}, {"outer_step": 2**40}, {"samples": 1.5}, {"sha256": "xyz"},
    {"phase": "bogus"}, {"time": float("nan")}, {"extra": 1}, {"leader": "not base58!"}, {"leader": None},
    {"leader": "Q" * 65},
])
def test_malformed_progress_records_are_ignored(change):
    identity = Identity.load_or_create(None)
    assert parse_progress(identity.record_subkey, {**GOOD, **change}, FINGERPRINT) is None


def test_records_without_an_owner_or_of_other_settings_are_ignored():
    identity = Identity.load_or_create(None)
    assert parse_progress(b"no owner", dict(GOOD), FINGERPRINT) is None
    assert parse_progress(identity.record_subkey, "garbage", FINGERPRINT) is None
    assert parse_progress(identity.record_subkey, dict(GOOD), "e" * 64) is None


def rec_at(peer, step, reachability, phase=READY):
    return PeerProgress(peer, step, "aa", phase, 8, 0.0, reachability)


def test_a_peer_steps_alone_only_in_an_empty_swarm():
    assert plan_averaging({"me": rec_at("me", 4, DIRECT)}, 4, "me", DIRECT).action == "alone"
    behind = {"me": rec_at("me", 4, DIRECT), "b": rec_at("b", 2, DIRECT, TRAINING)}
    plan = plan_averaging(behind, 4, "me", DIRECT)
    assert plan.action == "skip" and "not stepping alone" in plan.reason


def test_a_group_of_unreachable_peers_needs_an_assistant():
    records = {"me": rec_at("me", 4, UNREACHABLE), "b": rec_at("b", 4, UNREACHABLE)}
    plan = plan_averaging(records, 4, "me", UNREACHABLE)
    assert plan.action == "average" and plan.needs_assistant
    records["c"] = rec_at("c", 4, DIRECT)
    assert not plan_averaging(records, 4, "me", UNREACHABLE).needs_assistant
    assert not plan_averaging(records, 4, "c", DIRECT).needs_assistant


def test_an_assistant_helps_only_where_every_ready_peer_is_unreachable():
    unreachable = [rec_at(p, 4, UNREACHABLE) for p in "ab"]
    assert step_needing_help(unreachable) == 4
    assert step_needing_help([*unreachable, rec_at("c", 4, DIRECT)]) is None  # c reduces
    assert step_needing_help([*unreachable, rec_at("c", 4, UNREACHABLE, TRAINING)]) is None  # not ready yet
    assert step_needing_help(unreachable[:1]) is None  # nobody to average with


def test_an_assistant_joins_each_publication_of_ready_records_once():
    rounds = RoundsToAssist()
    ready = [rec_at(p, 4, UNREACHABLE) for p in "ab"]
    assert rounds.next_round(ready) == 4
    assert rounds.next_round(ready) is None  # the records of the round it just reduced, still "ready"
    retried = [replace(r, time=r.time + 30) for r in ready]  # the peers publish "ready" again: a retry
    assert rounds.next_round(retried) == 4
    assert rounds.next_round([rec_at(p, 5, UNREACHABLE) for p in "ab"]) == 5


def test_an_assistant_joins_no_round_for_one_newcomer_beside_the_records_of_the_round_it_reduced():
    """The NAT test's keeper run in CI: a and b's round toward step 5 was reduced, and their records still said
    "ready" at 4 when a joiner c published "ready" there on its way to load step 5; the assistant joined a round
    at 4 that never formed, while a, b and c waited 35 s for a reducer at 5."""
    rounds = RoundsToAssist()
    reduced = [rec_at(p, 4, UNREACHABLE) for p in "ab"]
    assert rounds.next_round(reduced) == 4
    assert rounds.next_round([*reduced, rec_at("c", 4, UNREACHABLE)]) is None  # c has nobody new to average with
    assert rounds.next_round([*reduced, rec_at("c", 4, UNREACHABLE), rec_at("d", 4, UNREACHABLE)]) == 4  # c and d do


def test_an_assistant_leaves_a_round_that_has_not_formed_for_a_later_step_that_needs_help():
    rounds = RoundsToAssist()
    at_4 = [rec_at(p, 4, UNREACHABLE) for p in "abc"]
    assert rounds.next_round(at_4) == 4
    assert rounds.overtaken(at_4, 4) is None  # its peers are still there
    moved_on = [rec_at(p, 5, UNREACHABLE) for p in "ab"] + at_4[2:]
    assert rounds.overtaken(moved_on, 4) == 5
    assert rounds.overtaken([rec_at("a", 5, UNREACHABLE), *at_4[1:]], 4) is None  # one peer at 5 needs nobody
    assert rounds.next_round(moved_on) == 5


def test_a_waiting_peer_gives_up_only_on_reachable_peers_that_do_not_answer_twice():
    silent = SilentPeers(answering=lambda peers: {"alive"} & set(peers), check_period_s=0.0)  # checks on every call
    assert silent.check(["alive", "dead"]) == []  # one miss is not enough
    assert silent.check(["alive", "dead"]) == ["dead"]
    assert silent.gone == {"dead"}
    # the wait asks only the busy peers that others can dial: one behind NAT may not answer, and is waited for
    busy = {r.peer_id: r for r in (rec_at("alive", 4, DIRECT, TRAINING), rec_at("behind-nat", 4, UNREACHABLE, TRAINING))}
    assert dialable(busy) == ["alive"]


def test_a_record_that_a_read_misses_stands_until_it_expires_or_its_author_replaces_it():
    def rec(peer, step, phase=READY, at=0.0):
        return PeerProgress(peer, step, "ab" * 32, phase, time=at)

    seen = merge_seen({}, [(rec("a", 3, at=1.0), 100.0), (rec("b", 3, at=1.0), 50.0)], now=10.0)
    # the next read misses b (a slow DHT node): b stands; a moved on: its newer record replaces the old one
    seen = merge_seen(seen, [(rec("a", 4, TRAINING, at=2.0), 110.0)], now=20.0)
    assert {peer: r.outer_step for peer, (r, _) in seen.items()} == {"a": 4, "b": 3}
    # an older record of a, read late from another node, does not replace its newer one
    seen = merge_seen(seen, [(rec("a", 3, at=1.0), 100.0)], now=21.0)
    assert seen["a"][0].outer_step == 4
    # b's record expires unless b refreshes it; a's LEFT record replaces its last one (the caller omits it)
    seen = merge_seen(seen, [(rec("a", 4, LEFT, at=3.0), 120.0)], now=60.0)
    assert set(seen) == {"a"} and seen["a"][0].phase == LEFT
