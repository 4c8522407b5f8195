"""The ways tensors are hashed: a state as sha256 of its fp32 bytes in the given order; a set of named
weights by name, dtype, shape and bytes."""

from __future__ import annotations

import hashlib
from typing import Mapping, Sequence

import torch


def tensors_sha256(tensors: Sequence[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def named_tensors_sha256(named: Mapping[str, torch.Tensor]) -> str:
    """sha256 of tensors by name, in sorted name order, each as its name, dtype, shape and raw bytes: what
    identifies a set of weights whatever the order a model registers them in, and tells bf16 from fp32."""
    digest = hashlib.sha256()
    for name in sorted(named):
        tensor = named[name].detach().to("cpu").contiguous()
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
