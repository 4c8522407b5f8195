"""The inner loop's compute options on CPU: micro-batches, out-of-memory recovery, precision, the CLI flags."""

from __future__ import annotations

import logging

import pytest
import torch
from click.testing import CliRunner

from p2p_diloco.cli import join, main, peer
from p2p_diloco.config import ComputeConfig, ConfigError
from p2p_diloco.node_runner import PeerOptions, with_compute_options
from p2p_diloco.train.inner import (InnerTrainer, autocast_dtype, describe_compute, make_inner_optimizer,
                                    prepare_for_compute)
from p2p_diloco.train.memory import MemoryFitError
from p2p_diloco.train.model import build_model
from tests.conftest import tiny_config

VOCAB = 300
CPU = torch.device("cpu")


class CountingStream:
    """Fixed batches, endlessly; `position` counts the batches taken, like the peers' streams."""

    def __init__(self, batches: list[torch.Tensor]):
        self.batches = batches
        self.position = 0

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        batch = self.batches[self.position % len(self.batches)]
        self.position += 1
        return batch


def tiny_run(batch_size: int = 4, grad_accumulation: int = 2, **inner):
    cfg = tiny_config(inner={"batch_size": batch_size, "grad_accumulation": grad_accumulation, **inner})
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (batch_size, cfg.data.seq_len), generator=generator) for _ in range(6)]
    return cfg, batches


def trainer_for(cfg, batches, micro_batch_size=None, compute=None) -> InnerTrainer:
    model = build_model(cfg.model, VOCAB, cfg.run.seed)
    return InnerTrainer(model, cfg.inner, CountingStream(batches), compute, micro_batch_size)


def parameters_of(trainer: InnerTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.params]


def reference_gradients(cfg, batches) -> tuple[float, list[torch.Tensor]]:
    """Plain torch: the mean loss over every sequence of one step's batches, in one pass, and its gradient."""
    model = build_model(cfg.model, VOCAB, cfg.run.seed)
    everything = torch.cat(batches[: cfg.inner.grad_accumulation])
    loss = model(input_ids=everything, labels=everything).loss
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("micro_batch_size", [4, 2, 1])
def test_micro_batches_give_the_gradient_of_the_whole_step(micro_batch_size):
    cfg, batches = tiny_run()
    trainer = trainer_for(cfg, batches, micro_batch_size)
    loss = trainer._accumulate(batches[: cfg.inner.grad_accumulation]).item()
    expected_loss, expected = reference_gradients(cfg, batches)
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    for param, grad in zip(trainer.params, expected):
        torch.testing.assert_close(param.grad, grad, rtol=1e-5, atol=1e-7)


