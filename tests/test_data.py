"""Data: the held-out split by content, bounded reads of endless streams, resumable per-peer orders.

Hub-source tests read a local directory of .jsonl shards through the same streaming code path as a
hub dataset, offline.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import itertools
import json
import random
import sys
from pathlib import Path

import pytest
import torch

from p2p_diloco.config import ConfigError, DataConfig, load_config
from p2p_diloco.train import data as data_module
from p2p_diloco.train.data import (
    DataError,
    TextData,
    checkpointed_stream_state,
    documents,
    heldout_documents,
    hub_holdout_scan_limit,
    hub_shard,
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
    return data_config(source="hub", hub_dataset=str(write_shards(tmp_path / "dataset", hub_docs)), shards=1)


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


def first_batches(data: TextData, seed: int, count: int) -> list[torch.Tensor]:
    return list(itertools.islice(data.peer_batches(BATCH, seed), count))


def run_with_states(stream, count: int) -> tuple[list[torch.Tensor], list[dict]]:
    """`count` batches of `stream`, and its state before each batch and after the last: states[p] resumes at p."""
    batches, states = [], [stream.state_dict()]
    for _ in range(count):
        batches.append(next(stream))
        states.append(stream.state_dict())
    return batches, states


def as_checkpointed(state: dict) -> dict:
    """The state as a checkpoint gives it back: through torch.save, and loadable with weights_only."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    assert len(buffer.getvalue()) < 20_000  # a few numbers and the packing buffer's tokens
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


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


def recording_tokenizer(data: TextData) -> list[str]:
    """Make `data` record every document it tokenizes from now on; returns that record."""
    read, tokenize = [], data.tokenizer

    class Recording:
        def __call__(self, text, **kwargs):
            read.append(text)
            return tokenize(text, **kwargs)

        def __getattr__(self, name):
            return getattr(tokenize, name)

    data.tokenizer = Recording()
    return read


@pytest.mark.timeout(120)
def test_hub_training_stream_never_reads_a_heldout_document(hub_cfg, hub_docs):
    heldout = set(heldout_documents(hub_cfg))
    assert heldout and len(heldout) < len(hub_docs)
    data = TextData(hub_cfg)
    read = recording_tokenizer(data)
    for peer in ("peer-a", "peer-b"):  # each peer, several passes: every order seen differs
        list(itertools.islice(data.peer_batches(BATCH, order_seed(0, peer)), 150))
    stored_order = [d for d in hub_docs if d not in heldout]
    assert read[: len(stored_order)] != stored_order  # the stream really was shuffled
    assert set(read) == set(hub_docs) - heldout
    assert not heldout & set(read)


def one_pass(stream) -> None:
    """Read `stream` until it starts its second pass over its shard: every document of the first is tokenized."""
    for _ in range(1000):
        if stream.state_dict()["pass_index"] > 0:
            return
        next(stream)
    raise AssertionError("no second pass after 1000 batches")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("files, shards", [(4, 2), (4, 3), (1, 2), (1, 3)])  # whole files, or every n-th document
def test_hub_shards_are_disjoint_and_together_are_the_training_set(tmp_path, hub_docs, offline, files, shards):
    folder = write_shards(tmp_path / "dataset", hub_docs, shards=files)
    cfg = data_config(source="hub", hub_dataset=str(folder), shards=shards)
    parts = [list(data_module._texts(cfg, hub_shard(cfg, shard))) for shard in range(shards)]
    assert sorted(d for part in parts for d in part) == sorted(hub_docs)  # each document in exactly one shard
    data = TextData(cfg)
    streams = data.for_peer(BATCH, order_seed(0, "peer-a"))
    assert streams.num_shards == shards
    read, read_by_shard = recording_tokenizer(data), []
    for shard in range(shards):  # a peer per shard, each reading one pass
        start = len(read)
        one_pass(streams.open(shard, None))
        read_by_shard.append(read[start:])
    training = {d for d in hub_docs if not is_holdout(d, cfg.holdout_fraction)}
    for read, part in zip(read_by_shard, parts):
        assert read and set(read) <= set(part)  # a peer reads its own shard only
    assert sorted(d for read in read_by_shard for d in set(read)) == sorted(training)  # disjoint, and all of it
    with pytest.raises(DataError, match=f"shard {shards} does not exist"):
        streams.open(shards, None)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shards", [2, 3])  # datasets splits by files, or keeps every third document
