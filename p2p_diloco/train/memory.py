"""How many sequences one forward/backward pass may take: the memory of a training step, estimated.

A data-stream batch holds ``inner.batch_size`` sequences; the inner loop splits it into micro-batches
of ``m`` sequences (``m`` divides the batch size) and accumulates their gradients. The memory of a step
is a part that does not depend on ``m`` plus ``m`` times the activations of one sequence, so the
largest ``m`` that fits a budget follows by division (:func:`fit_micro_batch`).

For a model of ``N`` parameters, a decoder of ``L`` layers, hidden size ``h``, MLP width ``i``, ``a``
attention heads and a vocabulary of ``V`` tokens, training on sequences of ``s`` tokens:

* Fixed part, in bytes: fp32 weights ``4·N``, their fp32 gradients ``4·N``, AdamW's two fp32 moments
  ``8·N`` (8-bit AdamW, bitsandbytes: ``2·N``, one byte per moment), and under bf16 autocast a 16-bit
  copy of each weight (autocast's cast cache, kept from the forward to the backward) ``2·N``.
  A 134M-parameter model with AdamW and bf16 autocast: 18 B × 134M ≈ 2.2 GiB.

* Activations kept for the backward pass, per layer and sequence, counted tensor by tensor as
  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv 2205.05198), section 4.1, count them for eq. 1. Their eq. 1, for a GPT block with 16-bit
  activations and dropout, is ``s·b·h·(34 + 5·a·s/h)`` bytes per layer at batch size ``b``: attention
  ``11·sbh + 5·as²b`` (the QKV input 2sbh, Q and K 4sbh, the softmax output 2as²b, its dropout mask
  as²b, the dropout output 2as²b, V 2sbh, the output projection's input 2sbh, its dropout mask sbh),
  the 4h-wide MLP ``19·sbh`` and two layer norms ``4·sbh``. A Llama block, as transformers runs it
  (eager attention, the one :func:`~p2p_diloco.train.model.build_model` asks for), keeps other
  tensors, so the same count gives, for one sequence (``b = 1``)::

      bf16 autocast: 34·s·h + 8·s·i + 6·a·s²        fp32: 40·s·h + 16·s·i + 4·a·s²

  Under autocast the residual stream stays fp32, and each RMSNorm keeps its fp32 input and
  normalised output (8sh, twice: 16sh); the Q, K and V projections each keep their own bf16 cast of
  the input (6sh); Q and K after the rotary embedding (4sh), V (2sh), the output projection's input
  (2sh), the gate and up projections' inputs (4sh); the softmax keeps its fp32 output and the
  attention-times-V product its bf16 cast (4 + 2 bytes per score, ``6·a·s²``; no dropout, so no
  masks); the SwiGLU MLP keeps the gate output, its SiLU, the up output and their product (4 × 2si).
  In fp32 the three projections share one input and the RMSNorm its weighted output (12sh per norm),
  Q, K, V and the output projection's input take 4sh each, the scores 4 bytes (the softmax output,
  which the product reuses), the MLP 4 × 4si. It exceeds eq. 1 where the blocks differ: fp32 norms
  under autocast, a cast of the input per projection, four MLP-wide tensors instead of two, and no
  dropout masks (for the 150M Llama of peers/llama-150m-c4.toml, 1024 tokens: 119 MB per layer against
  eq. 1's 90 MB). ``tests/test_memory_fit.py`` checks it against the tensors autograd saves. Models of
  other architectures get the same estimate, from their config's sizes.

* With gradient checkpointing (full recomputation, the paper's section 4.1 baseline) each layer keeps
  only its input, the fp32 residual stream ``4·s·h``, and the backward pass recomputes one layer at a
  time, whose full activations are held once: ``L·4·s·h`` plus one layer as above.

* The logits and the loss, per sequence: ``12·s·V`` bytes, at the peak of the loss's backward pass.
  transformers' causal-LM loss upcasts the logits to fp32 and takes the cross-entropy, a log-softmax
  then a negative log-likelihood; of the forward only the fp32 log-softmax output stays alive, saved
  for the backward (4 bytes per logit: the inner loop keeps only the loss, so the model's output, the
  bf16 logits under autocast, is dropped before the backward, and the fp32 upcast is saved by nothing).
  In the backward the log-softmax's backward holds that output, its incoming gradient (dense, fp32,
  from the negative log-likelihood's backward) and the gradient it makes for its input (fp32):
  ``4 + 4 + 4``, with bf16 or fp32 logits alike (measured on a CPU: 12.1 bytes per added logit of
  peak memory, either precision). The forward's peak is lower (bf16 logits, their fp32 upcast and the log-softmax: ``2 + 4 + 4``),
  and so is what follows (the gradient cast to bf16 for the head's backward). With a 32k vocabulary this
  is as much as several layers.

So one step takes ``fixed + m·per_sequence`` bytes (:class:`StepMemory`). Of the budget, 10%
(:data:`SAFETY_MARGIN_PERCENT`) is kept back for what the estimate leaves out: the gradients of the
activations in flight during the backward pass, the caching allocator's fragmentation, cuBLAS
workspaces and the temporaries of the optimizer step. On CUDA ``--max-memory`` is also a limit:
:func:`cap_allocator` caps torch's caching allocator at it (the CUDA context, a few hundred MiB, is
outside the cap), so a step that needs more runs out of memory within it, and the inner loop halves
its micro-batch (:class:`p2p_diloco.train.inner.InnerTrainer`) rather than grow into memory that
another process on the GPU may use. Without ``--max-memory`` the inner loop halves its micro-batch
when a step runs out of the GPU's memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from p2p_diloco.config import Config, ConfigError

GIB = 1024**3
SAFETY_MARGIN_PERCENT = 10  # of the budget, left free for the allocator, workspaces and the CUDA context


@dataclass(frozen=True)
class LayerBytes:
    """Bytes one decoder layer keeps for the backward pass per token and hidden unit (``s·h``), per token
    and MLP unit (``s·i``), and per attention score (``a·s²``); see the module docstring."""

    per_token_hidden: int
    per_token_mlp: int
    per_score: int


LAYER_BYTES = {True: LayerBytes(34, 8, 6), False: LayerBytes(40, 16, 4)}  # by bf16 autocast or not
RESIDUAL_BYTES = 4  # per value of the fp32 residual stream: what a checkpointed layer keeps of its input
# at the loss backward's peak: the fp32 log-softmax kept for it, its incoming fp32 gradient and its input's
LOSS_BYTES_PER_LOGIT = 4 + 4 + 4
OPTIMIZER_STATE_BYTES_PER_PARAM = {"adamw": 8, "adamw8bit": 2}


class MemoryFitError(ConfigError):
    """Not even one sequence per forward/backward pass fits the memory this peer may use; one line for the user."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder that its training memory depends on."""

    name: str
    parameters: int  # all of them, held as weights
    trainable_parameters: int  # those with gradients and optimizer state
    layers: int
    hidden_size: int
    heads: int
    vocab_size: int
    intermediate_size: int  # the MLP's width

    @classmethod
    def of(cls, model: torch.nn.Module, name: str) -> Optional["ModelShape"]:
        """Read off a transformers model's (text) config; None when it does not name these sizes. A config
        without an MLP width (GPT-2's ``n_inner = None``) means 4h."""
        config = model.config.get_text_config(decoder=True)
        sizes = [getattr(config, key, None) for key in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                                        "vocab_size")]
        if not all(isinstance(size, int) and size > 0 for size in sizes):
            return None
        mlp = getattr(config, "intermediate_size", None)
        params = list(model.parameters())
        return cls(name, sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad), *sizes,
                   mlp if isinstance(mlp, int) and mlp > 0 else 4 * sizes[1])


