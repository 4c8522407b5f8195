"""The check of a downloaded state against this peer's own (p2p_diloco/train/state_check.py), on real outer steps."""

import pytest
import torch

from p2p_diloco.schedule import FragmentSchedule
from p2p_diloco.sync.codecs import get_codec
from p2p_diloco.swarm.progress import LOADING, READY, TRAINING, PeerProgress
from p2p_diloco.train.outer import GlobalModel
from p2p_diloco.protocol.trust import choose_target, moved_past, unverified_step_trusted
from p2p_diloco.train.state_check import step_problem
from tests.conftest import tiny_config

pytestmark = pytest.mark.timeout(60)

GROWTH = 16.0  # outer.max_update_growth's default


def model(momentum=0.9, lr=0.7, seed=0):
    """A GlobalModel of four tensors of different scales, from subnormal-sized values up to hundreds."""
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(5, 7, generator=generator) * scale for scale in (1.0, 300.0, 1e-3, 1e-39)]
    return GlobalModel(params, tiny_config(outer={"momentum": momentum, "lr": lr}).outer)


def snapshot(global_model):
    return [t.clone() for t in global_model.params], [t.clone() for t in global_model.momentum_buffer]


def honest_mean(global_model, indices, generator, first):
    """A pseudo-gradient the update check accepts: below ‖θ‖ at the first step, below ‖b‖ after it."""
    scale = 0.05 if first else 0.3
    mean = []
    for i in indices:
        basis = global_model.params[i] if first else global_model.momentum_buffer[i]
        mean.append(torch.randn(basis.shape, generator=generator) * basis.abs().mean() * scale)
    return mean


def check(global_model, before, fragments, fragment, state=None, sparse=False):
    params, momentum_buffer = before
    return step_problem(params, momentum_buffer, state if state is not None else global_model.state_tensors(),
                        fragments, fragment, global_model.lr, global_model.momentum, GROWTH, sparse=sparse)


def stepped(momentum=0.9, fragments=((0, 1, 2, 3),), steps=6, seed=0):
    """(model after `steps` honest outer steps, the state before the last, the schedule, the last fragment)."""
    global_model = model(momentum, seed=seed)
    schedule = FragmentSchedule([list(f) for f in fragments], steps_per_outer=10 * len(fragments), sync_delay=0)
    generator = torch.Generator().manual_seed(seed + 1)
    taken = [0] * len(fragments)
    for step in range(steps):
        fragment = schedule.fragment_at(step)
        before = snapshot(global_model)
        indices = schedule.fragments[fragment]
        global_model.apply(honest_mean(global_model, indices, generator, first=taken[fragment] == 0), indices)
        taken[fragment] += 1
        assert check(global_model, before, schedule.fragments, fragment) is None, f"honest step {step} refused"
    return global_model, before, schedule, fragment


@pytest.mark.parametrize("seed", range(5))
def test_honest_steps_pass(seed):
    stepped(seed=seed, steps=8)


def test_honest_streaming_steps_move_one_fragment_and_pass():
    global_model, before, schedule, fragment = stepped(fragments=((0, 2), (1, 3)), steps=7)
    assert fragment == 0
    for i in schedule.fragments[1]:  # the other fragment did not move
        assert torch.equal(global_model.params[i], before[0][i])
    # checked as if the other fragment had synced, the step changes a fragment it must not
    assert "changed, but an outer step" in check(global_model, before, schedule.fragments, 1)


def test_plain_sgd_steps_pass_and_momentum_must_stay_zero():
    global_model, before, schedule, fragment = stepped(momentum=0.0)
    assert check(global_model, before, schedule.fragments, fragment) is None
    state = global_model.state_tensors()
    state[4] = state[4] + 1e-3
    assert "stays zero" in check(global_model, before, schedule.fragments, fragment, state)


