"""Data: the held-out split by content, bounded reads of endless streams, resumable per-peer orders.

Hub-source tests read a local directory of .jsonl shards through the same streaming code path as a
hub dataset, offline.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from pathlib import Path

import pytest
import torch

from p2p_diloco.config import DataConfig, load_config
from p2p_diloco.train import data as data_module
from p2p_diloco.train.data import (
    DataError,
    TextData,
    documents,
    heldout_documents,
    hub_holdout_scan_limit,
    is_holdout,
    load_tokenizer,
    order_seed,
    tokenizer_sha256,
    training_documents,
)
from tests.conftest import REPO, tiny_config

WORDS = ("river stone light market window garden letter engine silver morning harbor lantern "
         "quiet bright falls under over through carries holds finds keeps").split()
SEQ_LEN = 32
BATCH = 4


def make_documents(count: int, seed: int = 0) -> list[str]:
    """Distinct documents of 20-60 words, numbered so that none repeats."""
    rng = random.Random(seed)
    return [f"document {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) for i in range(count)]


def write_shards(folder: Path, docs: list[str], shards: int = 4) -> Path:
    """A local dataset: `shards` .jsonl files with a `text` column, the documents dealt in blocks."""
    folder.mkdir(parents=True, exist_ok=True)
    per_shard = -(-len(docs) // shards)
    for index in range(shards):
        rows = docs[index * per_shard : (index + 1) * per_shard]
        (folder / f"shard-{index}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in rows))
    return folder


def write_paragraphs(path: Path, docs: list[str]) -> Path:
    path.write_text("\n\n".join(docs) + "\n")
    return path


def data_config(**values) -> DataConfig:
    base = dict(vocab_size=300, seq_len=SEQ_LEN, holdout_fraction=0.2, max_documents=0)
    return tiny_config(data={**base, **values}).data


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def hub_docs() -> list[str]:
    return make_documents(120)


@pytest.fixture
def hub_cfg(tmp_path, hub_docs, offline) -> DataConfig:
    return data_config(source="hub", hub_dataset=str(write_shards(tmp_path / "dataset", hub_docs)))


@pytest.fixture
def files_cfg(tmp_path) -> DataConfig:
    path = write_paragraphs(tmp_path / "corpus.txt", make_documents(60, seed=1))
    return data_config(source="files", paths=[str(path)])


@pytest.fixture
def pydoc_cfg() -> DataConfig:
    return tiny_config().data


def endless_stream(monkeypatch, keep=lambda text: True) -> list[int]:
    """Make the hub source an endless stream (like C4) of documents that `keep` accepts; returns [rows read]."""
    import datasets

    rows_read = [0]

    def rows():
        for doc in (d for i in itertools.count() for d in make_documents(1, seed=i)):
            if keep(doc):
                rows_read[0] += 1
                yield {"text": doc}

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.IterableDataset.from_generator(rows))
    return rows_read


def count_stream_opens(monkeypatch) -> list[int]:
    import datasets

    opens, load = [0], datasets.load_dataset

    def counting_load(*args, **kwargs):
        opens[0] += 1
        return load(*args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", counting_load)
    return opens


def first_batches(data: TextData, seed: int, count: int, position: int = 0) -> list[torch.Tensor]:
    return list(itertools.islice(data.peer_batches(BATCH, seed, position), count))


# ----- the held-out split ---------------------------------------------------------------------------
def test_holdout_depends_on_the_text_alone():
    docs = make_documents(3000)
    held = [d for d in docs if is_holdout(d, 0.2)]
    assert 0.17 < len(held) / len(docs) < 0.23
    assert all(is_holdout(d, 0.2) for d in held)  # identical documents land on the same side
    assert not any(is_holdout(d, 0.0) for d in docs)
    assert set(held) <= {d for d in docs if is_holdout(d, 0.3)}  # a larger fraction only adds documents


def test_files_split_does_not_depend_on_document_order(tmp_path):
    docs = make_documents(80)
    forward = data_config(source="files", paths=[str(write_paragraphs(tmp_path / "a.txt", docs))])
    backward = data_config(source="files", paths=[str(write_paragraphs(tmp_path / "b.txt", docs[::-1]))])
    assert set(heldout_documents(forward)) == set(heldout_documents(backward))
    assert set(training_documents(forward)) == set(training_documents(backward))
    assert set(heldout_documents(forward)) and set(training_documents(forward))


def test_fraction_zero_gives_an_empty_heldout_tensor(pydoc_cfg):
    data = TextData(dataclasses.replace(pydoc_cfg, holdout_fraction=0.0))
    assert data.heldout.shape == (0, pydoc_cfg.seq_len)
    assert data.heldout.dtype == torch.long


# ----- a hub source: a local dataset directory, streamed ------------------------------------------
@pytest.mark.timeout(120)
def test_hub_directory_streams_batches_of_the_right_shape(hub_cfg):
    data = TextData(hub_cfg)
    assert data.train is None
    assert data.heldout.ndim == 2 and data.heldout.shape[1] == SEQ_LEN and len(data.heldout) > 0
    stream = data.peer_batches(BATCH, order_seed(0, "peer-a"))
    batches = list(itertools.islice(stream, 5))
    assert all(b.shape == (BATCH, SEQ_LEN) and b.dtype == torch.long for b in batches)
    assert stream.position == 5
    assert all(int(b.max()) < data.vocab_size for b in batches)


@pytest.mark.timeout(120)
def test_hub_training_stream_never_reads_a_heldout_document(hub_cfg, hub_docs, monkeypatch):
    heldout = set(heldout_documents(hub_cfg))
    assert heldout and len(heldout) < len(hub_docs)
    read: list[str] = []
    real_pass = data_module.hub_training_pass

    def recording_pass(cfg, shuffle_seed):
        for doc in real_pass(cfg, shuffle_seed):
            read.append(doc)
            yield doc

    monkeypatch.setattr(data_module, "hub_training_pass", recording_pass)
    data = TextData(hub_cfg)
    for peer in ("peer-a", "peer-b"):  # each peer, several passes: every shard order seen differs
        list(itertools.islice(data.peer_batches(BATCH, order_seed(0, peer)), 400))
    stored_order = [d for d in hub_docs if d not in heldout]
    assert read[: len(stored_order)] != stored_order  # the stream really was reshuffled
    assert set(read) == set(hub_docs) - heldout
    assert not heldout & set(read)


@pytest.mark.timeout(60)
def test_hub_fraction_zero_does_not_read_the_stream_for_heldout(hub_cfg, monkeypatch):
    opens = count_stream_opens(monkeypatch)
    data = TextData(dataclasses.replace(hub_cfg, holdout_fraction=0.0))
    assert opens[0] == 1  # the tokenizer's training documents only
    assert data.heldout.shape == (0, SEQ_LEN)


@pytest.mark.timeout(60)
def test_hub_heldout_scan_of_an_endless_stream_is_bounded(monkeypatch, offline):
    cfg = data_config(source="hub", hub_dataset="endless", holdout_fraction=0.5)
    monkeypatch.setattr(data_module, "HUB_HOLDOUT_DOCUMENTS", 5)
    rows_read = endless_stream(monkeypatch, keep=lambda text: not is_holdout(text, 0.5))
    assert list(heldout_documents(cfg)) == []
    assert hub_holdout_scan_limit(cfg) == 40
    assert 40 <= rows_read[0] <= 41  # datasets may read one row ahead
    assert hub_holdout_scan_limit(dataclasses.replace(cfg, max_documents=7)) == 7


@pytest.mark.timeout(60)
def test_hub_tokenizer_trains_on_a_bounded_prefix_of_an_endless_stream(monkeypatch, offline):
    cfg = data_config(source="hub", hub_dataset="endless", holdout_fraction=0.0)
    monkeypatch.setattr(data_module, "BPE_TRAINING_DOCUMENTS", 50)
    rows_read = endless_stream(monkeypatch)
    assert len(load_tokenizer(cfg)) > 256
    assert 50 <= rows_read[0] <= 51


@pytest.mark.timeout(60)
def test_hub_dataset_too_small_for_one_batch_fails_at_start(tmp_path, offline):
    folder = write_shards(tmp_path / "small", ["a short one", "another", "third"], shards=3)
    data = TextData(data_config(source="hub", hub_dataset=str(folder), holdout_fraction=0.0))
    with pytest.raises(DataError) as err:
        data.peer_batches(BATCH, order_seed(0, "peer-a"))
    message = str(err.value)
    assert "\n" not in message
    assert f"fewer than inner.batch_size = {BATCH}" in message and "smaller inner.batch_size" in message


# ----- files and pydoc: errors at start-up --------------------------------------------------------
def test_fewer_sequences_than_a_batch_fails_when_the_stream_is_created(files_cfg):
    data = TextData(files_cfg)
    too_many = len(data.train) + 1
    with pytest.raises(DataError) as err:
        data.peer_batches(too_many, order_seed(0, "peer-a"))  # no next(): the error is eager
    assert str(err.value) == (
        f"data: the corpus yields {len(data.train)} training sequences of {SEQ_LEN} tokens, fewer than "
        f"inner.batch_size = {too_many}; use more documents, a shorter data.seq_len or a smaller inner.batch_size"
    )


def test_a_missing_data_file_is_named(tmp_path):
    missing = tmp_path / "nowhere" / "corpus.txt"
    with pytest.raises(DataError) as err:
        TextData(data_config(source="files", paths=[str(missing)]))
    assert f"data: file '{missing}' listed in data.paths does not exist" in str(err.value)
    assert "\n" not in str(err.value)


# ----- each peer's order, resumable ---------------------------------------------------------------
@pytest.fixture(params=["pydoc", "files"])
def local_data(request, pydoc_cfg, files_cfg) -> TextData:
    return TextData(pydoc_cfg if request.param == "pydoc" else files_cfg)


def test_order_seeds_give_different_orders_of_the_same_sequences(local_data):
    per_epoch = len(local_data.train) // BATCH
    streams = [local_data.peer_batches(BATCH, order_seed(0, peer)) for peer in ("peer-a", "peer-b")]
    orders = [stream.epoch_order(0) for stream in streams]
    assert all(sorted(order.tolist()) == list(range(len(local_data.train))) for order in orders)
    assert not torch.equal(*orders)
    epochs = [torch.cat(list(itertools.islice(stream, per_epoch))) for stream in streams]
    assert not torch.equal(*epochs)
    for epoch, order in zip(epochs, orders):  # an epoch reads the training sequences in its permutation
        assert torch.equal(epoch, local_data.train[order[: per_epoch * BATCH]])


def test_one_seed_gives_one_order(local_data):
    seed = order_seed(0, "peer-a")
    per_epoch = len(local_data.train) // BATCH
    first, again = first_batches(local_data, seed, 3 * per_epoch), first_batches(local_data, seed, 3 * per_epoch)
    assert all(torch.equal(x, y) for x, y in zip(first, again, strict=True))
    assert not torch.equal(torch.cat(first[:per_epoch]), torch.cat(first[per_epoch : 2 * per_epoch]))  # each epoch anew


def test_a_resumed_stream_continues_the_uninterrupted_one(local_data):
    seed = order_seed(3, "peer-a")
    per_epoch = len(local_data.train) // BATCH
    uninterrupted = first_batches(local_data, seed, 3 * per_epoch)
    for position in (0, 1, per_epoch - 1, per_epoch, 2 * per_epoch + 1):
        stream = local_data.peer_batches(BATCH, seed, position)
        assert stream.position == position
        resumed = list(itertools.islice(stream, 3 * per_epoch - position))
        assert stream.position == 3 * per_epoch
        assert all(torch.equal(x, y) for x, y in zip(resumed, uninterrupted[position:], strict=True))


@pytest.mark.timeout(30)
def test_skipping_to_a_far_position_replays_nothing(local_data):
    stream = local_data.peer_batches(BATCH, order_seed(0, "peer-a"), position=10**15)
    assert next(stream).shape == (BATCH, SEQ_LEN)
    assert stream.position == 10**15 + 1


# ----- tokenizer fingerprint ----------------------------------------------------------------------
def test_tokenizer_sha256_tells_corpora_apart(tmp_path, monkeypatch):
    first = data_config(source="files", paths=[str(write_paragraphs(tmp_path / "a.txt", make_documents(60, 1)))])
    second = data_config(source="files", paths=[str(write_paragraphs(tmp_path / "b.txt", make_documents(60, 2)))])
    monkeypatch.setenv("P2P_DILOCO_CACHE", str(tmp_path / "cache-1"))
    hash_first, hash_second = tokenizer_sha256(load_tokenizer(first)), tokenizer_sha256(load_tokenizer(second))
    monkeypatch.setenv("P2P_DILOCO_CACHE", str(tmp_path / "cache-2"))  # trained again, not read from the cache
    retrained = load_tokenizer(first)
    assert hash_first != hash_second
    assert tokenizer_sha256(retrained) == hash_first
    retrained("some text", truncation=True, max_length=4)  # changes the backend's truncation setting
    assert tokenizer_sha256(retrained) == hash_first


def test_tokenizer_sha256_of_a_tokenizer_without_backend():
    class SlowTokenizer:
        all_special_tokens = ["<eos>"]

        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return dict(self.vocab)

    same = tokenizer_sha256(SlowTokenizer({"a": 0, "b": 1})), tokenizer_sha256(SlowTokenizer({"b": 1, "a": 0}))
    assert same[0] == same[1]
    assert tokenizer_sha256(SlowTokenizer({"a": 1, "b": 0})) != same[0]


# ----- the example configs ------------------------------------------------------------------------
def test_tinyshakespeare_corpus_ships_beside_its_config():
    config = REPO / "peers" / "tinyshakespeare.toml"
    cfg = load_config(config)
    (path,) = cfg.data.paths
    corpus = config.parent / path  # relative paths resolve against the config's folder
    assert corpus.is_file() and corpus.stat().st_size > 1_000_000
    assert corpus.read_text().startswith("First Citizen:")


def test_documents_of_the_pydoc_source_are_stable(pydoc_cfg):
    docs = list(documents(pydoc_cfg))
    assert len(docs) == pydoc_cfg.max_documents
    assert docs == list(documents(pydoc_cfg))
