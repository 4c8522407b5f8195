"""One membership per outer step (p2p_diloco/sync/membership.py), and a failed member costs only itself
(p2p_diloco/train/round_sync.py's attempts).

The plan is a function of the progress records: tested here on records alone. The swarm test runs 6
real peers on 127.0.0.1, started together: every step must be averaged by all 6 in one group, and a
member SIGKILLed mid all-reduce must cost the 5 others no step (they average again without it).
"""

import asyncio
import dataclasses
import hashlib

import pytest
import torch

from p2p_diloco.metrics import read_metrics
from p2p_diloco.swarm.progress import LOADING, READY, TRAINING, PeerProgress
from p2p_diloco.swarm.reachability import DIRECT, UNREACHABLE
from p2p_diloco.sync import membership
from p2p_diloco.protocol.membership import MAX_LEADERS, has_quorum, plan_membership
from p2p_diloco.sync.group_screen import GroupMetadata
from p2p_diloco.sync.membership import HOLD_S, PlannedMatchmaking
from tests.allreduce_case import START
from tests.swarm_helpers import (
    FAST_TIMEOUTS, assert_consistent, outer_steps, proc, start_bootstrap, start_peer, tiny_config_file,
    wait_for_steps, wait_until,
)
from tests.test_exact_allreduce import SHAPES, run_case

STATE = "ab" * 32


def record(peer: str, step: int = 4, phase: str = READY, sha: str = STATE, reachability: str = DIRECT) -> PeerProgress:
    return PeerProgress(peer, step, sha, phase, reachability=reachability)


def peer_ids(count: int) -> list[str]:  # base58-looking IDs; only their order matters here
    return [f"Qm{hashlib.sha256(str(i).encode()).hexdigest()[:44]}" for i in range(count)]


def test_every_peer_with_the_same_records_plans_the_same_leaders():
    peers = peer_ids(10)
    records = {p: record(p) for p in peers}
    plans = {plan_membership(records, 4, STATE, p, DIRECT) for p in peers}
    assert len(plans) == 1
    plan = plans.pop()
    assert plan.expected == 10 and len(plan.leaders) == MAX_LEADERS and set(plan.leaders) <= set(peers)
    # the order rotates with the step: over a few steps, more than one peer leads
    firsts = {plan_membership(records, step, STATE, peers[0], DIRECT).leaders[0] for step in range(12)}
    assert len(firsts) > 1
    # and with every attempt at one step: rounds that keep failing there do not keep one leader
    firsts = {plan_membership(records, 4, STATE, peers[0], DIRECT, attempt).leaders[0] for attempt in range(1, 13)}
    assert len(firsts) > 1


def test_the_plan_counts_ready_peers_of_this_state_and_leads_with_dialable_ones():
    peers = peer_ids(6)
    records = {
        peers[0]: record(peers[0]),
        peers[1]: record(peers[1], reachability=UNREACHABLE),  # a member, never a leader
        peers[2]: record(peers[2], phase=TRAINING),  # still training after round_wait_timeout: not expected
        peers[3]: record(peers[3], phase=LOADING),
        peers[4]: record(peers[4], sha="cd" * 32),  # another state: it could not average with this one
        peers[5]: record(peers[5], step=5),
    }
    plan = plan_membership(records, 4, STATE, peers[0], DIRECT)
    assert plan.expected == 2 and plan.leaders == (peers[0],)
    # this peer's own record may not be fresh yet: it is a member anyway
    assert plan_membership({}, 4, STATE, peers[0], DIRECT).expected == 1
    # nobody at the step can be dialled: no plan, hivemind's matchmaking (and an assistant) instead
    assert plan_membership({peers[1]: records[peers[1]]}, 4, STATE, peers[0], UNREACHABLE) is None


def test_a_retry_plans_among_the_failed_attempts_members_and_waits_for_no_newcomer():
    peers = peer_ids(5)
    first = plan_membership({p: record(p) for p in peers[:3]}, 4, STATE, peers[0], DIRECT)
    # peers[2] died in the round; peers[3] and peers[4] became ready at the step meanwhile
    now = {p: record(p) for p in (peers[0], peers[1], peers[3], peers[4])}
    retry = plan_membership(now, 4, STATE, peers[0], DIRECT, attempt=2, among=first.members)
    assert set(retry.members) == {peers[0], peers[1]} and set(retry.leaders) <= {peers[0], peers[1]}
    assert plan_membership(now, 4, STATE, peers[0], DIRECT, attempt=2).expected == 4  # without `among`: everyone