def test_a_step_of_a_mask_codecs_round_passes_in_a_sparse_run_only():
    """A round of a shared-mask codec steps only the values it carried (GlobalModel.apply): in a run whose codec
    sends a subset, the values left as they were pass, with no update there; in a dense run they are refused. A
    value whose θ moved alone, its momentum left as it was, is refused in either."""
    global_model, _, schedule, fragment = stepped(steps=3)
    before = snapshot(global_model)
    indices = schedule.fragments[fragment]
    generator = torch.Generator().manual_seed(7)
    codec = get_codec("mask8-e3m0").for_round(b"round")
    carried = [codec.carried(global_model.params[i].numel()).view_as(global_model.params[i]) for i in indices]
    mean = [torch.where(c, g, 0.0) for c, g in zip(carried, honest_mean(global_model, indices, generator, False))]
    global_model.apply(mean, indices, carried)
    assert check(global_model, before, schedule.fragments, fragment, sparse=True) is None
    assert "is not θ − η·(g + μ·b')" in check(global_model, before, schedule.fragments, fragment)
    state = [t.clone() for t in global_model.state_tensors()]
    not_carried = int((~carried[0]).flatten().nonzero()[0])
    state[0].view(-1)[not_carried] += 1e-4 * float(state[0].abs().max())
    assert "θ' of tensor 0 is not" in check(global_model, before, schedule.fragments, fragment, state, sparse=True)


def test_a_poisoned_theta_is_refused():
    global_model, before, schedule, fragment = stepped()
    state = [t.clone() for t in global_model.state_tensors()]
    state[0][2, 3] += 1e-4 * float(state[0].abs().max())  # one element, far below the update's own size
    assert "θ' of tensor 0 is not" in check(global_model, before, schedule.fragments, fragment, state)
    state = [t.clone() for t in global_model.state_tensors()]
    state[1].mul_(-1)  # θ replaced wholesale, momentum untouched
    assert "θ' of tensor 1 is not" in check(global_model, before, schedule.fragments, fragment, state)


def test_a_scaled_momentum_is_refused():
    global_model, before, schedule, fragment = stepped()
    count = len(global_model.params)
    for factor, why in ((100.0, "fails the update check"), (1.01, "is not θ − η·(g + μ·b')")):
        state = [t.clone() for t in global_model.state_tensors()]
        for t in state[count:]:
            t.mul_(factor)
        assert why in check(global_model, before, schedule.fragments, fragment, state), factor


def test_a_poisoned_state_consistent_with_its_momentum_fails_the_update_check():
    # the forger applies a huge g through the real Nesterov step: θ' and b' agree, the update does not
    global_model = model()
    schedule = FragmentSchedule([[0, 1, 2, 3]], steps_per_outer=10, sync_delay=0)
    generator = torch.Generator().manual_seed(3)
    global_model.apply(honest_mean(global_model, [0, 1, 2, 3], generator, first=True), [0, 1, 2, 3])
    before = snapshot(global_model)
    global_model.apply([100 * p for p in global_model.params], [0, 1, 2, 3])
    assert "fails the update check" in check(global_model, before, schedule.fragments, 0)


def test_a_change_in_another_fragment_is_refused_to_the_last_bit():
    global_model, before, schedule, fragment = stepped(fragments=((0, 2), (1, 3)), steps=5)
    assert fragment == 0
    state = [t.clone() for t in global_model.state_tensors()]
    state[1].view(torch.int32)[0, 0] ^= 1  # one ulp of one element of θ in the fragment that did not sync
    assert "tensor 1 changed" in check(global_model, before, schedule.fragments, fragment, state)
    state = [t.clone() for t in global_model.state_tensors()]
    state[4 + 3].view(torch.int32)[0, 0] ^= 1  # and of its momentum
    assert "tensor 3 changed" in check(global_model, before, schedule.fragments, fragment, state)


# ----- what the records vouch for ------------------------------------------------------------------
def rec(peer, step, sha, phase=TRAINING):
    return PeerProgress(peer, step, sha, phase)