def test_a_resumed_hub_stream_yields_what_the_uninterrupted_one_does(hub_cfg, monkeypatch, shards):
    monkeypatch.setattr(data_module, "HUB_SHUFFLE_BLOCK", 7)  # many blocks, and a resume inside one
    data = TextData(dataclasses.replace(hub_cfg, shards=shards))
    seed = order_seed(0, "peer-a")
    read = recording_tokenizer(data)
    stream = data.peer_batches(BATCH, seed, shard=1)
    uninterrupted, states, read_at = [], [stream.state_dict()], [0]  # read_at[p]: documents tokenized by batch p
    for _ in range(60):  # more than one pass over the shard
        uninterrupted.append(next(stream))
        states.append(stream.state_dict())
        read_at.append(len(read))
    assert max(state["pass_index"] for state in states) >= 1 and max(state["block"] for state in states) >= 3
    monkeypatch.setattr(data_module, "HUB_SHUFFLE_BLOCK", 5)  # a resumed stream cuts blocks as its state says
    for position in (0, 1, 13, 29, 47):
        start = len(read)
        resumed = data.peer_batches(BATCH, seed, shard=1, state=as_checkpointed(states[position]))
        assert resumed.position == position
        batches = list(itertools.islice(resumed, 60 - position))
        assert all(torch.equal(x, y) for x, y in zip(batches, uninterrupted[position:], strict=True)), position
        assert resumed.position == 60
        # per document: the resumed stream tokenizes what the uninterrupted one did next, and nothing it did before
        assert read[start:] == read[read_at[position] : read_at[60]], position
        del read[start:]
    other_peer = list(itertools.islice(data.peer_batches(BATCH, order_seed(0, "peer-b"), shard=1), 10))
    assert not all(torch.equal(x, y) for x, y in zip(other_peer, uninterrupted))  # the same shard, another order


_opened: list[str] | None = None  # the files opened while a test records them (see opened_files)


def _record_open(event: str, args: tuple) -> None:
    if event == "open" and _opened is not None and isinstance(args[0], str):
        _opened.append(args[0])


@pytest.fixture
def opened_files():
    """The paths this process opens during the test, seen by an audit hook (added once: hooks stay for good)."""
    global _opened
    if not getattr(sys, "_p2p_diloco_open_hook", False):
        sys.addaudithook(_record_open)
        sys._p2p_diloco_open_hook = True
    _opened = []
    yield _opened
    _opened = None


@pytest.mark.timeout(120)
def test_a_resumed_hub_stream_does_not_reopen_the_files_it_finished(tmp_path, hub_docs, offline, monkeypatch,
                                                                     opened_files):
    monkeypatch.setattr(data_module, "HUB_SHUFFLE_BLOCK", 7)
    folder = write_shards(tmp_path / "dataset", hub_docs)  # 4 files of 30 documents, read in order
    data = TextData(data_config(source="hub", hub_dataset=str(folder), shards=1))
    read = recording_tokenizer(data)
    seed = order_seed(0, "peer-a")
    stream = data.peer_batches(BATCH, seed)
    for _ in range(100):
        if set(read) & set(hub_docs[90:]):  # into the last file: the block read then began in the third
            break
        next(stream)
    state = stream.state_dict()
    assert state["pass_index"] == 0

    def opens_of_first_file(make_stream) -> int:
        del opened_files[:]
        list(itertools.islice(make_stream(), 3))
        return opened_files.count(str(folder / "shard-0.jsonl"))

    fresh = opens_of_first_file(lambda: data.peer_batches(BATCH, seed))
    resumed = opens_of_first_file(lambda: data.peer_batches(BATCH, seed, state=state))
    # load_dataset reads the head of the first file to learn the columns; a resumed stream reads no more of it
    # (datasets resumes at the start of the last arrow table it read, a part of the second file or a later one)
    assert resumed < fresh
    assert str(folder / "shard-2.jsonl") in opened_files


