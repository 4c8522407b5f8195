"""What the `bootstrap` and `peer` commands do: set up logging and signals, start, run, stop cleanly."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from p2p_diloco.exit_codes import (
    EXIT_ISLAND_BROKEN, EXIT_NO_STATE, EXIT_OK, EXIT_OTHER_SETTINGS, EXIT_UNREACHABLE, EXIT_USAGE, fail,
)
from p2p_diloco.logs import setup_logging
from p2p_diloco.stopping import install_stop_handlers, shutdown_dht, skip_final_garbage_collection

logger = logging.getLogger("p2p_diloco")


def print_maddrs(dht, prefix: str = "") -> None:
    from p2p_diloco.swarm.node import visible_maddrs

    for maddr in visible_maddrs(dht):
        print(f"{prefix}{maddr}", flush=True)


@dataclass(frozen=True)
class BootstrapOptions:
    """What a bootstrap node does besides the DHT: reduce for natted runs (`assist`), keep a run's state
    (`keep`: its config), and serve the runs' page (`page`: host, port, refresh seconds)."""

    assist: bool = True
    assist_max_params: int = 50_000_000
    keep: Optional[str] = None
    keep_eval_sequences: Optional[int] = None  # None: the run config's eval.sequences
    page: Optional[tuple[str, int, float]] = None


def run_bootstrap(host, port, announce_ip, identity_path, initial_peers, verbose,
                  options: BootstrapOptions = BootstrapOptions()) -> int:
    setup_logging(verbose)
    from p2p_diloco.process_tree import children_exit_with_this_process
    from p2p_diloco.swarm.identity import Identity, IdentityError
    from p2p_diloco.swarm.node import NodeAddressError, start_dht
    from p2p_diloco.swarm.records import key_phases, node_validators
    from p2p_diloco.run_page.server import serve_run_page
    from p2p_diloco.sync.assistant import AssistantPool

    stop = install_stop_handlers()
    children_exit_with_this_process()
    try:
        identity = Identity.load_or_create(identity_path)
        keeper = _prepare_keeper(options.keep, identity.peer_id, options.keep_eval_sequences) if options.keep \
            else None  # a bad config stops it before the node
        dht = start_dht(host, port, identity, node_validators(identity), announce_ip, initial_peers,
                        key_phases=key_phases())
    except (NodeAddressError, IdentityError, ValueError) as e:  # ConfigError and DataError are ValueErrors
        return fail(str(e), EXIT_USAGE)
    except ConnectionError as e:
        return fail(str(e), EXIT_UNREACHABLE)
    keeping = page = None
    try:
        print_maddrs(dht)
        logger.info("bootstrap node is up; give peers one of the addresses above as --initial-peers")
        if options.page is not None:
            page_host, page_port, refresh_s = options.page
            try:
                page = serve_run_page(dht, page_host, page_port, None, refresh_s)
            except OSError as e:
                return fail(str(e), EXIT_USAGE)
        pool = AssistantPool(dht, options.assist_max_params) if options.assist else None
        logger.info("reducing for runs whose peers nobody can dial: %s",
                    f"yes, up to {options.assist_max_params:,} parameters" if options.assist else "no (--no-assist)")
        if keeper is not None:
            keeping = _start_keeper(keeper, dht, identity, stop)
        stop.wait()
        if keeping is not None:
            keeping.join(KEEPER_STOP_S)
        if pool is not None:
            pool.close()
    finally:
        if page is not None:
            page.close()
        shutdown_dht(dht)
        logger.info("bootstrap node stopped")
    return EXIT_OK


KEEPER_STOP_S = 60.0  # how long a stopping bootstrap node waits for its keeper to leave the run


def _prepare_keeper(config_path: str, peer_id: str, eval_sequences: Optional[int]):
    """What the keeper of the run `config_path` describes needs before the node starts: the run config, the
    model (on the CPU: it holds θ_global and the momentum, and never trains), the run's settings and the
    first `eval_sequences` (None: ``eval.sequences``) held-out sequences it evaluates θ_global on.
    ConfigError or DataError (one line) if they cannot be had."""
    import torch

    from p2p_diloco.config import load_config

    cfg = load_config(config_path)
    model, settings, peer_data, _, heldout = _prepare_training(cfg, peer_id, torch.device("cpu"))
    return cfg, model, settings, peer_data, heldout[:cfg.eval.sequences if eval_sequences is None else eval_sequences]