def test_peers_in_step_do_not_follow_one_identitys_jump():
    records = {"me": rec("me", 4, "aa"), "b": rec("b", 4, "aa"), "evil": rec("evil", 9, "ff")}
    assert choose_target(records, "me", 4, "aa", (9, "ff"))[0] is None
    # nor right after an outer step, while a groupmate's record still says it commits the round
    records = {"me": rec("me", 4, "aa"), "b": rec("b", 3, "00", READY), "evil": rec("evil", 9, "ff")}
    assert choose_target(records, "me", 4, "aa", (9, "ff"))[0] is None
    # a state one step ahead is always worth a download: it is verified before it is used
    records["evil"] = rec("evil", 5, "ff")
    assert choose_target(records, "me", 4, "aa", (5, "ff"))[0] == (5, "ff")


def test_a_peer_alone_in_its_step_trusts_the_best_vouched_state_above_it():
    # a joiner (or a straggler left behind alone): the frontier's liar loses to the run's peers
    records = {"me": rec("me", 0, "00"), "a": rec("a", 6, "aa"), "b": rec("b", 6, "aa"), "c": rec("c", 6, "aa"),
               "evil": rec("evil", 10**6, "ff")}
    assert choose_target(records, "me", 0, "00", (10**6, "ff"))[0] == (6, "aa")
    assert choose_target(records, "me", 0, "00", (6, "aa"))[0] == (6, "aa")
    # while one of them still commits the round (ready at step 5), 2 against 2 decides nothing: it waits
    records["c"] = rec("c", 5, "cc", READY)
    assert choose_target(records, "me", 0, "00", (10**6, "ff"))[0] is None
    # a peer that loads vouches for nothing, not even the state it loads, but counts against every claim:
    # with one of 2 honest peers loading, the liar one step ahead of the other no longer wins the tie
    records = {"me": rec("me", 0, "00"), "a": rec("a", 7, "aa"), "b": rec("b", 7, "00", LOADING),
               "evil": rec("evil", 8, "ff")}
    assert choose_target(records, "me", 0, "00", (8, "ff"))[0] is None
    records["b"] = rec("b", 7, "aa")  # it loaded
    assert choose_target(records, "me", 0, "00", (8, "ff"))[0] == (7, "aa")
    records["evil"] = rec("evil", 8, "ff", LOADING)  # nor does a liar's loading record vouch for what it claims
    assert choose_target(records, "me", 0, "00", (8, "ff"))[0] == (7, "aa")
    # nor does this peer's own record count, left loading by a download that failed
    records["me"] = rec("me", 7, "00", LOADING)
    assert choose_target(records, "me", 0, "00", (7, "aa"))[0] == (7, "aa")
    # a record whose claim this peer set aside (a jump it would not take on one voucher) counts against
    # every other claim: left out, one honest peer that had just stepped left the other tied with the
    # liar one step ahead of both (a CI run's joiner took the poison so) ...
    records = {"me": rec("me", 0, "00"), "a": rec("a", 15, "aa"), "evil": rec("evil", 16, "ff")}
    set_aside = {"b": rec("b", 15, "aa")}
    # ... and it still vouches for a state that a live record claims too (in a later CI run a joiner set
    # aside every honest claim so, one by one, and averaged alone)
    assert choose_target(records, "me", 0, "00", (16, "ff"), set_aside=set_aside)[0] == (15, "aa")
    records["b"] = rec("b", 15, "aa")  # its record back: a set-aside claim does not count against itself
    assert choose_target(records, "me", 0, "00", (16, "ff"), set_aside=set_aside)[0] == (15, "aa")
    # but not for a claim that only set-aside records make
    assert choose_target({"me": rec("me", 0, "00"), "evil": rec("evil", 16, "ff")}, "me", 0, "00", (16, "ff"),
                         set_aside={"b": rec("b", 15, "aa")})[0] is None


