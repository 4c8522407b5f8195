"""Streaming DiLoCo in the swarm (arXiv 2501.18512): fragments, overlap and the merge, against a
single-process oracle written in plain torch."""

import pytest
import torch

from p2p_diloco.config import ConfigError
from p2p_diloco.metrics import MetricsWriter, read_metrics
from p2p_diloco.schedule import FragmentSchedule
from p2p_diloco.train.fragments import FragmentError, split_into_fragments
from p2p_diloco.train.model import build_model, trainable_parameters
from tests.conftest import tiny_config
from tests.inprocess import OracleWorker, fixed_batches, inprocess_peers, run_in_threads

VOCAB = 300
pytestmark = pytest.mark.timeout(300)


def oracle_streaming(cfg, batch_lists, outer_steps, fragments):
    """Streaming DiLoCo in plain torch: outer step t averages fragment t mod P after H/P inner steps;
    with τ > 0 every worker takes τ more inner steps before the mean is applied, then merges
    θ_local ← α·θ_local + (1 − α)·θ_global on the fragment. Returns θ_global and the outer momentum."""
    inner, outer = cfg.inner, cfg.outer
    theta = [p.detach().clone().float() for p in trainable_parameters(build_model(cfg.model, VOCAB, cfg.run.seed))]
    outer_opt = torch.optim.SGD(theta, lr=outer.lr, momentum=outer.momentum, nesterov=True)
    workers = [OracleWorker(cfg, VOCAB, batches) for batches in batch_lists]

    steps_per_sync = inner.steps_per_outer // len(fragments)
    ahead = 0
    for t in range(outer_steps):
        indices = fragments[t % len(fragments)]
        deltas = []
        for worker in workers:
            worker.train(steps_per_sync - ahead)
            deltas.append([theta[i].double() - worker.params[i].detach().double() for i in indices])
        for worker in workers:
            worker.train(outer.sync_delay)
        ahead = outer.sync_delay
        for k, i in enumerate(indices):
            theta[i].grad = (sum(d[k] for d in deltas) / len(deltas)).float()
        outer_opt.step()
        outer_opt.zero_grad(set_to_none=True)
        for worker in workers:
            with torch.no_grad():
                for i in indices:
                    worker.params[i].mul_(outer.merge_alpha).add_(theta[i], alpha=1 - outer.merge_alpha)
    momentum = [outer_opt.state.get(p, {}).get("momentum_buffer", torch.zeros_like(p)) for p in theta]
    return theta, momentum


def names_of(cfg):
    return [name for name, p in build_model(cfg.model, VOCAB, cfg.run.seed).named_parameters() if p.requires_grad]


@pytest.mark.parametrize("sync_delay, merge_alpha", [(0, 0.0), (2, 0.5)])
def test_two_peers_match_the_streaming_oracle(tmp_path, sync_delay, merge_alpha):
    torch.set_num_threads(1)
    cfg = tiny_config(model={"num_layers": 2}, inner={"steps_per_outer": 6},
                      outer={"fragments": 2, "sync_delay": sync_delay, "merge_alpha": merge_alpha,
                             "fixed_sync_delay": True,  # the oracle's τ: exactly sync_delay steps
                             "aggregation": "mean"},  # the oracle's weighted mean (see test_reference_math.py)
                      swarm={"match_ahead": True})
    outer_steps = 4  # each fragment syncs twice
    batch_lists = fixed_batches(2, outer_steps * 3 + sync_delay, cfg.inner.batch_size, cfg.data.seq_len, VOCAB)
    fragments = split_into_fragments(names_of(cfg), 2, "strided")
    expected_theta, expected_momentum = oracle_streaming(cfg, batch_lists, outer_steps, fragments)
    with inprocess_peers(cfg, VOCAB, batch_lists) as peers:
        for i, peer in enumerate(peers):
            peer.metrics = MetricsWriter(tmp_path / f"{i}.jsonl", peer.peer_id)
        run_in_threads(peers, outer_steps)
        assert len({peer.sha256 for peer in peers}) == 1, "peers ended with different global states"
        for peer in peers:
            assert peer.schedule.fragments == fragments
            assert peer.global_model.outer_step == outer_steps and peer.last_group_size == 2
            for got, want in zip(peer.global_model.params, expected_theta):
                assert (got - want).abs().max().item() <= 1e-6
            for got, want in zip(peer.global_model.momentum_buffers(), expected_momentum):
                assert (got - want).abs().max().item() <= 1e-6
    for i in range(2):
        records = [r for r in read_metrics(tmp_path / f"{i}.jsonl") if r["event"] == "outer_step"]
        assert [r["fragment"] for r in records] == [0, 1, 0, 1]
        assert [r["group_size"] for r in records] == [2] * outer_steps
        # the averager's matchmaking alone lasts matchmaking_time (2 s): the τ inner steps run meanwhile
        assert sum(r["steps_while_syncing"] for r in records) >= (outer_steps if sync_delay else 0)
        # from the second round on each peer said it was ready an inner step before its Δ (train/match_ahead.py:
        # half a round of 3 at most), and the swarm still matches the oracle
        assert all(r["lead_steps"] == 1 for r in records[1:]), [r["lead_steps"] for r in records]
        if not sync_delay:
            assert all(r["steps_while_syncing"] == 0 for r in records)