def _start_keeper(prepared, dht, identity, stop) -> threading.Thread:
    """Run the keeper of a run (:meth:`p2p_diloco.train.keeper.Keeper.keep`) on the bootstrap node's own
    DHT node and identity, in a thread, until `stop`."""
    from p2p_diloco.config import settings_fingerprint
    from p2p_diloco.swarm.node import RunNode
    from p2p_diloco.swarm.reachability import DIRECT, Reachability
    from p2p_diloco.train.keeper import Keeper

    cfg, model, settings, peer_data, heldout = prepared
    node = RunNode(dht, identity, Reachability(DIRECT, "the bootstrap node: peers dial it"))
    keeper = Keeper(cfg, model, peer_data, node, settings, stop_event=stop, heldout=heldout)
    logger.info("keeping the state of run %r (settings fingerprint %s)%s", cfg.run.name,
                settings_fingerprint(settings)[:16],
                f", written to {cfg.swarm.checkpoint_store} every {cfg.swarm.checkpoint_every} outer steps"
                if cfg.swarm.checkpoint_store and cfg.swarm.checkpoint_every else "")

    def keep() -> None:
        try:
            keeper.keep()
        except Exception:  # the node goes on serving the DHT and assisting
            logger.exception("the keeper of run %r stopped", cfg.run.name)

    thread = threading.Thread(target=keep, name="keeper", daemon=True)
    thread.start()
    return thread