@pytest.mark.timeout(120)
def test_a_stream_state_of_another_shard_seed_or_source_is_refused(hub_cfg, pydoc_cfg):
    data = TextData(dataclasses.replace(hub_cfg, shards=2))
    seed = order_seed(0, "peer-a")
    stream = data.peer_batches(BATCH, seed, shard=0)
    next(stream)
    state = stream.state_dict()
    refusals = [
        (data, dict(shard=1, state=state), "reads shard 0 of 2, not shard 1 of 2"),
        (data, dict(shard=-1), "shard -1 does not exist: data.shards = 2 numbers them 0 to 1"),
        (data, dict(shard=0, order_seed=seed + 1, state=state), "another order seed"),
        (data, dict(state={k: v for k, v in state.items() if k != "block_start"}), "state lacks block_start"),
        (data, dict(state=dict(state, position=-1)), "has position -1, not a batch count"),
        (data, dict(state=[1, 2]), "state is a list, not a stream's state_dict()"),
    ]
    resharded = copy.copy(data)  # the same data split into more shards: shard 0 is not the same part
    resharded.cfg = dataclasses.replace(data.cfg, shards=4)
    refusals.append((resharded, dict(state=state), "reads shard 0 of 2, not shard 0 of 4"))
    memory = TextData(pydoc_cfg)
    refusals.append((memory, dict(state=state), "of a 'hub' source, this config reads a 'in-memory' one"))
    memory_state = memory.peer_batches(BATCH, seed).state_dict()
    refusals.append((data, dict(state=memory_state), "of a 'in-memory' source, this config reads a 'hub' one"))
    for source, arguments, message in refusals:
        with pytest.raises(ValueError) as err:
            source.peer_batches(BATCH, arguments.pop("order_seed", seed), **arguments)
        assert isinstance(err.value, DataError) and message in str(err.value) and "\n" not in str(err.value)
    assert data.peer_batches(BATCH, seed, shard=0, state=state).position == 1  # the state itself is fine
    assert memory.for_peer(BATCH, seed).num_shards == 1


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
    cfg = data_config(source="hub", hub_dataset="endless", holdout_fraction=0.0, tokenizer_documents=50)
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
    uninterrupted, states = run_with_states(local_data.peer_batches(BATCH, seed), 3 * per_epoch)
    assert states[per_epoch] == dict(kind="in-memory", order_seed=seed, position=per_epoch)
    for position in (0, 1, per_epoch - 1, per_epoch, 2 * per_epoch + 1):
        stream = local_data.peer_batches(BATCH, seed, shard=5, state=as_checkpointed(states[position]))  # no shards
        assert stream.position == position
        resumed = list(itertools.islice(stream, 3 * per_epoch - position))
        assert stream.position == 3 * per_epoch
        assert all(torch.equal(x, y) for x, y in zip(resumed, uninterrupted[position:], strict=True))


def test_a_checkpoint_that_kept_only_its_data_position_resumes_there(local_data, hub_cfg):
    # saved before streams had a state: {"data_position": batches read}, no "data_state"
    seed = order_seed(3, "peer-a")
    per_epoch = len(local_data.train) // BATCH
    uninterrupted = first_batches(local_data, seed, per_epoch + 3)
    state = checkpointed_stream_state({"outer_step": 2, "data_position": per_epoch + 1}, seed)
    resumed = local_data.peer_batches(BATCH, seed, state=state)
    assert all(torch.equal(x, y) for x, y in zip(itertools.islice(resumed, 2), uninterrupted[per_epoch + 1:],
                                                 strict=True))
    # a checkpoint with a stream state gives it as it is; one without either starts afresh
    saved = local_data.peer_batches(BATCH, seed).state_dict()
    assert checkpointed_stream_state({"data_state": saved, "data_position": 99}, seed) is saved
    assert checkpointed_stream_state({"data_state": None}, seed) is None
    assert checkpointed_stream_state({}, seed) is None
    with pytest.raises(DataError, match="in-memory"):  # a hub stream cannot resume from a batch count
        TextData(hub_cfg).peer_batches(BATCH, seed, state=state)