def test_a_peer_that_plans_later_asks_the_leader_its_groupmates_already_ask():
    """The first planners named a leader; newcomers at the step would rank another first among more peers and
    form a second group at the step (the simulation, 16 peers, seed 8): they ask the named one first."""
    peers = peer_ids(12)
    early = {p: record(p) for p in peers[:6]}
    first = plan_membership(early, 4, STATE, peers[0], DIRECT).leaders[0]
    asked = {p: dataclasses.replace(r, leader=first) for p, r in early.items()}
    newcomers = {p: record(p) for p in peers[6:]}
    for peer in peers:
        plan = plan_membership({**asked, **newcomers}, 4, STATE, peer, DIRECT)
        assert plan.leaders[0] == first and plan.expected == 12 and len(set(plan.leaders)) == len(plan.leaders)
    # a leader named by no ready member of the plan (gone, or a stranger's pick) is not followed
    stranger = {p: dataclasses.replace(r, leader="QmNotAMember" + "x" * 30) for p, r in early.items()}
    assert plan_membership(stranger, 4, STATE, peers[0], DIRECT) == plan_membership(early, 4, STATE, peers[0], DIRECT)
    # the most named wins; a retry (among the failed round's members) ranks anew
    split = {**asked, peers[1]: dataclasses.replace(asked[peers[1]], leader=peers[5])}
    assert plan_membership(split, 4, STATE, peers[0], DIRECT).leaders[0] == first
    retry = plan_membership(asked, 4, STATE, peers[0], DIRECT, attempt=2, among=tuple(early))
    assert retry == plan_membership(early, 4, STATE, peers[0], DIRECT, attempt=2, among=tuple(early))


def leader_not_leading_yet(request_timeout: float) -> PlannedMatchmaking:
    """The part of a planned leader that holds join requests, alone: no DHT, no p2p daemon (the swarm tests
    below run the whole of it)."""
    leader = PlannedMatchmaking.__new__(PlannedMatchmaking)
    leader.began_leading, leader.request_timeout = asyncio.Event(), request_timeout
    return leader


async def hivemind_answers(log: list):
    """Stands for hivemind's join handler: what it did, in order."""
    log.append("answered")
    try:
        yield "ACCEPTED"
    finally:
        log.append("closed")


def test_the_hold_is_shorter_than_what_a_member_waits_for_its_answer():
    assert leader_not_leading_yet(60.0).hold_s == HOLD_S
    assert leader_not_leading_yet(0.4).hold_s == pytest.approx(0.2)


@pytest.mark.timeout(30)
def test_a_held_request_is_answered_as_soon_as_its_leader_begins_to_lead(monkeypatch):
    monkeypatch.setattr(membership, "HOLD_S", 30.0)  # no answer but the leader's beginning can free it

    async def scenario(log: list) -> None:
        leader = leader_not_leading_yet(request_timeout=100.0)
        answers = leader._after_leading_begins(hivemind_answers(log))
        first = asyncio.ensure_future(anext(answers))
        await asyncio.sleep(0.2)
        assert not first.done() and log == []  # held: hivemind's handler has not run
        log.append("leads")
        leader.began_leading.set()
        assert await asyncio.wait_for(first, 10) == "ACCEPTED"
        await answers.aclose()

    log = []
    asyncio.run(scenario(log))
    assert log == ["leads", "answered", "closed"]


@pytest.mark.timeout(30)
def test_a_leader_that_does_not_begin_answers_once_the_hold_is_over():
    async def scenario(log: list) -> str:
        leader = leader_not_leading_yet(request_timeout=0.02)  # a hold of 0.01 s
        answers = leader._after_leading_begins(hivemind_answers(log))
        try:
            return await asyncio.wait_for(anext(answers), 10)  # hivemind's handler answers (it refuses, there)
        finally:
            await answers.aclose()

    log = []
    assert asyncio.run(scenario(log)) == "ACCEPTED" and log == ["answered", "closed"]


def test_a_leaders_quorum_counts_the_peers_its_training_process_read_ready_since_it_planned():
    """The averager leads by the plan it was handed (`plan_members`), widened while the group forms by the peers
    read ready at the step since (protocol.membership.quorum_of, simulation seed 73 of 16 peers): 2 of a plan of 3
    run, 2 of the 5 seen since do not; a hand-over for another round's token changes nothing."""
    peers = peer_ids(5)
    plan = GroupMetadata(outer_step=4, global_sha256=STATE, samples=16, token="a" * 16, role="peer",
                         leaders=peers[:1], expected=3)
    leader = PlannedMatchmaking.__new__(PlannedMatchmaking)
    leader.planned_members = (plan.token, frozenset(peers[:3]))
    assert leader._quorum_size(plan) == 3 and has_quorum(2, leader._quorum_size(plan))
    leader.planned_members = (plan.token, frozenset(peers))
    assert leader._quorum_size(plan) == 5 and not has_quorum(2, leader._quorum_size(plan))
    leader.planned_members = ("b" * 16, frozenset(peers))
    assert leader._quorum_size(plan) == 3


