"""Text in, fixed-length token sequences out: corpus loading, tokenizer, packing and each peer's order.

Sources (``[data] source``):
  * ``pydoc``: the English help topics every CPython installation ships in ``pydoc_data`` (no
    download; the offline default used by the demo and the tests);
  * ``files``: local text files, one document per blank-line separated paragraph;
  * ``hub``: a Hugging Face hub dataset (or a local dataset directory), streamed.

A document is held out when a hash of its text says so (:func:`is_holdout`), never because of where
it stands: a streamed dataset is read in a different shard order by every peer and every pass, and a
split by position would let held-out documents leak into training. Tokens of consecutive documents
are joined with an end-of-text token and cut into ``seq_len`` windows.

For ``pydoc`` and ``files`` (small corpora) every peer reads all training sequences in its own
order, seeded by its peer ID: a fresh permutation per epoch, derived from (order seed, epoch) alone
(:class:`ShuffledBatches`). A hub stream is split into ``data.shards`` disjoint shards, each peer
reads one, in an order of its own (:class:`StreamedBatches`). Either stream tells its state after
each batch (``state_dict()``), and a stream opened from that state yields exactly what the
uninterrupted one would have: a restarted peer goes on where it was, replaying nothing.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch

from p2p_diloco.config import DataConfig

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
HUB_HOLDOUT_DOCUMENTS = 200  # a streamed corpus has no end: evaluate on this many held-out documents
HUB_HOLDOUT_SCAN_FACTOR = 4  # read at most this many times the documents expected to hold them
HUB_SHUFFLE_BLOCK = 10_000  # documents of a streamed shard permuted together (re-read at most once on resume)


class DataError(ValueError):
    """The corpus cannot feed training as configured; the message is one line for the user."""


def cache_dir() -> Path:
    path = Path(os.environ.get("P2P_DILOCO_CACHE", Path.home() / ".cache" / "p2p-diloco"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def derive_seed(*parts: object) -> int:
    """A 64-bit seed from the parts' text; the same parts give the same seed on every machine."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little")


def order_seed(run_seed: int, peer_id: str) -> int:
    """Each peer reads the data in its own order, derived from the run seed and its peer ID."""
    return derive_seed(run_seed, peer_id)


