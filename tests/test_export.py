"""`p2p-diloco export`: θ_global of a real peer's checkpoint as a transformers model folder.

One lone peer (a real `p2p-diloco peer` process on 127.0.0.1, no other peer), started from a pretrained
model folder (`model.pretrained`), takes an outer step with a checkpoint directory; its θ_global at step 0
is that folder's weights (tests/test_pretrained.py checks the rest of a pretrained start in-process); then

* `export` writes a folder that `AutoModelForCausalLM.from_pretrained` and
  `AutoTokenizer.from_pretrained` load, whose logits are θ_global's and whose tokenizer gives the
  run's ids, with a record of the global state it came from, every file with the mode the umask gives an
  ordinary write, and no progress bar after its success line;
* a checkpoint without the files a peer saves beside it exports with `--config`, and says so without;
* no checkpoint, a non-empty --out, a damaged checkpoint, tensors of another model and a --config of
  other settings than the checkpoint was trained with are one-line errors with exit status 2;
* the model files a peer saves replace what a crashed peer left half-written.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from p2p_diloco.config import load_config, settings_fingerprint
from p2p_diloco.exit_codes import EXIT_USAGE
from p2p_diloco.export import EXPORT_RECORD, run_export
from p2p_diloco.hashing import tensors_sha256
from p2p_diloco.metrics import read_metrics
from p2p_diloco.train.checkpoint import (EXPORT_RUN_FILE, checkpoint_path, export_assets_path, load_checkpoint,
                                         save_checkpoint, save_export_assets)
from p2p_diloco.train.data import TextData
from p2p_diloco.train.model import build_model, build_run_model, run_settings, trainable_parameters
from tests.conftest import REPO, Processes
from tests.swarm_helpers import pretrained_sections, save_pretrained_folder, tiny_config_file
from tests.wandb_files import offline_wandb, wandb_history, wandb_runs

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

TEXTS = ["def export(model): return model.save_pretrained(folder)", "Help on built-in function len."]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run config that starts from a pretrained folder, and the checkpoint directory of a lone peer that
    took one outer step with it; the peer's θ_global at step 0 was the folder's weights."""
    folder = tmp_path_factory.mktemp("trained")
    pretrained = save_pretrained_folder(folder / "pretrained", seed=7)
    config = tiny_config_file(folder, **pretrained_sections(pretrained))
    checkpoint_dir, metrics = folder / "checkpoint", folder / "peer.jsonl"
    processes = Processes(folder)
    # the module's processes share the session's tokenizer cache (conftest's isolated_cache)
    env = {"P2P_DILOCO_CACHE": str(tmp_path_factory.getbasetemp() / "cache"), "OMP_NUM_THREADS": "1",
           **offline_wandb(folder / "wandb-files")}
    try:
        peer = processes.start("peer", "peer", "--config", str(config), "--checkpoint-dir", str(checkpoint_dir),
                               "--max-outer-steps", "1", "--host", "127.0.0.1", "--metrics-file", str(metrics),
                               "--wandb", "p2p-diloco-test", env=env)
        assert peer.wait(240) == 0, processes.log("peer")
    finally:
        processes.stop_all()
    saved = trainable_parameters(AutoModelForCausalLM.from_pretrained(pretrained))
    join = next(r for r in read_metrics(metrics) if r["event"] == "join")
    assert join["outer_step"] == 0  # θ_global, then the outer momentum (zero)
    assert join["global_sha256"] == tensors_sha256([*saved, *(torch.zeros_like(p) for p in saved)])
    return config, checkpoint_dir


def test_the_peer_logged_its_metrics_to_wandb(trained):
    """`--wandb PROJECT` (here offline) logs a run of the peer, grouped by run.name, with its metrics' numbers."""
    folder = trained[0].parent
    (run_dir,) = (folder / "wandb-files" / "wandb").glob("offline-run-*")
    (step,) = [r for r in read_metrics(folder / "peer.jsonl") if r["event"] == "outer_step"]
    logged = [row for row in wandb_history(run_dir) if "outer_step/loss" in row]
    assert [(row["step"], row["outer_step/loss"], row["outer_step/group_size"]) for row in logged] == [
        (1, step["loss"], 1)]
    assert wandb_runs(run_dir) == [("p2p-diloco-test", "test")]


