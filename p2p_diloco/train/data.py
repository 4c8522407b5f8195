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

Every peer reads the same training sequences in its own order, seeded by its peer ID. For ``pydoc``
and ``files`` that order is a fresh permutation per epoch, derived from (order seed, epoch) alone, so
a restarted peer resumes at its checkpointed batch position without replaying anything
(:class:`ShuffledBatches`). A hub stream is reshuffled per pass (:class:`StreamedBatches`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
from pathlib import Path
from typing import Iterable, Iterator

import torch

from p2p_diloco.config import DataConfig

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
HUB_HOLDOUT_DOCUMENTS = 200  # a streamed corpus has no end: evaluate on this many held-out documents
HUB_HOLDOUT_SCAN_FACTOR = 4  # read at most this many times the documents expected to hold them
HUB_SHUFFLE_BUFFER = 10_000  # documents in datasets' shuffle buffer of a streamed pass
BPE_TRAINING_DOCUMENTS = 20_000  # the local BPE learns from this prefix of the training documents


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


def _hub_documents(cfg: DataConfig, shuffle_seed: int | None = None) -> Iterator[str]:
    """The texts of a hub source, in stored order or shuffled; the stream opens only on the first read."""
    stream = _hub_stream(cfg)
    if shuffle_seed is not None:
        stream = stream.shuffle(seed=shuffle_seed, buffer_size=HUB_SHUFFLE_BUFFER)
    for row in stream:
        if cfg.text_column not in row:
            raise DataError(
                f"data: dataset {cfg.hub_dataset!r} has no column data.text_column = {cfg.text_column!r}; "
                f"set it to one of {', '.join(map(repr, row))}"
            )
        yield row[cfg.text_column]


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


def hub_training_pass(cfg: DataConfig, shuffle_seed: int) -> Iterator[str]:
    """One pass over a hub source's training documents, shuffled by `shuffle_seed`.

    datasets shuffles the shard order and then draws from a HUB_SHUFFLE_BUFFER-document buffer; the
    held-out documents are dropped by content, so whatever that order, none of them is trained on.
    """
    docs = _hub_documents(cfg, shuffle_seed)
    return (doc for doc in docs if not is_holdout(doc, cfg.holdout_fraction))


# ----- tokenizer ----------------------------------------------------------------------------------
def load_tokenizer(cfg: DataConfig):
    """A hub tokenizer by name, or a byte-level BPE trained on the training documents and cached.

    The local tokenizer learns from the first BPE_TRAINING_DOCUMENTS training documents and is keyed
    by a hash of them and the vocabulary size, so every peer that reads the same corpus ends up with
    the same vocabulary (BPE training is deterministic); :func:`tokenizer_sha256` tells if not.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if cfg.tokenizer != "local-bpe":
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
        if tokenizer.eos_token is None:
            tokenizer.add_special_tokens({"eos_token": EOS_TOKEN})
        return tokenizer

    train_docs = list(itertools.islice(training_documents(cfg), BPE_TRAINING_DOCUMENTS))
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
    ``heldout`` is [n, seq_len], possibly with n = 0.
    """

    def __init__(self, cfg: DataConfig):
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg)
        self.vocab_size = len(self.tokenizer)
        self._eos = self.tokenizer.eos_token_id
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
        return pack(encoded, self.cfg.seq_len, self._eos)

    def _stack(self, sequences: Iterable[torch.Tensor]) -> torch.Tensor:
        seqs = list(sequences)
        return torch.stack(seqs) if seqs else torch.empty(0, self.cfg.seq_len, dtype=torch.long)

    def peer_batches(self, batch_size: int, order_seed: int, position: int = 0) -> "BatchStream":
        """An endless stream of [batch_size, seq_len] batches in this peer's order, from batch `position` on.

        Raises DataError at once when the corpus cannot fill one batch.
        """
        if position < 0:
            raise ValueError(f"data: batch position {position} is negative; positions count batches from 0")
        if self.train is None:
            return StreamedBatches(self, batch_size, order_seed, position)
        return ShuffledBatches(self.train, batch_size, order_seed, position)


class BatchStream:
    """An endless iterator of batches; ``position`` counts the batches read so far (what a checkpoint keeps)."""

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


class ShuffledBatches(BatchStream):
    """In-memory sequences, a fresh permutation per epoch; the incomplete last batch of an epoch is dropped.

    Epoch e is permuted by a generator seeded with (order_seed, e) alone, so batch p is found without
    replaying earlier epochs: a stream started at position p yields what an uninterrupted one yields
    from its p-th batch on.
    """

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


class StreamedBatches(BatchStream):
    """A hub source, streamed pass after pass, each pass shuffled by (order_seed, start position, pass).

    It cannot skip to a position yet: started at p it counts on from p, and mixing p into the shuffle
    seeds at least keeps a restarted peer from replaying its previous order. A pass that yields no
    complete batch raises DataError; the first batch is read at creation, so that happens at start-up.
    """

    def __init__(self, data: TextData, batch_size: int, order_seed: int, position: int = 0):
        super().__init__(batch_size, order_seed, position)
        self.data = data
        self._passes = self._read_passes(start=position)
        self._first: torch.Tensor | None = next(self._passes)

    def _read_passes(self, start: int) -> Iterator[torch.Tensor]:
        cfg = self.data.cfg
        for pass_index in itertools.count():
            docs = hub_training_pass(cfg, derive_seed(self.order_seed, "pass", start, pass_index))
            sequences = self.data.sequences(docs)
            found = False
            while len(batch := list(itertools.islice(sequences, self.batch_size))) == self.batch_size:
                found = True
                yield torch.stack(batch)
            if not found:
                raise _too_few_sequences(f"one pass over {cfg.hub_dataset!r} yields {len(batch)} training sequences",
                                         cfg.seq_len, self.batch_size)

    def _batch(self) -> torch.Tensor:
        if self._first is not None:
            batch, self._first = self._first, None
            return batch
        return next(self._passes)
