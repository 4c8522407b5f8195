"""Streaming DiLoCo's fragments: which parameters sync together (Douillard et al., arXiv 2501.18512, §2.1–2.2).

The model's transformer blocks are split into P fragments. With the strided layout (the paper's
better one) block i belongs to fragment i mod P; with the sequential layout, blocks
[i·L/P, (i+1)·L/P) form fragment i. Parameters outside the blocks go with the nearest block: the
embeddings with the first block's fragment, the final norm and the LM head with the last block's.

When each fragment syncs is :mod:`p2p_diloco.schedule`'s (sync reads it too, and knows no model).
Each fragment has its own part of θ_global and of the outer momentum (only its parameters take the
outer step). With P = 1 this is DiLoCo: the one fragment is the whole model, synced every H inner steps.
"""

from __future__ import annotations

import re
from typing import Sequence

import torch

from p2p_diloco.config import ConfigError, OuterConfig

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


def named_fragments(model: torch.nn.Module, groups: Sequence[Sequence[str]]) -> list[list[int]]:
    """The fragments a library user names: each a list of parameter names, a name also standing for every
    parameter under it (``"encoder"`` for ``encoder.0.weight``, ...); every trainable parameter in exactly one,
    in :func:`~p2p_diloco.train.model.trainable_parameters` order. FragmentError (one line) otherwise."""
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    if not groups or any(isinstance(group, str) or not group for group in groups):
        raise FragmentError("fragments: give a list of fragments, each a non-empty list of parameter names, "
                            "e.g. [['encoder'], ['decoder', 'head']]")

    def under(name: str, prefix: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    fragments: list[list[int]] = [[] for _ in groups]
    for i, name in enumerate(names):
        owners = [f for f, group in enumerate(groups) if any(under(name, prefix) for prefix in group)]
        if len(owners) != 1:
            raise FragmentError(f"fragments: parameter {name!r} is in {len(owners)} fragments; each trainable "
                                f"parameter must be in exactly one")
        fragments[owners[0]].append(i)
    empty = [f for f, indices in enumerate(fragments) if not indices]
    if empty:
        raise FragmentError(f"fragments: fragment {empty[0]} ({list(groups[empty[0]])}) names no trainable parameter")
    return fragments