def test_micro_batched_steps_reach_the_parameters_of_whole_batch_steps():
    cfg, batches = tiny_run()
    whole, micro = trainer_for(cfg, batches), trainer_for(cfg, batches, micro_batch_size=1)
    for _ in range(3):
        loss_whole, samples_whole = whole.step()
        loss_micro, samples_micro = micro.step()
        assert samples_whole == samples_micro == cfg.inner.batch_size * cfg.inner.grad_accumulation
        assert loss_micro == pytest.approx(loss_whole, rel=1e-5)
    for a, b in zip(parameters_of(whole), parameters_of(micro)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def fail_above(trainer: InnerTrainer, monkeypatch, max_sequences: int, passing: int = 0) -> None:
    """Simulate CUDA running out of memory at the seam: a micro-batch of more than `max_sequences`
    fails, after the first `passing` such ones went through (their gradients are then stale)."""
    seam, allowed = trainer.forward_backward, [passing]

    def allocating(micro_batch, weight):
        if len(micro_batch) > max_sequences:
            if allowed[0] == 0:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
            allowed[0] -= 1
        return seam(micro_batch, weight)

    monkeypatch.setattr(trainer, "forward_backward", allocating)


def test_out_of_memory_halves_the_micro_batch_and_redoes_the_same_step(monkeypatch, caplog):
    cfg, batches = tiny_run()
    trainer = trainer_for(cfg, batches)
    fail_above(trainer, monkeypatch, max_sequences=2, passing=1)  # fails in the step's second batch
    with caplog.at_level(logging.WARNING, logger="p2p_diloco.train.inner"):
        loss, samples = trainer.step()
    assert trainer.micro_batch_size == 2
    assert trainer.batches.position == cfg.inner.grad_accumulation  # the batches were taken once
    assert samples == cfg.inner.batch_size * cfg.inner.grad_accumulation
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["out of memory on cpu at micro-batch 4: redoing the step at micro-batch 2 x 2 per batch of 4"]

    uninterrupted = trainer_for(cfg, batches, micro_batch_size=2)
    assert uninterrupted.step() == (loss, samples)
    for a, b in zip(parameters_of(trainer), parameters_of(uninterrupted)):
        assert torch.equal(a, b)
    trainer.step()  # and the next steps go on at the smaller micro-batch
    assert trainer.micro_batch_size == 2 and trainer.batches.position == 2 * cfg.inner.grad_accumulation


def test_out_of_memory_halves_to_a_divisor_of_the_batch(monkeypatch):
    cfg, batches = tiny_run(batch_size=12, grad_accumulation=1)
    trainer = trainer_for(cfg, batches)
    fail_above(trainer, monkeypatch, max_sequences=5)
    trainer.step()
    assert trainer.micro_batch_size == 3  # 12 -> 6 fails -> 3


def test_out_of_memory_at_one_sequence_is_a_one_line_error(monkeypatch):
    cfg, batches = tiny_run()
    trainer = trainer_for(cfg, batches)
    before = parameters_of(trainer)
    fail_above(trainer, monkeypatch, max_sequences=0)
    with pytest.raises(MemoryFitError) as raised:  # a ConfigError: the peer prints it as one line and exits
        trainer.step()
    assert isinstance(raised.value, ConfigError) and not isinstance(raised.value, torch.OutOfMemoryError)
    message = str(raised.value)
    assert "\n" not in message
    assert message == ("out of memory on cpu with one sequence per forward/backward pass: use a GPU with more "
                       "memory, inner.optimizer = 'adamw8bit', --gradient-checkpointing, or a smaller model")
    assert trainer.micro_batch_size == 1 and trainer.batches.position == cfg.inner.grad_accumulation
    assert all(torch.equal(a, b) for a, b in zip(before, parameters_of(trainer)))  # no step taken
    assert trainer.steps_done == 0


def test_out_of_memory_outside_the_forward_backward_is_not_halved(monkeypatch):
    """Only a forward/backward pass's out-of-memory error is the micro-batch's; one in the optimizer step
    (or clipping, or the outer step) propagates as it is, to end the peer with its traceback."""
    cfg, batches = tiny_run()
    trainer = trainer_for(cfg, batches)

    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")

    monkeypatch.setattr(trainer.optimizer, "step", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        trainer.step()
    assert trainer.micro_batch_size == cfg.inner.batch_size


def test_micro_batch_size_defaults_and_must_divide_the_batch():
    cfg, batches = tiny_run()
    assert trainer_for(cfg, batches).micro_batch_size == cfg.inner.batch_size
    assert trainer_for(cfg, batches, compute=ComputeConfig(micro_batch_size=2)).micro_batch_size == 2
    assert trainer_for(cfg, batches, 1, ComputeConfig(micro_batch_size=2)).micro_batch_size == 1
    with pytest.raises(ConfigError, match="must be a multiple of the micro-batch size 3"):
        trainer_for(cfg, batches, micro_batch_size=3)


def test_precision_on_cpu_is_fp32_unless_bf16_is_asked_for():
    assert autocast_dtype("auto", CPU) is None
    assert autocast_dtype("fp32", CPU) is None
    assert autocast_dtype("bf16", CPU) is torch.bfloat16
    cfg, batches = tiny_run()
    trainer = trainer_for(cfg, batches, compute=ComputeConfig(precision="bf16"))
    loss, _ = trainer.step()
    assert torch.isfinite(torch.tensor(loss))
    assert all(p.dtype == torch.float32 for p in trainer.params)  # weights stay fp32 under autocast


def test_fused_adamw_only_on_cuda_and_the_description_says_what_runs():
    cfg = tiny_config()
    param = torch.nn.Parameter(torch.zeros(2))
    assert not make_inner_optimizer([param], cfg.inner, CPU).defaults["fused"]
    cuda = torch.device("cuda")
    assert describe_compute(cfg.inner, ComputeConfig(precision="bf16", gradient_checkpointing=True), cuda) == \
        "bf16 autocast, fused AdamW, gradient checkpointing"
    eight_bit = tiny_config(inner={"optimizer": "adamw8bit"}).inner
    assert describe_compute(eight_bit, ComputeConfig(compile=True), CPU) == "fp32, 8-bit AdamW, compiled"


def test_gradient_checkpointing_gives_the_same_gradient():
    cfg, batches = tiny_run()
    plain, checkpointed = trainer_for(cfg, batches), trainer_for(cfg, batches)
    prepare_for_compute(checkpointed.model, ComputeConfig(gradient_checkpointing=True))
    assert any(getattr(module, "gradient_checkpointing", False) for module in checkpointed.model.modules())
    for trainer in (plain, checkpointed):
        trainer.model.train()
        trainer._accumulate(batches[: cfg.inner.grad_accumulation])
    for a, b in zip(plain.params, checkpointed.params):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)


def test_compile_keeps_the_parameter_objects():
    cfg = tiny_config()
    model = build_model(cfg.model, VOCAB, cfg.run.seed)
    before = [id(p) for p in model.parameters()]
    prepare_for_compute(model, ComputeConfig(compile=True))
    assert [id(p) for p in model.parameters()] == before
    assert model._compiled_call_impl is not None  # nn.Module.compile: compiled at the first forward


def test_compute_config_is_validated():
    cfg = tiny_config()
    with pytest.raises(ConfigError, match=r"compute.precision = 'fp16' is invalid"):
        cfg.replace(compute={"precision": "fp16"})
    with pytest.raises(ConfigError, match=r"compute.max_memory_gib = -1 is invalid"):
        cfg.replace(compute={"max_memory_gib": -1})
    with pytest.raises(ConfigError, match=r"inner.batch_size = 4 must be a multiple of compute.micro_batch_size = 3"):
        cfg.replace(compute={"micro_batch_size": 3})


def parsed_options(command, args: list[str]) -> PeerOptions:
    params = command.make_context(command.name, list(args)).params  # click consumes the list it parses
    return PeerOptions(**{k: v for k, v in params.items() if k not in ("config_path", "manifest", "state_dir")})


@pytest.mark.parametrize("command, first", [(peer, ["--config", "run.toml"]), (join, ["run.toml"])])
def test_compute_flags_override_the_config(command, first):
    cfg = tiny_config().replace(compute={"compile": True, "precision": "fp32", "max_memory_gib": 8})
    assert with_compute_options(cfg, parsed_options(command, first)) == cfg  # no flag: the config's values
    flags = ["--precision", "bf16", "--no-compile", "--gradient-checkpointing", "--micro-batch-size", "2",
             "--max-memory", "1.5"]
    compute = with_compute_options(cfg, parsed_options(command, first + flags)).compute
    assert compute == ComputeConfig(precision="bf16", compile=False, gradient_checkpointing=True,
                                    micro_batch_size=2, max_memory_gib=1.5)
    with pytest.raises(ConfigError, match="must be a multiple of compute.micro_batch_size = 3"):
        with_compute_options(cfg, parsed_options(command, first + ["--micro-batch-size", "3"]))


def test_compute_flags_are_in_the_help():
    for command in ("peer", "join"):
        out = CliRunner().invoke(main, [command, "--help"]).output
        for flag in ("--precision", "--compile / --no-compile", "--gradient-checkpointing", "--micro-batch-size",
                     "--max-memory"):
            assert flag in out, (command, flag)
