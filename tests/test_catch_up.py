"""A peer behind the run with no state source never trains alone (p2p_diloco.train.catch_up)."""

import pytest

from p2p_diloco.swarm.progress import KEEPING, READY, TRAINING, PeerProgress, RunHistory
from p2p_diloco.protocol.plans import behind_alone
from p2p_diloco.train.catch_up import CatchUpWait, NoStateSource

ME, OTHER = "QmMe", "QmOther"


def record(peer: str, step: int, phase: str = TRAINING) -> PeerProgress:
    return PeerProgress(peer, step, "a" * 64, phase)


def test_behind_alone_only_while_the_run_is_ahead_and_nobody_is_at_this_step():
    ahead = RunHistory(outer_step=5, peers=2, age_s=3.0)
    assert behind_alone(0, ahead, {ME: record(ME, 0)}, ME)  # the newcomer to a run whose peers left
    assert not behind_alone(0, ahead, {ME: record(ME, 0), OTHER: record(OTHER, 0, READY)}, ME)  # a peer to average with
    assert not behind_alone(5, ahead, {ME: record(ME, 5)}, ME)  # it holds the run's latest step: it goes on
    assert not behind_alone(0, None, {ME: record(ME, 0)}, ME)  # a run with no history: it starts it
    assert behind_alone(3, ahead, {ME: record(ME, 3), OTHER: record(OTHER, 5)}, ME)  # live peers ahead only
    # a groupmate of the step this peer just took, whose new record is not read yet: company (in test_hostile's
    # swarm, a liar's claim far ahead made an honest peer wait 5 s after such a step)
    assert not behind_alone(3, ahead, {ME: record(ME, 3), OTHER: record(OTHER, 2, READY)}, ME)
    assert behind_alone(3, ahead, {ME: record(ME, 3), OTHER: record(OTHER, 2)}, ME)  # training at 2: behind itself
    # the keeper it loaded step 3 from is still there, while the run's peers are at step 5: it never averages
    assert behind_alone(3, ahead, {ME: record(ME, 3), "QmKeeper": record("QmKeeper", 3, KEEPING),
                                   OTHER: record(OTHER, 5)}, ME)


def test_the_wait_is_bounded_and_ends_with_one_line_that_says_what_to_do():
    now = [100.0]
    wait = CatchUpWait("demo", timeout_s=30, clock=lambda: now[0])
    history = RunHistory(outer_step=6, peers=2, age_s=4.0)
    wait.wait(0, history)
    now[0] += 29
    wait.wait(0, history)  # still within the bound
    wait.reset()  # it loaded the state meanwhile: the bound starts again
    now[0] += 29
    wait.wait(0, history)
    now[0] += 30
    with pytest.raises(NoStateSource) as raised:
        wait.wait(0, history, store="s3://bucket/demo")
    line = str(raised.value)
    assert "'demo' is at outer step 6 (2 peer record(s)" in line and "s3://bucket/demo" in line
    assert "second history" in line and "\n" not in line
