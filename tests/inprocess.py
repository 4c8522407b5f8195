"""Real DiLoCo peers inside the test process: each has its own DHT node and averager on loopback."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from p2p_diloco.config import Config, shared_settings
from p2p_diloco.swarm.node import start_run_node, visible_maddrs
from p2p_diloco.train.diloco import DiLoCoPeer
from p2p_diloco.train.model import build_model, trainable_parameters


@contextmanager
def inprocess_peers(cfg: Config, vocab_size: int, batch_lists: Sequence[list[torch.Tensor]]):
    """One DiLoCoPeer per batch list, all in one DHT; every DHT is shut down on exit."""
    nodes = []
    settings = shared_settings(cfg, tokenizer_sha256="fixed test batches")
    try:
        for _ in batch_lists:
            first = visible_maddrs(nodes[0].dht) if nodes else ()
            nodes.append(start_run_node(cfg.run.name, "127.0.0.1", 0, initial_peers=first))
        peers = [
            DiLoCoPeer(cfg, build_model(cfg.model, vocab_size, cfg.run.seed), ListData(batches), node, settings)
            for node, batches in zip(nodes, batch_lists)
        ]
        yield peers
    finally:
        for node in nodes:
            node.dht.shutdown()


def run_in_threads(peers: Sequence[DiLoCoPeer], max_outer_steps: int, timeout_s: float = 240.0) -> None:
    errors: list[BaseException] = []

    def target(peer: DiLoCoPeer) -> None:
        try:
            peer.run(max_outer_steps)
        except BaseException as e:  # surfaced in the test below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(peer,), daemon=True) for peer in peers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if any(t.is_alive() for t in threads):
        for peer in peers:
            peer.stop_event.set()
        for t in threads:
            t.join(30)
        raise TimeoutError(f"peers did not reach outer step {max_outer_steps} within {timeout_s} s")
    if errors:
        raise errors[0]


class ListData:
    """A DiLoCoPeer's data over a fixed list of batches (one shard: all of them)."""

    num_shards = 1

    def __init__(self, batches: list[torch.Tensor]):
        self.batches = batches

    def open(self, shard: int, state: dict | None) -> "ListStream":
        return ListStream(self.batches, state["position"] if state else 0)


class ListStream:
    """The batches of a list from `position` on; ends with the list."""

    def __init__(self, batches: list[torch.Tensor], position: int):
        self.batches, self.position = batches, position

    def __iter__(self) -> "ListStream":
        return self

    def __next__(self) -> torch.Tensor:
        if self.position >= len(self.batches):
            raise StopIteration
        self.position += 1
        return self.batches[self.position - 1]

    def state_dict(self) -> dict:
        return {"position": self.position}


def fixed_batches(num_peers: int, num_batches: int, batch_size: int, seq_len: int, vocab: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [
        [torch.randint(0, vocab, (batch_size, seq_len), generator=generator) for _ in range(num_batches)]
        for _ in range(num_peers)
    ]


def params_of(tensors: Iterator[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


class OracleWorker:
    """One DiLoCo worker of the plain-torch oracles: a model, its AdamW and lr schedule, its batches."""

    def __init__(self, cfg: Config, vocab_size: int, batches: list[torch.Tensor]):
        inner = cfg.inner
        self.model = build_model(cfg.model, vocab_size, cfg.run.seed)
        self.params = trainable_parameters(self.model)
        self.optimizer = torch.optim.AdamW(self.params, lr=inner.lr, betas=(inner.beta1, inner.beta2),
                                           weight_decay=inner.weight_decay)
        self.scheduler = get_cosine_with_min_lr_schedule_with_warmup(
            self.optimizer, inner.warmup_steps, inner.total_steps, min_lr_rate=inner.min_lr_ratio)
        self.batches = iter(batches)
        self.grad_clip = inner.grad_clip

    def train(self, steps: int) -> None:
        for _ in range(steps):
            batch = next(self.batches)
            self.model(input_ids=batch, labels=batch).loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()