# ----- documents ----------------------------------------------------------------------------------
def pydoc_documents() -> list[str]:
    """The pydoc help topics, sorted by topic name so every peer sees one order."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def file_documents(paths: Iterable[str]) -> list[str]:
    docs = []
    for path in paths:
        docs.extend(p.strip() for p in _read_text_file(Path(path)).split("\n\n") if p.strip())
    return docs


def _read_text_file(path: Path) -> str:
    if not path.is_file():
        what = "is not a regular file" if path.exists() else "does not exist"
        raise DataError(
            f"data: file {str(path)!r} listed in data.paths {what}; fix data.paths to name existing text files"
        )
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise DataError(f"data: file {str(path)!r} listed in data.paths cannot be read ({e.strerror})") from None


def _hub_stream(cfg: DataConfig):
    """The dataset as a datasets ``IterableDataset``: a hub name and a local directory are read alike."""
    import datasets

    stream = datasets.load_dataset(cfg.hub_dataset, cfg.hub_config or None, split=cfg.hub_split, streaming=True)
    return stream.take(cfg.max_documents) if cfg.max_documents else stream


def hub_shard(cfg: DataConfig, shard: int):
    """Shard `shard` of the hub source's ``data.shards``, in stored order.

    datasets' ``split_dataset_by_node`` gives each shard whole files when the dataset's file count
    divides by the shard count (C4's 1024 files and 1024 shards: one file each), and otherwise every
    `shards`-th document: either way the shards are disjoint and together hold every document. No
    datasets shuffle is applied on top: it reshuffles the file list before the split, with a seed of
    its own per peer, and the shards would overlap (:class:`StreamedBatches` shuffles instead). With
    ``data.max_documents``, datasets' ``take`` divides that count among the shards, each taking its
    part from its own files.
    """
    from datasets.distributed import split_dataset_by_node

    _check_shard(cfg, shard)
    stream = _hub_stream(cfg)
    return split_dataset_by_node(stream, rank=shard, world_size=cfg.shards) if cfg.shards > 1 else stream


def _check_shard(cfg: DataConfig, shard: int) -> None:
    if not 0 <= shard < cfg.shards:
        raise DataError(f"data: shard {shard} does not exist: data.shards = {cfg.shards} numbers them 0 to {cfg.shards - 1}")


def _texts(cfg: DataConfig, rows: Iterable[dict]) -> Iterator[str]:
    """The text column of the rows; a dataset without it is a one-line error naming the columns it has."""
    for row in rows:
        if cfg.text_column not in row:
            raise DataError(
                f"data: dataset {cfg.hub_dataset!r} has no column data.text_column = {cfg.text_column!r}; "
                f"set it to one of {', '.join(map(repr, row))}"
            )
        yield row[cfg.text_column]


def _hub_documents(cfg: DataConfig) -> Iterator[str]:
    """The texts of a hub source in stored order, unsharded; the stream opens only on the first read."""
    return _texts(cfg, _hub_stream(cfg))


def documents(cfg: DataConfig) -> Iterator[str]:
    """All documents of the configured source, in a fixed order (a hub stream in its stored order)."""
    if cfg.source == "hub":
        return _hub_documents(cfg)  # max_documents is applied by the stream
    docs: Iterable[str] = pydoc_documents() if cfg.source == "pydoc" else file_documents(cfg.paths)
    if cfg.max_documents:
        docs = itertools.islice(docs, cfg.max_documents)
    return iter(docs)


def is_holdout(text: str, holdout_fraction: float) -> bool:
    """Whether a document is held out: decided by its content, so every source, order, shard and peer agree.

    The first 8 bytes of sha256(text), read as a fraction of 2**64, fall below `holdout_fraction` for
    that share of documents; identical documents land on the same side.
    """
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < holdout_fraction


def training_documents(cfg: DataConfig) -> Iterator[str]:
    """The documents that are not held out, in the fixed order of :func:`documents`."""
    return (doc for doc in documents(cfg) if not is_holdout(doc, cfg.holdout_fraction))


def hub_holdout_scan_limit(cfg: DataConfig) -> int:
    """How many documents of a stream the held-out scan reads at most: a few times the expected need."""
    limit = math.ceil(HUB_HOLDOUT_SCAN_FACTOR * HUB_HOLDOUT_DOCUMENTS / cfg.holdout_fraction)
    return min(limit, cfg.max_documents) if cfg.max_documents else limit


def heldout_documents(cfg: DataConfig) -> Iterator[str]:
    """The held-out documents; for a hub source the first HUB_HOLDOUT_DOCUMENTS of a bounded scan."""
    if cfg.holdout_fraction <= 0:
        return iter(())
    docs = documents(cfg)
    if cfg.source == "hub":
        docs = itertools.islice(docs, hub_holdout_scan_limit(cfg))
    held = (doc for doc in docs if is_holdout(doc, cfg.holdout_fraction))
    return itertools.islice(held, HUB_HOLDOUT_DOCUMENTS) if cfg.source == "hub" else held


# ----- tokenizer ----------------------------------------------------------------------------------
def load_tokenizer(cfg: DataConfig, revision: str = ""):
    """A hub tokenizer by name (at `revision`: model.revision, for a pretrained model's own tokenizer) or a
    local folder, or a byte-level BPE trained on the training documents and cached.

    The local tokenizer learns from the first ``data.tokenizer_documents`` training documents (of a
    hub stream: its first documents in stored order, never more) and is keyed
    by a hash of them and the vocabulary size, so every peer that reads the same corpus ends up with
    the same vocabulary (BPE training is deterministic); :func:`tokenizer_sha256` tells if not.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if cfg.tokenizer != "local-bpe":
        try:
            tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer, revision=revision or None)
        except (OSError, ValueError) as e:  # no such folder or hub name (or no network to the hub)
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(f"data: tokenizer {cfg.tokenizer!r} cannot be loaded: {reason}") from None
        if tokenizer.eos_token is None:
            tokenizer.add_special_tokens({"eos_token": EOS_TOKEN})
        return tokenizer

    train_docs = list(itertools.islice(training_documents(cfg), cfg.tokenizer_documents))
    digest = hashlib.sha256()
    for doc in train_docs:
        digest.update(hashlib.sha256(doc.encode()).digest())
    digest.update(str(cfg.vocab_size).encode())
    path = cache_dir() / "tokenizers" / f"bpe-{digest.hexdigest()[:16]}.json"
    if not path.exists():
        _train_bpe(train_docs, cfg.vocab_size, path)
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token=EOS_TOKEN)


