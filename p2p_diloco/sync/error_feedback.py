"""Error feedback: each peer carries the quantization error of what it sent into its next send.

With a lossy codec, a peer sends Q(Δ + e) instead of Δ, where e is what the codec dropped from its
last send, and keeps e ← (Δ + e) − Q(Δ + e) (error-feedback SGD: Seide et al., Interspeech 2014;
Karimireddy et al., ICML 2019; SparseLoCo, arXiv 2508.15706, keeps it per DiLoCo
worker the same way). Nothing the codec drops is lost for good, only delayed by a round.

The residual is this peer's own and never travels. It is the error of coding each tensor of the
peer's Δ + e whole, in the codec's blocks; the all-reduce cuts the tensors into parts at offsets of
its own, so the bytes that leave differ from it within the codec's bound. A round that applied
nothing keeps the old residual: its Δ is sent again, whole, in the next round.
"""

from __future__ import annotations

from typing import Sequence

import torch

from p2p_diloco.sync.codecs import Codec


class ErrorFeedback:
    """The residual of each averaged tensor (zeros until a send), for a lossy `codec`."""

    def __init__(self, codec: Codec, shapes: Sequence[torch.Size]):
        self.codec = codec
        self.residual = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]

    @torch.no_grad()
    def compensate(self, indices: Sequence[int], delta: Sequence[torch.Tensor]) -> tuple[list, list]:
        """(Δ + e at `indices`, the residual to keep if it is sent): :meth:`commit` the latter after a round."""
        to_send = [d + self.residual[i] for i, d in zip(indices, delta)]
        residual = [t - self.roundtrip(t) for t in to_send]
        return to_send, residual

    def roundtrip(self, tensor: torch.Tensor) -> torch.Tensor:
        flat = tensor.reshape(-1).contiguous()
        return self.codec.decode(self.codec.encode(flat), flat.numel()).reshape(tensor.shape)

    def commit(self, indices: Sequence[int], residual: Sequence[torch.Tensor]) -> None:
        for i, r in zip(indices, residual):
            self.residual[i] = r
