"""Reducers are checked (p2p_diloco.sync.audit, p2p_diloco.sync.spot_check): who audits whom, the commit's
verdict on what each member saw, the chunks and the sample of a spot check, the auditor's recomputation on a
real reducer's chunks, and real all-reduce rounds among
in-process averagers: an honest round's record of what travelled, a reducer that returns a wrong
result to everyone (caught by its auditor, who bans it) and one that sends different results to
different members (each member it lied to bans it); the audit's bytes are counted, and at most 10 % of the
all-reduce's."""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import pytest
import torch

from p2p_diloco.swarm.records import AUDIT_OK, INPUTS_DIFFER, WRONG_MEAN, RoundReport
from p2p_diloco.sync import spot_check
from p2p_diloco.sync.audit import audit_request, auditors, check_reducer, read_audit_request, served_inputs
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


NUMELS = [2 * spot_check.CHUNK_VALUES + 1000, 64, 333]  # a reducer's parts: the first of three chunks


def reducer_case(codec_name: str, senders: int = 4):
    """A reducer's parts from `senders` senders, encoded: (codec, numels, sender names, weights, inputs)."""
    codec = CODECS[codec_name]
    generator = np.random.default_rng(5)
    names = PEERS[:senders]
    inputs = {name: [codec.encode(torch.from_numpy((generator.standard_normal(n) * 10.0 ** -s).astype(np.float32)))
                     for n in NUMELS] for s, name in enumerate(names)}
    return codec, NUMELS, names, [16.0, 48.0, 160.0, 3.0][:senders], inputs


def honest_outputs(codec, numels, names, weights, inputs, rule: AggregationRule) -> list[bytes]:
    """What a real SenderOrderReducer of `rule` returns on the decoded inputs, encoded as its runner does."""
    decoded = [[codec.decode(inputs[name][k], n) for k, n in enumerate(numels)] for name in names]
    reducer = functools.partial(SenderOrderReducer, rule=rule, codec=codec)
    results = reduce_parts(reducer, decoded, weights, list(range(len(names))))
    return [codec.encode(result) for result in results]


def audit(codec, rule, numels, names, weights, inputs, outputs, sample=None, served_by=None):
    """check_reducer's verdict on `outputs` from `inputs` as the senders state them, on `sample` (every chunk
    if None), with what the reducer serves computed from `served_by` (its inputs as it holds them; `inputs`)."""
    chunks = len(spot_check.reducer_chunks(codec, numels))
    sample = list(range(chunks)) if sample is None else sample
    stated = {name: spot_check.input_digest(spot_check.hash_list(codec, parts, numels)) for name, parts in inputs.items()}
    held = served_by or inputs
    served = dict(zip(names, served_inputs(codec, numels, [held[name] for name in names], sample)))
    return check_reducer(codec, rule, numels, names, weights, sample, served, stated, outputs)


@pytest.mark.parametrize("codec_name", sorted(CODECS))
def test_a_chunk_s_bytes_are_its_own_encoding(codec_name):
    """The bytes of a chunk cut from an encoded part decode to the chunk's values: what a sender sent, a
    reducer holds and an auditor fetches of a chunk is the part's encoding restricted to it."""
    codec = CODECS[codec_name]
    numel = 2 * spot_check.CHUNK_VALUES + 1000
    part = torch.from_numpy((np.random.default_rng(2).standard_normal(numel) * np.logspace(-4, 1, numel))
                            .astype(np.float32))
    data = codec.encode(part)
    spans = spot_check.chunk_spans(codec, numel)
    assert spans == ([(0, spot_check.CHUNK_VALUES), (spot_check.CHUNK_VALUES, 2 * spot_check.CHUNK_VALUES),
                      (2 * spot_check.CHUNK_VALUES, numel)] if spot_check.sliceable(codec) else [(0, numel)])
    whole = codec.decode(data, numel)
    for start, stop in spans:
        assert torch.equal(codec.decode(spot_check.chunk_bytes(codec, data, numel, start, stop), stop - start),
                           whole[start:stop])


