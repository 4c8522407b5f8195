"""A peer of several processes: the ranks that torchrun starts, behind one identity in the swarm.

DiLoCo is built for "islands of devices that are poorly connected" (Douillard et al., arXiv
2311.08105, §1): inside an island the devices are well connected and train data-parallel, or sharded;
only the outer step crosses the slow link. INTELLECT-1 (arXiv 2412.01152) ran 14 nodes of 8 H100 each
that way, FSDP inside a node and DiLoCo across.

Under ``torchrun --nproc-per-node N p2p-diloco peer …`` every rank builds the same model and reads
its own part of the peer's data stream (:class:`RankSlice`), and the inner steps are data-parallel:

* ``[compute] shard = false`` (default): each rank holds the whole model, wrapped in torch's
  DistributedDataParallel (NCCL on GPUs, gloo on CPUs), which averages the gradients of every
  inner step, so θ_local is the same on every rank;
* ``[compute] shard = true``: the ranks shard the model, its gradients and AdamW's state with FSDP2
  (``torch.distributed.fsdp.fully_shard``, one unit per transformer block), for a model larger than
  one device.

Only rank 0 is a peer of the swarm: it runs the DHT node, the averager, the state transfer, the outer
step and the checkpoint (:class:`~p2p_diloco.train.diloco.DiLoCoPeer`). The other ranks never open a
DHT node: they run :func:`follow`, which does what rank 0 tells them (:class:`IslandLead`), in
rank 0's order: an inner step (``step``), θ_local and the lr schedule from rank 0 after the outer step
or a loaded state changed them there (``push``: a broadcast; sharded, each rank keeps its shard),
θ_local to rank 0 before it computes Δ or saves a checkpoint (``gather``, sharded only: with DDP,
rank 0's θ_local is every rank's), the data stream to open, and ``stop``. So the swarm's θ_global is the
same bytes with any number of ranks: rank 0 computes Δ = θ_global − θ_local and the outer step on
whole tensors, as a single-process peer does, and the peer's sample count is the sum over its ranks.

A rank that fails stops the whole peer: torchrun stops the others, and a collective with a dead rank
raises :class:`IslandBroken` on the others. Rank 0 then leaves the swarm as any stopping peer does
(one peer leaves), and its checkpoint holds the whole peer's state, so a restarted island resumes from it.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from p2p_diloco.hashing import tensors_sha256
from p2p_diloco.train.model import trainable_parameters

logger = logging.getLogger(__name__)

# set to 1, every inner step ends with a check that θ_local is the same bytes on every rank (DDP only): a
# debugging aid that hashes the whole model each step, off by default
CHECK_REPLICAS = os.environ.get("P2P_DILOCO_CHECK_ISLAND") == "1"

# how long a rank waits in a collective: the followers wait for rank 0's next command while it is away in
# the swarm (a catch-up wait, a sync, a state download), each of which its own timeout bounds well below this
ISLAND_TIMEOUT_S = 3600.0


class IslandBroken(RuntimeError):
    """A collective with the island's other ranks failed: one of them died. The peer stops."""


def island_size() -> int:
    """How many ranks torchrun started for this peer (1 when it did not start this process)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def island_rank() -> int:
    """This process's rank in its island: 0 for a peer that torchrun did not start (rank 0 is the peer)."""
    return int(os.environ.get("RANK", "0")) if island_size() > 1 else 0


def island_device(name: str, local_rank: int) -> torch.device:
    """Each rank's device: ``auto`` and ``cuda`` mean this rank's GPU, cuda:LOCAL_RANK (the CPU on a machine
    without CUDA); a numbered GPU would put every rank on one device, so it is refused."""
    if name in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    if name == "cuda":
        raise ValueError("--device cuda: CUDA is not available on this machine; use --device cpu")
    if name in ("auto", "cpu"):
        return torch.device("cpu")
    raise ValueError(f"--device {name}: under torchrun each rank takes its own GPU (cuda:LOCAL_RANK); "
                     "use --device auto, cuda or cpu")