def _train_bpe(docs: list[str], vocab_size: int, path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    logger.info("training a %d-token byte-level BPE tokenizer on %d documents", vocab_size, len(docs))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, path)


def tokenizer_sha256(tokenizer) -> str:
    """sha256 of what decides the token ids, so peers can tell that they tokenize alike.

    A fast tokenizer is hashed by its backend's JSON (vocabulary, merges, normalizer, pre-tokenizer,
    special tokens), less the truncation and padding settings that encoding calls change on the fly;
    any other tokenizer by its sorted vocabulary and special tokens.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None)
        spec.pop("padding", None)
    else:
        spec = {"vocab": sorted(tokenizer.get_vocab().items()), "special": sorted(tokenizer.all_special_tokens)}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def largest_token_id(tokenizer) -> int:
    """The largest id the tokenizer can emit: its vocabulary, added tokens and EOS may leave gaps past len()."""
    eos = tokenizer.eos_token_id if isinstance(tokenizer.eos_token_id, int) else 0
    return max(max(tokenizer.get_vocab().values(), default=0), len(tokenizer) - 1, eos)


# ----- sequences and batches ----------------------------------------------------------------------
def pack(token_streams: Iterable[list[int]], seq_len: int, eos_id: int) -> Iterator[torch.Tensor]:
    """Concatenate tokenized documents (separated by EOS) and cut them into seq_len windows."""
    buffer: list[int] = []
    for ids in token_streams:
        buffer.extend(ids)
        buffer.append(eos_id)
        while len(buffer) >= seq_len:
            yield torch.tensor(buffer[:seq_len], dtype=torch.long)
            buffer = buffer[seq_len:]


def _too_few_sequences(what: str, seq_len: int, batch_size: int) -> DataError:
    return DataError(
        f"data: {what} of {seq_len} tokens, fewer than inner.batch_size = {batch_size}; "
        "use more documents, a shorter data.seq_len or a smaller inner.batch_size"
    )


class TextData:
    """The run's tokenizer plus its packed training and held-out sequences.

    ``train`` is None for a hub source, whose training sequences are streamed by :meth:`peer_batches`;
    ``heldout`` is [n, seq_len], possibly with n = 0. `tokenizer_revision`: see :func:`load_tokenizer`.
    """

    def __init__(self, cfg: DataConfig, tokenizer_revision: str = ""):
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg, tokenizer_revision)
        self.vocab_size = largest_token_id(self.tokenizer) + 1  # what the model must embed
        self.eos_id = self.tokenizer.eos_token_id
        self.train = None
        if cfg.source == "hub":
            self.heldout = self._stack(self.sequences(heldout_documents(cfg)))
        else:  # one pass over the corpus, split as heldout_documents and training_documents split it
            heldout_docs, training_docs = [], []
            for doc in documents(cfg):
                (heldout_docs if is_holdout(doc, cfg.holdout_fraction) else training_docs).append(doc)
            self.heldout = self._stack(self.sequences(heldout_docs))
            self.train = self._stack(self.sequences(training_docs))
            if len(self.train) == 0:
                raise DataError(
                    f"data: the corpus yields no training sequence of data.seq_len = {cfg.seq_len} tokens; "
                    "use more documents or a shorter data.seq_len"
                )
            logger.info("data: %d training and %d held-out sequences of %d tokens",
                        len(self.train), len(self.heldout), cfg.seq_len)

    def sequences(self, docs: Iterable[str]) -> Iterator[torch.Tensor]:
        """The documents tokenized and packed into seq_len windows."""
        encoded = (self.tokenizer(doc, add_special_tokens=False)["input_ids"] for doc in docs)
        return pack(encoded, self.cfg.seq_len, self.eos_id)

    def _stack(self, sequences: Iterable[torch.Tensor]) -> torch.Tensor:
        seqs = list(sequences)
        return torch.stack(seqs) if seqs else torch.empty(0, self.cfg.seq_len, dtype=torch.long)

    def peer_batches(self, batch_size: int, order_seed: int, shard: int = 0,
                     state: Optional[dict] = None) -> "BatchStream":
        """An endless stream of [batch_size, seq_len] batches in this peer's order.

        A hub source reads its shard `shard`, 0 <= shard < ``data.shards``; in-memory sources ignore
        `shard` (every peer reads the whole small corpus). The stream starts at the beginning, or, with
        `state` (a stream's ``state_dict()``), right after that stream's last batch. Raises DataError
        (a ValueError) at once when the corpus cannot fill one batch, when the shard does not exist,
        or when `state` belongs to another kind of source, shard or order seed.
        """
        if self.train is None:
            return StreamedBatches(self, batch_size, order_seed, shard, state)
        if state is not None:
            _check_state(state, ShuffledBatches, order_seed)
        return ShuffledBatches(self.train, batch_size, order_seed, state["position"] if state else 0)

    def for_peer(self, batch_size: int, order_seed: int) -> "PeerStreams":
        """What a DiLoCo peer opens its stream from (:class:`p2p_diloco.train.member.PeerData`)."""
        return PeerStreams(self, batch_size, order_seed)


@dataclass
class PeerStreams:
    """One peer's batches: from which of `num_shards` shards (1 for in-memory sources), from which state."""

    data: TextData
    batch_size: int
    order_seed: int

    @property
    def num_shards(self) -> int:
        return self.data.cfg.shards if self.data.train is None else 1

    def open(self, shard: int, state: Optional[dict]) -> "BatchStream":
        return self.data.peer_batches(self.batch_size, self.order_seed, shard=shard, state=state)


def _check_state(state: Any, stream: type["BatchStream"], order_seed: int, shard: Optional[int] = None,
                 shards: Optional[int] = None) -> None:
    """A saved stream state must be whole and come from a stream of this kind, order seed and shard."""
    kind = stream.KIND
    if not isinstance(state, dict):
        raise DataError(f"data: the saved stream state is a {type(state).__name__}, not a stream's state_dict()")
    if state.get("kind") != kind:
        raise DataError(f"data: the saved stream state is of a {state.get('kind')!r} source, this config reads a "
                        f"{kind!r} one")
    missing = [key for key in stream.STATE_KEYS if key not in state]
    if missing:
        raise DataError(f"data: the saved stream state lacks {', '.join(missing)} (saved by another version?)")
    if not (isinstance(state["position"], int) and state["position"] >= 0):
        raise DataError(f"data: the saved stream state has position {state['position']!r}, not a batch count")
    if state["order_seed"] != order_seed:
        raise DataError("data: the saved stream state has another order seed (another run seed or peer identity)")
    if shard is not None and (state["shard"], state["shards"]) != (shard, shards):
        raise DataError(f"data: the saved stream state reads shard {state['shard']} of {state['shards']}, "
                        f"not shard {shard} of {shards}")


class BatchStream:
    """An endless iterator of batches; ``position`` counts the batches read so far (across restarts), and
    ``state_dict()`` is what a checkpoint keeps to resume right after the last batch read: a small dict
    of numbers, strings and lists that ``torch.save`` keeps and :meth:`TextData.peer_batches` takes back."""

    KIND = ""
    STATE_KEYS: tuple[str, ...] = ("kind", "order_seed", "position")

    def __init__(self, batch_size: int, order_seed: int, position: int):
        self.batch_size = batch_size
        self.order_seed = order_seed
        self.position = position

    def __iter__(self) -> "BatchStream":
        return self

    def __next__(self) -> torch.Tensor:
        batch = self._batch()
        self.position += 1
        return batch

    def _batch(self) -> torch.Tensor:
        raise NotImplementedError

    def state_dict(self) -> dict:
        raise NotImplementedError


class ShuffledBatches(BatchStream):
    """In-memory sequences, a fresh permutation per epoch; the incomplete last batch of an epoch is dropped.

    Epoch e is permuted by a generator seeded with (order_seed, e) alone, so batch p is found without
    replaying earlier epochs: a stream started at position p yields what an uninterrupted one yields
    from its p-th batch on. Its state is that position.
    """

    KIND = "in-memory"

    def __init__(self, train: torch.Tensor, batch_size: int, order_seed: int, position: int = 0):
        super().__init__(batch_size, order_seed, position)
        if len(train) < batch_size:
            raise _too_few_sequences(f"the corpus yields {len(train)} training sequences", train.shape[1], batch_size)
        self.train = train
        self.batches_per_epoch = len(train) // batch_size
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.long)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(derive_seed(self.order_seed, "epoch", epoch))
        return torch.randperm(len(self.train), generator=generator)

    def _batch(self) -> torch.Tensor:
        epoch, index = divmod(self.position, self.batches_per_epoch)
        if epoch != self._epoch:
            self._epoch, self._order = epoch, self.epoch_order(epoch)
        return self.train[self._order[index * self.batch_size : (index + 1) * self.batch_size]]

    def state_dict(self) -> dict:
        return dict(kind=self.KIND, order_seed=self.order_seed, position=self.position)


