"""The inner loop: its lr schedule (held at the minimum after total_steps), O(1) fast-forward, 8-bit AdamW."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from p2p_diloco.train.inner import InnerTrainer, inner_lr_factor
from p2p_diloco.train.model import build_model
from tests.conftest import tiny_config

VOCAB = 300


def transformers_factors(warmup: int, total: int, ratio: float, steps: range) -> list[float]:
    """transformers' schedule, read off a LambdaLR on a dummy optimizer with lr 1."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, total, min_lr_rate=ratio)
    return [scheduler.lr_lambdas[0](step) for step in steps]


def tiny_trainer(optimizer: str = "adamw", total_steps: int = 400) -> InnerTrainer:
    cfg = tiny_config(inner={"optimizer": optimizer, "total_steps": total_steps})
    torch.manual_seed(0)
    batches = iter(lambda: torch.randint(0, VOCAB, (cfg.inner.batch_size, cfg.data.seq_len)), None)
    return InnerTrainer(build_model(cfg.model, VOCAB, cfg.run.seed), cfg.inner, batches)


def scheduler_steps(trainer: InnerTrainer, count: int) -> None:
    with warnings.catch_warnings():  # stepping without optimizer steps is what this test means to do
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(count):
            trainer.scheduler.step()
            trainer.steps_done += 1


@pytest.mark.parametrize("warmup, total, ratio", [(0, 1, 0.1), (2, 400, 0.1), (50, 1000, 0.0), (100, 5000, 0.3)])
def test_schedule_is_transformers_up_to_total_steps(warmup, total, ratio):
    steps = range(0, total + 1)
    ours = [inner_lr_factor(step, warmup, total, ratio) for step in steps]
    assert ours == transformers_factors(warmup, total, ratio, steps)  # bit for bit


def test_schedule_stays_at_the_minimum_after_total_steps():
    warmup, total, ratio = 0, 1000, 0.1
    theirs = transformers_factors(warmup, total, ratio, range(1000, 2001, 500))
    assert theirs == pytest.approx([0.1, 0.55, 1.0])  # the bug: transformers' cosine climbs back
    for step in (1000, 1001, 1500, 2000, 10**6, 10**15):
        assert inner_lr_factor(step, warmup, total, ratio) == ratio


def test_trainer_lr_follows_the_schedule():
    trainer = tiny_trainer(total_steps=10)
    lr = trainer.cfg.lr
    for step in range(1, 15):
        scheduler_steps(trainer, 1)
        assert trainer.scheduler.get_last_lr()[0] == pytest.approx(lr * inner_lr_factor(step, 2, 10, 0.1), rel=1e-12)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * lr)


@pytest.mark.timeout(10)
def test_fast_forward_to_an_absurd_step_returns_at_once():
    trainer = tiny_trainer()
    trainer.fast_forward_schedule(10**15)
    assert trainer.steps_done == 10**15
    min_lr = trainer.cfg.lr * trainer.cfg.min_lr_ratio
    assert trainer.scheduler.get_last_lr()[0] == pytest.approx(min_lr)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(min_lr)


@pytest.mark.parametrize("k", [1, 2, 3, 37, 399, 400, 401, 450])
def test_fast_forward_equals_real_scheduler_steps(k):
    stepped, jumped = tiny_trainer(), tiny_trainer()
    scheduler_steps(stepped, k)
    jumped.fast_forward_schedule(k)
    assert jumped.steps_done == stepped.steps_done == k
    assert jumped.scheduler.get_last_lr() == stepped.scheduler.get_last_lr()
    scheduler_steps(stepped, 1)  # and the next real step continues from there
    scheduler_steps(jumped, 1)
    assert jumped.scheduler.get_last_lr() == stepped.scheduler.get_last_lr()


def test_fast_forward_never_goes_back():
    trainer = tiny_trainer()
    scheduler_steps(trainer, 20)
    lr = trainer.scheduler.get_last_lr()
    trainer.fast_forward_schedule(5)
    assert trainer.steps_done == 20 and trainer.scheduler.get_last_lr() == lr


@pytest.mark.timeout(120)
def test_adamw8bit_trains_a_tiny_llama_on_cpu():
    torch.set_num_threads(1)
    trainer = tiny_trainer("adamw8bit")
    assert type(trainer.optimizer).__name__ == "AdamW8bit"
    batch = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(1))
    trainer.batches = iter(lambda: batch, None)  # one fixed batch, over and over
    losses = [trainer.step()[0] for _ in range(30)]
    assert trainer.steps_done == 30
    assert losses[-1] < losses[0] - 0.5, losses
    states = [trainer.optimizer.state[p] for p in trainer.params if p.numel() >= 4096]
    assert states and all(s["state1"].dtype == torch.uint8 for s in states)  # the 8-bit state really is used