@dataclass(frozen=True)
class StepMemory:
    """The estimated bytes of one training step: ``fixed_bytes + m · per_sequence_bytes`` at micro-batch m."""

    fixed_bytes: int  # weights, gradients, optimizer state (and autocast's weight copies)
    per_sequence_bytes: int  # activations and logits of one sequence
    model: ModelShape
    seq_len: int
    optimizer: str
    gradient_checkpointing: bool

    def bytes_at(self, micro_batch_size: int) -> int:
        return self.fixed_bytes + micro_batch_size * self.per_sequence_bytes


def layer_activation_bytes(shape: ModelShape, seq_len: int, bf16: bool) -> int:
    """What one decoder layer keeps for the backward pass of one sequence: ``34·s·h + 8·s·i + 6·a·s²``
    bytes under bf16 autocast, ``40·s·h + 16·s·i + 4·a·s²`` in fp32 (Korthikanti et al. 2022's count for
    eq. 1, arXiv 2205.05198, done for a Llama block; see the module docstring)."""
    s, per = seq_len, LAYER_BYTES[bf16]
    return (per.per_token_hidden * s * shape.hidden_size + per.per_token_mlp * s * shape.intermediate_size
            + per.per_score * shape.heads * s * s)


def activation_bytes_per_sequence(shape: ModelShape, seq_len: int, bf16: bool, gradient_checkpointing: bool) -> int:
    """Activations one sequence keeps for the backward pass, logits included (see the module docstring)."""
    layer = layer_activation_bytes(shape, seq_len, bf16)
    if gradient_checkpointing:  # each layer's input, and one layer recomputed at a time
        layers = shape.layers * seq_len * shape.hidden_size * RESIDUAL_BYTES + layer
    else:
        layers = shape.layers * layer
    logits = seq_len * shape.vocab_size * LOSS_BYTES_PER_LOGIT  # the same with bf16 or fp32 logits
    return layers + logits


