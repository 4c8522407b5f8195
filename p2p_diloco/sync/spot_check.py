"""Spot checks of a reducer: its result recomputed on a sample of chunks chosen after the round.

An auditor that fetched all of a reducer's inputs moved as many bytes as the reducer received,
two thirds of a peer's all-reduce bytes in a group of 4 (issue 43). A sample does the same job at a
fraction of the bytes, provided that every sampled piece can be recomputed on its own, that the
bytes the auditor gets are bound to what the senders sent, and that the reducer cannot know the
sample before it has sent its result:

* **Chunks, recomputed alone.** A reducer's parts are cut into chunks of :data:`CHUNK_VALUES`
  values from each part's start, and the reducer aggregates chunk by chunk
  (:func:`aggregate_in_chunks`): the robust rules clip by the norm of what they are given
  (:func:`~p2p_diloco.sync.robust.aggregate`: the median norm, CenteredClip's distances), so a
  chunk's result is a function of the senders' values of that chunk alone. (A sample of whole
  parts would be sound too, but a reducer has about 8 parts: one of them is an eighth of its
  inputs.) A chunk starts on every codec's block grid, so its bytes in a sender's encoded part are
  the encoding of the chunk alone (:func:`chunk_bytes`); a codec whose layout this module does not
  know (:func:`sliceable`) is checked by whole parts. BTARD (Gorbunov et al., arXiv 2106.11257)
  runs CenteredClip on each part of a butterfly all-reduce alike; a chunk of 16,384 values is
  such a part.
* **Bound to the senders.** A sender's signed round report states, for each reducer, the sha256 of
  the list of the sha256 of each chunk it sent it (:func:`input_digest`, a hash list: a Merkle tree
  of depth 2). The reducer serves its auditor each sender's hash list (32 bytes a chunk) and the
  sampled chunks; the auditor checks the list against the sender's digest and each chunk against
  its entry (:func:`judge_served`).
* **Chosen after the round.** The sample is drawn from the auditor's secret (:func:`sample_seed`), 16
  random bytes whose commitment is the auditor's attempt token (:func:`token_of`), which every member
  gathered before any part moved. The auditor reveals the secret in its request, once it holds all of
  the reducer's averaged parts; the reducer checks it against the token and draws the same sample.
  So the reducer sends its result before it can know the sample, and nothing it sends changes the
  sample: it cannot try variants of its result until one's sample misses its changes, as it could
  with a seed of the round's own bytes. A result it sent others later than its auditor must still be
  the bytes its report states, which every member checks (:func:`~p2p_diloco.sync.commit.judge`).
* **A fixed share.** :func:`sample_size` chunks of a reducer's N: one in :data:`SAMPLE_ONE_IN`, at
  least one. The auditor fetches that share of the reducer's inputs plus the hash lists; a peer's
  all-reduce moves at least as many bytes as a reducer's inputs, so the audit is at most
  1/SAMPLE_ONE_IN + 32/(a chunk's bytes) of them (8.7 % with the 4-bit codecs) once N ≥ SAMPLE_ONE_IN.

A reducer that changes k of its N chunks (a chunk is changed if any of its values is) is caught
with probability ``1 − C(N − k, s) / C(N, s)`` ≥ ``1 − (1 − k/N)^s`` for s sampled chunks
(:func:`catch_probability`; its table is in docs/security.md).
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Optional, Sequence

import torch

from p2p_diloco.sync.codecs import Codec
from p2p_diloco.sync.robust import AggregationRule, aggregate

CHUNK_VALUES = 16384  # a multiple of every codec's block (64, 256); as fast to aggregate as a whole part
SAMPLE_ONE_IN = 12  # the auditor checks one chunk in this many of a reducer's
HASH_BYTES = 32  # a sha256


@functools.lru_cache(maxsize=64)  # a round's codec may be its own (Codec.for_round): a few at a time
def sliceable(codec: Codec) -> bool:
    """Whether a chunk's bytes are a slice of `codec`'s encoded part (:func:`chunk_bytes`): the codes of
    each value in order, then (block codecs) one float32 scale per block. Probed once per codec on a
    part of three chunks with blocks of every magnitude, so that a codec with another layout is
    audited by whole parts instead of wrongly."""
    if CHUNK_VALUES % codec.blocksize:
        return False
    generator = torch.Generator().manual_seed(43)
    numel = 2 * CHUNK_VALUES + 100
    probe = torch.randn(numel, generator=generator) * torch.logspace(-6, 2, numel)
    try:
        data = codec.encode(probe)
        return all(_slice(codec, data, numel, start, stop) == codec.encode(probe[start:stop])
                   for start, stop in ((0, CHUNK_VALUES), (CHUNK_VALUES, 2 * CHUNK_VALUES), (2 * CHUNK_VALUES, numel)))
    except (ValueError, IndexError):
        return False


def chunk_spans(codec: Codec, numel: int) -> list[tuple[int, int]]:
    """The chunks (start, stop) of a part of `numel` values: :data:`CHUNK_VALUES` each from its start, the
    last one shorter; the whole part as one chunk with a codec that is not :func:`sliceable`."""
    if numel <= CHUNK_VALUES or not sliceable(codec):
        return [(0, numel)]
    return [(start, min(start + CHUNK_VALUES, numel)) for start in range(0, numel, CHUNK_VALUES)]


def reducer_chunks(codec: Codec, part_numels: Sequence[int]) -> list[tuple[int, int, int]]:
    """A reducer's chunks in order, numbered from 0 across its parts: (part index, start, stop)."""
    return [(index, start, stop) for index, numel in enumerate(part_numels) for start, stop in chunk_spans(codec, numel)]


