"""One fragment's θ_local moved between the training device and θ_global's CPU copy.

DiLoCo's outer step (arXiv 2311.08105, Alg. 1) reads θ_local to form Δ = θ_global − θ_local (line 10)
and, after the outer update (line 12), writes θ_global back into θ_local (line 3 of the next round;
Streaming DiLoCo, arXiv 2501.18512, merges θ_local ← α·θ_local + (1 − α)·θ_global instead).
θ_global lives in fp32 on the CPU (:mod:`p2p_diloco.train.outer`). :func:`transfer_for` picks how:

* On CUDA, :class:`FlatTransfer`. Copied parameter by parameter, each direction is one synchronous
  copy per tensor, ~110 for a 12-layer Llama, each waiting for the device. Here each direction is a
  single copy of one contiguous buffer:

      device → host  θ_local of the fragment is flattened and cast to fp32 on the device (one kernel)
                     and copied once into a page-locked host buffer; the host waits for that copy;
      host → device  θ_global of the fragment is written into the page-locked buffer, copied once to
                     the device without waiting, and merged into each parameter there; the merge
                     kernels queue behind the copy, so the host never waits for the device (a CUDA
                     event recorded behind the copy keeps the buffer from being rewritten before the
                     copy has read it).

  Page-locked (pinned) host memory lets the copies run as DMA transfers, asynchronously to the host
  (CUDA C++ Programming Guide, "Page-Locked Host Memory"). Each fragment's host buffer is allocated
  once and reused by every outer step. The device-side flat buffer is taken from torch's caching
  allocator for the length of one transfer: a resident one would hold 4 bytes per parameter of device
  memory during every inner step, while the cache hands the same block back without a cudaMalloc.

* Elsewhere (a CPU peer), :class:`DirectTransfer`: nothing moves between devices, so a flat buffer
  would only add a copy each way and 4 bytes per parameter for the run. θ_local is read as it is
  (fp32 parameters on the CPU are not copied at all) and θ_global is merged into each parameter
  directly.

Both give the per-parameter copies' bits: casting to fp32 is exact, copies move bits, and the merge
runs the same element-wise operations on the same operands. :class:`FlatTransfer` also runs on a CPU
(a plain buffer), which is how ``tests/test_transfer.py`` checks its logic without a GPU.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch


class FlatTransfer:
    """θ_local ⇄ θ_global for one fragment on CUDA: its parameters' shapes and one fp32 host buffer (pinned) for
    all of them. It runs on a CPU too, with a plain buffer (the tests and benchmarks/gpu.py use it there)."""

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
            self.host.copy_(on_device)  # blocking: the host reads the buffer next
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
        check_shapes(self.shapes, local_params)

    def _record_event(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _wait_until_host_read(self) -> None:
        """A host → device copy still in flight reads the host buffer: it must not be overwritten before."""
        if self._host_read is not None:
            self._host_read.synchronize()
            self._host_read = None


class DirectTransfer:
    """θ_local ⇄ θ_global for one fragment off CUDA (a CPU peer): no buffer, and no copy of fp32 CPU parameters."""

    def __init__(self, local_params: Sequence[torch.Tensor]):
        self.shapes = [p.shape for p in local_params]

    @torch.no_grad()
    def gather(self, local_params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """θ_local in fp32 on the CPU: the parameters themselves (detached) when they are fp32 CPU tensors,
        else fp32 CPU copies; read them before θ_local changes."""
        check_shapes(self.shapes, local_params)
        return [p.detach().to("cpu", torch.float32) for p in local_params]

    @torch.no_grad()
    def scatter(self, global_params: Sequence[torch.Tensor], local_params: Sequence[torch.Tensor],
                alpha: float) -> None:
        """θ_local ← α·θ_local + (1 − α)·θ_global (α = 0: a copy), cast to each local parameter's dtype."""
        check_shapes(self.shapes, local_params)
        for p, g in zip(local_params, global_params):
            merge_(p, g.to(p.device, p.dtype), alpha)


Transfer = Union[FlatTransfer, DirectTransfer]


def transfer_for(local_params: Sequence[torch.Tensor]) -> Transfer:
    """The flat, page-locked transfer for parameters on CUDA; the direct one elsewhere (see the module docstring)."""
    if local_params[0].device.type == "cuda":
        return FlatTransfer(local_params)
    return DirectTransfer(local_params)


def check_shapes(shapes: Sequence[torch.Size], local_params: Sequence[torch.Tensor]) -> None:
    """ValueError unless `local_params` have the `shapes` a transfer was made for."""
    given = [p.shape for p in local_params]
    if given != list(shapes):
        raise ValueError(f"{len(given)} parameters of other shapes than the {len(shapes)} this transfer was made for")


def split_flat(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Views of consecutive pieces of the 1-D `flat`, one per shape."""
    pieces = flat.split([shape.numel() for shape in shapes])
    return [piece.view(shape) for piece, shape in zip(pieces, shapes)]


def merge_(local: torch.Tensor, global_value: torch.Tensor, alpha: float) -> None:
    """local ← α·local + (1 − α)·global in place (Streaming DiLoCo's merge, arXiv 2501.18512); α = 0 copies.

    Two multiplies and one add, each rounded once to the local dtype, so the result is the same bits
    on every CPU: ``add_(global, alpha=1 − α)`` would be one fused multiply-add on ATen's AVX2 and
    AVX-512 kernels and two roundings on its default kernel. α and 1 − α are rounded to the
    tensor's compute precision (float32) first, as torch does with a Python scalar.
    """
    if alpha == 0:
        local.copy_(global_value)
    else:
        local.mul_(alpha).add_(torch.mul(global_value, 1 - alpha))
