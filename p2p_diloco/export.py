"""What `p2p-diloco export` does: θ_global of a peer's checkpoint as a transformers model folder.

The checkpoint holds θ_global and the outer momentum, in :func:`trainable_parameters` order, and
nothing about the model they belong to. That comes from the ``model/`` folder a peer writes beside
its checkpoint at start-up (the model's transformers config and the run's tokenizer, see
:func:`p2p_diloco.train.checkpoint.save_export_assets`) or, for a checkpoint written before peers
did so, from the run config, built the way a peer builds it. The model is built on the CPU in fp32,
given θ_global, and saved with ``save_pretrained`` (safetensors) beside the tokenizer and
``p2p_diloco_export.json``, which says which run, outer step and global state it came from. A
checkpoint that names the settings fingerprint it was trained with is refused with a model of other
settings (a run config that is not the run's, or a local tokenizer trained differently).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

EXPORT_RECORD = "p2p_diloco_export.json"


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked; the message is one line for the user."""


@dataclass
class ModelSource:
    """A model to hold θ_global (fp32, CPU), the run's tokenizer, and where both came from."""

    model: "PreTrainedModel"  # noqa: F821 (transformers is imported lazily)
    tokenizer: object
    run_name: Optional[str]
    described_as: str  # for messages: "the model saved beside the checkpoint", "run config X"
    fingerprint: Optional[str] = None  # of the run settings (p2p_diloco.config.run_fingerprint), when known


def read_checkpoint(checkpoint_dir: str | os.PathLike) -> dict:
    """The checkpoint in `checkpoint_dir`, whole and matching its own sha256."""
    from p2p_diloco.hashing import tensors_sha256
    from p2p_diloco.train.checkpoint import checkpoint_path, load_checkpoint

    path = checkpoint_path(checkpoint_dir)
    if not path.is_file():
        raise ExportError(f"no checkpoint in {str(checkpoint_dir)!r} (no {path.name}); give the --checkpoint-dir "
                          f"of a peer that has taken an outer step (a joined peer's is <state dir>/checkpoint)")
    state = load_checkpoint(checkpoint_dir)
    if not isinstance(state, dict) or not isinstance(state.get("global_state"), (list, tuple)):
        raise ExportError(f"{str(path)!r} is not a readable p2p-diloco checkpoint")
    if tensors_sha256(state["global_state"]) != state.get("sha256"):
        raise ExportError(f"{str(path)!r} is damaged: its tensors do not match the sha256 it was saved with")
    return state


def model_from_saved_assets(checkpoint_dir: str | os.PathLike) -> Optional[ModelSource]:
    """The model and tokenizer a peer saved beside its checkpoint; None for a checkpoint written before peers did."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from p2p_diloco.train.checkpoint import EXPORT_RUN_FILE, export_assets_path

    folder = export_assets_path(checkpoint_dir)
    if not (folder / "config.json").is_file():
        return None
    run_file = folder / EXPORT_RUN_FILE
    run = json.loads(run_file.read_text()) if run_file.is_file() else {}
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).float()  # as θ_global is
    return ModelSource(model, AutoTokenizer.from_pretrained(folder), run.get("run_name"),
                       f"the model saved in {str(folder)!r}", run.get("fingerprint"))


def model_from_run_config(config_path: str | os.PathLike) -> ModelSource:
    """The model and tokenizer of a run config, built as a peer of the run builds them.

    Raises ConfigError or DataError (one line each) when the config is invalid or its tokenizer
    cannot be loaded.
    """
    from p2p_diloco.config import load_config, settings_fingerprint
    from p2p_diloco.train.data import load_tokenizer
    from p2p_diloco.train.model import build_run_model, run_settings

    cfg = load_config(config_path)
    tokenizer = load_tokenizer(cfg.data, cfg.model.revision)
    model = build_run_model(cfg, tokenizer).float()  # θ_global is fp32, whatever dtype a hub config names
    return ModelSource(model, tokenizer, cfg.run.name, f"run config {str(config_path)!r}",
                       settings_fingerprint(run_settings(cfg, tokenizer, model)))


def check_same_settings(state: dict, source: ModelSource) -> None:
    """A checkpoint that names the settings fingerprint it was trained with must match the model's: a
    run config with other settings (a locally trained tokenizer even differs between Python versions)
    would give θ_global a tokenizer it was not trained with."""
    trained_with = state.get("fingerprint")
    if trained_with and source.fingerprint and trained_with != source.fingerprint:
        raise ExportError(f"the checkpoint was trained with other settings than {source.described_as} (settings "
                          f"fingerprint {trained_with[:12]}, not {source.fingerprint[:12]}); pass the run's own "
                          f"config with --config")


def load_global_parameters(model, global_state: list, described_as: str) -> None:
    """Copy θ_global, the first half of a checkpoint's global state, into the model's trainable parameters.

    The tensors must be as many as the model's parameters twice over (θ_global, then the outer
    momentum), and θ_global's fp32 tensors of their shapes, finite
    (:func:`p2p_diloco.remote_input.tensor_problem`); `described_as` names the model in the ExportError.
    """
    import torch

    from p2p_diloco.remote_input import tensor_problem
    from p2p_diloco.train.model import trainable_parameters

    params = trainable_parameters(model)
    names = {id(p): name for name, p in model.named_parameters()}
    if len(global_state) != 2 * len(params):
        raise ExportError(f"the checkpoint holds {len(global_state)} tensors where {described_as} has "
                          f"{len(params)} parameters (θ_global and the outer momentum would be {2 * len(params)}): "
                          f"they are not the same model")
    with torch.no_grad():
        for index, (param, tensor) in enumerate(zip(params, global_state)):
            name = names.get(id(param), f"parameter {index}")
            problem = tensor_problem(tensor, param.shape, f"its tensor for {name}")
            if problem is not None:
                raise ExportError(f"cannot load the checkpoint into {described_as}: {problem}")
            param.copy_(tensor)


def match_special_tokens(source: ModelSource) -> None:
    """Give the model's config and generation config the tokenizer's BOS, EOS and padding ids, so that
    ``generate()`` stops at the tokenizer's EOS (a Llama built from run-config sizes has Llama's ids)."""
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(source.tokenizer, key, None)
        for config in (source.model.config, source.model.generation_config):
            if config is not None:
                setattr(config, key, value)


def check_out_folder(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {str(out)!r} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"--out {str(out)!r} exists and is not empty; pass --force to write into it "
                          f"(files of the same names are replaced)")


def file_states(folder: Path) -> dict[Path, tuple[int, int]]:
    """Each file in `folder` (not below it): its inode and modification time, to tell which files a save wrote."""
    return {path: (path.stat().st_ino, path.stat().st_mtime_ns) for path in folder.iterdir() if path.is_file()}


def give_normal_modes(paths) -> None:
    """The mode an ordinary write gives a new file (0666 less the umask: 0644 for the usual 022). safetensors
    writes model.safetensors through a private temporary file: it was left 0600, readable by its owner alone."""
    umask = os.umask(0o022)  # reading the umask means setting it; put back at once (export is single-threaded)
    os.umask(umask)
    for path in paths:
        os.chmod(path, 0o666 & ~umask)


@contextlib.contextmanager
def no_transformers_progress_bar():
    """transformers' progress bars off ("Writing model shards", shown after the model was written), as they were after."""
    from transformers.utils import logging as transformers_logging

    was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            transformers_logging.enable_progress_bar()


