"""Run configuration: one TOML file per run, validated in full before anything starts.

Every peer of a run must load the same file: the model shape, the tokenizer and the seed decide the
initial global parameters, and the run name decides which DHT keys and all-reduce groups a peer uses.
Defaults are the recommended values; the DiLoCo paper's (arXiv 2311.08105, section 3) are scaled
down to the small models this project is usually tried with first.

A bad value raises :class:`ConfigError` with one line naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping



class ConfigError(ValueError):
    """A config value is missing, unknown or out of range; the message is one line for the user."""


def _spec(default: Any, check: Callable[[Any], bool], allowed: str) -> Any:
    """A dataclass field with a validity check and the human-readable rule it enforces."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"check": check, "allowed": allowed})
    return field(default=default, metadata={"check": check, "allowed": allowed})


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def int_at_least(default: int, lo: int) -> Any:
    return _spec(default, lambda v: _is_int(v) and v >= lo, f"an integer >= {lo}")


def positive(default: float) -> Any:
    return _spec(default, lambda v: _is_num(v) and v > 0, "a number > 0")


def non_negative(default: float) -> Any:
    return _spec(default, lambda v: _is_num(v) and v >= 0, "a number >= 0")


def in_range(default: float, lo: float, hi: float) -> Any:
    return _spec(default, lambda v: _is_num(v) and lo <= v <= hi, f"a number in [{lo}, {hi}]")


def one_of(default: str, *choices: str) -> Any:
    return _spec(default, lambda v: v in choices, "one of " + ", ".join(repr(c) for c in choices))


def boolean(default: bool) -> Any:
    return _spec(default, lambda v: isinstance(v, bool), "true or false")


def text(default: str, pattern: str = r".*", allowed: str = "a string") -> Any:
    return _spec(default, lambda v: isinstance(v, str) and re.fullmatch(pattern, v) is not None, allowed)


def string_list(default: list) -> Any:
    return _spec(default, lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v), "a list of strings")


def is_peer_id(text: Any) -> bool:
    """Whether `text` is a libp2p peer ID in base58, as `p2p-diloco` prints them (``Qm...``): a multihash."""
    import base58
    import multihash

    try:
        multihash.decode(base58.b58decode(text.encode("ascii")))
        return True
    except Exception:  # not ASCII, not base58, or not a multihash
        return False


def peer_id_list(default: list) -> Any:
    return _spec(default, lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
                 "a list of peer IDs (strings)")


