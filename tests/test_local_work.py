"""θ_local and what it holds beyond θ_global change, are saved and are dropped together (train/local_work.py)."""

import pytest
import torch

from p2p_diloco.config import OuterConfig
from p2p_diloco.train.error_feedback import ErrorFeedback
from p2p_diloco.train.local_work import LocalWork
from p2p_diloco.train.outer import GlobalModel

SHAPES = [torch.Size([4, 3]), torch.Size([5])]


def local_work(seed: int) -> tuple[LocalWork, GlobalModel]:
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(shape, generator=generator) for shape in SHAPES]
    global_model = GlobalModel([p + 1 for p in params], OuterConfig())
    return LocalWork(params, num_fragments=2, error_feedback=ErrorFeedback(SHAPES)), global_model


def trained(work: LocalWork, global_model: GlobalModel) -> None:
    """Two inner steps, one ahead of the sync, and an applied round of fragment 0 whose part the group
    counted with an error of 0.25 on every value."""
    work.contribution.add(2.0, 8)
    work.contribution.add(1.0, 8)
    work.steps_ahead = 1
    indices = [0]
    to_send = work.to_send(indices, global_model.pseudo_gradient(work.params, indices))
    work.sent(indices, to_send, [t - 0.25 for t in to_send])
    work.contribution.synced(0, 16)
    work.contribution.add(3.0, 8)


def test_what_the_group_did_not_count_is_owed_to_the_next_send():
    work, global_model = local_work(0)
    trained(work, global_model)
    assert torch.equal(work.error_feedback.residual[0], torch.full(SHAPES[0], 0.25))
    assert not work.error_feedback.residual[1].any()  # fragment 1 has not been sent yet
    delta = global_model.pseudo_gradient(work.params, [0])
    assert torch.equal(work.to_send([0], delta)[0], delta[0] + 0.25)
    work.sent([0], delta, None)  # counted exactly (a peer alone): nothing owed
    assert not work.error_feedback.residual[0].any()


def test_what_the_group_did_not_count_goes_into_theta_local_with_the_merge():
    """The residual leaves the error feedback for θ_local: merged with θ_global − e, the next Δ holds e, as a
    compensated send would, and the inner steps start from the point that holds it (train/error_feedback.py)."""
    work, global_model = local_work(0)
    trained(work, global_model)
    global_model.apply([torch.ones(SHAPES[0])], [0])
    global_model.merge_into(work.params, [0], alpha=0.0, owed=work.owed([0]))
    assert not work.error_feedback.residual[0].any()  # owed once: to θ_local, not to the next send as well
    delta = global_model.pseudo_gradient(work.params, [0])[0]
    assert torch.allclose(delta, torch.full(SHAPES[0], 0.25)) and torch.equal(work.to_send([0], [delta])[0], delta)
    assert work.owed([1])[0].equal(torch.zeros(SHAPES[1]))  # fragment 1 owes nothing


def test_a_checkpoint_restores_all_of_it():
    work, global_model = local_work(0)
    trained(work, global_model)
    restored, _ = local_work(1)  # other θ_local, nothing trained
    restored.load_state_dict(work.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(restored.params, work.params))
    assert restored.contribution.state_dict() == work.contribution.state_dict()
    assert (restored.contribution.samples(0), restored.contribution.samples(1)) == (8, 24)
    assert restored.steps_ahead == 1
    assert all(torch.equal(a, b) for a, b in zip(restored.error_feedback.residual, work.error_feedback.residual))


def test_a_checkpoint_of_another_model_changes_nothing():
    work, global_model = local_work(0)
    trained(work, global_model)
    before = work.state_dict()
    other = LocalWork([torch.zeros(2, 2)], num_fragments=2)
    with pytest.raises(ValueError, match="this model's parameters"):
        work.load_state_dict(other.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(work.params, before["params"]))
    assert work.contribution.state_dict() == before["contribution"]


def test_a_downloaded_state_replaces_all_of_it():
    work, global_model = local_work(0)
    trained(work, global_model)
    work.replace_with(global_model, [[0], [1]])
    assert all(torch.equal(a, b) for a, b in zip(work.params, global_model.params))
    assert (work.contribution.samples(0), work.contribution.samples(1), work.steps_ahead) == (0, 0, 0)
    assert not any(r.any() for r in work.error_feedback.residual)


def test_a_state_loaded_after_a_missed_round_takes_all_of_it_over():
    """keeps_work: θ_local ← θ_global' − Δ, so the pseudo-gradient and everything around it carry over."""
    work, global_model = local_work(0)
    trained(work, global_model)
    fragments = [[0], [1]]
    before = work.pseudo_gradients(global_model, fragments)
    counts, residual = work.contribution.state_dict(), [r.clone() for r in work.error_feedback.residual]
    local_before = [p.clone() for p in work.params]
    _, loaded = local_work(7)  # another θ_global, as a download brings it
    global_model.load_state_tensors(loaded.state_tensors(), 5)
    work.rebase(global_model, fragments, before)
    after = work.pseudo_gradients(global_model, fragments)
    assert all(torch.allclose(a, b, atol=1e-6) for fa, fb in zip(before, after) for a, b in zip(fa, fb))
    assert not any(torch.allclose(a, b) for a, b in zip(work.params, local_before))  # it moved with θ_global
    assert work.contribution.state_dict() == counts and work.steps_ahead == 1
    assert all(torch.equal(a, b) for a, b in zip(work.error_feedback.residual, residual))


def test_a_fragment_sent_in_a_failed_round_stays_unsettled_until_applied_or_replaced():
    work, global_model = local_work(0)
    work.sent_in_failed_round(1)
    restored, _ = local_work(1)
    restored.load_state_dict(work.state_dict())
    assert restored.sent_unsettled == {1}
    work.sent([0], global_model.pseudo_gradient(work.params, [0]), None, fragment=0)
    assert work.sent_unsettled == {1}  # another fragment's round settles nothing of fragment 1
    work.sent([1], global_model.pseudo_gradient(work.params, [1]), None, fragment=1)
    assert work.sent_unsettled == set()
    restored.replace_with(global_model, [[0], [1]])
    assert restored.sent_unsettled == set()