def state_bytes(shape: ModelShape, optimizer: str, bf16: bool, shards: int = 1) -> int:
    """fp32 weights and gradients, the optimizer's state, and autocast's 16-bit weight copies, on one rank of
    `shards` that shard them (FSDP2 in an island peer, p2p_diloco.train.island), which also holds one decoder
    layer's weights and gradients whole while it computes that layer."""
    per_trainable = 4 + OPTIMIZER_STATE_BYTES_PER_PARAM[optimizer] + (2 if bf16 else 0)
    whole = 4 * shape.parameters + per_trainable * shape.trainable_parameters
    if shards == 1:
        return whole
    return whole // shards + 8 * shape.parameters // max(shape.layers, 1)


def step_memory(shape: ModelShape, seq_len: int, optimizer: str, bf16: bool,
                gradient_checkpointing: bool, shards: int = 1) -> StepMemory:
    return StepMemory(state_bytes(shape, optimizer, bf16, shards),
                      activation_bytes_per_sequence(shape, seq_len, bf16, gradient_checkpointing),
                      shape, seq_len, optimizer, gradient_checkpointing)


@dataclass(frozen=True)
class MemoryBudget:
    """The bytes a peer may use on its device, and where that number came from (for messages)."""

    total_bytes: int
    device: str
    source: str  # "--max-memory / compute.max_memory_gib" or "free at start-up"

    @property
    def usable_bytes(self) -> int:
        """The budget less :data:`SAFETY_MARGIN_PERCENT`."""
        return self.total_bytes * (100 - SAFETY_MARGIN_PERCENT) // 100


def memory_budget(device: torch.device, max_memory_gib: float) -> Optional[MemoryBudget]:
    """``max_memory_gib`` when > 0; else, on CUDA, what the device has free plus what this process's
    allocator already holds (the model's weights, on the device by now, are counted by the estimate);
    else (CPU) None: no fit."""
    if max_memory_gib > 0:
        return MemoryBudget(int(max_memory_gib * GIB), str(device), f"--max-memory {max_memory_gib:g}")
    if device.type != "cuda":
        return None
    free_bytes, _total = torch.cuda.mem_get_info(device)
    return MemoryBudget(free_bytes + torch.cuda.memory_reserved(device), str(device), "free at start-up")


def cap_allocator(device: torch.device, max_memory_gib: float) -> Optional[int]:
    """With ``max_memory_gib`` > 0 on CUDA, make it a limit: torch's caching allocator may then hold at most
    that many bytes of the device (``torch.cuda.set_per_process_memory_fraction``), and a step that needs
    more raises an out-of-memory error there. Returns the cap in bytes; None (nothing capped) without a
    ``max_memory_gib`` or off CUDA."""
    if max_memory_gib <= 0 or device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    total_bytes = torch.cuda.get_device_properties(index).total_memory
    cap_bytes = min(int(max_memory_gib * GIB), total_bytes)
    torch.cuda.set_per_process_memory_fraction(cap_bytes / total_bytes, index)
    return cap_bytes


