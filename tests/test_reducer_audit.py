"""Reducers are checked (p2p_diloco.sync.audit): who audits whom, the commit's verdict on what each
member saw, the auditor's recomputation on a real reducer's parts, and real all-reduce rounds among
in-process averagers: an honest round's record of what travelled, a reducer that returns a wrong
result to everyone (caught by its auditor, who bans it) and one that sends different results to
different members (each member it lied to bans it)."""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import pytest
import torch

from p2p_diloco.swarm.records import AUDIT_OK, INPUTS_DIFFER, WRONG_MEAN, RoundReport
from p2p_diloco.sync.audit import auditors, check_reducer, digest
from p2p_diloco.sync.codecs import CODECS
from p2p_diloco.sync.commit import judge
from p2p_diloco.sync.exact_allreduce import SenderOrderReducer
from p2p_diloco.sync.robust import EXACT_MEAN, AggregationRule, aggregate
from tests.allreduce_case import START
from tests.test_exact_allreduce import (
    CASE_TIMEOUT_S, assert_counted_is_the_round_trip, reduce_parts, run_case, run_cases,
)

PEERS = [f"Qm{c * 44}" for c in "abcdefg"]  # base58 peer IDs, sorted as written
SHA = {name: hashlib.sha256(name.encode()).hexdigest() for name in ("mean", "other", "sent", "lie")}


def tokens_of(peers: list[str], salt: str = "") -> dict[str, str]:
    return {p: hashlib.sha256((p + salt).encode()).hexdigest()[:16] for p in peers}


@pytest.mark.parametrize("members", [2, 3, 7])
def test_every_reducer_is_audited_by_another_member_the_same_on_every_member(members):
    tokens = tokens_of(PEERS[:members])
    assigned = auditors(tokens, PEERS[:members])
    assert sorted(assigned) == PEERS[:members]
    assert all(auditor != reducer and auditor in tokens for reducer, auditor in assigned.items())
    assert sorted(assigned.values()) == PEERS[:members]  # a rotation: each member audits exactly one reducer
    # whatever order a member holds the group in
    assert auditors(dict(reversed(tokens.items())), list(reversed(PEERS[:members]))) == assigned
    # a reducer that is no member (an assistant) is not audited; a member that reduces nothing is not either
    assert auditors(tokens, [PEERS[0], "Qm" + "z" * 44]) == {PEERS[0]: assigned[PEERS[0]]}


def test_the_rotation_follows_the_rounds_tokens():
    rotations = {auditors(tokens_of(PEERS, salt=str(i)), PEERS)[PEERS[0]] for i in range(40)}
    assert len(rotations) == len(PEERS) - 1  # every other member audits the first one in some round


def report(mean: str = SHA["mean"], complete: bool = True, **fields) -> RoundReport:
    return RoundReport(outer_step=3, token="0" * 16, complete=complete, mean_sha256=mean if complete else None,
                       **fields)


def test_a_reducer_whose_statement_differs_from_what_this_peer_received_is_the_culprit():
    reducer, other = PEERS[1], PEERS[2]
    received = {PEERS[0]: SHA["mean"], reducer: SHA["sent"]}
    reports = {reducer: report(outputs={reducer: SHA["lie"]}), other: report(mean=SHA["other"])}
    void, final = judge(reports, {reducer, other}, SHA["mean"], received)
    assert final and void.culprit == reducer and "different values to different peers" in void.reason
    # a reducer that states nothing of what it sent is its own culprit too
    void, final = judge({reducer: report()}, {reducer, other}, SHA["mean"], received)
    assert final and void.culprit == reducer


def test_a_reducer_whose_parts_came_through_a_relay_is_nobody_s_culprit():
    """The relay may have changed the parts (p2p_diloco.sync.relay): void, but nobody is convicted."""
    reducer = PEERS[1]
    received = {PEERS[0]: SHA["mean"], reducer: SHA["sent"]}
    reports = {reducer: report(outputs={reducer: SHA["lie"]})}
    void, final = judge(reports, {reducer}, SHA["mean"], received, relayed=(reducer,))
    assert final and void.culprit is None and "or its relay changed them" in void.reason


