"""The swarm computes DiLoCo exactly: compared with a plain single-process DiLoCo written in torch."""

import pytest
import torch

from p2p_diloco.train.model import build_model, trainable_parameters
from tests.conftest import tiny_config
from tests.inprocess import OracleWorker, fixed_batches, inprocess_peers, run_in_threads

VOCAB = 300
pytestmark = pytest.mark.timeout(300)


def oracle_diloco(cfg, batch_lists, outer_steps):
    """DiLoCo (arXiv 2311.08105, Algorithm 1) in plain torch: k workers, H AdamW steps, Nesterov outer step."""
    inner = cfg.inner
    theta = [p.detach().clone().float() for p in trainable_parameters(build_model(cfg.model, VOCAB, cfg.run.seed))]
    outer_opt = torch.optim.SGD(theta, lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=True)
    workers = [OracleWorker(cfg, VOCAB, batches) for batches in batch_lists]
    for _ in range(outer_steps):
        deltas, weights = [], []
        for worker in workers:
            with torch.no_grad():
                for p, g in zip(worker.params, theta):
                    p.copy_(g)
            worker.train(inner.steps_per_outer)
            deltas.append([g.double() - p.detach().double() for g, p in zip(theta, worker.params)])
            weights.append(inner.steps_per_outer * inner.batch_size)
        for i, g in enumerate(theta):
            g.grad = (sum(w * d[i] for w, d in zip(weights, deltas)) / sum(weights)).float()
        outer_opt.step()
        outer_opt.zero_grad()
    return theta


# the oracle is DiLoCo's weighted mean: the run's default robust rule clips each honest part to the median norm
# (sync/robust.py, issue 44), so the exact math is checked under the exact mean; the robust rule has its own tests
EXACT_MEAN = {"aggregation": "mean"}


def test_three_peers_match_the_oracle_after_two_outer_steps():
    torch.set_num_threads(1)
    cfg = tiny_config(outer=EXACT_MEAN)
    outer_steps = 2
    batch_lists = fixed_batches(3, outer_steps * cfg.inner.steps_per_outer, cfg.inner.batch_size,
                                cfg.data.seq_len, VOCAB)
    expected = oracle_diloco(cfg, batch_lists, outer_steps)
    with inprocess_peers(cfg, VOCAB, batch_lists) as peers:
        run_in_threads(peers, outer_steps)
        hashes = {peer.sha256 for peer in peers}
        assert len(hashes) == 1, "peers ended the outer step with different global models"
        for peer in peers:
            assert peer.global_model.outer_step == outer_steps
            assert peer.last_group_size == 3
            for got, want in zip(peer.global_model.params, expected):
                assert (got - want).abs().max().item() <= 1e-6


def test_one_peer_with_outer_lr_one_and_no_momentum_is_plain_adamw():
    torch.set_num_threads(1)
    cfg = tiny_config(outer={"lr": 1.0, "momentum": 0.0})
    outer_steps = 3
    (batches,) = fixed_batches(1, outer_steps * cfg.inner.steps_per_outer, cfg.inner.batch_size,
                               cfg.data.seq_len, VOCAB, seed=1)
    worker = OracleWorker(cfg, VOCAB, batches)
    worker.train(len(batches))
    params = worker.params
    with inprocess_peers(cfg, VOCAB, [batches]) as (peer,):
        run_in_threads([peer], outer_steps)
        assert peer.last_group_size == 1
        # θ_g − 1·(θ_g − θ_l) equals θ_l up to one rounding per outer step
        for got, want in zip(peer.global_model.params, params):
            assert (got - want.detach()).abs().max().item() <= 1e-6