def test_strided_and_sequential_fragments_hold_every_parameter_once():
    cfg = tiny_config(model={"num_layers": 4})
    names = names_of(cfg)
    layer = {i: next(k for k, n in enumerate(names) if f"layers.{i}." in n) for i in range(4)}
    strided = split_into_fragments(names, 2, "strided")
    sequential = split_into_fragments(names, 2, "sequential")
    for fragments in (strided, sequential):
        assert sorted(i for f in fragments for i in f) == list(range(len(names)))
        assert 0 in fragments[0]  # the embeddings go with the first block
    assert layer[0] in strided[0] and layer[2] in strided[0] and layer[1] in strided[1] and layer[3] in strided[1]
    assert layer[0] in sequential[0] and layer[1] in sequential[0] and layer[2] in sequential[1]
    assert len(names) - 1 in strided[1] and len(names) - 1 in sequential[1]  # the head goes with the last block
    assert split_into_fragments(names, 1, "strided") == [list(range(len(names)))]
    with pytest.raises(FragmentError, match="5 fragments"):
        split_into_fragments(names, 5, "strided")
    with pytest.raises(FragmentError, match="numbered transformer block"):
        split_into_fragments(["embed.weight", "head.weight"], 2, "strided")


@pytest.mark.parametrize("outer, message", [
    ({"fragments": 3}, "outer.fragments = 3 exceeds model.num_layers = 2"),
    ({"fragments": 2, "merge_alpha": 1.5}, "outer.merge_alpha = 1.5 is invalid"),
    ({"fragment_layout": "random"}, "outer.fragment_layout = 'random' is invalid"),
    ({"error_feedback": "yes"}, "outer.error_feedback = 'yes' is invalid: must be true or false"),
])
def test_streaming_settings_are_checked_up_front(outer, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(model={"num_layers": 2}, inner={"steps_per_outer": 6}, outer=outer)
    with pytest.raises(ConfigError, match="must be a multiple of outer.fragments"):
        tiny_config(model={"num_layers": 2}, inner={"steps_per_outer": 5}, outer={"fragments": 2})


def test_the_overlap_is_shorter_than_a_fragment_round():
    """τ < H/P: one fragment in flight at a time, and every round trains at least one step of its own."""
    fragments = [[0], [1]]
    assert FragmentSchedule(fragments, steps_per_outer=6, sync_delay=5).sync_delay == 2
    assert FragmentSchedule(fragments, steps_per_outer=6, sync_delay=1).sync_delay == 1
    assert FragmentSchedule([[0, 1]], steps_per_outer=1, sync_delay=5).sync_delay == 0
    assert FragmentSchedule(fragments, steps_per_outer=10, sync_delay=-1).sync_delay == 4  # the longest


def test_an_adaptive_overlap_ends_with_the_first_step_after_the_sync_and_a_fixed_one_runs_all_of_its_steps():
    """Unless fixed, τ is the most: the loop stops after the first inner step that ends with the sync done,
    and runs one step at least (the sync began with the Δ); past τ it waits, either way."""
    adaptive = FragmentSchedule([[0]], steps_per_outer=10, sync_delay=3, fixed_delay=False)
    fixed = FragmentSchedule([[0]], steps_per_outer=10, sync_delay=3, fixed_delay=True)

    def steps_run(schedule, sync_done_after: int) -> int:
        """Inner steps beside a sync that is done once `sync_done_after` of them have run."""
        steps = 0
        while schedule.overlaps(steps, sync_done=steps >= sync_done_after):
            steps += 1
        return steps

    assert [steps_run(adaptive, n) for n in (0, 1, 2, 3, 5)] == [1, 1, 2, 3, 3]
    assert [steps_run(fixed, n) for n in (0, 1, 2, 3, 5)] == [3, 3, 3, 3, 3]
    blocking = FragmentSchedule([[0]], steps_per_outer=10, sync_delay=0, fixed_delay=False)
    assert not blocking.overlaps(0, sync_done=False)