LATE_ANSWER_S = 1.5  # a leader's answer to a join request it accepts comes this late: more than request_timeout (1 s)


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_members_join_the_planned_leader_and_pass_over_a_dead_one(tmp_path):
    """Three real averagers: one round led by the peer the plan names, one whose first leader is a peer ID
    no node holds (dead): each ends with the three in one group and the same bytes. In a third round the
    leader's plan names only itself and peer 1, which comes 2 s late (of a 6 s window), while peer 2, which
    the plan does not name (a peer that arrived at the step after the leader read the records), comes at
    once: it fills no member's place, and the leader waits for peer 1.

    Every leader answers the members it takes in 1.5 s late, later than request_timeout (1 s), as a
    member whose event loop stalls sees it: a member waits for that answer, or it would leave a group
    that counts it (the group then waits for its parts in vain) and find no other."""
    peers, samples = 3, [16, 48, 160]
    generator = torch.Generator().manual_seed(0)
    rounds = [{"inputs": [[torch.randn(s, generator=generator) for s in SHAPES] for _ in range(peers)],
               "starts": [START] * peers, "leaders": leaders} for leaders in ([2, 0], ["dead", 1], [0])]
    rounds[2].update(members=[0, 1], delays=[0.0, 2.0, 0.0])
    case = run_case("none", {"rounds": rounds, "samples": samples}, tmp_path, faults=f"join_answer_delay={LATE_ANSWER_S}")
    *full, late = case["rounds"]
    # the planned members averaged together; the unplanned peer with them, or in no group at all
    assert late["errors"][:2] == [None, None] and late["mean_sha256"][0] == late["mean_sha256"][1], late["errors"]
    assert late["errors"][2] is None or "no group formed" in late["errors"][2], late["errors"]
    assert late["mean_sha256"][2] in (None, late["mean_sha256"][0])
    for round_, result in zip(rounds, full):
        assert result["errors"] == [None] * peers, (round_["leaders"], result["errors"])
        assert result["group_size"] == [peers] * peers and len(set(result["mean_sha256"])) == 1
        expected = [sum(w * x[j].double() for w, x in zip(samples, round_["inputs"])) / sum(samples)
                    for j in range(len(SHAPES))]
        for got, want in zip(result["means"][0], expected):
            assert torch.allclose(got.double(), want, atol=1e-6)


PEERS = 6  # two rows of 3: parts between a sender and a reducer of other rows and columns go through a relay
KILLED = PEERS - 1
KILL_ROUND = 3  # the victim pauses in its third all-reduce (outer step 3), and is killed there
# as a reducer, and as a sender too: in one CI run the reducer's pause never came in that round (the victim
# reduced no part of it, as hivemind's load balancing may decide for a tiny model), but every member sends
VICTIM_FAULTS = f"allreduce_delay=60,allreduce_send_delay=60,allreduce_delay_round={KILL_ROUND}"


@pytest.mark.swarm
@pytest.mark.timeout(600)
@pytest.mark.long  # CI: the kill in test_faults.py, rounds through relays in tests/test_exact_allreduce.py
def test_six_peers_average_as_one_and_a_member_killed_mid_round_costs_only_itself(processes, tmp_path):
    """6 peers, every round in groups of 3 (p2p_diloco.sync.relay: parts cross two links where a sender and
    a reducer share neither group nor column), so the victim dies as a sender, a reducer and a relay."""
    config = tiny_config_file(tmp_path, inner={"steps_per_outer": 10}, swarm={**FAST_TIMEOUTS, "relay_group_size": 3})
    maddr = start_bootstrap(processes)
    metrics = [start_peer(processes, f"peer{i}", config, maddr, "--wait-for-peers", str(PEERS),
                          faults=VICTIM_FAULTS if i == KILLED else "")
               for i in range(PEERS)]
    survivors = [m for i, m in enumerate(metrics) if i != KILLED]

    wait_for_steps(metrics, KILL_ROUND - 1, timeout_s=360)
    for step in range(1, KILL_ROUND):  # every step: all 6 peers in one group, one θ_global
        records = [r for m in metrics for r in outer_steps(m) if r["outer_step"] == step]
        assert len(records) == PEERS and {r["group_size"] for r in records} == {PEERS}, records
    assert_consistent(metrics)

    victim = f"peer{KILLED}"
    wait_until(lambda: "pausing mid all-reduce" in processes.log(victim), 180, f"{victim} to pause mid all-reduce")
    processes.kill(proc(processes, victim))

    wait_for_steps(survivors, KILL_ROUND + 1, timeout_s=240)
    assert_consistent(survivors)
    for path in survivors:
        events = read_metrics(path)
        killed_step = next(r for r in outer_steps(path) if r["outer_step"] == KILL_ROUND)
        # the round the victim broke was averaged again by the 5 others, and applied: their inner steps count
        assert killed_step["group_size"] == PEERS - 1 and killed_step["attempt"] == 2, killed_step
        assert any(r["event"] == "attempt_failed" and r["outer_step"] == KILL_ROUND - 1 for r in events), path
        assert not [r for r in events if r["event"] in ("round_failed", "state_loaded")], path
        next_step = next(r for r in outer_steps(path) if r["outer_step"] == KILL_ROUND + 1)
        assert next_step["group_size"] == PEERS - 1 and next_step["attempt"] == 1, next_step
