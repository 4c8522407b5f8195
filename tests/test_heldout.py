"""The held-out evaluation of θ_global while a run trains (p2p_diloco/train/heldout.py), in-process.

(A real peer writing `eval` records and publishing its held-out loss: tests/test_run_page.py's swarm.)
"""

import pytest
import torch

from p2p_diloco.train.heldout import EvalSchedule, HeldoutEval, evaluate_global
from p2p_diloco.train.model import build_model, evaluate_loss, trainable_parameters
from tests.conftest import tiny_config
from tests.cuda_marks import ON_CUDA

CFG = tiny_config()
VOCAB = 300


def due_steps(schedule: EvalSchedule, steps) -> list[int]:
    evaluated = []
    for step in steps:
        if schedule.due(step):
            schedule.done(step)
            evaluated.append(step)
    return evaluated


def test_a_peer_evaluates_at_each_multiple_and_one_that_jumps_evaluates_where_it_lands_once_per_span():
    assert due_steps(EvalSchedule(4), range(0, 13)) == [4, 8, 12]  # nothing before step 4 (the initial model)
    assert due_steps(EvalSchedule(1), range(0, 4)) == [1, 2, 3]
    # a joiner that loads step 6, or a keeper that reads the run every few seconds: once per span of 4
    assert due_steps(EvalSchedule(4), [3, 6, 7, 9, 10, 11, 13, 17]) == [6, 9, 13, 17]
    assert due_steps(EvalSchedule(0), range(0, 30)) == []  # eval.every = 0: never


def models():
    """The same architecture twice: one to train (θ_local), one that holds θ_global as its parameters."""
    local = build_model(CFG.model, VOCAB, seed=0)
    holding_global = build_model(CFG.model, VOCAB, seed=1)  # another init: θ_global differs from θ_local
    return local, holding_global


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
def test_theta_global_is_evaluated_in_the_training_model_and_theta_local_is_back_bit_for_bit(device):
    """θ_global in fp32 on the CPU, as GlobalModel keeps it; the model training on `device`."""
    local, holding_global = models()
    local, holding_global = local.to(device), holding_global.to(device)
    params = trainable_parameters(local)
    before = [p.detach().clone() for p in params]
    theta_global = [p.detach().to("cpu", copy=True) for p in trainable_parameters(holding_global)]
    sequences = torch.randint(0, VOCAB, (5, CFG.data.seq_len), generator=torch.Generator().manual_seed(0))

    loss = evaluate_global(local, params, theta_global, sequences, batch_size=2)

    assert loss == evaluate_loss(holding_global, sequences, batch_size=2)  # θ_global's loss, not θ_local's
    assert loss != evaluate_loss(local, sequences)
    assert all(torch.equal(p, b) for p, b in zip(params, before))  # θ_local as it was
    assert evaluate_global(local, params, theta_global, sequences[:0], batch_size=2) is None


def test_theta_local_is_back_even_when_the_evaluation_fails():
    local, holding_global = models()
    params = trainable_parameters(local)
    before = [p.detach().clone() for p in params]
    out_of_vocabulary = torch.full((2, CFG.data.seq_len), VOCAB + 5)
    try:
        evaluate_global(local, params, trainable_parameters(holding_global), out_of_vocabulary, batch_size=2)
    except IndexError:
        pass
    else:
        raise AssertionError("an id past the embedding should fail")
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_an_evaluation_says_its_step_and_sequences_only_when_it_is_due():
    local, holding_global = models()
    sequences = torch.randint(0, VOCAB, (3, CFG.data.seq_len), generator=torch.Generator().manual_seed(1))
    heldout = HeldoutEval(sequences, every=2, batch_size=16)
    theta_global = trainable_parameters(holding_global)
    assert heldout.maybe(1, local, trainable_parameters(local), theta_global) is None
    evaluation = heldout.maybe(2, local, trainable_parameters(local), theta_global)
    assert (evaluation.outer_step, evaluation.sequences) == (2, 3) and evaluation.seconds >= 0
    assert evaluation.loss == evaluate_loss(holding_global, sequences)
    assert heldout.maybe(3, local, trainable_parameters(local), theta_global) is None