@dataclass(frozen=True)
class RunConfig:
    name: str = text("demo", r"[A-Za-z0-9_-]{1,64}", "1-64 letters, digits, '_' or '-' (it prefixes DHT keys)")
    seed: int = int_at_least(0, 0)
    # a private run: the peer IDs (base58, as each peer prints them) of the only identities whose DHT records
    # and group membership the run's peers accept (p2p_diloco.swarm.records.RunMembers); empty: a public run
    allowed_peers: list = peer_id_list([])


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-architecture causal LM built from these sizes, or any AutoConfig-compatible `name`, both
    initialised from scratch; or the weights of a pretrained model (`pretrained`)."""

    name: str = text("llama", r"\S+", "'llama' (built from the sizes below) or a hub model name")
    hidden_size: int = int_at_least(64, 8)
    num_layers: int = int_at_least(2, 1)
    num_heads: int = int_at_least(4, 1)
    intermediate_size: int = int_at_least(256, 8)
    max_position_embeddings: int = int_at_least(512, 8)
    # start from these weights, not from scratch (p2p_diloco.train.pretrained): a hub model id ("org/name") or a
    # local save_pretrained folder. Its config is the architecture (name and sizes above may not contradict it),
    # its tokenizer must be the run's (data.tokenizer = the same), and the sha256 of its weights, not this
    # string, is one of the run's shared settings: every peer starts from the same θ_global
    pretrained: str = text("", allowed="a hub model id or a local model folder ('' : start from scratch)")
    # the hub revision (branch, tag or commit) of `pretrained` and of its tokenizer; '' : the default branch
    revision: str = text("", allowed="a branch, tag or commit of model.pretrained on the hub ('' : the default)")

    @property
    def sized_here(self) -> bool:
        """Whether the model is a Llama built from this section's sizes (not a hub or pretrained config's)."""
        return self.name == "llama" and not self.pretrained

    @property
    def label(self) -> str:
        """The model's name in messages: the pretrained model's, else `name`."""
        return self.pretrained or self.name


@dataclass(frozen=True)
class DataConfig:
    """Where text comes from, how it is tokenized and packed into fixed-length training sequences."""

    source: str = one_of("pydoc", "pydoc", "files", "hub")
    paths: list = string_list([])
    hub_dataset: str = text("", allowed="a dataset name on the HF hub")
    hub_config: str = text("", allowed="a dataset config name")
    hub_split: str = text("train", r"\S+", "a split name")
    text_column: str = text("text", r"\S+", "a column name")
    tokenizer: str = text("local-bpe", r"\S+", "'local-bpe' (trained on the corpus) or a hub tokenizer name")
    # the local BPE's vocabulary; a hub tokenizer brings its own, and the model embeds what the tokenizer
    # emits (a llama is built to its size, a hub model is resized to it), so this value goes unused then
    vocab_size: int = int_at_least(1024, 260)
    seq_len: int = int_at_least(64, 8)
    holdout_fraction: float = in_range(0.05, 0.0, 0.5)
    max_documents: int = int_at_least(0, 0)
    # a local BPE learns from at most this many training documents (of a hub stream: its first ones, in
    # stored order and unsharded, so every peer trains the same tokenizer without reading the whole stream)
    tokenizer_documents: int = int_at_least(20_000, 1)
    # disjoint parts a hub stream is split into (datasets' split_dataset_by_node); each peer reads one that
    # no live peer reads, and resumes it from its checkpoint. Ignored for pydoc and files: every peer reads
    # the whole small corpus, each in its own order
    shards: int = int_at_least(64, 1)


@dataclass(frozen=True)
class InnerConfig:
    """Local AdamW between outer steps (DiLoCo Algorithm 1, lines 4-8)."""

    optimizer: str = one_of("adamw", "adamw", "adamw8bit")
    lr: float = positive(1e-3)
    weight_decay: float = non_negative(0.1)
    beta1: float = in_range(0.9, 0.0, 0.999999)
    beta2: float = in_range(0.95, 0.0, 0.999999)
    warmup_steps: int = int_at_least(50, 0)
    total_steps: int = int_at_least(2000, 1)
    min_lr_ratio: float = in_range(0.1, 0.0, 1.0)
    grad_clip: float = non_negative(1.0)
    batch_size: int = int_at_least(16, 1)
    grad_accumulation: int = int_at_least(1, 1)
    steps_per_outer: int = int_at_least(50, 1)


# the codecs of p2p_diloco.sync.codecs and the aggregation rules of p2p_diloco.sync.robust, by name: config
# is a leaf and imports no other layer (tests/test_config.py checks that the lists agree)
CODEC_NAMES = ("none", "fp16", "bf16", "int8", "nf4", "fp4-bnb", "fp4-e3m0", "mask8-e3m0", "mask16-e3m0", "2bit",
               "1bit", "mask4-2bit", "mask2-1bit")
AGGREGATION_NAMES = ("centered-clip", "trimmed-mean", "mean")


@dataclass(frozen=True)
class OuterConfig:
    """Outer Nesterov SGD on the pseudo-gradient (DiLoCo Algorithm 1, line 12)."""

    lr: float = positive(0.7)
    momentum: float = in_range(0.9, 0.0, 0.999999)
    # how the pseudo-gradient's parts travel in the all-reduce (p2p_diloco.sync.codecs; reducers sum in fp32)
    codec: str = one_of("fp4-e3m0", *CODEC_NAMES)
    # each peer adds what the group did not count of its last sent pseudo-gradient to its next
    # (p2p_diloco.train.error_feedback); nothing to feed back with codec "none"
    error_feedback: bool = boolean(True)
    # Streaming DiLoCo (arXiv 2501.18512): the transformer blocks split into this many fragments, one synced
    # every steps_per_outer / fragments inner steps (p2p_diloco.train.fragments)
    fragments: int = int_at_least(1, 1)
    fragment_layout: str = one_of("strided", "strided", "sequential")
    # the most inner steps that run while a fragment's all-reduce is in flight, at most steps_per_outer /
    # fragments − 1 (a larger value is lowered to that, with a log line; -1 asks for that many); 0 blocks
    # until it is done. The outer step is applied after the first of them that ends with the sync done
    sync_delay: int = int_at_least(10, -1)
    # true: exactly sync_delay inner steps run beside every sync, Streaming DiLoCo's fixed τ, even where the
    # sync ended after the first (p2p_diloco.schedule)
    fixed_sync_delay: bool = boolean(False)
    # θ_local ← α·θ_local + (1 − α)·θ_global for the synced fragment, once its outer step is applied
    merge_alpha: float = in_range(0.5, 0.0, 1.0)
    # how each reducer aggregates the group's parts (p2p_diloco.sync.robust, docs/security.md): sample claims
    # counted up to claim_cap × the group's median claim and while no minority outweighs the rest, parts'
    # norms at norm_clip × the median norm, then CenteredClip (radius clip_factor × the median distance,
    # clip_iterations times) or a trimmed mean (trim_fraction each side); "mean" is DiLoCo's exact
    # sample-weighted mean, with no protection against a hostile peer
    aggregation: str = one_of("centered-clip", *AGGREGATION_NAMES)
    clip_factor: float = _spec(2.0, lambda v: _is_num(v) and v >= 1, "a number >= 1")
    clip_iterations: int = _spec(3, lambda v: _is_int(v) and 1 <= v <= 100, "an integer in [1, 100]")
    trim_fraction: float = in_range(0.25, 0.0, 0.5)
    claim_cap: float = _spec(4.0, lambda v: _is_num(v) and v >= 1, "a number >= 1")
    norm_clip: float = _spec(1.0, lambda v: _is_num(v) and v >= 1, "a number >= 1")
    # CenteredClip: a part pointing away from the coordinate-wise median (a negative inner product) counts nothing
    drop_opposed: bool = boolean(True)
    # a round's mean g of a fragment is void on every peer if ‖g‖ > max_update_growth × ‖b‖ (b: the fragment's
    # outer momentum), or ‖g‖ > ‖θ_global‖ at its first outer step (p2p_diloco.train.update_check); 0: no check
    max_update_growth: float = non_negative(16.0)


@dataclass(frozen=True)
class ComputeConfig:
    """How this peer computes its inner steps: its own choice, not the run's (outside the settings
    fingerprint), since none of it changes what a step computes beyond rounding. The CLI's
    ``--precision``, ``--compile``, ``--gradient-checkpointing``, ``--micro-batch-size`` and
    ``--max-memory`` override these."""

    # "auto": bf16 autocast on a CUDA device that supports it, fp32 elsewhere
    precision: str = one_of("auto", "auto", "bf16", "fp32")
    # torch.compile the model's forward (nn.Module.compile, in place); the first steps are slow while it compiles
    compile: bool = boolean(False)
    # recompute each block's activations in the backward pass (transformers' gradient checkpointing):
    # far less activation memory for about a third more compute
    gradient_checkpointing: bool = boolean(False)
    # sequences per forward/backward pass; inner.batch_size must be a multiple. 0: on a GPU, or with
    # max_memory_gib, the largest that fits the memory the peer may use (p2p_diloco.train.memory), at most
    # inner.batch_size; on a CPU without max_memory_gib, inner.batch_size
    micro_batch_size: int = int_at_least(0, 0)
    # GiB of device memory the peer may use (on a GPU, also the cap of torch's caching allocator);
    # 0: on a GPU, what it has free at start-up; on a CPU, no limit (and no fitting)
    max_memory_gib: float = non_negative(0.0)
    # a peer of several ranks (torchrun --nproc-per-node N p2p-diloco peer ...; p2p_diloco.train.island):
    # shard the model, its gradients and AdamW's state over the ranks with FSDP2, for a model larger than one
    # device; false: each rank holds the whole model (DDP). A single-process peer ignores it
    shard: bool = boolean(False)


@dataclass(frozen=True)
class EvalConfig:
    """The held-out loss of θ_global while the run trains (p2p_diloco.train.heldout): each peer's own choice,
    outside the settings fingerprint, so peers of one run may evaluate differently or not at all."""

    # outer steps between evaluations (a peer evaluates the first θ_global it holds in each span of this many
    # outer steps); 0: never. On the demo, 16 sequences every 10 outer steps cost well under 1 % of its time
    every: int = int_at_least(10, 0)
    # the first this many sequences of the run's held-out split (data.holdout_fraction), the same on every peer
    sequences: int = int_at_least(16, 1)


@dataclass(frozen=True)
class SwarmConfig:
    """Timeouts (seconds) of every network wait; see docs/timeouts.md for what each bounds."""

    matchmaking_time: float = positive(3.0)
    request_timeout: float = positive(2.0)
    round_wait_timeout: float = non_negative(30.0)
    allreduce_timeout: float = positive(120.0)
    next_chunk_timeout: float = positive(10.0)
    commit_timeout: float = positive(15.0)
    # say "ready" a few inner steps before the pseudo-gradient is taken, so that the round's group forms while
    # they run (from this peer's step time and its last rounds' matching time: train/match_ahead.py); false:
    # only once it is taken
    match_ahead: bool = boolean(True)
    # attempts at a step's round: after a void one (a member died mid-round) the survivors average again
    # without it, so a failure costs the failed peer, not the step (p2p_diloco.train.round_sync)
    round_attempts: int = int_at_least(2, 1)
    # past this many members a round's parts go through relays, so that each peer dials about 2·√N others,
    # not N − 1; the result is the same bytes (p2p_diloco.sync.relay). 0: always a flat butterfly
    relay_group_size: int = int_at_least(32, 0)
    state_download_timeout: float = positive(120.0)
    # a peer that sees the run ahead of it and can get no state (from peers, nor from the checkpoint store)
    # waits this long for one, not training, then stops: it never starts a second history (train/catch_up.py)
    state_wait_timeout: float = positive(600.0)
    # where the run's global state is kept for when no peer is up (sync/state_store.py): a directory or an
    # fsspec URL (s3://, gs://, hf://); a joiner that finds no peer to download from starts from the newest
    # state there. '' : none
    checkpoint_store: str = text("", allowed="a directory path or an fsspec URL ('' for none)")
    # this peer writes the global state to checkpoint_store every this many outer steps (the host's peers,
    # which hold the store's credentials); 0: it only reads the store
    checkpoint_every: int = int_at_least(0, 0)
    progress_ttl: float = positive(60.0)
    start_wait_timeout: float = non_negative(120.0)
    checkpoint_dir: str = text("", allowed="a directory path ('' disables checkpoints)")
    # multiaddrs of the run's bootstrap nodes, used when --initial-peers is not given (a run manifest names them)
    initial_peers: list = string_list([])


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)

    def replace(self, **sections: Mapping[str, Any]) -> "Config":
        """A copy with some values changed, e.g. ``cfg.replace(inner={"steps_per_outer": 5})``; validated."""
        raw = dataclasses.asdict(self)
        for section, values in sections.items():
            raw[section].update(values)
        return config_from_dict(raw)


def _build_section(cls: type, section: str, raw: Mapping[str, Any]) -> Any:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config: [{section}] must be a table, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"config: unknown key {section}.{unknown[0]}; allowed keys: {', '.join(fields)}")
    values = {}
    for name, f in fields.items():
        if name not in raw:
            continue
        given = value = raw[name]
        if _is_int(value) and f.type == "float":
            value = float(value)
        if not f.metadata["check"](value):
            raise ConfigError(f"config: {section}.{name} = {given!r} is invalid: must be {f.metadata['allowed']}")
        values[name] = value
    return cls(**values)


def _check_llama_sizes(model: ModelConfig, seq_len: int) -> None:
    """The sizes of a Llama built from the config (a hub model's sizes come from its own config)."""
    if model.hidden_size % model.num_heads != 0:
        raise ConfigError(
            f"config: model.hidden_size = {model.hidden_size} must be divisible by model.num_heads = {model.num_heads}"
        )
    head_size = model.hidden_size // model.num_heads
    if head_size % 2 != 0:  # rotary position embeddings rotate pairs of dimensions
        raise ConfigError(
            f"config: model.hidden_size / model.num_heads = {head_size} must be even (rotary embeddings need "
            f"pairs of dimensions); change model.hidden_size or model.num_heads"
        )
    if seq_len > model.max_position_embeddings:
        raise ConfigError(
            f"config: data.seq_len = {seq_len} exceeds model.max_position_embeddings = {model.max_position_embeddings}"
        )


def _check_fragments(cfg: Config) -> None:
    """Streaming DiLoCo's schedule: P fragments, one synced every H/P inner steps."""
    outer, steps = cfg.outer, cfg.inner.steps_per_outer
    if cfg.model.sized_here and outer.fragments > cfg.model.num_layers:
        raise ConfigError(f"config: outer.fragments = {outer.fragments} exceeds model.num_layers = "
                          f"{cfg.model.num_layers}: each fragment needs at least one transformer block")
    if steps % outer.fragments != 0:
        raise ConfigError(f"config: inner.steps_per_outer = {steps} must be a multiple of outer.fragments = "
                          f"{outer.fragments} (one fragment syncs every steps_per_outer / fragments inner steps)")


def mask_stride(codec: str) -> int:
    """The stride of a codec that sends one value in `stride` (p2p_diloco.sync.codecs.SharedMaskCodec, named
    ``mask<stride>-<values>``); 0 for a codec that sends every value."""
    sparse = re.fullmatch(r"mask(\d+)-.+", codec)
    return int(sparse.group(1)) if sparse else 0


def _check_codec_needs_feedback(outer: OuterConfig) -> None:
    """A codec that sends one value in `stride` (p2p_diloco.sync.codecs.SharedMaskCodec) needs error feedback: without
    it the values a round does not send are dropped from the run for good; so does a codec of 1 or 2 bits a value
    (MeanScaledCodec), which clips what lies beyond its top level."""
    stride = mask_stride(outer.codec)
    if stride and not outer.error_feedback:
        raise ConfigError(f"config: outer.codec = {outer.codec!r} sends 1 value in {stride} of each pseudo-gradient and "
                          f"needs outer.error_feedback = true, or the {stride - 1} in {stride} it does not send are "
                          "dropped every round")
    bits = re.fullmatch(r"(?:mask\d+-)?(\d)bit", outer.codec)  # MeanScaledCodec: 1 or 2 bits a value
    if bits and not outer.error_feedback:
        raise ConfigError(f"config: outer.codec = {outer.codec!r} codes each value in {bits.group(1)} bit(s) around its "
                          "block's mean |x|, clipping the largest, and needs outer.error_feedback = true, or what it "
                          "clips and rounds off is lost every round")


# the outer momentum above which a mask codec's runs were measured worse (docs/benchmarks.md, issue 43: mask2-1bit
# +1.3 % of fp32 with lr 1.4, momentum 0.5; +2.9 % with lr 1.0, momentum 0.8; mask4-2bit +7.4 % with the defaults)
MASK_CODEC_MOMENTUM_ADVISED = 0.5
MASK_CODEC_LR_ADVISED = 1.4


def advice(cfg: Config) -> list[str]:
    """Settings that are valid but that the benchmarks measured worse than another choice, each a sentence for a
    peer's log at start (a run's settings are its own: nothing is changed)."""
    notes = []
    stride = mask_stride(cfg.outer.codec)
    if stride and cfg.outer.momentum > MASK_CODEC_MOMENTUM_ADVISED:
        notes.append(f"outer.codec = {cfg.outer.codec!r} with outer.momentum = {cfg.outer.momentum:g}: a value is sent "
                     f"one round in {stride} with what it gathered meanwhile, and its momentum moves only then, "
                     f"so this momentum remembers {stride}× as many rounds as in a dense run; the demo model "
                     f"trained best with outer.lr = {MASK_CODEC_LR_ADVISED:g} and outer.momentum = "
                     f"{MASK_CODEC_MOMENTUM_ADVISED:g} (docs/benchmarks.md, the 1- and 2-bit codecs)")
    return notes


def _check_pretrained(cfg: Config) -> None:
    """What a pretrained model decides (its architecture, its tokenizer) is not also set otherwise; its sizes
    are checked against its own config once it is read (p2p_diloco.train.pretrained)."""
    model = cfg.model
    if not model.pretrained:
        if model.revision:
            raise ConfigError(f"config: model.revision = {model.revision!r} needs model.pretrained: a revision is "
                              f"the version of a pretrained model to start from")
        return
    if model.name != "llama":
        raise ConfigError(f"config: model.name = {model.name!r} conflicts with model.pretrained = "
                          f"{model.pretrained!r}: the pretrained model's own config is the architecture; remove "
                          f"model.name")
    if cfg.data.tokenizer != model.pretrained:
        raise ConfigError(f"config: data.tokenizer = {cfg.data.tokenizer!r} is invalid with model.pretrained = "
                          f"{model.pretrained!r}: the model reads the token ids of its own tokenizer; set "
                          f"data.tokenizer = {model.pretrained!r}")


def _check_allowed_peers(run: RunConfig) -> None:
    for index, peer_id in enumerate(run.allowed_peers):
        if not is_peer_id(peer_id):
            raise ConfigError(f"config: run.allowed_peers[{index}] = {peer_id!r} is not a peer ID; copy each one "
                              f"as its peer prints it (the part after /p2p/ of its address, e.g. QmXyZ...)")


def check_member(cfg: Config, peer_id: str) -> None:
    """Raise ConfigError unless a peer of identity `peer_id` may take part in the run (a private run lists it)."""
    if cfg.run.allowed_peers and peer_id not in cfg.run.allowed_peers:
        raise ConfigError(f"this peer's identity {peer_id} is not in run.allowed_peers of this private run: send "
                          f"that peer ID to the run's organiser to be listed, and start again with the same "
                          f"identity (--identity-path, or join's --state-dir)")


def _check_consistency(cfg: Config) -> None:
    """Rules that involve more than one key."""
    _check_allowed_peers(cfg.run)
    if cfg.model.sized_here:
        _check_llama_sizes(cfg.model, cfg.data.seq_len)
    _check_pretrained(cfg)
    if cfg.data.source == "files" and not cfg.data.paths:
        raise ConfigError("config: data.paths = [] is invalid when data.source = 'files': list at least one text file")
    if cfg.data.source == "hub" and not cfg.data.hub_dataset:
        raise ConfigError("config: data.hub_dataset = '' is invalid when data.source = 'hub': name a hub dataset")
    if cfg.inner.warmup_steps >= cfg.inner.total_steps:
        raise ConfigError(
            f"config: inner.warmup_steps = {cfg.inner.warmup_steps} must be smaller than "
            f"inner.total_steps = {cfg.inner.total_steps}"
        )
    if cfg.inner.steps_per_outer > cfg.inner.total_steps:
        raise ConfigError(
            f"config: inner.steps_per_outer = {cfg.inner.steps_per_outer} exceeds inner.total_steps = "
            f"{cfg.inner.total_steps}: the lr schedule would end inside the first outer step"
        )
    _check_fragments(cfg)
    _check_codec_needs_feedback(cfg.outer)
    micro = cfg.compute.micro_batch_size
    if micro and cfg.inner.batch_size % micro != 0:
        raise ConfigError(f"config: inner.batch_size = {cfg.inner.batch_size} must be a multiple of "
                          f"compute.micro_batch_size = {micro} (each batch is split into micro-batches)")
    if cfg.swarm.request_timeout >= cfg.swarm.matchmaking_time:
        # hivemind: request_timeout must be smaller than min_matchmaking_time to avoid deadlocks
        raise ConfigError(
            f"config: swarm.request_timeout = {cfg.swarm.request_timeout} must be smaller than "
            f"swarm.matchmaking_time = {cfg.swarm.matchmaking_time}"
        )


SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Config)}