def export_cli(*args: str, env: dict | None = None, umask: int = -1) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "p2p_diloco.cli", "export", *args], capture_output=True, text=True,
                          timeout=240, env={**(os.environ if env is None else env), "PYTHONPATH": str(REPO)},
                          umask=umask)


def model_holding_theta_global(config, checkpoint_dir):
    """The run's model built the way the tests build it, with θ_global of the checkpoint; and the run's tokenizer."""
    cfg = load_config(config)
    data = TextData(cfg.data)
    model = build_model(cfg.model, data.vocab_size, cfg.run.seed, cfg.data.seq_len)
    state = load_checkpoint(checkpoint_dir)
    params = trainable_parameters(model)
    with torch.no_grad():
        for param, tensor in zip(params, state["global_state"][: len(params)]):
            param.copy_(tensor)
    return model.eval(), data.tokenizer


def test_the_exported_folder_loads_with_theta_globals_logits_and_the_runs_tokenizer(trained, tmp_path):
    config, checkpoint_dir = trained
    out = tmp_path / "model"
    result = export_cli("--checkpoint-dir", str(checkpoint_dir), "--out", str(out), umask=0o027)
    assert result.returncode == 0, result.stderr
    assert "exported θ_global (run 'test', outer step 1" in result.stdout
    assert "Writing model shards" not in result.stderr  # no transformers progress bar after the success line
    # every file as an ordinary write makes it under this umask (safetensors' own write left 0600)
    modes = {path.name: oct(path.stat().st_mode & 0o777) for path in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {oct(0o640)}, modes

    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    reference, run_tokenizer = model_holding_theta_global(config, checkpoint_dir)
    for text in TEXTS:
        assert tokenizer(text)["input_ids"] == run_tokenizer(text)["input_ids"]
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    batch = torch.tensor([run_tokenizer(text)["input_ids"][:10] for text in TEXTS])
    with torch.no_grad():
        logits = exported(input_ids=batch).logits
        torch.testing.assert_close(logits, reference(input_ids=batch).logits, rtol=0, atol=1e-6)
        fresh = build_model(load_config(config).model, reference.config.vocab_size, 0)
        assert not torch.allclose(logits, fresh(input_ids=batch).logits)  # the outer step moved θ_global
    assert exported.generation_config.eos_token_id == run_tokenizer.eos_token_id

    record = json.loads((out / EXPORT_RECORD).read_text())
    saved = load_checkpoint(checkpoint_dir)
    assert record["global_sha256"] == saved["sha256"] and record["outer_step"] == saved["outer_step"] == 1
    assert record["run_name"] == "test"


def test_a_checkpoint_without_saved_model_files_exports_with_its_run_config(trained, tmp_path, capsys):
    config, checkpoint_dir = trained
    older = tmp_path / "older"  # as a peer wrote it before peers saved the model's config and tokenizer
    older.mkdir()
    shutil.copy(checkpoint_path(checkpoint_dir), checkpoint_path(older))
    assert run_export(str(older), str(tmp_path / "a"), None, False) == EXIT_USAGE
    message = one_line_error(capsys)
    assert "has no saved model config and tokenizer" in message and "or pass --config RUN.toml" in message

    assert run_export(str(older), str(tmp_path / "from-config"), str(config), False) == 0
    assert run_export(str(checkpoint_dir), str(tmp_path / "from-saved"), None, False) == 0
    from_config, from_saved = (load_file(tmp_path / name / "model.safetensors") for name in ("from-config", "from-saved"))
    assert from_config.keys() == from_saved.keys()
    assert all(torch.equal(from_config[key], from_saved[key]) for key in from_saved)


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_no_checkpoint_and_a_non_empty_out_folder_are_refused(trained, tmp_path, capsys):
    _, checkpoint_dir = trained
    assert run_export(str(tmp_path / "empty"), str(tmp_path / "a"), None, False) == EXIT_USAGE
    assert "no checkpoint in" in one_line_error(capsys)

    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert run_export(str(checkpoint_dir), str(out), None, False) == EXIT_USAGE
    assert "exists and is not empty; pass --force" in one_line_error(capsys)
    assert not (out / "model.safetensors").exists()
    assert run_export(str(checkpoint_dir), str(out), None, True) == 0
    assert (out / "model.safetensors").exists() and (out / "notes.txt").read_text() == "mine"


def rewritten_checkpoint(checkpoint_dir, folder, change, rehash: bool) -> str:
    """A copy of the checkpoint and its saved model files whose global state `change` altered, with its
    sha256 recomputed when `rehash` (else a damaged file)."""
    shutil.copytree(checkpoint_dir, folder)
    state = load_checkpoint(folder)
    change(state["global_state"])
    if rehash:
        state["sha256"] = tensors_sha256(state["global_state"])
    save_checkpoint(folder, state)
    return str(folder)


@pytest.mark.parametrize("change, rehash, message", [
    (lambda tensors: tensors.pop(), True, "the checkpoint holds 23 tensors where the model saved in"),
    (lambda tensors: tensors.__setitem__(0, tensors[0][:-1]), True,
     "its tensor for model.embed_tokens.weight has shape (299, 32), expected (300, 32)"),
    (lambda tensors: tensors.__setitem__(0, tensors[0].double()), True,
     "its tensor for model.embed_tokens.weight has dtype torch.float64, expected torch.float32"),
    (lambda tensors: tensors[1].fill_(float("nan")), True, "holds NaN or infinite values"),
    (lambda tensors: tensors[2].add_(1.0), False, "is damaged: its tensors do not match the sha256"),
], ids=["count", "shape", "dtype", "nan", "damaged"])
def test_a_checkpoint_that_does_not_fit_the_model_is_refused(trained, tmp_path, capsys, change, rehash, message):
    _, checkpoint_dir = trained
    bad = rewritten_checkpoint(checkpoint_dir, tmp_path / "bad", change, rehash)
    assert run_export(bad, str(tmp_path / "out"), None, False) == EXIT_USAGE
    assert message in one_line_error(capsys)
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_config_of_other_settings_than_the_checkpoints_is_refused(trained, tmp_path, capsys):
    config, checkpoint_dir = trained
    cfg = load_config(config)
    tokenizer = TextData(cfg.data).tokenizer
    fingerprint = settings_fingerprint(run_settings(cfg, tokenizer, build_run_model(cfg, tokenizer)))
    capsys.readouterr()  # transformers' loading progress bar
    assert load_checkpoint(checkpoint_dir)["fingerprint"] == fingerprint
    saved = json.loads((export_assets_path(checkpoint_dir) / EXPORT_RUN_FILE).read_text())
    assert saved == {"run_name": "test", "fingerprint": fingerprint}

    other = tiny_config_file(tmp_path / "other", inner={"lr": 1e-3})  # the same model, trained otherwise
    assert run_export(str(checkpoint_dir), str(tmp_path / "out"), str(other), False) == EXIT_USAGE
    message = one_line_error(capsys)
    assert f"the checkpoint was trained with other settings than run config {str(other)!r}" in message
    assert f"(settings fingerprint {fingerprint[:12]}, not " in message and "pass the run's own config" in message
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_saving_the_model_files_removes_what_a_crashed_peer_left(trained, tmp_path):
    _, checkpoint_dir = trained
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint_dir, copy)
    for leftover in (".model.tmp999999", ".model.old999999"):  # another process's, half-written
        (copy / leftover).mkdir()
        (copy / leftover / "config.json").write_text("{")
    folder = export_assets_path(copy)
    save_export_assets(copy, AutoConfig.from_pretrained(folder), AutoTokenizer.from_pretrained(folder), "test", None)
    assert not list(copy.glob(".model.*"))
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()