def test_a_different_mean_waits_for_every_report_so_that_one_may_name_its_cause():
    reducer, other = PEERS[1], PEERS[2]
    received = {reducer: SHA["sent"]}
    honest = report(outputs={reducer: SHA["sent"]})
    void, final = judge({other: report(mean=SHA["other"])}, {reducer, other}, SHA["mean"], received)
    assert not final and void.culprit is None and "different mean" in void.reason
    void, final = judge({other: report(mean=SHA["other"]), reducer: honest}, {reducer, other}, SHA["mean"], received)
    assert final and void.culprit is None  # nobody this peer can convict: the round is void, nobody banned
    void, final = judge({other: report(), reducer: honest}, {reducer, other}, SHA["mean"], received)
    assert final and void is None
    void, final = judge({other: report(complete=False)}, {reducer, other}, SHA["mean"], received)
    assert final and "incomplete" in void.reason and void.culprit is None


def reducer_case(codec_name: str, senders: int = 4):
    """A reducer's parts from `senders` senders, encoded: (codec, numels, sender names, weights, inputs)."""
    codec = CODECS[codec_name]
    generator = np.random.default_rng(5)
    numels = [1000, 64, 333]
    names = PEERS[:senders]
    inputs = {name: [codec.encode(torch.from_numpy((generator.standard_normal(n) * 10.0 ** -s).astype(np.float32)))
                     for n in numels] for s, name in enumerate(names)}
    return codec, numels, names, [16.0, 48.0, 160.0, 3.0][:senders], inputs


def honest_outputs(codec, numels, names, weights, inputs, rule: AggregationRule) -> list[bytes]:
    """What a real SenderOrderReducer of `rule` returns on the decoded inputs, encoded as its runner does."""
    decoded = [[codec.decode(inputs[name][k], n) for k, n in enumerate(numels)] for name in names]
    results = reduce_parts(functools.partial(SenderOrderReducer, rule=rule), decoded, weights, list(range(len(names))))
    return [codec.encode(result) for result in results]


@pytest.mark.parametrize("rule", [EXACT_MEAN, AggregationRule("centered-clip"), AggregationRule("trimmed-mean")],
                         ids=lambda rule: rule.name)
@pytest.mark.parametrize("codec_name", ["none", "fp4-e3m0"])
def test_the_audit_recomputes_what_the_reducer_computed(codec_name, rule):
    codec, numels, names, weights, inputs = reducer_case(codec_name)
    outputs = honest_outputs(codec, numels, names, weights, inputs, rule)
    stated = {name: digest(parts) for name, parts in inputs.items()}
    assert check_reducer(codec, rule, numels, names, weights, inputs, stated, outputs) == (AUDIT_OK, "")

    # a wrong result, the same for everyone: the sign of one part flipped
    wrong = [codec.encode(-codec.decode(outputs[1], numels[1])), *outputs[2:]]
    verdict, detail = check_reducer(codec, rule, numels, names, weights, inputs, stated, [outputs[0], *wrong])
    assert verdict == WRONG_MEAN and "part 1" in detail

    # the reducer holds other parts from a sender than that sender states it sent
    swapped = {**inputs, names[2]: [inputs[names[2]][0], inputs[names[3]][1], inputs[names[2]][2]]}
    assert check_reducer(codec, rule, numels, names, weights, swapped, stated, outputs)[0] == INPUTS_DIFFER


