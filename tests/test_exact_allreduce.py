"""The all-reduce result is the sample-weighted mean and bit-identical on every peer of the group."""

import threading

import pytest
import torch

from p2p_diloco.config import SwarmConfig
from p2p_diloco.swarm.node import start_run_node, visible_maddrs
from p2p_diloco.sync.outer_sync import OuterSync
from p2p_diloco.hashing import tensors_sha256

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(180)]


def test_weighted_mean_is_bit_identical_on_all_peers():
    cfg = SwarmConfig(matchmaking_time=2.0, request_timeout=1.0)
    shapes = [torch.Size([300, 77]), torch.Size([1001]), torch.Size([3, 5, 7])]
    generator = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(s, generator=generator) * 1e-2 for s in shapes] for _ in range(4)]
    samples = [16, 48, 32, 160]
    dhts, syncs = [], []
    start = "5" * 64  # the sha256 of the global state every peer starts from
    try:
        for _ in range(4):
            first = visible_maddrs(dhts[0]) if dhts else ()
            node = start_run_node("exact", "127.0.0.1", 0, initial_peers=first)
            dhts.append(node.dht)
            syncs.append(OuterSync(node.dht, "exact", "f" * 64, node.identity.record_subkey, shapes, cfg,
                                   state_provider=lambda: ({}, [])))
        results = [None] * 4

        def average(i):
            results[i] = syncs[i].average(inputs[i], samples[i], outer_step=0, global_sha256=start)

        threads = [threading.Thread(target=average, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert all(r is not None for r in results)
        assert len({tensors_sha256(r.mean) for r in results}) == 1
        expected = [sum(w * x[j].double() for w, x in zip(samples, inputs)) / sum(samples) for j in range(3)]
        for r in results:
            assert r.group_size == 4 and r.group_samples == sum(samples)
            for got, want in zip(r.mean, expected):
                assert (got.double() - want).abs().max().item() < 1e-8
        assert all(s.averager.traffic.sent > 0 and s.averager.traffic.received > 0 for s in syncs)
    finally:
        for s in syncs:
            s.shutdown()
        for d in dhts:
            d.shutdown()