@pytest.fixture
def recorded_hub(monkeypatch):
    """huggingface_hub's HfApi.create_repo and upload_folder replaced by recorders (no hub is reachable here),
    with a token in HF_TOKEN; `fail` makes upload_folder answer as a hub that refuses it would."""
    import httpx
    from huggingface_hub import HfApi, RepoUrl
    from huggingface_hub.errors import HfHubHTTPError

    calls = {"fail": False}

    def create_repo(self, repo_id, **options):
        calls["create_repo"] = dict(token=self.token, repo_id=repo_id, **options)
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, **options):
        if calls["fail"]:
            response = httpx.Response(403, request=httpx.Request("POST", "https://huggingface.co/api/models/x"))
            raise HfHubHTTPError("403 Forbidden: you do not have write access to me/tiny-model\nmore detail",
                                 response=response)
        files = sorted(path.name for path in Path(options["folder_path"]).iterdir())
        calls["upload_folder"] = dict(token=self.token, files=files, **options)

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    monkeypatch.setenv("HF_TOKEN", "hf_recorded")
    return calls


def test_push_to_hub_creates_the_repo_and_uploads_the_exported_folder(trained, tmp_path, recorded_hub):
    from click.testing import CliRunner

    from p2p_diloco.cli import main

    _, checkpoint_dir = trained
    out = tmp_path / "model"
    result = CliRunner().invoke(main, ["export", "--checkpoint-dir", str(checkpoint_dir), "--out", str(out),
                                       "--push-to-hub", "me/tiny-model", "--private"])
    assert result.exit_code == 0, result.output
    assert "pushed to https://huggingface.co/me/tiny-model" in result.stdout
    assert recorded_hub["create_repo"] == dict(token="hf_recorded", repo_id="me/tiny-model", repo_type="model",
                                               private=True, exist_ok=True)
    upload = recorded_hub["upload_folder"]
    assert upload["token"] == "hf_recorded" and upload["repo_id"] == "me/tiny-model"
    assert upload["folder_path"] == str(out) and upload["repo_type"] == "model"
    assert {"config.json", "model.safetensors", "tokenizer.json", EXPORT_RECORD} <= set(upload["files"])
    assert sorted(path.name for path in out.iterdir()) == upload["files"]
    assert upload["commit_message"].startswith("p2p-diloco export of θ_global (run 'test', outer step 1, global ")