def nudged(codec, result: torch.Tensor) -> bytes:
    """The encoding of `result` (a reducer's exact result) changed by the least a hostile reducer can change:
    ``none``: one value one ulp up; a block codec: the first block's float32 scale one ulp up (a block of
    values, each well within the codec's error bound of `result`)."""
    data = bytearray(codec.encode(result))
    if codec.name == "none":
        values = np.frombuffer(data, "<f4").copy()
        values[7] = np.nextafter(values[7], np.float32(np.inf))
        return values.tobytes()
    first_scale = len(data) - 4 * -(-result.numel() // codec.blocksize)
    scale = np.frombuffer(data[first_scale:first_scale + 4], "<f4").copy()
    data[first_scale:first_scale + 4] = np.nextafter(scale, np.float32(np.inf)).tobytes()
    return bytes(data)


@pytest.mark.parametrize("codec_name", ["none", "int8", "nf4", "fp4-bnb", "fp4-e3m0"])
def test_with_a_reproducible_encoding_the_audit_is_bit_exact(codec_name):
    """A reducer may not move a value even within the codec's error bound where every CPU encodes alike."""
    codec, numels, names, weights, inputs = reducer_case(codec_name)
    rule = AggregationRule("centered-clip")
    outputs = honest_outputs(codec, numels, names, weights, inputs, rule)
    stated = {name: digest(parts) for name, parts in inputs.items()}
    result = aggregate([codec.decode(inputs[name][2], numels[2]) for name in names], weights, rule)
    wrong = nudged(codec, result)
    moved = int((codec.decode(wrong, numels[2]) != codec.decode(outputs[2], numels[2])).sum())
    assert moved
    if codec.name != "none":  # a bound check would pass it: only the comparison of bytes catches it
        assert (codec.decode(wrong, numels[2]) - result).abs().le(codec.error_bound(result)).all()
    verdict, detail = check_reducer(codec, rule, numels, names, weights, inputs, stated, [*outputs[:2], wrong])
    assert verdict == WRONG_MEAN and f"{moved} of {numels[2]} values" in detail


CODEC = "fp4-e3m0"  # the shipped default
# three tensors of one part each, as large as each other: hivemind gives each of three peers one to reduce
CASE_SHAPES = [torch.Size([64, 32])] * 3


def case_inputs(peers: int = 3) -> dict:
    generator = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(s, generator=generator) * 1e-2 for s in CASE_SHAPES] for _ in range(peers)]
    return {"rounds": [{"inputs": inputs, "starts": [START] * peers}], "samples": [16, 48, 160],
            "error_feedback": True}


# tests/hostile_peer.py's, peer 0 the hostile reducer
ATTACKS = ("garbage-reducer", "equivocating-reducer", "misquoting-reducer")
AUDITED_TIMEOUT_S = CASE_TIMEOUT_S + 60 * len(ATTACKS)


@pytest.fixture(scope="module")
def audited_rounds(tmp_path_factory) -> dict:
    """One round of three peers, honest, and once with each of :data:`ATTACKS`, among the same DHT nodes:
    the result of each, by run (``CODEC`` or ``CODEC:ATTACK``)."""
    runs = [CODEC, *(f"{CODEC}:{attack}" for attack in ATTACKS)]
    return run_cases(runs, case_inputs(), tmp_path_factory.mktemp("audited"), timeout_s=AUDITED_TIMEOUT_S)


@pytest.mark.swarm
@pytest.mark.timeout(AUDITED_TIMEOUT_S + 30)
def test_an_honest_round_records_what_travelled_and_passes_its_audits(audited_rounds):
    """Three honest peers, one round: every member counts its own reduced parts, like the parts it sent,
    as the codec's round trip; all agree on each reducer's results, name the same auditors, and every
    audit passes (the round is applied)."""
    result = audited_rounds[CODEC]
    round_ = result["rounds"][0]
    assert round_["errors"] == [None] * 3, round_["errors"]
    assert_counted_is_the_round_trip(round_, CODECS[CODEC])
    digests = round_["digests"]
    peers = result["peer_ids"]
    assert all(set(d["inputs"]) == set(d["outputs"]) == set(peers) for d in digests)  # everyone reduced
    for reducer in peers:
        assert len({d["outputs"][reducer] for d in digests}) == 1  # everyone got the bytes the reducer kept
    assert len({tuple(sorted(d["auditors"].items())) for d in digests}) == 1
    assert sorted(digests[0]["auditors"].values()) == sorted(peers)
    assert result["banned"] == [[]] * 3


