"""GlobalModel's transfers against the per-parameter code they replaced, on any device
(tests/test_transfer.py on the CPU, tests/test_cuda_transfer.py on a GPU): the flat one
(FlatTransfer, what a GPU peer uses, checked on the CPU too) and the one a peer picks by default
(transfer_for: flat on CUDA, direct elsewhere).

A tiny Llama with 2 Streaming DiLoCo fragments (arXiv 2501.18512) takes outer steps t = 0..3 on
fragment t mod 2: random drift stands in for the inner steps, then Δ = θ_global − θ_local, the outer
Nesterov step and the merge θ_local ← α·θ_local + (1 − α)·θ_global (DiLoCo, arXiv 2311.08105, Alg. 1
lines 10-12). A plain-torch reference does the same with one copy per parameter and the same
arithmetic (:func:`~p2p_diloco.train.outer.nesterov_step_`, :func:`~p2p_diloco.train.transfer.merge_`:
what is compared is the transfers, not the update); every Δ, the state's
sha256 after each outer step and θ_local after each merge (and after copy_to, fragment by fragment
and whole) must be the same bits.
"""

from __future__ import annotations

from typing import Sequence

import torch

from p2p_diloco.config import OuterConfig
from p2p_diloco.hashing import tensors_sha256
from p2p_diloco.train.fragments import model_fragments
from p2p_diloco.train.model import build_model, trainable_parameters
from p2p_diloco.train.outer import GlobalModel, TransferFactory, nesterov_step_
from p2p_diloco.train.transfer import FlatTransfer, merge_, transfer_for
from tests.conftest import tiny_config

VOCAB = 300
OUTER_STEPS = 4  # each of the 2 fragments syncs twice
DRIFT = 1e-2  # standard deviation of the stand-in for a round of inner steps
INTEGER_OF_WIDTH = {4: torch.int32, 2: torch.int16}
# θ_local is fp32 in this project (bf16 only under autocast); bf16 parameters exercise the casts
DTYPES_AND_ALPHAS = [(dtype, alpha) for dtype in (torch.float32, torch.bfloat16) for alpha in (0.0, 0.5)]
TRANSFER_FACTORIES = {"flat": FlatTransfer, "default": transfer_for}


class PerParameterReference:
    """θ_global and its outer Nesterov SGD in plain torch, each parameter copied on its own; the
    arithmetic (the outer step, the merge) is GlobalModel's own, so only the transfers differ."""

    def __init__(self, local_params: Sequence[torch.Tensor], cfg: OuterConfig):
        self.params = [p.detach().to("cpu", torch.float32, copy=True) for p in local_params]
        self.momentum = [torch.zeros_like(p) for p in self.params]
        self.cfg = cfg

    def pseudo_gradient(self, local_params, indices) -> list[torch.Tensor]:
        return [self.params[i] - local_params[i].detach().to("cpu", torch.float32) for i in indices]

    def apply(self, mean_delta, indices) -> None:
        for i, delta in zip(indices, mean_delta):
            nesterov_step_(self.params[i], self.momentum[i], delta, self.cfg.lr, self.cfg.momentum)

    @torch.no_grad()
    def merge_into(self, local_params, indices, alpha: float) -> None:
        for i in indices:
            merge_(local_params[i], self.params[i].to(local_params[i].device, local_params[i].dtype), alpha)

    @torch.no_grad()
    def copy_to(self, local_params) -> None:
        for local, value in zip(local_params, self.params):
            local.copy_(value)

    def sha256(self) -> str:
        return tensors_sha256([*self.params, *self.momentum])


def tiny_llama(device: str, dtype: torch.dtype):
    """The tests' tiny Llama with 2 blocks, in 2 strided fragments, on `device` in `dtype`."""
    cfg = tiny_config(model={"num_layers": 2}, inner={"steps_per_outer": 6}, outer={"fragments": 2})
    model = build_model(cfg.model, VOCAB, cfg.run.seed).to(device, dtype)
    return cfg, model, model_fragments(model, cfg.outer)


def first_fragment_transfer(device: str) -> tuple[list[torch.Tensor], FlatTransfer]:
    """The tiny Llama's first fragment in fp32 on `device`, and a flat transfer made for it."""
    _, model, fragments = tiny_llama(device, torch.float32)
    params = [trainable_parameters(model)[i] for i in fragments[0]]
    return params, FlatTransfer(params)


def assert_same_bits(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert (a.dtype, a.shape, a.device) == (e.dtype, e.shape, e.device)
        as_integers = INTEGER_OF_WIDTH[a.element_size()]
        assert torch.equal(a.detach().view(as_integers), e.detach().view(as_integers))


@torch.no_grad()
def drift_(param_sets: Sequence[Sequence[torch.Tensor]], generator: torch.Generator) -> None:
    """The same random change to each set of parameters: a stand-in for a round of inner steps."""
    for params in zip(*param_sets):
        noise = (torch.randn(params[0].shape, generator=generator) * DRIFT).to(params[0].device, params[0].dtype)
        for p in params:
            p.add_(noise)


def check_outer_steps(device: str, dtype: torch.dtype, alpha: float,
                      transfer_factory: TransferFactory = transfer_for) -> None:
    """OUTER_STEPS outer steps of GlobalModel (its fragments' transfers made by `transfer_factory`) and of the
    reference, compared bit for bit after each stage."""
    cfg, model, fragments = tiny_llama(device, dtype)
    assert len(fragments) == 2
    local = trainable_parameters(model)
    reference_local = [p.detach().clone() for p in local]
    global_model = GlobalModel(local, cfg.outer, transfer_factory)
    reference = PerParameterReference(reference_local, cfg.outer)
    generator = torch.Generator().manual_seed(0)
    for t in range(OUTER_STEPS):
        indices = fragments[t % len(fragments)]
        drift_([local, reference_local], generator)
        delta = global_model.pseudo_gradient(local, indices)
        assert_same_bits(delta, reference.pseudo_gradient(reference_local, indices))
        mean_delta = [d * 0.5 for d in delta]  # a stand-in for the group's mean
        global_model.apply(mean_delta, indices)
        reference.apply(mean_delta, indices)
        assert global_model.sha256() == reference.sha256()
        global_model.merge_into(local, indices, alpha)
        reference.merge_into(reference_local, indices, alpha)
        assert_same_bits(local, reference_local)
    for copy_fragments in (fragments, None):  # through the fragments' transfers, then one of the whole model
        drift_([local, reference_local], generator)
        global_model.copy_to(local, copy_fragments)
        reference.copy_to(reference_local)
        assert_same_bits(local, reference_local)