def export_checkpoint(checkpoint_dir: str | os.PathLike, out: str | os.PathLike,
                      config_path: Optional[str | os.PathLike] = None, force: bool = False) -> dict:
    """Write θ_global of the checkpoint in `checkpoint_dir` to folder `out` as a transformers model with
    its tokenizer; returns what ``p2p_diloco_export.json`` records.

    The model and tokenizer come from the run config at `config_path` when given, else from what the
    peer saved beside the checkpoint. Raises ExportError, ConfigError or DataError (one line each).
    """
    from p2p_diloco.version import __version__
    from p2p_diloco.train.checkpoint import checkpoint_path

    out = Path(out)
    check_out_folder(out, force)
    state = read_checkpoint(checkpoint_dir)
    source = model_from_run_config(config_path) if config_path else model_from_saved_assets(checkpoint_dir)
    if source is None:
        raise ExportError(f"{str(checkpoint_dir)!r} has no saved model config and tokenizer (the checkpoint predates "
                          f"them): run the peer once more with this --checkpoint-dir, or pass --config RUN.toml")
    check_same_settings(state, source)
    load_global_parameters(source.model, state["global_state"], source.described_as)
    match_special_tokens(source)
    out.mkdir(parents=True, exist_ok=True)
    before = file_states(out)
    with no_transformers_progress_bar():  # the success line is the last thing `export` prints
        source.model.save_pretrained(out)
        source.tokenizer.save_pretrained(out)
    give_normal_modes(path for path, state in file_states(out).items() if before.get(path) != state)
    record = dict(run_name=source.run_name, outer_step=state.get("outer_step"), global_sha256=state["sha256"],
                  checkpoint=str(checkpoint_path(checkpoint_dir).resolve()), model_from=source.described_as,
                  p2p_diloco_version=__version__)
    (out / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record


def run_export(checkpoint_dir: str, out: str, config_path: Optional[str], force: bool,
               push_to_hub: Optional[str] = None, private: bool = False) -> int:
    """The `export` command: export, then say what was written, and with `push_to_hub` upload it
    (p2p_diloco.hub_publish; the token is checked first). An error is one line and exit status 2."""
    from p2p_diloco.config import ConfigError
    from p2p_diloco.exit_codes import EXIT_OK, EXIT_USAGE, fail
    from p2p_diloco.hub_publish import HubError, check_repo_id, hub_token, push_folder
    from p2p_diloco.train.data import DataError

    try:
        if private and not push_to_hub:
            raise ExportError("--private applies to the repo --push-to-hub creates; pass --push-to-hub REPO too")
        token = None
        if push_to_hub:
            check_repo_id(push_to_hub)
            token = hub_token()
        record = export_checkpoint(checkpoint_dir, out, config_path, force)
    except (ExportError, HubError, ConfigError, DataError) as e:
        return fail(str(e), EXIT_USAGE)
    run = f"run {record['run_name']!r}, " if record["run_name"] else ""
    what = f"θ_global ({run}outer step {record['outer_step']}, global {record['global_sha256'][:12]})"
    print(f"exported {what} to {out}: load it with AutoModelForCausalLM.from_pretrained and "
          f"AutoTokenizer.from_pretrained", flush=True)
    if push_to_hub:
        try:
            url = push_folder(out, push_to_hub, private, token, f"p2p-diloco export of {what}")
        except HubError as e:
            return fail(str(e), EXIT_USAGE)
        print(f"pushed to {url}: load it with AutoModelForCausalLM.from_pretrained({push_to_hub!r})", flush=True)
    return EXIT_OK