@pytest.mark.parametrize("args, message", [
    (("--push-to-hub", "me/a b"), "--push-to-hub 'me/a b' is not a hub repository id (NAME or ORG/NAME): "),
    (("--private",), "--private applies to the repo --push-to-hub creates; pass --push-to-hub REPO too"),
    (("--push-to-hub", "me/tiny-model"), "--push-to-hub me/tiny-model: the upload failed: 403 Forbidden: you do "
                                         "not have write access to me/tiny-model (the model is exported in "),
], ids=["repo-id", "private-alone", "refused"])
def test_a_push_to_hub_that_cannot_be_done_is_a_one_line_error(trained, tmp_path, capsys, recorded_hub, args,
                                                                message):
    _, checkpoint_dir = trained
    recorded_hub["fail"] = True
    push_to_hub = args[1] if args[0] == "--push-to-hub" else None
    code = run_export(str(checkpoint_dir), str(tmp_path / "out"), None, False, push_to_hub, "--private" in args)
    assert code == EXIT_USAGE
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' progress bar, if it exported
    assert last.startswith("error: ") and message in last


def test_push_to_hub_without_a_token_stops_before_exporting(trained, tmp_path):
    _, checkpoint_dir = trained
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH")}
    env["HF_HOME"] = str(tmp_path / "hf-home")  # no token file that `hf auth login` would have written
    result = export_cli("--checkpoint-dir", str(checkpoint_dir), "--out", str(tmp_path / "out"),
                        "--push-to-hub", "me/tiny-model", env=env)
    assert result.returncode == EXIT_USAGE
    assert result.stderr.strip() == ("error: --push-to-hub needs a Hugging Face token with write access: log in "
                                     "with `hf auth login` or set HF_TOKEN")
    assert not (tmp_path / "out").exists()