@pytest.mark.parametrize("rule", [EXACT_MEAN, AggregationRule("centered-clip"), AggregationRule("trimmed-mean")],
                         ids=lambda rule: rule.name)
def test_a_reducer_aggregates_chunk_by_chunk(rule):
    """Each chunk's result is the rule's on that chunk alone, so that an auditor can recompute it alone; DiLoCo's
    mean, coordinate by coordinate, is the same bits as on the whole part."""
    codec = CODECS[CODEC]
    generator = np.random.default_rng(3)
    parts = [torch.from_numpy(generator.standard_normal(NUMELS[0]).astype(np.float32)) for _ in range(4)]
    claims = [16.0, 48.0, 160.0, 3.0]
    result = spot_check.aggregate_in_chunks(parts, claims, rule, codec)
    for start, stop in spot_check.chunk_spans(codec, NUMELS[0]):
        assert torch.equal(result[start:stop], aggregate([p[start:stop] for p in parts], claims, rule))
    if rule is EXACT_MEAN:
        assert torch.equal(result, aggregate(parts, claims, rule))


def test_the_sample_is_drawn_from_the_auditor_s_secret_which_its_token_commits_to():
    """The auditor's token, gathered before the round, is the commitment to its secret; the reducer, given the
    secret in the request, checks it and draws the same sample; another secret draws another."""
    secret, other = bytes(range(16)), bytes(range(1, 17))
    token = spot_check.token_of(secret)
    assert len(token) == 16 and int(token, 16) >= 0 and token != spot_check.token_of(other)
    token_of_reducer = "0123456789abcdef"
    assert read_audit_request(audit_request(token_of_reducer, secret)) == (token_of_reducer, secret)
    assert read_audit_request(b"0123:zz") == ("0123", None) and read_audit_request(b"0123:00ff") == ("0123", None)
    sample = spot_check.spot_sample(spot_check.sample_seed(secret), PEERS[0], 240)
    assert len(sample) == 240 // spot_check.SAMPLE_ONE_IN and sample == sorted(set(sample))
    assert sample == spot_check.spot_sample(spot_check.sample_seed(secret), PEERS[0], 240)
    assert spot_check.spot_sample(spot_check.sample_seed(other), PEERS[0], 240) != sample
    assert len(spot_check.spot_sample(spot_check.sample_seed(secret), PEERS[0], 3)) == 1  # one chunk at least


def test_the_probability_of_a_catch():
    """``1 − C(N − k, s) / C(N, s)``: 1 when every chunk is changed, at least ``1 − (1 − k/N)^s``, and the
    share of seeds whose sample holds a changed chunk."""
    assert spot_check.catch_probability(240, 240) == 1.0 and spot_check.catch_probability(240, 0) == 0.0
    for changed in (1, 12, 24, 120):
        assert spot_check.catch_probability(240, changed) >= 1 - (1 - changed / 240) ** 20
    hits = sum(bool(set(spot_check.spot_sample(bytes([i]) * 32, PEERS[0], 48)) & {0, 1, 2, 3}) for i in range(200))
    assert abs(hits / 200 - spot_check.catch_probability(48, 4)) < 0.15


@pytest.mark.parametrize("rule", [EXACT_MEAN, AggregationRule("centered-clip"), AggregationRule("trimmed-mean")],
                         ids=lambda rule: rule.name)
@pytest.mark.parametrize("codec_name", ["none", "fp4-e3m0"])
def test_the_audit_recomputes_what_the_reducer_computed(codec_name, rule):
    codec, numels, names, weights, inputs = reducer_case(codec_name)
    outputs = honest_outputs(codec, numels, names, weights, inputs, rule)
    assert audit(codec, rule, numels, names, weights, inputs, outputs) == (AUDIT_OK, "")

    # a wrong result, the same for everyone: the sign of one part flipped
    wrong = [codec.encode(-codec.decode(outputs[1], numels[1])), *outputs[2:]]
    verdict, detail = audit(codec, rule, numels, names, weights, inputs, [outputs[0], *wrong])
    assert verdict == WRONG_MEAN and "part 1" in detail

    # the reducer holds other parts from a sender than that sender states it sent
    swapped = {**inputs, names[2]: [inputs[names[2]][0], inputs[names[3]][1], inputs[names[2]][2]]}
    assert audit(codec, rule, numels, names, weights, inputs, outputs, served_by=swapped)[0] == INPUTS_DIFFER


