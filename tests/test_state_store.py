"""The run's checkpoint store (p2p_diloco.sync.state_store): what a joiner reads when no peer serves the
run's state, on fsspec's local and memory filesystems (standing in for s3://, gs://, hf://)."""

import io
import json

import pytest
import torch

from p2p_diloco.hashing import tensors_sha256
from p2p_diloco.sync.state_store import StateStore, StoreError, StoreWriter

SHAPES = [(4, 3), (5,)]


def state(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=generator) for s in SHAPES * 2]  # θ_global, then the momentum


def write(store: StateStore, step: int) -> list[torch.Tensor]:
    tensors = state(step)
    store.write(step, tensors_sha256(tensors), inner_steps=10 * step, tensors=tensors)
    return tensors


@pytest.fixture(params=["directory", "memory"])
def url(request, tmp_path):
    if request.param == "directory":
        return str(tmp_path / "store")
    return f"memory://store-{tmp_path.name}"


def test_the_newest_whole_state_is_read_back_exactly(url):
    store = StateStore(url, "run", "f" * 64)
    write(store, 2)
    newest = write(store, 3)
    got = store.newest(SHAPES)
    assert (got.outer_step, got.sha256, got.inner_steps) == (3, tensors_sha256(newest), 30)
    assert all(torch.equal(a, b) for a, b in zip(got.tensors, newest))
    assert store.newest(SHAPES, above_step=3) is None
    assert store.newest(SHAPES, above_step=2).outer_step == 3


def test_a_write_cut_short_is_skipped_for_the_state_before_it(url):
    store = StateStore(url, "run", "f" * 64)
    write(store, 2)
    tensors = write(store, 3)
    fs, path = store.fs, store._path("states", f"{tensors_sha256(tensors)}.pt")
    data = fs.cat_file(path)
    fs.pipe_file(path, data[: len(data) // 2])  # the state's file cut short, its manifest written
    assert store.newest(SHAPES).outer_step == 2
    forged = io.BytesIO()  # as long, and loads, but holds other tensors than the manifest's hash
    torch.save({"outer_step": 3, "sha256": tensors_sha256(tensors), "inner_steps": 30, "tensors": state(99)}, forged)
    assert len(forged.getvalue()) == len(data)
    fs.pipe_file(path, forged.getvalue())
    assert store.newest(SHAPES).outer_step == 2
    fs.pipe_file(store._path("steps", f"{4:012d}.json"), b'{"outer_step": 4, "sha2')  # a manifest cut short
    assert store.newest(SHAPES).outer_step == 2
    fs.pipe_file(path, data)  # the file whole again
    assert store.newest(SHAPES).outer_step == 3


def test_states_of_other_runs_settings_or_shapes_are_not_used(url):
    write(StateStore(url, "other-run", "f" * 64), 5)
    write(StateStore(url, "run", "e" * 64), 6)
    store = StateStore(url, "run", "f" * 64)
    write(store, 1)
    assert store.newest(SHAPES).outer_step == 1
    assert store.newest([(4, 3), (6,)]) is None  # a model of other shapes: nothing here fits it
    manifests = store.manifests()
    assert [m["outer_step"] for m in manifests] == [1]
    assert json.loads(json.dumps(manifests[0]))["fingerprint"] == "f" * 64


def test_an_empty_store_has_nothing_and_an_unknown_protocol_is_a_clear_error(tmp_path):
    assert StateStore(str(tmp_path / "none-yet"), "run", "f" * 64).newest(SHAPES) is None
    with pytest.raises(StoreError, match="checkpoint store 'nosuchfs://x'"):
        StateStore("nosuchfs://x", "run", "f" * 64)


def test_the_writer_writes_every_n_outer_steps_in_the_background(tmp_path):
    store = StateStore(str(tmp_path / "store"), "run", "f" * 64)
    writer = StoreWriter(store, every=2)
    for step in (1, 2, 3):
        tensors = state(step)
        writer.after_step(step, tensors_sha256(tensors), 10 * step, lambda t=tensors: t)
        writer.close(timeout=30) if step == 2 else None
    writer.close(timeout=30)
    assert [m["outer_step"] for m in store.manifests()] == [2]
