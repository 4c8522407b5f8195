"""The one way tensors are hashed: sha256 of their fp32 bytes, in the given order."""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch


def tensors_sha256(tensors: Sequence[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()