def hostile_case(attack: str, audited_rounds: dict) -> tuple[dict, str]:
    """The round of three peers in which peer 0 is a hostile reducer (tests/hostile_peer.py's `attack`)."""
    result = audited_rounds[f"{CODEC}:{attack}"]
    errors = result["rounds"][0]["errors"]
    assert all(e is not None and "round void" in e for e in errors), errors  # nobody applies the round
    return result, result["peer_ids"][0]


@pytest.mark.swarm
@pytest.mark.timeout(AUDITED_TIMEOUT_S + 30)
def test_a_reducer_that_returns_a_wrong_result_to_everyone_is_caught_by_its_auditor(audited_rounds):
    result, hostile = hostile_case("garbage-reducer", audited_rounds)
    errors = result["rounds"][0]["errors"]
    auditor = next(i for i, e in enumerate(errors) if f"this peer's audit of reducer {hostile[-8:]}" in e)
    assert "wrong mean" in errors[auditor] and auditor != 0
    other = 3 - auditor  # the third member waited for the auditor's verdict
    assert f"the audit of reducer {hostile[-8:]}" in errors[other] and "wrong mean" in errors[other]
    # the auditor bans the reducer on its own list; nobody bans an honest peer
    assert result["banned"][auditor] == [hostile] and result["banned"][other] == [] and result["banned"][0] == []


@pytest.mark.swarm
@pytest.mark.timeout(AUDITED_TIMEOUT_S + 30)
def test_a_reducer_that_sends_different_results_to_different_members_is_banned_by_them(audited_rounds):
    result, hostile = hostile_case("equivocating-reducer", audited_rounds)
    errors = result["rounds"][0]["errors"]
    for honest in (1, 2):  # each got other bytes than the reducer's own report states it sent
        assert f"reducer {hostile[-8:]}" in errors[honest] and "different values to different peers" in errors[honest]
        assert result["banned"][honest] == [hostile]
    assert result["banned"][0] == []


@pytest.mark.swarm
@pytest.mark.timeout(AUDITED_TIMEOUT_S + 30)
def test_a_reducer_that_misquotes_its_inputs_voids_the_round_and_is_not_convicted(audited_rounds):
    """The reducer averages honestly but serves its auditor each sender's parts as another's. The
    auditor fetched them and recomputed a wrong result before the reports came in, yet the senders'
    digests are judged first: the verdict is "inputs differ" (the reducer or a sender lies), the round
    is void, and nobody is banned."""
    result, hostile = hostile_case("misquoting-reducer", audited_rounds)
    errors = result["rounds"][0]["errors"]
    auditor = next(i for i, e in enumerate(errors) if f"this peer's audit of reducer {hostile[-8:]}" in e)
    assert auditor != 0 and INPUTS_DIFFER in errors[auditor] and WRONG_MEAN not in errors[auditor]
    other = 3 - auditor
    assert f"the audit of reducer {hostile[-8:]}" in errors[other] and INPUTS_DIFFER in errors[other]
    assert result["banned"] == [[]] * 3


@pytest.mark.swarm
@pytest.mark.timeout(180)
def test_a_relay_that_changes_what_it_forwards_voids_the_round_and_frames_nobody(tmp_path):
    """4 peers in groups of 2 (p2p_diloco.sync.relay): each relays one sender's parts to one reducer, and
    peer 0 returns that sender averaged parts times 3. The sender's bytes then differ from the reducer's
    statement: every member voids the round, and nobody is banned (the reducer did nothing wrong)."""
    generator = torch.Generator().manual_seed(0)
    shapes = [torch.Size([1000])] * 8  # one part each, two for every reducer
    inputs = [[torch.randn(s, generator=generator) * 1e-2 for s in shapes] for _ in range(4)]
    round_ = {"inputs": inputs, "starts": [START] * 4, "leaders": [1, 2, 3], "relay_group": 2}
    result = run_case(f"{CODEC}:tampering-relay", {"rounds": [round_], "samples": [16, 48, 160, 32]}, tmp_path)
    errors = result["rounds"][0]["errors"]
    assert all(e is not None and "round void" in e for e in errors), errors
    assert any("or its relay changed them" in e for e in errors), errors
    assert result["banned"] == [[]] * 4