def _slice(codec: Codec, data: bytes, numel: int, start: int, stop: int) -> bytes:
    if codec.blocksize == 1:
        width = codec.encoded_size(1)
        return bytes(data[width * start:width * stop])

    def codes(values: int) -> int:  # the bytes of the codes of `values` values, before the scales
        return codec.encoded_size(values) - 4 * -(-values // codec.blocksize)

    scales = codes(numel) + 4 * (start // codec.blocksize)
    return bytes(data[codes(start):codes(stop)]) + bytes(data[scales:codes(numel) + 4 * -(-stop // codec.blocksize)])


def chunk_bytes(codec: Codec, data: bytes, numel: int, start: int, stop: int) -> bytes:
    """The bytes of values [start, stop) of the encoded part `data` (`numel` values), a chunk of
    :func:`chunk_spans`: the chunk's own encoding."""
    if len(data) != codec.encoded_size(numel):
        raise ValueError(f"a part of {numel} values is {codec.encoded_size(numel)} bytes, got {len(data)}")
    if (start, stop) == (0, numel):
        return bytes(data)
    return _slice(codec, data, numel, start, stop)


def chunk_hashes(codec: Codec, data: bytes, numel: int) -> bytes:
    """The sha256 of each chunk of the encoded part `data`, in order, concatenated: its entries of a hash list."""
    return b"".join(hashlib.sha256(chunk_bytes(codec, data, numel, start, stop)).digest()
                    for start, stop in chunk_spans(codec, numel))


def hash_list(codec: Codec, parts: Sequence[bytes], part_numels: Sequence[int]) -> bytes:
    """The hash list of a sender's encoded parts for one reducer: :func:`chunk_hashes` of each part, in order."""
    return b"".join(chunk_hashes(codec, data, numel) for data, numel in zip(parts, part_numels))


def input_digest(hashes: bytes) -> str:
    """What a round report states of the parts a sender sent a reducer: the sha256 of their hash list."""
    return hashlib.sha256(hashes).hexdigest()


SECRET_BYTES = 16


def token_of(secret: bytes) -> str:
    """The attempt token a peer gathers for a round (16 hex digits, as before): the commitment to its secret."""
    return hashlib.sha256(b"p2p-diloco audit secret " + secret).hexdigest()[:16]


def sample_seed(secret: bytes) -> bytes:
    """The seed of the sample an auditor draws with its `secret` (:func:`spot_sample`)."""
    return hashlib.sha256(b"p2p-diloco spot check " + secret).digest()


def sample_size(chunks: int) -> int:
    """How many of a reducer's `chunks` its auditor checks: one in :data:`SAMPLE_ONE_IN`, at least one."""
    return min(chunks, max(1, chunks // SAMPLE_ONE_IN))


def spot_sample(seed: bytes, reducer: str, chunks: int) -> list[int]:
    """The chunks of `reducer` (base58) that its auditor checks, in order: the :func:`sample_size` of its
    `chunks` with the smallest sha256(seed, reducer, index), the same on every member."""
    ranked = sorted(range(chunks), key=lambda i: hashlib.sha256(seed + reducer.encode() + i.to_bytes(8, "big")).digest())
    return sorted(ranked[:sample_size(chunks)])


def aggregate_in_chunks(parts: Sequence[torch.Tensor], claims: Sequence[float], rule: AggregationRule,
                        codec: Codec) -> torch.Tensor:
    """A reducer's result for one part: :func:`~p2p_diloco.sync.robust.aggregate` of each chunk of the
    senders' parts (:func:`chunk_spans`), so that an auditor can recompute any chunk alone."""
    shape = parts[0].shape
    spans = chunk_spans(codec, parts[0].numel())
    if len(spans) == 1:
        return aggregate(parts, claims, rule)
    flat = [part.reshape(-1) for part in parts]
    return torch.cat([aggregate([f[start:stop] for f in flat], claims, rule) for start, stop in spans]).reshape(shape)


def catch_probability(chunks: int, changed: int, sampled: Optional[int] = None) -> float:
    """The probability that a sample of `sampled` (default :func:`sample_size`) of `chunks` chunks holds
    one of the `changed` ones: ``1 − C(N − k, s) / C(N, s)``."""
    sampled = sample_size(chunks) if sampled is None else sampled
    return 1.0 - math.comb(chunks - changed, sampled) / math.comb(chunks, sampled)
