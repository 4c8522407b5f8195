"""The outer step's device transfers (p2p_diloco/train/transfer.py) on the CPU: the flat one and the
direct one a CPU peer takes give the same bits as one copy per parameter; buffers are reused across
outer steps, and the direct path copies nothing."""

import pytest
import torch

from p2p_diloco.train.model import trainable_parameters
from p2p_diloco.config import OuterConfig
from p2p_diloco.train.outer import GlobalModel
from p2p_diloco.train.transfer import DirectTransfer, FlatTransfer, transfer_for
from tests.transfer_case import (
    DTYPES_AND_ALPHAS, TRANSFER_FACTORIES, assert_same_bits, check_outer_steps, first_fragment_transfer, tiny_llama,
)


@pytest.mark.parametrize("factory", TRANSFER_FACTORIES)
@pytest.mark.parametrize("dtype, alpha", DTYPES_AND_ALPHAS)
def test_transfers_give_the_per_parameter_bits(dtype, alpha, factory):
    check_outer_steps("cpu", dtype, alpha, TRANSFER_FACTORIES[factory])


def test_a_cpu_peer_takes_the_direct_path_without_copies():
    _, model, fragments = tiny_llama("cpu", torch.float32)
    params = trainable_parameters(model)
    assert isinstance(transfer_for(params), DirectTransfer)
    gathered = transfer_for(params).gather(params)
    assert [v.data_ptr() for v in gathered] == [p.data_ptr() for p in params]  # the parameters themselves
    global_model = GlobalModel(params, OuterConfig())
    global_model.pseudo_gradient(params, fragments[0])
    assert all(isinstance(t, DirectTransfer) for t in global_model._transfers.values())


def test_copy_to_needs_fragments_that_cover_the_model():
    _, model, fragments = tiny_llama("cpu", torch.float32)
    params = trainable_parameters(model)
    with pytest.raises(ValueError, match="do not cover each"):
        GlobalModel(params, OuterConfig()).copy_to(params, fragments[:1])


def test_the_host_buffer_is_made_once_and_reused():
    params, transfer = first_fragment_transfer("cpu")
    assert not transfer.host.is_pinned()  # nothing to pin for on a CPU
    assert transfer.host.numel() == sum(p.numel() for p in params)
    first = transfer.gather(params)
    with torch.no_grad():
        params[0].add_(1.0)
    second = transfer.gather(params)
    assert [v.data_ptr() for v in first] == [v.data_ptr() for v in second]
    assert_same_bits(second, [p.detach() for p in params])


def test_a_transfer_refuses_other_parameters():
    _, model, fragments = tiny_llama("cpu", torch.float32)
    params = trainable_parameters(model)
    transfer = FlatTransfer([params[i] for i in fragments[0]])
    with pytest.raises(ValueError, match="other shapes"):
        transfer.gather([params[i] for i in fragments[1]])