def _pick_device(name: str):
    """The torch device for the inner loop; a device this machine does not have is a one-line error."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a torch device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {name}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    try:
        torch.empty(1, device=device)
    except Exception as e:  # mps, xpu, ... that this build or machine lacks
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--device {name}: cannot use it on this machine ({reason}); use --device cpu") from None
    return device


def _prepare_compute(model, cfg, device, shards: int = 1) -> int:
    """Gradient checkpointing and compile as ``[compute]`` asks, the micro-batch that fits this peer's
    memory (p2p_diloco.train.memory), and on CUDA the allocator capped at ``--max-memory``, said in one log
    line; returns that micro-batch size."""
    from p2p_diloco.train.inner import autocast_dtype, describe_compute, prepare_for_compute
    from p2p_diloco.train.memory import cap_allocator, choose_micro_batch, format_bytes

    prepare_for_compute(model, cfg.compute)
    bf16 = autocast_dtype(cfg.compute.precision, device) is not None
    fit = choose_micro_batch(model, cfg, device, bf16, shards)
    cap = cap_allocator(device, cfg.compute.max_memory_gib)
    logger.info("%s, %s; %s%s", fit.describe_split(), describe_compute(cfg.inner, cfg.compute, device),
                fit.describe_memory(), f"; allocator capped at {format_bytes(cap)}" if cap else "")
    return fit.micro_batch_size


def _prepare_training(cfg, peer_id: str, device, shards: int = 1):
    """The model, the run settings every peer must share, this peer's data (opened when it joins), the
    micro-batch size it computes with (on one rank of `shards` that share the model's state, in an island)
    and the run's held-out sequences.

    Raises DataError or ConfigError (one line for the user) before the peer joins the swarm.
    """
    from p2p_diloco.train.data import TextData, order_seed
    from p2p_diloco.train.fragments import model_fragments
    from p2p_diloco.train.model import build_run_model, run_settings

    data = TextData(cfg.data, cfg.model.revision)
    model = build_run_model(cfg, data.tokenizer)
    settings = run_settings(cfg, data.tokenizer, model)  # of the weights as built: θ_global at step 0
    model = model.to(device)
    model_fragments(model, cfg.outer)  # a hub model with fewer blocks than outer.fragments stops here
    micro_batch_size = _prepare_compute(model, cfg, device, shards)
    peer_data = data.for_peer(cfg.inner.batch_size, order_seed(cfg.run.seed, peer_id))
    if data.train is not None:  # in memory: a corpus too small for one batch is found now, before joining
        peer_data.open(0, None)
    return model, settings, peer_data, micro_batch_size, data.heldout


def _save_export_assets(cfg, model_config, tokenizer, fingerprint: str) -> None:
    """Beside the checkpoint, what `p2p-diloco export` needs to make a model of it; a peer that cannot
    write them trains on (export then needs --config)."""
    from p2p_diloco.train.checkpoint import save_export_assets

    try:
        save_export_assets(cfg.swarm.checkpoint_dir, model_config, tokenizer, cfg.run.name, fingerprint)
    except OSError as e:
        logger.warning("could not save the model config and tokenizer in %s: %s", cfg.swarm.checkpoint_dir, e)


@dataclass
class PeerOptions:
    """What the `peer` and `join` commands take beyond the run config (see their --help)."""

    host: str = "0.0.0.0"
    port: int = 0
    announce_ip: Optional[str] = None
    identity_path: Optional[str] = None
    initial_peers: Sequence[str] = ()  # replace the config's swarm.initial_peers when given
    verbose: bool = False
    metrics_file: Optional[str] = None
    checkpoint_dir: Optional[str] = None  # overrides swarm.checkpoint_dir
    max_outer_steps: Optional[int] = None
    device: str = "auto"
    wait_for_peers: int = 1
    ignore_other_settings: bool = False  # train even if the run's live peers publish other settings
    tensorboard: Optional[str] = None
    wandb: Optional[str] = None  # a Weights & Biases project
    # override the config's [compute] values of the same names when given
    precision: Optional[str] = None
    compile: Optional[bool] = None
    gradient_checkpointing: Optional[bool] = None
    micro_batch_size: Optional[int] = None
    max_memory_gib: Optional[float] = None
    shard: Optional[bool] = None


def with_compute_options(cfg, options: PeerOptions):
    """The config with the [compute] values that `options` gives (--precision, --compile, ...); validated."""
    from p2p_diloco.config import ComputeConfig

    given = {f.name: getattr(options, f.name) for f in dataclasses.fields(ComputeConfig)
             if getattr(options, f.name) is not None}
    return cfg.replace(compute=given) if given else cfg


def _initial_peers(cfg, options: PeerOptions, config_path) -> list[str]:
    """--initial-peers, else the config's (a manifest's) swarm.initial_peers; both checked."""
    from p2p_diloco.swarm.node import parse_initial_peers

    if options.initial_peers:
        return parse_initial_peers(options.initial_peers)
    return parse_initial_peers(cfg.swarm.initial_peers, where=f"swarm.initial_peers in {config_path}:")


def run_peer(config_path, options: PeerOptions) -> int:
    """The `peer` command; under torchrun, each rank of an island peer (p2p_diloco.train.island)."""
    from p2p_diloco.train.island import island_size

    if island_size() > 1:
        return _run_island_rank(config_path, options)
    setup_logging(options.verbose)
    try:
        cfg, initial_peers = _peer_config(config_path, options)
        device = _pick_device(options.device)
    except (ValueError, RuntimeError) as e:  # ConfigError and NodeAddressError are ValueErrors
        return fail(str(e), EXIT_USAGE)
    return _run_peer(cfg, initial_peers, device, options, None)


def _peer_config(config_path, options: PeerOptions):
    """The run config with the command's overrides, and the initial peers; ValueError (one line) if bad."""
    from p2p_diloco.config import load_config

    cfg = load_config(config_path)
    if options.checkpoint_dir:
        cfg = cfg.replace(swarm={"checkpoint_dir": str(options.checkpoint_dir)})
    cfg = with_compute_options(cfg, options)
    return cfg, _initial_peers(cfg, options, config_path)


def _run_island_rank(config_path, options: PeerOptions) -> int:
    """One rank of a peer under torchrun: rank 0 is the peer (:func:`_run_peer`), and always tells the others
    to stop when it does; the others follow it (:func:`_follow`)."""
    from p2p_diloco.train.island import Island

    rank = int(os.environ["RANK"])
    setup_logging(options.verbose, prefix=f"[rank {rank}] ")
    try:
        cfg, initial_peers = _peer_config(config_path, options)
        island = Island(options.device, cfg.compute.shard)
    except ValueError as e:  # every rank finds the same error
        return fail(str(e), EXIT_USAGE)
    logger.info("island peer: %s", island.describe())
    try:
        if not island.is_lead:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 leaves the swarm, then tells this rank to stop
            return _follow(cfg, island)
        return _run_peer(cfg, initial_peers, island.device, options, island)
    finally:
        island.close()