def format_bytes(n: int) -> str:
    """``"21.3 GiB"``, or ``"312 MiB"`` below 1 GiB."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.0f} MiB"


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of `n` that is <= `at_most` (>= 1)."""
    return next(d for d in range(min(n, max(at_most, 1)), 0, -1) if n % d == 0)


@dataclass(frozen=True)
class MemoryFit:
    """The micro-batch chosen for a batch, and the memory estimate behind the choice (None: not estimated)."""

    micro_batch_size: int
    accumulation: int  # micro-batches per data-stream batch
    estimated_bytes: Optional[int] = None
    budget_bytes: Optional[int] = None

    def describe_split(self) -> str:
        batch_size = self.micro_batch_size * self.accumulation
        return f"micro-batch {self.micro_batch_size} x {self.accumulation} per batch of {batch_size}"

    def describe_memory(self) -> str:
        if self.estimated_bytes is None:
            return "no memory estimate for this model"
        estimate = f"estimated {format_bytes(self.estimated_bytes)}"
        return f"{estimate} of {format_bytes(self.budget_bytes)}" if self.budget_bytes else estimate


def memory_remedies(optimizer: str, gradient_checkpointing: bool) -> str:
    """``"use a GPU with more memory, inner.optimizer = 'adamw8bit', ..."``: what would need less memory,
    leaving out what this peer already does."""
    remedies = ["use a GPU with more memory"]
    if optimizer != "adamw8bit":
        remedies.append("inner.optimizer = 'adamw8bit'")
    if not gradient_checkpointing:
        remedies.append("--gradient-checkpointing")
    return ", ".join(remedies) + ", or a smaller model"


def _too_little_memory(memory: StepMemory, budget: MemoryBudget) -> MemoryFitError:
    shape = memory.model
    state = "8-bit AdamW state" if memory.optimizer == "adamw8bit" else "AdamW state"
    remedies = memory_remedies(memory.optimizer, memory.gradient_checkpointing)
    return MemoryFitError(
        f"model {shape.name} ({shape.parameters / 1e6:.1f}M parameters) needs {format_bytes(memory.fixed_bytes)} for "
        f"weights, gradients and {state} plus {format_bytes(memory.per_sequence_bytes)} per sequence of "
        f"{memory.seq_len} tokens; {format_bytes(budget.total_bytes)} available on {budget.device} ({budget.source}), "
        f"{100 - SAFETY_MARGIN_PERCENT}% of it usable: {remedies}")


def fit_micro_batch(memory: StepMemory, batch_size: int, budget: MemoryBudget) -> MemoryFit:
    """The largest divisor of `batch_size` whose step fits the usable budget; MemoryFitError if 1 does not."""
    fitting = (budget.usable_bytes - memory.fixed_bytes) // memory.per_sequence_bytes
    if fitting < 1:
        raise _too_little_memory(memory, budget)
    micro = largest_divisor(batch_size, fitting)
    return MemoryFit(micro, batch_size // micro, memory.bytes_at(micro), budget.total_bytes)


def choose_micro_batch(model: torch.nn.Module, cfg: Config, device: torch.device, bf16: bool,
                       shards: int = 1) -> MemoryFit:
    """The micro-batch a peer trains with (under bf16 autocast if `bf16`): ``compute.micro_batch_size`` when
    set, else the largest that fits its memory budget (:func:`memory_budget`), else (no budget, or a model
    whose sizes are unknown) the whole batch. Counted per rank: in an island whose `shards` ranks shard
    the model, each holds that share of its state."""
    compute, batch_size = cfg.compute, cfg.inner.batch_size
    shape = ModelShape.of(model, cfg.model.label)
    budget = memory_budget(device, compute.max_memory_gib)
    memory = shape and step_memory(shape, cfg.data.seq_len, cfg.inner.optimizer, bf16, compute.gradient_checkpointing,
                                   shards)
    if compute.micro_batch_size or memory is None or budget is None:
        micro = compute.micro_batch_size or batch_size
        return MemoryFit(micro, batch_size // micro, memory and memory.bytes_at(micro),
                         budget and budget.total_bytes)
    return fit_micro_batch(memory, batch_size, budget)
