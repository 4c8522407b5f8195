"""Text in, fixed-length token sequences out: corpus loading, tokenizer, packing and each peer's order.

Sources (``[data] source``):
  * ``pydoc``: the English help topics every CPython installation ships in ``pydoc_data`` (no
    download; the offline default used by the demo and the tests);
  * ``files``: local text files, one document per blank-line separated paragraph;
  * ``hub``: a Hugging Face hub dataset, streamed.

Documents are split into train and held-out by position (every k-th document is held out, with
k = round(1 / holdout_fraction)), which works the same for finite and streamed corpora. Tokens of
consecutive documents are joined with an end-of-text token and cut into ``seq_len`` windows.
Every peer reads the same training sequences in its own order, seeded by its peer ID.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
from pathlib import Path
from typing import Iterable, Iterator

import torch

from p2p_diloco.config import DataConfig

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
HUB_HOLDOUT_DOCUMENTS = 200  # a streamed corpus has no end: evaluate on this many held-out documents


def cache_dir() -> Path:
    path = Path(os.environ.get("P2P_DILOCO_CACHE", Path.home() / ".cache" / "p2p-diloco"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def pydoc_documents() -> list[str]:
    """The pydoc help topics, sorted by topic name so every peer sees one order."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def file_documents(paths: Iterable[str]) -> list[str]:
    docs = []
    for path in paths:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        docs.extend(p.strip() for p in text.split("\n\n") if p.strip())
    return docs


def _hub_documents(cfg: DataConfig) -> Iterator[str]:
    import datasets

    stream = datasets.load_dataset(cfg.hub_dataset, cfg.hub_config or None, split=cfg.hub_split, streaming=True)
    for row in stream:
        yield row[cfg.text_column]


def documents(cfg: DataConfig) -> Iterator[str]:
    """All documents of the configured source, in a fixed order."""
    if cfg.source == "pydoc":
        docs: Iterable[str] = pydoc_documents()
    elif cfg.source == "files":
        docs = file_documents(cfg.paths)
    else:
        docs = _hub_documents(cfg)
    if cfg.max_documents:
        docs = itertools.islice(docs, cfg.max_documents)
    return iter(docs)


def is_holdout(doc_index: int, holdout_fraction: float) -> bool:
    if holdout_fraction <= 0:
        return False
    return doc_index % max(1, round(1 / holdout_fraction)) == 0


def load_tokenizer(cfg: DataConfig):
    """A hub tokenizer by name, or a byte-level BPE trained on the training documents and cached.

    The local tokenizer is keyed by a hash of the corpus and vocabulary size, so every peer of a run
    that reads the same corpus ends up with the same vocabulary (BPE training is deterministic).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if cfg.tokenizer != "local-bpe":
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
        if tokenizer.eos_token is None:
            tokenizer.add_special_tokens({"eos_token": EOS_TOKEN})
        return tokenizer

    train_docs = [d for i, d in enumerate(documents(cfg)) if not is_holdout(i, cfg.holdout_fraction)]
    if cfg.source == "hub":
        train_docs = train_docs[:20000]
    digest = hashlib.sha256()
    for doc in train_docs:
        digest.update(hashlib.sha256(doc.encode()).digest())
    digest.update(str(cfg.vocab_size).encode())
    path = cache_dir() / "tokenizers" / f"bpe-{digest.hexdigest()[:16]}.json"
    if not path.exists():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        logger.info("training a %d-token byte-level BPE tokenizer on %d documents", cfg.vocab_size, len(train_docs))
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=cfg.vocab_size,
            special_tokens=[EOS_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(train_docs, trainer=trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tok.save(str(tmp))
        os.replace(tmp, path)
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token=EOS_TOKEN)


def pack(token_streams: Iterable[list[int]], seq_len: int, eos_id: int) -> Iterator[torch.Tensor]:
    """Concatenate tokenized documents (separated by EOS) and cut them into seq_len windows."""
    buffer: list[int] = []
    for ids in token_streams:
        buffer.extend(ids)
        buffer.append(eos_id)
        while len(buffer) >= seq_len:
            yield torch.tensor(buffer[:seq_len], dtype=torch.long)
            buffer = buffer[seq_len:]


class TextData:
    """The run's tokenizer plus its packed training and held-out sequences."""

    def __init__(self, cfg: DataConfig):
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg)
        self.vocab_size = len(self.tokenizer)
        self._eos = self.tokenizer.eos_token_id
        if cfg.source == "hub":
            held = (d for i, d in enumerate(documents(cfg)) if is_holdout(i, cfg.holdout_fraction))
            self.heldout = self._stack(pack(self._encode(itertools.islice(held, HUB_HOLDOUT_DOCUMENTS)), cfg.seq_len, self._eos))
            self.train = None  # streamed on demand in peer_batches
        else:
            docs = list(documents(cfg))
            train_docs = [d for i, d in enumerate(docs) if not is_holdout(i, cfg.holdout_fraction)]
            held_docs = [d for i, d in enumerate(docs) if is_holdout(i, cfg.holdout_fraction)]
            self.train = self._stack(pack(self._encode(train_docs), cfg.seq_len, self._eos))
            self.heldout = self._stack(pack(self._encode(held_docs), cfg.seq_len, self._eos))
            if len(self.train) == 0:
                raise ValueError(f"data: the corpus yields no training sequence of data.seq_len = {cfg.seq_len} tokens")
            logger.info("data: %d training and %d held-out sequences of %d tokens",
                        len(self.train), len(self.heldout), cfg.seq_len)

    def _encode(self, docs: Iterable[str]) -> Iterator[list[int]]:
        for doc in docs:
            yield self.tokenizer(doc, add_special_tokens=False)["input_ids"]

    def _stack(self, sequences: Iterable[torch.Tensor]) -> torch.Tensor:
        seqs = list(sequences)
        return torch.stack(seqs) if seqs else torch.empty(0, self.cfg.seq_len, dtype=torch.long)

    def peer_batches(self, batch_size: int, order_seed: int) -> Iterator[torch.Tensor]:
        """An endless stream of [batch_size, seq_len] batches in this peer's own order."""
        if self.train is None:
            yield from self._hub_batches(batch_size, order_seed)
            return
        generator = torch.Generator().manual_seed(order_seed)
        while True:
            order = torch.randperm(len(self.train), generator=generator)
            for start in range(0, len(order) - batch_size + 1, batch_size):
                yield self.train[order[start : start + batch_size]]

    def _hub_batches(self, batch_size: int, order_seed: int) -> Iterator[torch.Tensor]:
        import datasets

        cfg = self.cfg
        for epoch in itertools.count():
            stream = datasets.load_dataset(cfg.hub_dataset, cfg.hub_config or None, split=cfg.hub_split, streaming=True)
            stream = stream.filter(lambda _, i: not is_holdout(i, cfg.holdout_fraction), with_indices=True)
            stream = stream.shuffle(seed=order_seed + epoch, buffer_size=10_000)
            docs = (row[cfg.text_column] for row in stream)
            sequences = pack(self._encode(docs), cfg.seq_len, self._eos)
            while batch := list(itertools.islice(sequences, batch_size)):
                if len(batch) == batch_size:
                    yield torch.stack(batch)


def order_seed(run_seed: int, peer_id: str) -> int:
    """Each peer reads the data in its own order, derived from the run seed and its peer ID."""
    return int.from_bytes(hashlib.sha256(f"{run_seed}/{peer_id}".encode()).digest()[:8], "little")