def _follow(cfg, island) -> int:
    """A rank other than 0: build what rank 0 builds, with rank 0's peer ID, then do as it says."""
    from p2p_diloco.train.inner import InnerTrainer
    from p2p_diloco.train.island import follow

    command = island.receive()
    if command[0] == "stop":  # rank 0 stopped before it had an identity
        return EXIT_OK
    _, peer_id = command
    model, _, peer_data, micro_batch_size, _ = _prepare_training(cfg, peer_id, island.device, _shards(island))
    forward_model = island.prepare_model(model)
    trainer = InnerTrainer(model, cfg.inner, iter(()), cfg.compute, micro_batch_size, island, forward_model)
    reason = follow(island, model, trainer, peer_data)
    logger.info("stopping: %s", reason)
    skip_final_garbage_collection()
    return EXIT_OK


def _shards(island) -> int:
    """How many ranks share the model's state (the memory fit counts per rank): all when sharded."""
    return island.world_size if island is not None and island.shard else 1


def _run_peer(cfg, initial_peers, device, options: PeerOptions, island) -> int:
    """A peer, alone or as rank 0 of `island`, from its config to its exit status: it builds the model, its data
    and its inner trainer, then trains through :class:`p2p_diloco.DiLoCo`, as a library user's loop does."""
    from p2p_diloco.api import DiLoCo, DiLoCoError
    from p2p_diloco.config import ConfigError, check_member, settings_fingerprint
    from p2p_diloco.metrics import MetricsWriter
    from p2p_diloco.process_tree import children_exit_with_this_process
    from p2p_diloco.swarm.identity import Identity, IdentityError
    from p2p_diloco.swarm.node import check_listen_address
    from p2p_diloco.train.data import DataError
    from p2p_diloco.train.checkpoint import check_checkpoint_settings
    from p2p_diloco.train.catch_up import NoStateSource
    from p2p_diloco.train.diloco import RunSettingsMismatch
    from p2p_diloco.train.display import InnerProgress
    from p2p_diloco.train.island import IslandBroken, IslandLead
    from p2p_diloco.train.memory import MemoryFitError

    metrics, lead = None, None  # metrics: closed on every path from here on (TensorBoard: a thread; wandb: a process)
    try:
        identity = Identity.load_or_create(options.identity_path)
        check_member(cfg, identity.peer_id)  # a private run that does not list it would refuse all it does
        check_listen_address(options.host, options.port)  # now, not after minutes of building a large model
        metrics = MetricsWriter(options.metrics_file, identity.peer_id, tensorboard_dir=options.tensorboard,
                                wandb_project=options.wandb, wandb_group=cfg.run.name)
        if island is not None:
            island.send("hello", identity.peer_id)  # the other ranks read the data in this peer's order
        model, settings, peer_data, micro_batch_size, heldout = _prepare_training(cfg, identity.peer_id, device,
                                                                               _shards(island))
        if island is not None:
            lead = IslandLead(island, model, island.prepare_model(model))
        if cfg.swarm.checkpoint_dir:  # before its export assets are rewritten for this config
            check_checkpoint_settings(cfg.swarm.checkpoint_dir, settings_fingerprint(settings))
    except (IdentityError, DataError, ConfigError, ValueError) as e:
        if metrics is not None:
            metrics.close()
        _stop_island(island, str(e))
        return fail(str(e), EXIT_USAGE)
    if cfg.swarm.checkpoint_dir:
        _save_export_assets(cfg, model.config, peer_data.data.tokenizer, settings_fingerprint(settings))
    children_exit_with_this_process()
    why = " (under torchrun: one of this island's ranks stopped, or torchrun was stopped)" if island else ""
    # the model, data and inner trainer built here; the run's bootstrap nodes are its keepers (DiLoCo trusts them)
    diloco = DiLoCo(model, None, config=cfg, initial_peers=initial_peers, host=options.host, port=options.port,
                    announce_ip=options.announce_ip, identity=identity, wait_for_peers=options.wait_for_peers,
                    ignore_other_settings=options.ignore_other_settings, data=peer_data, settings=settings,
                    metrics=metrics, display=InnerProgress(), island=lead, heldout=heldout[:cfg.eval.sequences],
                    micro_batch_size=micro_batch_size, stop_event=install_stop_handlers(why))
    error: Optional[tuple[str, int]] = None
    try:
        try:
            diloco.start()
        except DiLoCoError as e:  # port or identity in use, a store fsspec cannot open: EXIT_USAGE
            unreachable = isinstance(e.__cause__, ConnectionError)
            error = (str(e), EXIT_UNREACHABLE if unreachable else EXIT_USAGE)
        if error is None:
            _say_reachability(diloco, options, metrics)
            diloco.run(options.max_outer_steps)
    except RunSettingsMismatch as e:
        error = (str(e), EXIT_OTHER_SETTINGS)
    except NoStateSource as e:
        error = (str(e), EXIT_NO_STATE)
    except (DataError, MemoryFitError) as e:  # out of memory at one sequence per pass; any other OOM: a traceback
        error = (str(e), EXIT_USAGE)
    except IslandBroken as e:
        error = (str(e), EXIT_ISLAND_BROKEN)
    finally:
        _stop_island(island, error[0] if error else "the peer stopped")
        metrics.close()  # before the DHT stops this process's children: wandb's service is one
        diloco.close()
    logger.info("peer stopped")
    skip_final_garbage_collection()
    return fail(*error) if error else EXIT_OK  # the error is the last line the user sees


