"""Hostile volunteers with the run's own settings: poisoned pseudo-gradients, lying sample claims, lying reducers.

Each swarm runs honest `p2p-diloco peer` processes and hostile ones (tests/hostile_peer.py: the
project's own peer, patched to alter what it sends) on 127.0.0.1, with the tiny test model. A
minority of senders that scale, flip or replace Δ by noise, or claim 2^48 samples, must not move
θ_global far (robust aggregation, p2p_diloco/sync/robust.py, and the update check,
p2p_diloco/train/update_check.py); a reducer that returns garbage, or different values to different
peers, must be caught and kept out. Each time the honest peers must keep one θ_global (one sha256
per outer step), and their loss must stay finite and fall.

Attacks share swarms to keep CI short: the rules tolerate a minority, so each swarm of 5 holds 2
attackers (7 peers on 2 loaded cores split into several groups per round). "The loss falls": every
round after the first has a lower training loss than the first. With α = 0 (the tiny config) every
round starts from θ_global, so a θ_global pushed far off shows as a loss above the first round's,
which starts from the initial weights, about as good as a uniform guess (ln 300).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from p2p_diloco.metrics import read_metrics
from tests.swarm_helpers import (
    FAST_TIMEOUTS, assert_consistent, hashes_by_step, outer_steps, peer_id_of, start_bootstrap, start_peer,
    tiny_config_file, wait_until,
)

pytestmark = pytest.mark.swarm

STEPS = 3  # outer steps the honest peers must take with the attackers in the swarm (before the defence, the
# loss of step 3 was above the first round's with ×100 and noise, of step 2 with the 2^48 claim)
STEPS_TIMEOUT_S = 200  # a bound on a swarm's whole run (under the tests' timeout), not a speed requirement
# bans are local: each honest peer drops a hostile reducer only once its own audit convicted it, and until then
# the groups of peers that did and did not keep voiding (72-162 s of this bound in runs of that test)
REDUCER_STEPS_TIMEOUT_S = 300


@dataclass
class Hostile:
    """A hostile peer of a swarm: its attack (tests/hostile_peer.py), its process name and metrics file."""

    attack: str
    name: str
    metrics: Path

    def attacked_steps(self, processes) -> set[int]:
        """The outer steps toward which it altered what it sent, from its own lines."""
        return {int(n) for n in re.findall(r"attacked outer step (\d+)", processes.log(self.name))}

    @property
    def peer_id(self) -> str:
        return peer_id_of(self.metrics)

    def reduced_rounds(self, processes) -> int:
        """How many all-reduces it reduced with its reducer attack."""
        return processes.log(self.name).count("attacked a round as reducer")

    def counted(self, processes, honest: list[Path]) -> set[int]:
        """The outer steps the honest peers applied with this attacker's altered input in the group: it
        applied the same θ_global there, which a peer does only when every groupmate committed the same mean."""
        honest_hashes = hashes_by_step(honest)
        applied = {r["outer_step"] for r in outer_steps(self.metrics)
                   if honest_hashes.get(r["outer_step"]) == {r["global_sha256"]}}
        return self.attacked_steps(processes) & applied


def start_swarm(processes, tmp_path: Path, honest: int, attacks: list[str],
                round_wait_s: float = FAST_TIMEOUTS["round_wait_timeout"]) -> tuple[list[Path], list[Hostile]]:
    """A bootstrap node, `honest` honest peers and one hostile peer per attack, all starting together on the
    tiny config (a ready peer waits `round_wait_s` for the others at its step); returns the honest peers'
    metrics files and the hostile peers."""
    config = tiny_config_file(tmp_path, inner={"steps_per_outer": 5},
                              swarm={**FAST_TIMEOUTS, "round_wait_timeout": round_wait_s})
    maddr = start_bootstrap(processes)
    together = ("--wait-for-peers", str(honest + len(attacks)))  # the first round holds everybody
    honest_metrics = [start_peer(processes, f"peer{i}", config, maddr, *together) for i in range(honest)]
    hostile = [Hostile(attack, f"hostile{i}", start_peer(processes, f"hostile{i}", config, maddr, *together,
                                                         attack=attack))
               for i, attack in enumerate(attacks)]
    return honest_metrics, hostile


def steps_reached(metrics: list[Path]) -> int:
    """The outer step that every one of these peers has recorded."""
    return min((outer_steps(m)[-1]["outer_step"] if outer_steps(m) else 0) for m in metrics)


def assert_honest_peers_sound(processes, honest: list[Path]) -> None:
    """One θ_global per outer step, every loss finite, at every outer step after the first some honest
    peer's round loss below the highest of outer step 1's, no honest peer exited."""
    assert_consistent(honest)
    # the rounds toward outer step 1 start from the initial weights, about as good as a uniform guess
    # (ln vocab_size): every later round starts from θ_global, and one pushed far off starts above them.
    # A peer's own first round is no such bound: one that loaded the state first starts it trained
    # (in a CI run such a peer's loss rose from 4.38 to 4.58 two honest steps later, below the 5.18
    # that the peers' rounds from the initial weights had)
    initial = [r["loss"] for path in honest for r in outer_steps(path) if r["outer_step"] == 1]
    assert initial, "no honest peer recorded outer step 1"
    later: dict[int, list[float]] = {}
    for path in honest:
        records = outer_steps(path)
        losses = [r["loss"] for r in records]
        assert all(math.isfinite(loss) for loss in losses), f"{path.name}: losses {losses}"
        for r in records:
            if r["outer_step"] > 1:
                later.setdefault(r["outer_step"], []).append(r["loss"])
    # θ_global is one for every honest peer (above), so one pushed far off raises every honest peer's next
    # round; one peer's round can rise alone, from its own batches. In a CI run whose outer step 1 came
    # after several failed attempts (the peers kept training, so its losses were 4.92-4.94, not about 5.4),
    # one peer's round at step 5 measured 5.39 where the other's, from the same θ_global, measured 4.80
    risen = {step: losses for step, losses in later.items() if min(losses) >= max(initial)}
    assert not risen, f"every honest peer's loss rose above outer step 1's ({initial}) at: {risen}"
    peers = [p for p in processes.procs if p.name.startswith("peer")]
    assert all(p.poll() is None for p in peers), [(p.name, p.returncode) for p in peers]


def assert_no_claim_outweighs_the_rest(honest: list[Path]) -> None:
    """Every round counted at most twice the samples of its largest claim among the honest peers per member (a
    liar's 2^48 counts at most what the rest of its group weighs: sync/robust.py fair_weights)."""
    claims: dict[int, list[int]] = {}
    for path in honest:
        for r in outer_steps(path):
            claims.setdefault(r["outer_step"], []).append(r["samples"])
    for path in honest:
        for r in outer_steps(path):
            assert r["group_samples"] <= 2 * r["group_size"] * max(claims[r["outer_step"]]), (r, claims)


def survive_sender_attacks(processes, tmp_path: Path, honest: int, attacks: list[str]) -> None:
    """Run the swarm until the honest peers took STEPS outer steps and each attacker's altered Δ was in at
    least one of them; then the honest peers must be sound, and no round counted an inflated claim in full."""
    honest_metrics, hostile = start_swarm(processes, tmp_path, honest, attacks)
    counted = lambda: {h.attack: sorted(h.counted(processes, honest_metrics)) for h in hostile}  # noqa: E731
    wait_until(lambda: steps_reached(honest_metrics) >= STEPS and all(counted().values()), STEPS_TIMEOUT_S,
               f"{STEPS} outer steps of the honest peers, each attack in one of them")
    assert_honest_peers_sound(processes, honest_metrics)
    assert_no_claim_outweighs_the_rest(honest_metrics)


@pytest.mark.timeout(300)
def test_delta_scaled_by_100_or_replaced_by_noise_cannot_poison_theta_global(processes, tmp_path):
    """100·Δ with a claim of 2^48 samples (issue 19: 100·Δ destroyed θ_global for good; issue 44: the claim counts
    at most what the rest weigh) and noise of 100·‖Δ‖, from 2 of 5 peers."""
    survive_sender_attacks(processes, tmp_path, honest=3, attacks=["samples+scale:100", "noise:100"])


@pytest.mark.timeout(300)
@pytest.mark.long  # CI: the 100·Δ swarm above, with its 2^48 claim; the claims' bound in tests/test_robust.py
def test_delta_scaled_by_3_or_flipped_with_an_inflated_sample_claim_cannot_poison_theta_global(processes, tmp_path):
    """3·Δ (issue 19: +11 % held-out loss), and −Δ weighted by a claim of 2^48 samples, from 2 of 5 peers: with
    DiLoCo's exact mean the claim makes the liar's −Δ the mean; counted at most as the rest of its group, and
    with CenteredClip's radius shrunk by its weight, it pulls no harder than a plain sign flip."""
    survive_sender_attacks(processes, tmp_path, honest=3, attacks=["scale:3", "samples+flip"])


@pytest.mark.timeout(400)
@pytest.mark.long  # CI: tests/test_reducer_audit.py, caught by the auditor, banned for equivocating
def test_a_reducer_that_returns_garbage_or_equivocates_is_caught(processes, tmp_path):
    """A reducer that returns 100 × the mean plus noise to everyone, and one that returns a different
    value to each sender, in one swarm of 3 honest peers: both must be caught, and the honest peers must
    go on with one sound θ_global."""
    # a ready peer waits 5 s, not 15, for the others at its step: the hostile reducers, once banned, sit
    # "loading" at every later step (no honest peer serves them its state), and the honest peers, which take
    # their 5 inner steps of the tiny model in well under a second, waited the whole bound for them each round
    honest_metrics, hostile = start_swarm(processes, tmp_path, 3, ["garbage-reducer", "equivocating-reducer"],
                                          round_wait_s=5.0)
    wait_until(lambda: steps_reached(honest_metrics) >= STEPS and all(h.reduced_rounds(processes) for h in hostile),
               REDUCER_STEPS_TIMEOUT_S,
               f"{STEPS} outer steps of the honest peers, after both hostile reducers reduced a round")
    assert_honest_peers_sound(processes, honest_metrics)
    void = [r["reason"] for m in honest_metrics for r in read_metrics(m)
            if r["event"] in ("round_failed", "attempt_failed")]
    for h in hostile:  # each caught by name (peers name a groupmate by its ID's last 8 characters) ...
        assert any(h.peer_id[-8:] in reason for reason in void), f"{h.attack} never caught: {void}"
    for path in honest_metrics:  # ... and no round the honest peers applied had a hostile reducer in it
        assert all(r["group_size"] <= len(honest_metrics) for r in outer_steps(path)), outer_steps(path)