class RankSlice:
    """One rank's part of its peer's data stream: of every `world_size` consecutive batches, the `rank`-th.

    The ranks take their batches in lockstep, one per inner step, so the stream's position (in the peer's
    batches) is the same on every rank and the checkpoint's saved position resumes each of them.
    """

    def __init__(self, stream, rank: int, world_size: int):
        self.stream, self.rank, self.world_size = stream, rank, world_size

    @property
    def position(self) -> int:
        return self.stream.position

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        batches = [next(self.stream) for _ in range(self.world_size)]
        return batches[self.rank]

    def state_dict(self) -> dict:
        return self.stream.state_dict()


class Island:
    """This process's place in its island: its rank, the island's size, its device, and the process groups.

    The gradients travel on the default group (NCCL on GPUs, gloo on CPUs); rank 0's commands and the
    Python objects they carry on a gloo group, so that a follower waits for them on the CPU.
    """

    def __init__(self, device_name: str, shard: bool):
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = island_device(device_name, self.local_rank)
        self.shard = shard
        timeout = datetime.timedelta(seconds=ISLAND_TIMEOUT_S)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            dist.init_process_group("nccl", timeout=timeout, device_id=self.device)
            self.control = dist.new_group(backend="gloo", timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)
            self.control = dist.group.WORLD

    @property
    def is_lead(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size} on {self.device}, " + \
            ("model sharded (FSDP2)" if self.shard else "model replicated (DDP)")

    # ----- the model on every rank ---------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module the inner steps call: the model sharded in place by FSDP2 (one unit per transformer
        block, named by transformers' ``_no_split_modules``, then the root), or wrapped in DDP. A collective:
        every rank calls it at the same point."""
        if self.shard:
            from torch.distributed.fsdp import fully_shard

            blocks = set(getattr(model, "_no_split_modules", None) or ())
            for module in model.modules():
                if type(module).__name__ in blocks:
                    fully_shard(module)
            fully_shard(model)
            return model
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[self.device] if self.device.type == "cuda" else None,
                                       gradient_as_bucket_view=True)

    def accumulating(self, forward_model: torch.nn.Module, last: bool):
        """The context of one micro-batch's backward pass: gradients are averaged over the ranks only in
        the step's last one (DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync``)."""
        if self.shard:
            forward_model.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last else forward_model.no_sync()

    def sum_over_ranks(self, loss: torch.Tensor, samples: int) -> tuple[float, int]:
        """The island's step: the mean of the ranks' losses and the sum of their samples."""
        total = torch.stack([loss.detach().float(), torch.tensor(float(samples), device=loss.device)])
        dist.all_reduce(total)
        return total[0].item() / self.world_size, int(total[1].item())

    def check_replicas(self, params: Sequence[torch.Tensor], inner_steps: int) -> None:
        """With ``P2P_DILOCO_CHECK_ISLAND=1`` and DDP: IslandBroken unless θ_local hashes the same on every rank."""
        if not CHECK_REPLICAS or self.shard:
            return
        digests: list = [None] * self.world_size
        dist.all_gather_object(digests, tensors_sha256(params), group=self.control)
        if len(set(digests)) > 1:
            raise IslandBroken(f"θ_local differs across the island's ranks after inner step {inner_steps}: "
                               f"{[d[:12] for d in digests]}")
        if self.is_lead:
            logger.info("island check: θ_local is the same on all %d ranks after inner step %d (%s)",
                        self.world_size, inner_steps, digests[0][:12])

    # ----- commands from rank 0 ----------------------------------------------------------------------
    def send(self, *command) -> None:
        dist.broadcast_object_list([command], src=0, group=self.control)

    def receive(self) -> tuple:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    @torch.no_grad()
    def push_params(self, params: Sequence[torch.Tensor], full: Optional[Sequence[torch.Tensor]]) -> None:
        """Rank 0's θ_local to every rank: with DDP, a broadcast into each rank's parameters; sharded, each
        rank keeps its shard of each whole tensor broadcast from rank 0 (`full`, rank 0's copy)."""
        if not self.shard:
            for p in params:
                dist.broadcast(p.data, src=0)
            return
        from torch.distributed.tensor import distribute_tensor

        for i, p in enumerate(params):
            whole = full[i].to(self.device, torch.float32) if full is not None else \
                torch.empty(p.shape, dtype=torch.float32, device=self.device)
            dist.broadcast(whole, src=0)
            local = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(local)

    @torch.no_grad()
    def gather_params(self, params: Sequence[torch.Tensor], into: Optional[Sequence[torch.Tensor]]) -> None:
        """Every rank's shards of θ_local, whole, into rank 0's copy `into` (sharded only)."""
        for i, p in enumerate(params):
            whole = p.full_tensor()
            if into is not None:
                into[i].copy_(whole)

    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Optional[dict]:
        """The inner optimizer's whole state on rank 0 (None elsewhere), keyed as ``optimizer.state_dict()``
        keys it in one process, so that a checkpoint loads with any number of ranks: torch.distributed.
        checkpoint's full state dict, gathered from the shards with FSDP2. A collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        state = get_optimizer_state_dict(model, optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return _keyed_by_index(state, _trainable_names(model)) if self.is_lead else None

    def load_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             state: Optional[dict]) -> None:
        """Rank 0's `state` (keyed as :meth:`optimizer_state` returns it) into every rank's optimizer, its
        tensors broadcast from rank 0 (each rank keeps its shard with FSDP2). A collective.

        The lr stays each rank's own: its schedule owns it, and the state carries the lr of the step it was
        saved at. Rank 0 loads it at its first push, after its schedule may have moved on to the run's
        position (a state loaded from the run right after the restore); the others fast-forward theirs
        after this."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = _trainable_names(model)
        schedule_lrs = [group["lr"] for group in optimizer.param_groups]
        set_optimizer_state_dict(model, optimizer, _keyed_by_name(state, names) if self.is_lead else {},
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        for group, lr in zip(optimizer.param_groups, schedule_lrs):
            group["lr"] = lr

    def stop_others(self, reason: str) -> None:
        """Rank 0 tells the other ranks to exit; a dead rank's broken connection is ignored."""
        with contextlib.suppress(Exception):
            self.send("stop", reason)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _trainable_names(model: torch.nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def _keyed_by_index(state: dict, names: list[str]) -> dict:
    """torch.distributed.checkpoint's optimizer state (keyed by parameter name) keyed by index, as
    ``Optimizer.state_dict()`` keys it."""
    index = {name: i for i, name in enumerate(names)}
    return dict(state={index[name]: value for name, value in state["state"].items()},
                param_groups=[dict(group, params=[index[name] for name in group["params"]])
                              for group in state["param_groups"]])


def _keyed_by_name(state: dict, names: list[str]) -> dict:
    return dict(state={names[i]: value for i, value in state["state"].items()},
                param_groups=[dict(group, params=[names[i] for i in group["params"]])
                              for group in state["param_groups"]])


class IslandLead:
    """Rank 0's side: the island seen from :class:`~p2p_diloco.train.diloco.DiLoCoPeer`.

    θ_local, for the peer, is :attr:`params`: the model's trainable parameters with DDP, a whole copy on the
    CPU when sharded. The peer says when it changed them (:meth:`changed`) and before it reads them
    (:meth:`pull`); each inner step starts with :meth:`before_step`. A single-process peer gets
    :class:`SoloIsland`, whose methods do nothing.
    """

    def __init__(self, island: Island, model: torch.nn.Module, forward_model: torch.nn.Module):
        self.island, self.model, self.forward_model = island, model, forward_model
        self.world_size = island.world_size
        self._model_params = trainable_parameters(model)
        self._pending_steps: Optional[int] = None  # the lr schedule's position to push, with θ_local
        self._pending_indices: set[int] = set()  # the parameters of θ_local to push
        self._pending_optimizer: Optional[tuple[torch.optim.Optimizer, dict]] = None
        self._stale = island.shard  # sharded: the shards took inner steps since rank 0's copy was gathered
        if island.shard:  # rank 0's whole θ_local, filled from the shards now
            self.params = [torch.empty(p.shape, dtype=torch.float32) for p in self._model_params]
            self.pull()
        else:
            self.params = self._model_params

    @contextlib.contextmanager
    def guard(self):
        """Around anything that waits on the other ranks: a failure there (a rank died) is IslandBroken."""
        try:
            yield
        except IslandBroken:
            raise
        except (RuntimeError, ConnectionError) as e:  # gloo and NCCL raise RuntimeError subclasses
            raise IslandBroken(f"a rank of this island failed ({str(e).strip().splitlines()[0][:200]}): "
                               "stopping the peer") from e

    def changed(self, inner_steps: int, indices: Optional[Sequence[int]] = None) -> None:
        """Rank 0 changed θ_local's parameters at `indices` (None: all; an outer step changes one fragment's, a
        loaded state or checkpoint all) and maybe its lr schedule's position (`inner_steps`): the other
        ranks get them before the next step."""
        self._pending_steps = inner_steps
        self._pending_indices.update(range(len(self.params)) if indices is None else indices)

    def load_optimizer(self, optimizer: torch.optim.Optimizer, state: dict, inner_steps: int) -> None:
        """A checkpoint's inner optimizer state (keyed as in one process), for every rank (this one included)
        before the next step or the next read of it."""
        self._pending_optimizer = (optimizer, state)
        self.changed(inner_steps)

    def push(self) -> None:
        """Send θ_local's changed parameters (and a loaded optimizer state) to the other ranks now."""
        if self._pending_steps is None:
            return
        indices = sorted(self._pending_indices)
        self.island.send("push", self._pending_steps, indices, self._pending_optimizer is not None)
        self.island.push_params([self._model_params[i] for i in indices],
                                [self.params[i] for i in indices] if self.island.shard else None)
        if self._pending_optimizer is not None:
            self.island.load_optimizer_state(self.model, *self._pending_optimizer)
        self._pending_steps, self._pending_indices, self._pending_optimizer = None, set(), None

    def before_step(self) -> None:
        with self.guard():
            self.push()
            self.island.send("step")
            self._stale = self.island.shard

    def pull(self) -> None:
        """θ_local from the shards into :attr:`params`, before rank 0 reads it: sharded, and only when the
        shards took inner steps since the last gather (rank 0's copy is newer than the shards only before a
        push, and no step runs before one)."""
        if self._stale:
            with self.guard():
                self.island.send("gather")
                self.island.gather_params(self._model_params, self.params)
            self._stale = False

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The inner optimizer's whole state, for rank 0's checkpoint."""
        with self.guard():
            self.push()
            self.island.send("optimizer")
            return self.island.optimizer_state(self.model, optimizer)

    def open_stream(self, stream, shard: Optional[int], state: Optional[dict]):
        """Rank 0 opened the peer's data stream (`shard`, from `state`): every rank opens it too, and each
        reads its own part."""
        with self.guard():
            self.island.send("open", shard, state)
        return RankSlice(stream, 0, self.world_size)


class SoloIsland:
    """A single-process peer: an island of one, where every island command does nothing."""

    world_size = 1
    island = None
    forward_model = None

    def __init__(self, model: torch.nn.Module):
        self.params = trainable_parameters(model)

    def guard(self):
        return contextlib.nullcontext()

    def changed(self, inner_steps: int, indices: Optional[Sequence[int]] = None) -> None:
        pass

    def load_optimizer(self, optimizer: torch.optim.Optimizer, state: dict, inner_steps: int) -> None:
        optimizer.load_state_dict(state)

    def before_step(self) -> None:
        pass

    def pull(self) -> None:
        pass

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return optimizer.state_dict()

    def open_stream(self, stream, shard: Optional[int], state: Optional[dict]):
        return stream


def follow(island: Island, model: torch.nn.Module, trainer, data) -> str:
    """A rank other than 0: do what rank 0 says until it says stop; returns its reason.

    `trainer` is this rank's :class:`~p2p_diloco.train.inner.InnerTrainer` over the prepared `model`, `data`
    the peer's :class:`~p2p_diloco.train.member.PeerData` (built with rank 0's order seed).
    """
    params = trainable_parameters(model)
    while True:
        command, *args = island.receive()
        if command == "step":
            trainer.step()
        elif command == "push":
            inner_steps, indices, with_optimizer = args
            island.push_params([params[i] for i in indices], None)
            if with_optimizer:
                island.load_optimizer_state(model, trainer.optimizer, None)
            trainer.fast_forward_schedule(inner_steps)
        elif command == "gather":
            island.gather_params(params, None)
        elif command == "optimizer":
            island.optimizer_state(model, trainer.optimizer)
        elif command == "open":
            shard, state = args
            trainer.batches = RankSlice(data.open(shard, state), island.rank, island.world_size)
        elif command == "stop":
            return args[0]
        else:
            raise IslandBroken(f"rank 0 sent an unknown command {command!r}")