def _say_reachability(diloco, options: PeerOptions, metrics) -> None:
    """Where others reach this peer, and whether they can (its first lines on stdout), and the same in its metrics;
    then the run's settings (their fingerprint, and :func:`~p2p_diloco.config.advice` on them) in its log."""
    from p2p_diloco.config import advice

    print_maddrs(diloco.node.dht, prefix="peer reachable at ")
    reachability = diloco.node.reachability
    summary = reachability.summary(options.port)
    print(summary, flush=True)
    logger.info("run %r, settings fingerprint %s", diloco.config.run.name, diloco.fingerprint[:16])
    for note in advice(diloco.config):
        logger.warning(note)
    metrics.write("reachability", reachability=reachability.mode, detail=reachability.detail,
                  reduces=reachability.can_reduce, summary=summary)


def _stop_island(island, reason: str) -> None:
    """Rank 0 tells its island's other ranks to stop (they wait for its next command)."""
    if island is not None:
        island.stop_others(reason)


def run_join(manifest: str, state_dir: Optional[str], options: PeerOptions) -> int:
    """`peer` on a run manifest, with this peer's identity, checkpoint and metrics in its state directory."""
    from p2p_diloco.config import ConfigError, load_config
    from p2p_diloco.manifest import ManifestError, StateDir, default_state_dir, find_manifest, lock_state_dir
    from p2p_diloco.train.island import island_rank

    try:
        path = find_manifest(manifest)
        cfg = load_config(path)
        if not cfg.swarm.initial_peers and not options.initial_peers:
            raise ManifestError(f"{path} names no bootstrap node (swarm.initial_peers): pass --initial-peers")
        state_path = state_dir or default_state_dir(cfg.run.name)
        # the peer of an island is its rank 0 (p2p_diloco.train.island): the other ranks use none of its state
        state = lock_state_dir(state_path) if island_rank() == 0 else StateDir(Path(state_path), None)
    except (ConfigError, ManifestError) as e:
        setup_logging(options.verbose)
        return fail(str(e), EXIT_USAGE)
    if island_rank() == 0:
        print(f"joining run {cfg.run.name!r} from {path}; this peer's state is in {state.path}", flush=True)
    options = dataclasses.replace(
        options,
        identity_path=options.identity_path or str(state.identity_path),
        checkpoint_dir=options.checkpoint_dir or str(state.checkpoint_dir),
        metrics_file=options.metrics_file or str(state.metrics_file),
    )
    return run_peer(path, options)
