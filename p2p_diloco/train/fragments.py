"""Streaming DiLoCo's fragments and their schedule (Douillard et al., arXiv 2501.18512, §2.1–2.2).

The model's transformer blocks are split into P fragments. With the strided layout (the paper's
better one) block i belongs to fragment i mod P; with the sequential layout, blocks
[i·L/P, (i+1)·L/P) form fragment i. Parameters outside the blocks go with the nearest block: the
embeddings with the first block's fragment, the final norm and the LM head with the last block's.

Every peer counts the same outer steps, so the schedule is a function of the outer step alone:
outer step t syncs fragment t mod P after H/P inner steps. Each fragment is then synced every
H inner steps, fragment p at offset (p + 1)·H/P, one fragment in flight at a time, and each has
its own part of θ_global and of the outer momentum (only its parameters take the outer step).
With P = 1 this is DiLoCo: the one fragment is the whole model, synced every H inner steps.
"""

from __future__ import annotations

import logging
import re
from typing import Sequence

import torch

from p2p_diloco.config import ConfigError, OuterConfig

logger = logging.getLogger(__name__)

BLOCK_INDEX = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)\.")  # Llama, BERT-style, GPT-2, others


class FragmentError(ConfigError):
    """The model cannot be split into the fragments the config asks for."""


def model_fragments(model: torch.nn.Module, cfg: OuterConfig) -> list[list[int]]:
    """The fragments of `model`'s trainable parameters (in :func:`~p2p_diloco.train.model.trainable_parameters`
    order) that ``outer.fragments`` and ``outer.fragment_layout`` ask for; FragmentError if it has too few blocks."""
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    try:
        return split_into_fragments(names, cfg.fragments, cfg.fragment_layout)
    except FragmentError as e:
        raise FragmentError(f"config: outer.fragments = {cfg.fragments} does not fit the model: {e}") from None


def split_into_fragments(names: Sequence[str], num_fragments: int, layout: str) -> list[list[int]]:
    """The indices (into `names`, the trainable parameters in order) of each fragment's parameters."""
    blocks = [_block_index(name) for name in names]
    numbered = sorted({b for b in blocks if b is not None})
    if not numbered:
        if num_fragments == 1:
            return [list(range(len(names)))]
        raise FragmentError(f"cannot split the model into {num_fragments} fragments: none of its parameter names "
                            f"holds a numbered transformer block (such as 'model.layers.0.')")
    if num_fragments > len(numbered):
        raise FragmentError(f"cannot split {len(numbered)} transformer blocks into {num_fragments} fragments")
    position = {block: i for i, block in enumerate(numbered)}

    def fragment_of_block(block: int) -> int:
        i = position[block]
        return i % num_fragments if layout == "strided" else i * num_fragments // len(numbered)

    first = next(i for i, b in enumerate(blocks) if b is not None)
    fragments: list[list[int]] = [[] for _ in range(num_fragments)]
    for i, block in enumerate(blocks):
        if block is None:  # outside the blocks: embeddings before them, final norm and head after
            block = numbered[0] if i < first else numbered[-1]
        fragments[fragment_of_block(block)].append(i)
    return fragments


def _block_index(name: str):
    match = BLOCK_INDEX.search(name)
    return int(match.group(1)) if match else None


def fragment_at(outer_step: int, num_fragments: int) -> int:
    """The fragment that outer step `outer_step` syncs: every member of a round, assistants included, agrees."""
    return outer_step % num_fragments


class FragmentSchedule:
    """Which fragment outer step t syncs, after how many inner steps, and how many more inner steps run
    while it syncs (arXiv 2501.18512, §2: H/P and τ)."""

    def __init__(self, fragments: list[list[int]], steps_per_outer: int, sync_delay: int):
        """`sync_delay` is τ, or -1 for the longest overlap the schedule allows."""
        self.fragments = fragments
        self.steps_per_sync = steps_per_outer // len(fragments)  # H / P
        # τ < H/P: one fragment in flight at a time, and each round trains at least one step of its own
        longest = self.steps_per_sync - 1
        self.sync_delay = longest if sync_delay < 0 else min(sync_delay, longest)
        if self.sync_delay < sync_delay:
            logger.info("outer.sync_delay = %d is lowered to %d: at most steps_per_outer / fragments - 1 inner steps "
                        "run while a fragment syncs", sync_delay, self.sync_delay)

    def fragment_at(self, outer_step: int) -> int:
        return fragment_at(outer_step, len(self.fragments))