@pytest.mark.timeout(30)
def test_resuming_at_a_far_position_replays_nothing(local_data):
    seed = order_seed(0, "peer-a")
    state = dict(local_data.peer_batches(BATCH, seed).state_dict(), position=10**15)
    stream = local_data.peer_batches(BATCH, seed, state=state)
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


def test_a_tokenizer_with_ids_the_model_cannot_embed_is_refused_at_start(pydoc_cfg):
    from p2p_diloco.train.model import build_model, check_vocabulary_fits

    data = TextData(pydoc_cfg)
    sizes = tiny_config().model
    check_vocabulary_fits(build_model(sizes, data.vocab_size, 0), data.tokenizer, "llama", "local-bpe")
    with pytest.raises(ConfigError) as err:
        check_vocabulary_fits(build_model(sizes, 100, 0), data.tokenizer, "llama", "local-bpe")
    assert str(err.value) == (
        f"config: tokenizer 'local-bpe' emits token ids up to {data.vocab_size - 1}, but model 'llama' embeds only "
        f"100 tokens; use a tokenizer whose vocabulary fits the model (for a hub model, its own tokenizer)")


def save_tokenizer(folder: Path, vocab_size: int) -> str:
    """A byte-level BPE of about `vocab_size` tokens, saved as a tokenizer directory AutoTokenizer loads offline."""
    load_tokenizer(dataclasses.replace(tiny_config().data, vocab_size=vocab_size)).save_pretrained(folder)
    return str(folder)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tokens", [1024, 280])  # more tokens than the model's own 300, and fewer than its pad id
def test_a_hub_model_embeds_every_id_a_hub_tokenizer_emits(tmp_path, offline, tokens):
    from transformers import LlamaConfig

    from p2p_diloco.train.model import build_model, check_vocabulary_fits

    model_dir = tmp_path / "model"  # a hub model by path, with a vocabulary of its own
    LlamaConfig(vocab_size=300, pad_token_id=299, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=64).save_pretrained(model_dir)
    cfg = tiny_config(model={"name": str(model_dir)}, data={"tokenizer": save_tokenizer(tmp_path / "tok", tokens)})
    data = TextData(cfg.data)
    assert (data.vocab_size > 300) == (tokens > 300)
    model = build_model(cfg.model, data.vocab_size, 0, cfg.data.seq_len)  # pad id 299 of 280 tokens: cleared
    assert model.get_input_embeddings().num_embeddings == model.get_output_embeddings().out_features == data.vocab_size
    check_vocabulary_fits(model, data.tokenizer, cfg.model.name, cfg.data.tokenizer)
    batch = next(data.peer_batches(BATCH, order_seed(0, "peer-a")))
    assert int(batch.max()) < data.vocab_size
    assert torch.isfinite(model(input_ids=batch, labels=batch).loss)
    with pytest.raises(ConfigError) as err:  # a model that embeds fewer ids than the tokenizer emits
        check_vocabulary_fits(build_model(cfg.model, 260, 0), data.tokenizer, cfg.model.name, cfg.data.tokenizer)
    assert str(err.value).startswith(f"config: tokenizer {cfg.data.tokenizer!r} emits token ids up to "
                                     f"{data.vocab_size - 1}, but model {str(model_dir)!r} embeds only 260 tokens")



def test_the_ranks_of_an_island_read_disjoint_parts_of_its_stream_and_resume_together():
    from p2p_diloco.train.data import ShuffledBatches
    from p2p_diloco.train.island import RankSlice

    def stream(position=0):
        return ShuffledBatches(torch.arange(40).reshape(20, 2), 2, order_seed=7, position=position)

    whole = [next(stream(p)).tolist() for p in range(6)]
    ranks = [RankSlice(stream(), rank, 3) for rank in range(3)]
    taken = [[next(r).tolist() for r in ranks] for _ in range(2)]  # two inner steps, in lockstep
    assert [batch for step in taken for batch in step] == whole  # every batch read once, by one rank
    assert {r.position for r in ranks} == {6} and ranks[1].state_dict() == stream(6).state_dict()
    resumed = RankSlice(stream(ranks[1].state_dict()["position"]), 1, 3)
    assert next(resumed).tolist() == next(stream(7)).tolist()