def checkpointed_stream_state(checkpoint: dict, order_seed: int) -> Optional[dict]:
    """The stream state a checkpoint resumes from: its ``data_state``; in a checkpoint saved before
    streams had one, the in-memory stream's state at its ``data_position`` (the batches it had read),
    in this peer's order (`order_seed`). A hub stream cannot resume from that: it reads its shard
    from the start. None: no state saved (a fresh stream)."""
    if "data_state" in checkpoint or not isinstance(checkpoint.get("data_position"), int):
        return checkpoint.get("data_state")
    return dict(kind=ShuffledBatches.KIND, order_seed=order_seed, position=checkpoint["data_position"])


class StreamedBatches(BatchStream):
    """One shard of a hub source (:func:`hub_shard`), pass after pass, in this peer's own order.

    The shard is read in stored order, HUB_SHUFFLE_BLOCK documents a block; each block is permuted
    by a generator seeded with (order seed, pass, block), its held-out documents are dropped, and the
    rest are tokenized and packed. The state after a batch is where that leaves the stream: the
    pass and block, datasets' own resumable state of the shard at the block's start
    (``IterableDataset.state_dict()``), how many of the block's documents are consumed, and the
    tokens left in the packing buffer. Resuming reloads the shard's state, reads the block again,
    permutes it alike and skips what was consumed: the batches are exactly those the uninterrupted
    stream yields, and no document is tokenized twice in a pass, at the cost of re-reading one block.
    datasets' resume reopens the file of the last arrow table it had read, skips the rows up to the
    saved one, and leaves the files before unopened. (datasets' own ``shuffle(buffer_size=...)`` is not restored by
    ``load_state_dict``: its buffer's contents are lost on resume, as the datasets docs say under
    "Save a dataset checkpoint and resume iteration"; hence this block shuffle, whose block is re-read.)
    The block size goes into the state, so a resumed stream cuts its blocks alike.

    A pass drops its last incomplete batch; a pass that yields no complete batch raises DataError.
    The first batch is read at creation, so that happens at start-up.
    """

    KIND = "hub"
    STATE_KEYS = BatchStream.STATE_KEYS + ("shard", "shards", "block_size", "pass_index", "block", "block_start",
                                           "consumed", "tokens")

    def __init__(self, data: TextData, batch_size: int, order_seed: int, shard: int = 0,
                 state: Optional[dict] = None):
        _check_shard(data.cfg, shard)
        if state is not None:
            _check_state(state, type(self), order_seed, shard, data.cfg.shards)
        super().__init__(batch_size, order_seed, state["position"] if state else 0)
        self.data, self.shard = data, shard
        self._state = state or dict(kind=self.KIND, order_seed=order_seed, position=0, shard=shard,
                                    shards=data.cfg.shards, block_size=HUB_SHUFFLE_BLOCK, pass_index=0, block=0,
                                    block_start=None, consumed=0, tokens=[])
        self.block_size = self._state["block_size"]
        self._batches = self._read(self._state)
        self._first: Optional[tuple[torch.Tensor, dict]] = next(self._batches)

    def _read(self, start: dict) -> Iterator[tuple[torch.Tensor, dict]]:
        """(batch, the state right after it) from `start` on."""
        cfg, eos = self.data.cfg, self.data.eos_id
        pass_index, block, block_start = start["pass_index"], start["block"], start["block_start"]
        consumed, tokens = start["consumed"], list(start["tokens"])
        sequences: list[torch.Tensor] = []
        while True:
            whole_pass = block_start is None and consumed == 0 and not tokens
            stream = hub_shard(cfg, self.shard)
            if block_start is not None:
                stream.load_state_dict(copy.deepcopy(block_start))
            rows = iter(stream)
            batches_this_pass = 0
            while docs := list(_texts(cfg, itertools.islice(rows, self.block_size))):
                generator = torch.Generator().manual_seed(derive_seed(self.order_seed, "pass", pass_index, block))
                order = torch.randperm(len(docs), generator=generator).tolist()
                while True:
                    cut = 0  # tokens[:cut] are in sequences already (a long document is not copied per cut)
                    while len(tokens) - cut >= cfg.seq_len:
                        sequences.append(torch.tensor(tokens[cut : cut + cfg.seq_len], dtype=torch.long))
                        cut += cfg.seq_len
                        if len(sequences) == self.batch_size:
                            batches_this_pass += 1
                            yield torch.stack(sequences), dict(
                                start, pass_index=pass_index, block=block, block_start=block_start,
                                consumed=consumed, tokens=tokens[cut:])
                            sequences = []
                    tokens = tokens[cut:]
                    if consumed == len(docs):
                        break
                    doc = docs[order[consumed]]
                    consumed += 1
                    if not is_holdout(doc, cfg.holdout_fraction):
                        tokens.extend(self.data.tokenizer(doc, add_special_tokens=False)["input_ids"])
                        tokens.append(eos)
                block, consumed = block + 1, 0
                block_start = copy.deepcopy(stream.state_dict())
            if batches_this_pass == 0 and whole_pass:
                raise _too_few_sequences(f"one pass over shard {self.shard} of {cfg.hub_dataset!r} yields "
                                         f"{len(sequences)} training sequences", cfg.seq_len, self.batch_size)
            pass_index, block, block_start, consumed, tokens, sequences = pass_index + 1, 0, None, 0, [], []

    def _batch(self) -> torch.Tensor:
        if self._first is not None:
            (batch, self._state), self._first = self._first, None
        else:
            batch, self._state = next(self._batches)
        return batch

    def state_dict(self) -> dict:
        """The state after the last batch taken (at creation: the state it started from)."""
        return dict(copy.deepcopy(self._state), position=self.position)
