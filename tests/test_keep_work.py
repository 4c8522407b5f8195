"""A load keeps the inner steps of a round the peer missed, rebased onto the loaded state, and drops those a state
may hold already (protocol.plans.keeps_work, train/state_loading.py): a real in-process peer on 127.0.0.1 adopts
states one outer step ahead of its own, as a download brings them; and checks that such a state is an outer step
from its own, a mask codec's lazy step included."""

import json

import pytest
import torch

from p2p_diloco.metrics import MetricsWriter
from p2p_diloco.train.outer import GlobalModel
from tests.conftest import tiny_config
from tests.inprocess import fixed_batches, inprocess_peers

pytestmark = pytest.mark.timeout(120)

VOCAB = 64


def one_step_on(run: GlobalModel, seed: int) -> None:
    """The run's next outer step: a group's mean applied to its θ_global."""
    generator = torch.Generator().manual_seed(seed)
    run.apply([torch.randn(p.shape, generator=generator) * 0.01 for p in run.params], range(len(run.params)))


def last_load(path) -> dict:
    return [json.loads(line) for line in path.read_text().splitlines() if '"state_loaded"' in line][-1]


def test_a_peer_that_missed_a_round_keeps_its_inner_steps_and_drops_those_a_state_may_hold(tmp_path):
    cfg = tiny_config(model={"num_layers": 2}, inner={"steps_per_outer": 4}, outer={"fragments": 2})
    (batches,) = fixed_batches(1, 1, cfg.inner.batch_size, cfg.data.seq_len, VOCAB)
    with inprocess_peers(cfg, VOCAB, [batches]) as (peer,):
        metrics = tmp_path / "metrics.jsonl"
        peer.metrics = MetricsWriter(metrics, peer.peer_id)
        everything = range(len(peer.local_params))
        run = GlobalModel([p.clone() for p in peer.global_model.params], cfg.outer)
        one_step_on(run, seed=1)  # the round this peer missed
        with torch.no_grad():  # its own inner steps meanwhile
            generator = torch.Generator().manual_seed(2)
            for p in peer.local_params:
                p.add_(torch.randn(p.shape, generator=generator) * 0.01)
        peer.local.contribution.add(2.0, 16)
        held = peer.global_model.pseudo_gradient(peer.local_params, everything)

        peer._adopt(run.state_tensors(), 1, 0, "a round it missed", source="peer", donor="test")

        assert peer.global_model.outer_step == 1 and peer.sha256 == run.sha256()
        kept = peer.global_model.pseudo_gradient(peer.local_params, everything)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(held, kept))
        assert not all(torch.allclose(a, b) for a, b in zip(peer.global_model.params, peer.local_params))
        assert peer.local.contribution.samples(0) == 16
        record = last_load(metrics)
        assert (record["samples_kept"], record["samples_dropped"]) == (16, 0)

        # its Δ of fragment 0 then travels in a round that fails after tensors moved: another member may commit
        # it, and the next state may hold it, so the next load drops every inner step with the old state
        peer.local.sent_in_failed_round(0)
        one_step_on(run, seed=3)
        peer._adopt(run.state_tensors(), 2, 0, "a round that failed for this peer", source="peer", donor="test")
        assert all(torch.equal(g, p) for g, p in zip(peer.global_model.params, peer.local_params))
        assert peer.local.contribution.samples(0) == 0 and not peer.local.sent_unsettled
        record = last_load(metrics)
        assert (record["samples_kept"], record["samples_dropped"]) == (0, 16)


@pytest.mark.parametrize("codec", ["mask2-1bit", "fp4-e3m0"])
def test_a_state_one_mask_round_ahead_passes_the_step_check_in_a_mask_run_only(codec):
    """A state one outer step ahead whose round stepped only the values its mask carried (GlobalModel.apply): a
    peer of a run whose codec sends a subset (its config's outer.codec) accepts it as an outer step from its own
    state; a peer of a dense run refuses it, as the values left as they were do not follow its momentum."""
    from p2p_diloco.sync.codecs import get_codec
    from p2p_diloco.sync.state_transfer import GlobalState

    cfg = tiny_config(outer={"codec": codec, "error_feedback": True})
    (batches,) = fixed_batches(1, 1, cfg.inner.batch_size, cfg.data.seq_len, VOCAB)
    with inprocess_peers(cfg, VOCAB, [batches]) as (peer,):
        run = GlobalModel([p.clone() for p in peer.global_model.params], cfg.outer)
        one_step_on(run, seed=1)  # a dense first step: a momentum that is not zero
        peer._adopt(run.state_tensors(), 1, 0, "a round it missed", source="peer", donor="test")
        mask = get_codec("mask2-1bit").for_round(b"the next round")
        carried = [mask.carried(p.numel()).view_as(p) for p in run.params]
        generator = torch.Generator().manual_seed(2)
        mean = [torch.where(c, torch.randn(p.shape, generator=generator) * 0.01, 0.0)
                for c, p in zip(carried, run.params)]
        run.apply(mean, range(len(run.params)), carried)
        state = GlobalState(outer_step=2, sha256=run.sha256(), inner_steps=0, tensors=run.state_tensors(),
                            donor="test")
        problem = peer._step_refusal(state, records={})
        if codec == "mask2-1bit":
            assert problem is None
        else:
            assert problem is not None and "is not θ − η·(g + μ·b')" in problem
