"""How far ahead of its Δ a peer says it is ready (train/match_ahead.py), and the pieces around it."""

import itertools
import threading

import torch

from p2p_diloco.polling import poll_intervals
from p2p_diloco.sync.outer_sync import PendingDelta, RoundTimes
from p2p_diloco.train.match_ahead import MARGIN, RECORD_READ_S, MatchLead


def test_no_lead_before_a_round_is_measured_nor_when_switched_off():
    assert MatchLead(enabled=True, max_s=5.0).steps(step_s=0.1, steps_per_round=24) == 0
    off = MatchLead(enabled=False, max_s=5.0)
    off.record(1.0)
    assert off.steps(step_s=0.1, steps_per_round=24) == 0


def test_the_lead_covers_the_median_matching_time_in_inner_steps():
    lead = MatchLead(enabled=True, max_s=5.0)
    for seconds in (0.3, 9.0, 0.2, 0.4, -1.0):  # one outlier, one clock step backwards
        lead.record(seconds)
    assert lead.seconds == MARGIN * 0.3 + RECORD_READ_S
    assert lead.steps(step_s=0.1, steps_per_round=24) == 5  # ceil(0.475 / 0.1)
    assert lead.steps(step_s=0.0, steps_per_round=24) == 0  # no step timed yet


def test_the_lead_is_capped_by_seconds_and_by_half_a_round():
    lead = MatchLead(enabled=True, max_s=2.0)
    lead.record(30.0)  # a first round that waited long for its groupmates
    assert lead.seconds == 2.0
    assert lead.steps(step_s=0.5, steps_per_round=24) == 4
    assert lead.steps(step_s=0.01, steps_per_round=24) == 12
    assert lead.steps(step_s=0.01, steps_per_round=3) == 1


def test_poll_intervals_grow_to_their_cap():
    assert list(itertools.islice(poll_intervals(0.1, 0.3), 5)) == [0.1, 0.15000000000000002, 0.22500000000000003,
                                                                   0.3, 0.3]
    assert list(itertools.islice(poll_intervals(1.0, 0.5), 2)) == [0.5, 0.5]


def test_a_pending_delta_is_handed_over_once_or_abandoned():
    delta = PendingDelta()
    assert not delta.settled and not delta.wait(0.01)
    threading.Timer(0.05, delta.hand_over, args=([torch.ones(2)],)).start()
    assert delta.wait(10) and delta.settled and torch.equal(delta.tensors[0], torch.ones(2))
    gone = PendingDelta()
    gone.abandon()
    assert gone.settled and gone.tensors is None
    assert PendingDelta([torch.zeros(1)]).settled


def test_a_rounds_phases_split_its_seconds():
    ahead = RoundTimes(started=10.0, assembled=10.5, handed_over=11.0, reduced=11.5, agreed=11.75, audited=12.0)
    assert ahead.phases() == dict(match=0.5, late=0.5, allreduce=0.5, commit=0.25, audit=0.25)
    # the Δ was there first (no lead): nothing late, the all-reduce from the group's assembly
    plain = RoundTimes(started=10.0, assembled=10.5, handed_over=9.9, reduced=11.0, agreed=11.25, audited=11.5)
    assert plain.phases() == dict(match=0.5, late=0.0, allreduce=0.5, commit=0.25, audit=0.25)