def test_a_changed_chunk_is_caught_when_the_sample_holds_it():
    """A reducer that changes one chunk of its first part (the second of three) passes a sample without it and
    fails one with it; a sender's chunk served from other bytes than its hash list states is caught either way."""
    codec, numels, names, weights, inputs = reducer_case(CODEC)
    rule = AggregationRule("centered-clip")
    outputs = honest_outputs(codec, numels, names, weights, inputs, rule)
    first = codec.decode(outputs[0], numels[0])
    first[spot_check.CHUNK_VALUES + 5] = 10 * first.abs().max()
    changed = [codec.encode(first), *outputs[1:]]
    assert audit(codec, rule, numels, names, weights, inputs, changed, sample=[0, 2, 3, 4]) == (AUDIT_OK, "")
    verdict, detail = audit(codec, rule, numels, names, weights, inputs, changed, sample=[1, 4])
    assert verdict == WRONG_MEAN and f"values {spot_check.CHUNK_VALUES}-{2 * spot_check.CHUNK_VALUES}" in detail
    # the second chunk of a sender's first part served from other bytes: its hash is not the list's entry
    other = codec.decode(inputs[names[1]][0], numels[0])
    other[spot_check.CHUNK_VALUES:2 * spot_check.CHUNK_VALUES] *= 2
    held = {**inputs, names[1]: [codec.encode(other), *inputs[names[1]][1:]]}
    assert audit(codec, rule, numels, names, weights, inputs, outputs, sample=[1], served_by=held)[0] == INPUTS_DIFFER
    assert audit(codec, rule, numels, names, weights, inputs, outputs, sample=[0], served_by=held)[0] == INPUTS_DIFFER


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
    result = aggregate([codec.decode(inputs[name][2], numels[2]) for name in names], weights, rule)
    wrong = nudged(codec, result)
    moved = int((codec.decode(wrong, numels[2]) != codec.decode(outputs[2], numels[2])).sum())
    assert moved
    if codec.name != "none":  # a bound check would pass it: only the comparison of bytes catches it
        assert (codec.decode(wrong, numels[2]) - result).abs().le(codec.error_bound(result)).all()
    verdict, detail = audit(codec, rule, numels, names, weights, inputs, [*outputs[:2], wrong])
    assert verdict == WRONG_MEAN and f"{moved} of {numels[2]} are" in detail


CODEC = "fp4-e3m0"  # the shipped default
# three tensors as large as each other, each of 16 chunks (p2p_diloco.sync.spot_check): each of three peers
# reduces about a third of the values, 16 chunks, of which its auditor checks one
CASE_SHAPES = [torch.Size([512, 512])] * 3


def case_inputs(peers: int = 3) -> dict:
    generator = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(s, generator=generator) * 1e-2 for s in CASE_SHAPES] for _ in range(peers)]
    # planned as a swarm of peers that dial each other plans its rounds, honest leaders first (peer 0 is the hostile
    # reducer): the leader starts once its members joined, where hivemind's matchmaking gathers for 2 s a run
    round_ = {"inputs": inputs, "starts": [START] * peers, "leaders": [*range(1, peers), 0]}
    return {"rounds": [round_], "samples": [16, 48, 160], "error_feedback": True}


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
    # every peer audited one reducer and was audited once: the spot check's bytes are counted, and are at
    # most 10 % of the all-reduce's (a twelfth of a reducer's inputs, and the hash lists)
    for phases in result["by_phase"]:
        audited = phases["audit"]["sent"] + phases["audit"]["received"]
        reduced = phases["allreduce"]["sent"] + phases["allreduce"]["received"]
        assert phases["audit"]["sent"] > 0 and phases["audit"]["received"] > 0
        assert audited <= 0.10 * reduced, phases


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
