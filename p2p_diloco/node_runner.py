"""What the `bootstrap` and `peer` commands do: set up logging and signals, start, run, stop cleanly."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

logger = logging.getLogger("p2p_diloco")

EXIT_OK, EXIT_USAGE, EXIT_UNREACHABLE = 0, 2, 3


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not verbose:  # hivemind's own INFO lines are noise for a user; its warnings still show
        logging.getLogger("hivemind").setLevel(logging.WARNING)


def install_stop_handlers() -> threading.Event:
    """SIGINT and SIGTERM set the returned event; a second signal exits at once."""
    stop = threading.Event()

    def handle(signum, _frame):
        if stop.is_set():
            os._exit(128 + signum)
        logger.info("received %s: leaving the swarm", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGTERM, handle)
    return stop


def shutdown_dht(dht) -> None:
    """Stop the DHT (and with it p2pd), then make sure no process this node started is left running."""
    from p2p_diloco.process_tree import descendant_pids, stop_processes, without_torch_shm_manager

    children = without_torch_shm_manager(descendant_pids(os.getpid()))  # the manager exits with us
    dht.shutdown()
    stop_processes(children)


def skip_final_garbage_collection() -> None:
    """Let the interpreter exit without its final garbage collections over every object that torch,
    transformers and hivemind have made: they took 2-3 s after a peer had already stopped (more on a
    loaded machine), while a leaving peer must be gone within seconds. Files and sockets are closed by
    then; the operating system frees the memory."""
    import gc

    gc.freeze()


def _fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def print_maddrs(dht, prefix: str = "") -> None:
    from p2p_diloco.swarm.node import visible_maddrs

    for maddr in visible_maddrs(dht):
        print(f"{prefix}{maddr}", flush=True)


def run_bootstrap(host, port, announce_ip, identity_path, initial_peers, verbose, assist: bool,
                  assist_max_params: int) -> int:
    setup_logging(verbose)
    from p2p_diloco.process_tree import children_exit_with_this_process
    from p2p_diloco.swarm.identity import Identity, IdentityError
    from p2p_diloco.swarm.node import NodeAddressError, start_dht
    from p2p_diloco.swarm.records import node_validators
    from p2p_diloco.sync.assistant import AssistantPool

    stop = install_stop_handlers()
    children_exit_with_this_process()
    try:
        identity = Identity.load_or_create(identity_path)
        dht = start_dht(host, port, identity, node_validators(identity), announce_ip, initial_peers)
    except (NodeAddressError, IdentityError) as e:
        return _fail(str(e), EXIT_USAGE)
    except ConnectionError as e:
        return _fail(str(e), EXIT_UNREACHABLE)
    try:
        print_maddrs(dht)
        logger.info("bootstrap node is up; give peers one of the addresses above as --initial-peers")
        pool = AssistantPool(dht, assist_max_params) if assist else None
        logger.info("reducing for runs whose peers nobody can dial: %s",
                    f"yes, up to {assist_max_params:,} parameters" if assist else "no (--no-assist)")
        stop.wait()
        if pool is not None:
            pool.close()
    finally:
        shutdown_dht(dht)
        logger.info("bootstrap node stopped")
    return EXIT_OK


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


def _prepare_training(cfg, peer_id: str, device):
    """The model, the fingerprint of the run's settings, and this peer's data stream from a batch position.

    Raises DataError or ConfigError (one line for the user) before the peer joins the swarm: the data
    stream from batch 0 is created here, so a corpus too small for one batch is found at once.
    """
    from p2p_diloco.config import run_fingerprint
    from p2p_diloco.train.data import TextData, order_seed, tokenizer_sha256
    from p2p_diloco.train.fragments import model_fragments
    from p2p_diloco.train.model import build_model

    data = TextData(cfg.data)
    seed = order_seed(cfg.run.seed, peer_id)
    first_stream = {0: data.peer_batches(cfg.inner.batch_size, seed)}

    def batches_from(position: int):
        return first_stream.pop(position, None) or data.peer_batches(cfg.inner.batch_size, seed, position)

    model = build_model(cfg.model, data.vocab_size, cfg.run.seed, cfg.data.seq_len).to(device)
    model_fragments(model, cfg.outer)  # a hub model with fewer blocks than outer.fragments stops here
    return model, run_fingerprint(cfg, tokenizer_sha256(data.tokenizer)), batches_from


def run_peer(config_path, host, port, announce_ip, identity_path, initial_peers, verbose,
             metrics_file, checkpoint_dir, max_outer_steps, device_name, wait_for_peers: int = 1) -> int:
    setup_logging(verbose)
    from p2p_diloco.config import ConfigError, load_config
    from p2p_diloco.process_tree import children_exit_with_this_process
    from p2p_diloco.swarm.node import NodeAddressError, parse_initial_peers

    try:
        cfg = load_config(config_path)
        if checkpoint_dir:
            cfg = cfg.replace(swarm={"checkpoint_dir": checkpoint_dir})
        parse_initial_peers(initial_peers)
        device = _pick_device(device_name)
    except (ConfigError, NodeAddressError, ValueError, RuntimeError) as e:
        return _fail(str(e), EXIT_USAGE)

    from p2p_diloco.metrics import MetricsWriter
    from p2p_diloco.swarm.identity import Identity, IdentityError
    from p2p_diloco.swarm.node import start_run_node
    from p2p_diloco.train.data import DataError
    from p2p_diloco.train.diloco import DiLoCoPeer

    try:
        identity = Identity.load_or_create(identity_path)
        model, fingerprint, batches_from = _prepare_training(cfg, identity.peer_id, device)
    except (IdentityError, DataError, ConfigError) as e:
        return _fail(str(e), EXIT_USAGE)
    children_exit_with_this_process()
    try:
        node = start_run_node(cfg.run.name, host, port, identity, announce_ip, initial_peers)
    except NodeAddressError as e:
        return _fail(str(e), EXIT_USAGE)
    except ConnectionError as e:
        return _fail(str(e), EXIT_UNREACHABLE)
    dht = node.dht
    try:
        print_maddrs(dht, prefix="peer reachable at ")
        summary = node.reachability.summary(port)
        print(summary, flush=True)
        logger.info("run %r, settings fingerprint %s", cfg.run.name, fingerprint[:16])
        metrics = MetricsWriter(metrics_file, identity.peer_id)
        metrics.write("reachability", reachability=node.reachability.mode, detail=node.reachability.detail,
                      reduces=node.reachability.can_reduce, summary=summary)
        trainer = DiLoCoPeer(cfg, model, batches_from, node, fingerprint, metrics, stop_event=install_stop_handlers())
        trainer.run(max_outer_steps, wait_for_peers)
        metrics.close()
    finally:
        shutdown_dht(dht)
    logger.info("peer stopped")
    skip_final_garbage_collection()
    return EXIT_OK
