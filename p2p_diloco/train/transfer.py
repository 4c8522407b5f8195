"""One fragment's θ_local moved between the training device and θ_global's CPU copy as one flat buffer.

DiLoCo's outer step (arXiv 2311.08105, Alg. 1) reads θ_local to form Δ = θ_global − θ_local (line 10)
and, after the outer update (line 12), writes θ_global back into θ_local (line 3 of the next round;
Streaming DiLoCo, arXiv 2501.18512, merges θ_local ← α·θ_local + (1 − α)·θ_global instead).
θ_global lives in fp32 on the CPU (:mod:`p2p_diloco.train.outer`). Copied parameter by parameter,
each direction is one synchronous copy per tensor, ~110 for a 12-layer Llama, each waiting for the
device. Here each direction is a single copy of one contiguous buffer:

    device → host  θ_local of the fragment is flattened and cast to fp32 on the device (one kernel),
                   copied once into a page-locked host buffer, and the host waits for that copy only
                   (a CUDA event recorded behind it);
    host → device  θ_global of the fragment is written into the page-locked buffer, copied once to
                   the device without waiting, and merged into each parameter there; the merge
                   kernels queue behind the copy, so the host never waits for the device.

Page-locked (pinned) host memory lets the copies run as DMA transfers, asynchronously to the host
(CUDA C++ Programming Guide, "Page-Locked Host Memory"). On the CPU nothing is pinned and nothing
moves between devices, but the same code runs on a plain buffer. Each fragment's host buffer is
allocated once and reused by every outer step. The device-side flat buffer is taken from torch's
caching allocator for the length of one transfer: a resident one would hold 4 bytes per parameter of
device memory during every inner step, while the cache hands the same block back without a
cudaMalloc.

The values are bit-identical to the per-parameter copies': casting to fp32 is exact, copies move
bits, and the merge runs the same element-wise operations on the same operands.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


class FlatTransfer:
    """θ_local ⇄ θ_global for one fragment: its parameters' shapes and one fp32 host buffer for all of them."""

    def __init__(self, local_params: Sequence[torch.Tensor]):
        self.device = local_params[0].device
        self.shapes = [p.shape for p in local_params]
        numel = sum(shape.numel() for shape in self.shapes)
        self.host = torch.empty(numel, dtype=torch.float32, pin_memory=self.device.type == "cuda")
        self._host_read: Optional[torch.cuda.Event] = None  # recorded after the last host → device copy

    @torch.no_grad()
    def gather(self, local_params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """θ_local in fp32 on the CPU: one view of the host buffer per parameter, valid until the next transfer."""
        self._check(local_params)
        self._wait_until_host_read()
        flat = [p.detach().reshape(-1) for p in local_params]
        if self.device.type == "cpu":
            torch.cat(flat, out=self.host)
        else:
            on_device = torch.cat(flat, out=torch.empty(self.host.shape, dtype=torch.float32, device=self.device))
            self.host.copy_(on_device, non_blocking=True)
            self._record_event().synchronize()  # waits for this copy, not for later work
        return split_flat(self.host, self.shapes)

    @torch.no_grad()
    def scatter(self, global_params: Sequence[torch.Tensor], local_params: Sequence[torch.Tensor],
                alpha: float) -> None:
        """θ_local ← α·θ_local + (1 − α)·θ_global (α = 0: a copy), cast to each local parameter's dtype."""
        self._check(local_params)
        self._wait_until_host_read()
        torch.cat([g.reshape(-1) for g in global_params], out=self.host)
        if self.device.type == "cpu":
            on_device = self.host
        else:
            on_device = torch.empty(self.host.shape, dtype=torch.float32, device=self.device)
            on_device.copy_(self.host, non_blocking=True)
            self._host_read = self._record_event()  # the host buffer may be written again once this fires
        for p, g in zip(local_params, split_flat(on_device, self.shapes)):
            merge_(p, g.to(p.dtype), alpha)

    def _check(self, local_params: Sequence[torch.Tensor]) -> None:
        shapes = [p.shape for p in local_params]
        if shapes != self.shapes:
            raise ValueError(f"{len(shapes)} parameters of other shapes than the {len(self.shapes)} this "
                             f"transfer was made for")

    def _record_event(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _wait_until_host_read(self) -> None:
        """A host → device copy still in flight reads the host buffer: it must not be overwritten before."""
        if self._host_read is not None:
            self._host_read.synchronize()
            self._host_read = None


def split_flat(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Views of consecutive pieces of the 1-D `flat`, one per shape."""
    pieces = flat.split([shape.numel() for shape in shapes])
    return [piece.view(shape) for piece, shape in zip(pieces, shapes)]


def merge_(local: torch.Tensor, global_value: torch.Tensor, alpha: float) -> None:
    """local ← α·local + (1 − α)·global in place (Streaming DiLoCo's merge, arXiv 2501.18512); α = 0 copies."""
    if alpha == 0:
        local.copy_(global_value)
    else:
        local.mul_(alpha).add_(global_value, alpha=1 - alpha)