def config_from_dict(raw: Mapping[str, Any]) -> Config:
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"config: unknown section [{unknown[0]}]; allowed sections: {', '.join(SECTIONS)}")
    sections = {name: _build_section(factory, name, raw.get(name, {})) for name, factory in SECTIONS.items()}
    cfg = Config(**sections)
    _check_consistency(cfg)
    return cfg


def load_config(path: str | Path) -> Config:
    """Read and validate a run config; raises ConfigError with a one-line message.

    Relative ``data.paths`` are resolved against the config file's directory, so a config names the
    data that ships beside it wherever it is started from.
    """
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config: file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config: {str(path)!r} is not valid TOML: {e}") from None
    cfg = config_from_dict(raw)
    if cfg.data.paths:
        cfg = cfg.replace(data={"paths": [str(path.parent / p) for p in cfg.data.paths]})
    return cfg


def shared_settings(cfg: Config, tokenizer_sha256: str, pretrained_sha256: str | None = None) -> dict[str, Any]:
    """The settings every peer of a run must share, flat (``{"inner.lr": 0.001, ...}``), with the sha256
    of the tokenizer it trains with and, for a run that starts from a pretrained model, of its weights.

    Peers whose settings differ must not average: their parameters mean different things (model,
    tokenizer), or their pseudo-gradients come from different optimisation problems (data, inner and
    outer optimizer, seed). Left out: timeouts and other `[swarm]` values (each peer's own), `[compute]`
    (how a peer computes: precision, compile, micro-batches), `[eval]` (how often it measures θ_global), the local paths of data files (the corpus
    shows in a locally trained tokenizer), and how a peer splits its batch into accumulated batches
    (only batch_size × grad_accumulation counts). Peers publish these in
    their status records, so a peer that finds the run on other settings can name the ones that differ.

    A private run's allow-list counts as ``run.allowed_peers``, the sha256 of its sorted peer IDs
    (:func:`allowed_peers_sha256`), so that peers with different lists never meet; a public run has no
    such entry (its fingerprint is the one it had before allow-lists existed). Likewise a pretrained model
    counts as ``model.pretrained_sha256`` (:func:`p2p_diloco.train.pretrained.weights_sha256`), not by its
    id or folder (nor its tokenizer's, the same), which differ between peers' machines; the hashes pin a
    revision too.
    """
    if bool(cfg.model.pretrained) != bool(pretrained_sha256):
        raise ValueError("shared_settings: pretrained_sha256 is given exactly when model.pretrained is set")
    model = dataclasses.asdict(cfg.model)
    model.pop("pretrained"), model.pop("revision")
    if pretrained_sha256:
        model["pretrained_sha256"] = pretrained_sha256
    inner = dataclasses.asdict(cfg.inner)
    inner["samples_per_step"] = inner.pop("batch_size") * inner.pop("grad_accumulation")
    data = dataclasses.asdict(cfg.data)
    data.pop("paths")
    if pretrained_sha256:
        data.pop("tokenizer")
    run = dataclasses.asdict(cfg.run)
    allowed_peers = run.pop("allowed_peers")
    if allowed_peers:
        run["allowed_peers"] = allowed_peers_sha256(allowed_peers)
    sections = dict(run=run, model=model, data=data, inner=inner,
                    outer=dataclasses.asdict(cfg.outer))
    flat = {f"{section}.{key}": value for section, values in sections.items() for key, value in values.items()}
    return {**flat, "tokenizer_sha256": tokenizer_sha256}