def test_a_tie_among_the_claims_above_decides_nothing():
    # a joiner's DHT read missed the record of one of 2 honest peers: the liar one step ahead of the other
    # ties with it, and took the later step's tie in three CI runs; now the joiner waits and reads again
    records = {"me": rec("me", 0, "00"), "a": rec("a", 12, "aa"), "evil": rec("evil", 13, "ff")}
    assert choose_target(records, "me", 0, "00", (13, "ff"))[0] is None
    records["b"] = rec("b", 12, "aa")  # the next read finds it
    assert choose_target(records, "me", 0, "00", (13, "ff"))[0] == (12, "aa")
    # nor does the one-state tie of a group that commits a round decide, when nothing else is claimed
    records = {"me": rec("me", 0, "00"), "a": rec("a", 12, "aa", READY), "b": rec("b", 13, "bb")}
    assert choose_target(records, "me", 0, "00", (13, "bb"))[0] is None
    # while the run's records are split between two steps (a group commits), a third claim is not trusted
    records = {"me": rec("me", 0, "00"), "a": rec("a", 6, "aa", READY), "b": rec("b", 7, "bb"),
               "evil": rec("evil", 8, "ff")}
    assert choose_target(records, "me", 0, "00", (8, "ff"))[0] is None
    # a straggler left alone: a former groupmate's word counts before a stranger's, even one step further
    records = {"me": rec("me", 13, "00"), "mate": rec("mate", 16, "aa"), "evil": rec("evil", 17, "ff")}
    assert choose_target(records, "me", 13, "00", (17, "ff"), frozenset({"mate"}))[0] == (16, "aa")
    assert choose_target(records, "me", 13, "00", (17, "ff"))[0] is None  # a joiner cannot tell them apart
    # alone against one identity, it trusts on first use
    assert choose_target({"me": rec("me", 4, "00"), "a": rec("a", 6, "aa")}, "me", 4, "00", (6, "aa"))[0] == (6, "aa")
    # joiners at step 0 together vouch for nothing: the run's initial state is every fresh peer's
    records = {"me": rec("me", 0, "00"), "b": rec("b", 0, "00"), "first": rec("first", 2, "aa")}
    assert choose_target(records, "me", 0, "00", (2, "aa"))[0] == (2, "aa")


def test_ties_go_to_the_later_step_so_equal_halves_join_again():
    records = {"me": rec("me", 4, "aa"), "b": rec("b", 4, "aa"), "c": rec("c", 7, "cc"), "d": rec("d", 7, "cc")}
    assert choose_target(records, "me", 4, "aa", (7, "cc"))[0] == (7, "cc")
    records["e"] = rec("e", 4, "aa")  # a larger group behind is the swarm: it keeps its state
    assert choose_target(records, "me", 4, "aa", (7, "cc"))[0] is None


def test_a_failed_step_is_taken_only_on_more_than_one_identitys_word():
    records = {"me": rec("me", 4, "aa"), "evil": rec("evil", 5, "ff")}
    assert not unverified_step_trusted(records, "me", 4, "aa", (5, "ff"))
    # this peer forked: two peers moved on from a state it does not hold
    records = {"me": rec("me", 4, "aa"), "c": rec("c", 5, "cc"), "d": rec("d", 5, "cc")}
    assert unverified_step_trusted(records, "me", 4, "aa", (5, "cc"))
    records["b"] = rec("b", 4, "aa")
    records["e"] = rec("e", 4, "aa")
    assert not unverified_step_trusted(records, "me", 4, "aa", (5, "cc"))


def test_the_run_moved_past_a_step_only_by_a_state_this_peer_would_load():
    """A round at a step is over once a state above it is one this peer would load (choose_target). One liar's
    claim three steps ahead ended the rounds of 16 peers whenever it claimed a new step, and the LOADING records of
    peers trying a liar's claim one step ahead ended every round at the step for 70 s (the simulation, 16 peers,
    seeds 28 and 36)."""
    in_step = {peer: rec(peer, 13, "aa", READY) for peer in ("me", "b", "c")}
    assert not moved_past(in_step, "me", 13, "aa")
    assert not moved_past({**in_step, "evil": rec("evil", 16, "ff")}, "me", 13, "aa")  # a jump nobody vouches for
    assert not moved_past({**in_step, "b": rec("b", 14, "aa", LOADING)}, "me", 13, "aa")  # it holds nothing yet
    assert moved_past({**in_step, "b": rec("b", 14, "bb")}, "me", 13, "aa")  # a groupmate's next step
    went_on = {**in_step, "b": rec("b", 16, "dd"), "c": rec("c", 16, "dd")}  # two vouch for a jump: the run left
    assert moved_past(went_on, "me", 13, "aa")
