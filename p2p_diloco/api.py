"""DiLoCo in any PyTorch training loop: :class:`DiLoCo`, the object the CLI's peers train through too.

::

    import p2p_diloco

    with p2p_diloco.DiLoCo(model, inner_optimizer, run="my-run", initial_peers=[...], sync_every=500,
                           host="0.0.0.0") as diloco:
        for batch in loader:
            loss = compute_loss(model, batch)
            loss.backward()
            inner_optimizer.step()
            inner_optimizer.zero_grad()
            diloco.step(samples=len(batch))  # syncs at outer-step boundaries, in the background

The loop is DiLoCo's inner loop (arXiv 2311.08105, Algorithm 1, lines 4-8); every ``sync_every`` inner steps
the peer averages its pseudo-gradient θ_global − θ_local with the run's other peers and applies the outer
Nesterov step (lines 9-12), as a CLI peer does: the same driver (:class:`~p2p_diloco.train.diloco.DiLoCoPeer`),
the same records, codecs, defence and state transfer. Only where the inner steps come from differs: the CLI's
:class:`~p2p_diloco.train.inner.InnerTrainer` computes them, a library peer's loop takes them and says so with
:meth:`DiLoCo.step` (:mod:`p2p_diloco.train.user_loop`: the two threads take turns, so the driver changes the
model's parameters only inside ``step()``).

Peers average only with peers of the same settings fingerprint: for a library peer, its parameters' names,
shapes and dtypes, the sha256 of the model's weights when the DiLoCo object is made (build the model the same
way, with the same seed, on every peer, and restore a checkpoint with :meth:`DiLoCo.load_state_dict`, not into
the model first), ``sync_every`` and the outer settings (:func:`model_settings`).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from p2p_diloco.config import Config, ConfigError, config_from_dict, settings_fingerprint
from p2p_diloco.train.user_loop import DriverStopped, LoopEnded, UserLoop

logger = logging.getLogger(__name__)

LEAVE_TIMEOUT_S = 300.0  # the most a leave waits for the driver: a round's own waits end well before


class DiLoCoError(RuntimeError):
    """Something the DiLoCo peer cannot do, in one line for the user (the cause, if any, is ``__cause__``)."""


def model_settings(model: torch.nn.Module, cfg: Config) -> dict[str, Any]:
    """The settings every peer of a library run must share, flat as :func:`p2p_diloco.config.shared_settings`
    gives a CLI run's: the run's name (and allow-list), the parameters' names, shapes and dtypes (as one sha256,
    and their count), the sha256 of the weights as they are now (θ_global at outer step 0), ``sync_every``
    and every ``[outer]`` setting. Peers whose settings differ never average (their fingerprints differ)."""
    from dataclasses import asdict

    from p2p_diloco.config import allowed_peers_sha256
    from p2p_diloco.train.pretrained import weights_sha256

    layout = [[name, list(p.shape), str(p.dtype).removeprefix("torch."), p.requires_grad]
              for name, p in model.named_parameters()]
    settings: dict[str, Any] = {"run.name": cfg.run.name}
    if cfg.run.allowed_peers:
        settings["run.allowed_peers"] = allowed_peers_sha256(cfg.run.allowed_peers)
    settings.update({
        "model.parameters_sha256": hashlib.sha256(json.dumps(layout).encode()).hexdigest(),
        "model.parameter_count": sum(p.numel() for p in model.parameters()),
        "model.initial_sha256": weights_sha256(model),
        "inner.steps_per_outer": cfg.inner.steps_per_outer,
    })
    settings.update({f"outer.{key}": value for key, value in asdict(cfg.outer).items()})
    return settings


def library_config(run_name: str, sync_every: Optional[int], fragments: int, base: Optional[Config] = None,
                   **sections: Optional[Mapping[str, Any]]) -> Config:
    """The run config of a library peer: `base` (a manifest's) or the CLI's defaults, with the run's name,
    ``sync_every`` (``inner.steps_per_outer``), the number of fragments and the given sections' values
    (``outer={...}``, ``swarm={...}``, ``run={...}``) over it; validated (ConfigError, one line). The
    ``[model]`` and ``[data]`` sections are the CLI's and play no part (the model and data are the user's)."""
    raw: dict[str, dict] = {}
    if base is not None:
        from dataclasses import asdict

        raw = {name: asdict(getattr(base, name)) for name in ("run", "outer", "swarm", "eval")}
        raw["inner"] = {"steps_per_outer": base.inner.steps_per_outer}
    for name, values in sections.items():
        if values:
            if not isinstance(values, Mapping):
                raise ConfigError(f"DiLoCo({name}=...) takes a dict of [{name}] settings, not {type(values).__name__}")
            raw.setdefault(name, {}).update(values)
    raw.setdefault("run", {})["name"] = run_name
    inner = raw.setdefault("inner", {})
    if sync_every is not None:
        inner["steps_per_outer"] = sync_every
    steps = inner.get("steps_per_outer", 50)
    # the CLI's lr schedule is not the library's (the user's loop has its own): only its bounds are checked
    inner.update(warmup_steps=0, total_steps=max(steps, 1) if isinstance(steps, int) else 1)
    raw.setdefault("outer", {})["fragments"] = fragments
    raw["model"] = {"name": "custom"}
    try:
        return config_from_dict(raw)
    except ConfigError as e:
        raise ConfigError(str(e).replace("inner.steps_per_outer", "sync_every")) from None


class DiLoCo:
    """One peer of a DiLoCo run over a hivemind swarm, around a model and its inner optimizer (see the module).

    `model` trains in the caller's loop with `inner_optimizer`; `run` names the run (its peers' DHT keys),
    `initial_peers` are multiaddrs of running nodes (a bootstrap node's); `sync_every` is H, the inner steps
    between two outer steps. `host`/`port`/`announce_ip` are where this peer listens and what it tells the
    swarm (as the CLI's ``--host`` etc.), `identity` a key file that keeps its peer ID across restarts.
    `fragments`: Streaming DiLoCo's fragments (arXiv 2501.18512), a number (the model's numbered transformer
    blocks are split, as the CLI does) or lists of parameter names (a name also stands for every parameter
    under it). `outer`, `swarm` and `run_settings` take any ``[outer]``, ``[swarm]`` and ``[run]`` value of a
    run config (the defaults are the CLI's: outer Nesterov, codec, robust aggregation, timeouts; see
    docs/api.md). `checkpoint_dir`: the peer's whole state is saved there after every outer step and
    restored at the start (the user's optimizer included); `metrics_file`: its JSON-lines metrics.
    `wait_for_peers`: the first round waits for that many peers (this one included); with
    `ignore_other_settings` the peer trains even where every live peer of the run has other settings.

    The CLI passes what it builds itself: `config` (a run config, whose values the keywords above
    override), `inner_steps` (a step source that computes them: :meth:`run` then trains, not :meth:`step`),
    `data`, `settings`, `metrics`, `display`, `island`, `heldout`, `micro_batch_size`, `stop_event`.
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: Optional[torch.optim.Optimizer], *,
                 run: Optional[str] = None, initial_peers: Sequence[str] = (), sync_every: Optional[int] = None,
                 host: str = "0.0.0.0", port: int = 0, announce_ip: Optional[str] = None, identity: Any = None,
                 fragments: Union[int, Sequence[Sequence[str]], None] = None,
                 outer: Optional[Mapping[str, Any]] = None, swarm: Optional[Mapping[str, Any]] = None,
                 run_settings: Optional[Mapping[str, Any]] = None, checkpoint_dir: Optional[str] = None,
                 metrics_file: Optional[str] = None, wait_for_peers: int = 1, ignore_other_settings: bool = False,
                 config: Optional[Config] = None, inner_steps: Any = None, data: Any = None,
                 settings: Optional[dict] = None, metrics: Any = None, display: Any = None, island: Any = None,
                 heldout: Optional[torch.Tensor] = None, micro_batch_size: Optional[int] = None,
                 stop_event: Optional[threading.Event] = None):
        from p2p_diloco.swarm.node import parse_initial_peers
        from p2p_diloco.train.fragments import FragmentError, model_fragments, named_fragments

        if not isinstance(model, torch.nn.Module):
            raise DiLoCoError(f"DiLoCo: model must be a torch.nn.Module, not {type(model).__name__}")
        if not any(p.requires_grad for p in model.parameters()):
            raise DiLoCoError("DiLoCo: the model has no trainable parameters")
        self.model = model
        self._cli = inner_steps is not None or inner_optimizer is None
        if not self._cli and not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise DiLoCoError(f"DiLoCo: inner_optimizer must be a torch.optim.Optimizer, not "
                              f"{type(inner_optimizer).__name__}")
        self.stop_event = stop_event or threading.Event()
        try:
            if config is not None and run is None and sync_every is None and not (outer or swarm or run_settings) \
                    and fragments is None and self._cli:
                self.config = config  # the CLI's own run config, as it is
            else:
                count = fragments if isinstance(fragments, int) else len(fragments) if fragments else \
                    (config.outer.fragments if config is not None else 1)
                name = run or (config.run.name if config is not None else None)
                if not name:
                    raise ConfigError("DiLoCo: name the run (run='my-run'): its peers find each other by it")
                self.config = library_config(name, sync_every, count, config, outer=outer, swarm=swarm,
                                             run=run_settings)
            if checkpoint_dir is not None:
                self.config = self.config.replace(swarm={"checkpoint_dir": str(checkpoint_dir)})
            self.initial_peers = parse_initial_peers(list(initial_peers or self.config.swarm.initial_peers))
            if fragments is None or isinstance(fragments, int):
                self.fragments = model_fragments(model, self.config.outer) if self.config.outer.fragments > 1 \
                    else [list(range(sum(p.requires_grad for p in model.parameters())))]
            else:
                self.fragments = named_fragments(model, fragments)
        except (ConfigError, FragmentError, ValueError) as e:
            raise DiLoCoError(str(e)) from None
        self.settings = settings if settings is not None else model_settings(model, self.config)
        self.fingerprint = settings_fingerprint(self.settings)
        self.host, self.port, self.announce_ip, self.identity = host, port, announce_ip, identity
        self.wait_for_peers, self.ignore_other_settings = wait_for_peers, ignore_other_settings
        self.metrics_file = metrics_file
        self._parts = dict(data=data, display=display, island=island, heldout=heldout,
                           micro_batch_size=micro_batch_size)
        self._metrics = metrics
        self._owns_metrics = metrics is None
        self._loop = None if self._cli else UserLoop(model, inner_optimizer, self.stop_event)
        self._inner_steps = inner_steps if inner_steps is not None else self._loop
        self._pending_state: Optional[dict] = None
        self.node = None
        self.peer = None
        self._driver: Optional[threading.Thread] = None
        self._driver_error: Optional[BaseException] = None
        self._children_before: set[int] = set()

    @classmethod
    def from_manifest(cls, path: str, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                      **kwargs: Any) -> "DiLoCo":
        """A peer of the run that the manifest at `path` (or a manifest this project ships, by name) describes:
        its name, bootstrap nodes, ``inner.steps_per_outer`` and its ``[outer]`` and ``[swarm]`` settings;
        `kwargs` as for :class:`DiLoCo` override them."""
        from p2p_diloco.config import load_config
        from p2p_diloco.manifest import ManifestError, find_manifest

        try:
            config = load_config(find_manifest(str(path)))
        except (ConfigError, ManifestError) as e:
            raise DiLoCoError(str(e)) from None
        kwargs.setdefault("run", config.run.name)
        return cls(model, inner_optimizer, config=config, **kwargs)

    # ----- where θ_global is ----------------------------------------------------------------------
    @property
    def outer_step(self) -> int:
        """The outer step θ_global is at (0 before the first)."""
        return self.peer.global_model.outer_step if self.peer is not None else \
            int(self._pending_state["outer_step"]) if self._pending_state else 0

    @property
    def global_sha256(self) -> Optional[str]:
        """The sha256 of θ_global and the outer momentum: equal on every peer at the same outer step."""
        return self.peer.sha256 if self.peer is not None else None

    @property
    def inner_steps(self) -> int:
        """Inner steps counted so far (a joiner takes the run's count from the state it loads)."""
        return self._inner_steps.steps_done

    @property
    def peer_id(self) -> Optional[str]:
        """This peer's ID in the swarm (once started)."""
        return self.peer.peer_id if self.peer is not None else None

    @property
    def maddrs(self) -> list[str]:
        """The multiaddrs other peers can dial to reach this one (give one as their `initial_peers`)."""
        from p2p_diloco.swarm.node import visible_maddrs

        return visible_maddrs(self.node.dht) if self.node is not None else []

    # ----- the swarm ------------------------------------------------------------------------------
    def __enter__(self) -> "DiLoCo":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def start(self) -> None:
        """Join the swarm: start the DHT node and the peer; for a library peer, the driver too, returning when
        it is ready for the first inner step (after loading the run's state, if the run is ahead)."""
        if self.node is not None:
            raise DiLoCoError("DiLoCo: this peer has already started")
        from p2p_diloco.metrics import MetricsWriter
        from p2p_diloco.process_tree import children_exit_with_this_process, descendant_pids
        from p2p_diloco.swarm.identity import Identity, IdentityError
        from p2p_diloco.swarm.node import NodeAddressError, check_listen_address, peer_ids_of, start_run_node
        from p2p_diloco.sync.state_store import StoreError
        from p2p_diloco.train.diloco import DiLoCoPeer

        try:
            identity = self.identity if isinstance(self.identity, Identity) else Identity.load_or_create(
                None if self.identity is None else str(self.identity))
            check_listen_address(self.host, self.port)
            # hivemind's processes (the DHT, p2pd, the averager) exit with this one however it dies: a loop killed
            # by SIGTERM before it left the `with` block left them running (tests/test_library.py, once)
            children_exit_with_this_process()
            self._children_before = set(descendant_pids(os.getpid()))
            self.node = start_run_node(self.config.run.name, self.host, self.port, identity, self.announce_ip,
                                       self.initial_peers, self.config.run.allowed_peers)
        except (IdentityError, NodeAddressError, ConnectionError) as e:  # a key, a port, a bootstrap node
            raise DiLoCoError(str(e)) from e
        try:
            if self._metrics is None:
                self._metrics = MetricsWriter(self.metrics_file, identity.peer_id)
            self.peer = DiLoCoPeer(self.config, self.model, self._parts["data"], self.node, self.settings,
                                   self._metrics, stop_event=self.stop_event, display=self._parts["display"],
                                   micro_batch_size=self._parts["micro_batch_size"],
                                   trusted_peers=peer_ids_of(self.initial_peers), island=self._parts["island"],
                                   heldout=self._parts["heldout"], inner=self._inner_steps, fragments=self.fragments)
            if self._loop is not None:
                self.peer.override_hint = "ignore_other_settings=True"  # a keyword here, not the CLI's flag
            if self._pending_state is not None:
                self._restore(self._pending_state)
        except StoreError as e:  # a checkpoint store that fsspec cannot open
            self._shut_down()
            raise DiLoCoError(str(e)) from e
        except BaseException:
            self._shut_down()
            raise
        atexit.register(self.close)  # a loop that dies without leaving the `with` block (a Trainer's crash) leaves too
        if self._loop is not None:
            self._driver = threading.Thread(target=self._drive, name="diloco-driver", daemon=True)
            self._driver.start()
            try:
                self._loop.wait_for_turn()
            except DriverStopped:
                error = self._driver_error
                self.close()
                raise DiLoCoError(one_line(error)) from error

    def run(self, max_outer_steps: Optional[int] = None) -> None:
        """Train in this thread with a step source that computes its own inner steps (the CLI's), until stopped
        or at outer step `max_outer_steps`; the errors are the driver's own."""
        if self._loop is not None:
            raise DiLoCoError("DiLoCo.run() trains with a step source of its own (the CLI's); a training loop "
                              "calls step() after each inner step")
        if self.peer is None:
            self.start()
        self.peer.run(max_outer_steps, self.wait_for_peers, self.ignore_other_settings)

    def _drive(self) -> None:
        """The driver's thread: the peer's outer steps, until the user's loop ends or an error stops it."""
        reason = "the peer has left the swarm"
        try:
            self.peer.run(None, self.wait_for_peers, self.ignore_other_settings)
        except LoopEnded:
            pass
        except BaseException as e:  # handed to the user's thread: step() raises it in one line
            self._driver_error = e
            reason = one_line(e)
            logger.error("the DiLoCo peer stopped: %s", reason, exc_info=not isinstance(e, (ValueError, RuntimeError)))
        finally:
            self._loop.ended(reason)

    def step(self, samples: int, loss: Optional[float] = None) -> None:
        """One inner step of the user's loop ended, over `samples` samples (its weight in the group's mean;
        `loss`, a float, shows in the status and metrics). At an outer-step boundary the round's sync starts
        here (and runs beside the next inner steps with ``outer={"sync_delay": τ}``), and the outer step is
        applied here, to the model's parameters: call it after ``optimizer.step()``, before the next forward."""
        if self._loop is None:
            raise DiLoCoError("DiLoCo.step() is for a training loop; a peer with its own step source trains with run()")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise DiLoCoError(f"DiLoCo.step(samples={samples!r}): samples is the number of samples of this inner "
                              f"step, an integer >= 1")
        if isinstance(loss, torch.Tensor):
            loss = loss.item()
        try:
            self._loop.took_step(samples, loss)
        except DriverStopped as e:
            raise DiLoCoError(one_line(self._driver_error) if self._driver_error else str(e)) \
                from self._driver_error
        except RuntimeError as e:
            raise DiLoCoError(str(e)) from None

    def close(self) -> None:
        """Leave the swarm: a sync in flight ends, the run's records say this peer left, its processes stop
        (bounded). Called when the ``with`` block exits, on Ctrl+C too."""
        atexit.unregister(self.close)
        self.stop_event.set()
        if self._driver is not None:
            self._driver.join(LEAVE_TIMEOUT_S)
            if self._driver.is_alive():
                logger.warning("the DiLoCo driver did not stop within %.0f s", LEAVE_TIMEOUT_S)
            self._driver = None
        self._shut_down()

    def _shut_down(self) -> None:
        from p2p_diloco.stopping import shutdown_dht

        if self._owns_metrics and self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self.node is not None:  # the peer's leave stopped its averager; the DHT, and whatever is left, now
            # a library peer's caller may have processes of its own; the CLI's process stops every child it has
            shutdown_dht(self.node.dht, keep=self._children_before if self._loop is not None else ())
            self.node = None

    # ----- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What resumes this peer's place in the run: θ_global, the outer momentum, θ_local with its unsynced
        samples and error-feedback residual, the outer step and the settings fingerprint (the inner optimizer's
        state is the user's to save). Take it between inner steps (outside :meth:`step`)."""
        if self.peer is None:
            if self._pending_state is not None:
                return dict(self._pending_state)
            raise DiLoCoError("DiLoCo.state_dict(): the peer has not started; nothing to save yet")
        with self.peer._state_lock:
            return dict(outer_step=self.peer.global_model.outer_step, sha256=self.peer.sha256,
                        fingerprint=self.fingerprint, inner_steps=self._inner_steps.steps_done,
                        global_state=[t.detach().to("cpu", copy=True) for t in self.peer.global_model.state_tensors()],
                        local=self.peer.local.state_dict())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: before the peer starts (it then joins at that outer step, and
        loads the run's state only if the run is ahead). A state of other settings is refused in one line."""
        if self.peer is not None:
            raise DiLoCoError("DiLoCo.load_state_dict(): load the state before the peer starts (before `with`)")
        missing = {"outer_step", "fingerprint", "global_state", "local"} - set(state)
        if missing:
            raise DiLoCoError(f"DiLoCo.load_state_dict(): not a DiLoCo state (it lacks {', '.join(sorted(missing))})")
        if state["fingerprint"] != self.fingerprint:
            raise DiLoCoError(f"DiLoCo.load_state_dict(): the state was saved with other settings (fingerprint "
                              f"{str(state['fingerprint'])[:12]}, this peer's {self.fingerprint[:12]})")
        self._pending_state = dict(state)

    def _restore(self, state: Mapping[str, Any]) -> None:
        peer = self.peer
        try:
            peer._adopt_saved(state)
        except ValueError as e:
            raise DiLoCoError(f"DiLoCo.load_state_dict(): {e}") from None
        peer._after_state_change()
        logger.info("resumed at outer step %d from a saved DiLoCo state", peer.global_model.outer_step)


def one_line(error: Optional[BaseException]) -> str:
    """An error's message on one line (its type where it has none)."""
    if error is None:
        return "the peer stopped"
    text = " ".join(str(error).split())
    return text or type(error).__name__
