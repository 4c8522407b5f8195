"""The outer step's flat device transfers (p2p_diloco/train/transfer.py) on the CPU: the same bits as
one copy per parameter, buffers reused across outer steps."""

import pytest
import torch

from p2p_diloco.train.model import trainable_parameters
from p2p_diloco.train.transfer import FlatTransfer
from tests.transfer_case import (
    DTYPES_AND_ALPHAS, assert_same_bits, check_outer_steps, first_fragment_transfer, tiny_llama,
)


@pytest.mark.parametrize("dtype, alpha", DTYPES_AND_ALPHAS)
def test_flat_transfers_give_the_per_parameter_bits(dtype, alpha):
    check_outer_steps("cpu", dtype, alpha)


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
