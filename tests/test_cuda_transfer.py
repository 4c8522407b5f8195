"""The outer step's flat device transfers on a GPU, what a peer takes there: the same bits as one copy
per parameter, through a page-locked host buffer. Skipped without a CUDA device."""

import pytest

from p2p_diloco.train.transfer import FlatTransfer, transfer_for
from tests.cuda_marks import NEEDS_CUDA
from tests.transfer_case import DTYPES_AND_ALPHAS, check_outer_steps, first_fragment_transfer

pytestmark = NEEDS_CUDA


@pytest.mark.parametrize("dtype, alpha", DTYPES_AND_ALPHAS)
def test_flat_transfers_give_the_per_parameter_bits_on_cuda(dtype, alpha):
    check_outer_steps("cuda", dtype, alpha)  # the default factory: flat on CUDA


def test_the_host_buffer_is_pinned_and_cuda_takes_the_flat_path():
    params, transfer = first_fragment_transfer("cuda")
    assert transfer.host.is_pinned()
    assert isinstance(transfer_for(params), FlatTransfer)
