"""The marks of a test that needs a CUDA GPU: marked ``cuda``, and skipped where there is none. Only pytest
and torch here (no hivemind), so that tests/test_codecs.py runs on an image that has nothing else."""

import pytest
import torch

NEEDS_CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ON_CUDA = pytest.param("cuda", marks=NEEDS_CUDA)  # the "cuda" case of a test parametrized by device


def needs_cuda(test):
    """`test` with the marks of :data:`NEEDS_CUDA`."""
    for mark in NEEDS_CUDA:
        test = mark(test)
    return test