def allowed_peers_sha256(peer_ids: list[str]) -> str:
    """One value for a private run's allow-list, whatever the order or repetitions of its peer IDs."""
    return hashlib.sha256("\n".join(sorted(set(peer_ids))).encode()).hexdigest()


def settings_fingerprint(settings: Mapping[str, Any]) -> str:
    """sha256 of :func:`shared_settings`: peers of one run have one fingerprint."""
    return hashlib.sha256(json.dumps(dict(settings), sort_keys=True).encode()).hexdigest()


def run_fingerprint(cfg: Config, tokenizer_sha256: str, pretrained_sha256: str | None = None) -> str:
    """The fingerprint of this config's shared settings with this tokenizer and pretrained weights (see
    :func:`shared_settings`)."""
    return settings_fingerprint(shared_settings(cfg, tokenizer_sha256, pretrained_sha256))


def settings_differences(mine: Mapping[str, Any], theirs: Mapping[str, Any], limit: int = 3) -> list[str]:
    """``["inner.lr = 0.005 here, 0.001 there", ...]``: the first `limit` settings that differ, by name."""
    names = sorted(set(mine) | set(theirs), key=lambda name: (name == "tokenizer_sha256", name))
    differing = [name for name in names if mine.get(name) != theirs.get(name)]

    def show(value: Any) -> str:
        return "(unset)" if value is None else (value[:12] if isinstance(value, str) and len(value) == 64 else repr(value))

    described = [f"{name} = {show(mine.get(name))} here, {show(theirs.get(name))} there" for name in differing[:limit]]
    if len(differing) > limit:
        described.append(f"and {len(differing) - limit} more")
    return described
