"""DiLoCo around a plain PyTorch loop: a small MLP (not a transformers model) learns a fixed map, in a swarm.

    python examples/plain_loop.py                          # the first peer: prints its address
    python examples/plain_loop.py --initial-peers ADDRESS  # more peers (or all of them, from a bootstrap node)
"""

import argparse

import torch
from torch import nn

import p2p_diloco


TARGET = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))  # the map every peer learns


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every peer: part of the run's settings fingerprint
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))


def main() -> None:
    parser = argparse.ArgumentParser(description="Train an MLP with DiLoCo over a swarm of peers.")
    parser.add_argument("--initial-peers", nargs="*", default=[], help="multiaddrs of running peers")
    parser.add_argument("--run", default="plain-loop", help="the run's name: peers of one run average together")
    parser.add_argument("--outer-steps", type=int, default=5, help="stop at this outer step")
    parser.add_argument("--sync-every", type=int, default=20, help="inner steps per outer step (H)")
    parser.add_argument("--data-seed", type=int, default=None, help="this peer's data order (default: random)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--metrics-file", default=None, help="JSON-lines metrics of every outer step")
    parser.add_argument("--wait-for-peers", type=int, default=1, help="start once this many peers are in the run")
    args = parser.parse_args()

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.Generator()
    data.manual_seed(args.data_seed) if args.data_seed is not None else data.seed()

    with p2p_diloco.DiLoCo(model, optimizer, run=args.run, initial_peers=args.initial_peers,
                           sync_every=args.sync_every, host=args.host, metrics_file=args.metrics_file,
                           wait_for_peers=args.wait_for_peers) as diloco:
        print("peer reachable at", *diloco.maddrs, flush=True)
        while diloco.outer_step < args.outer_steps:
            x = torch.randn(32, 16, generator=data)
            loss = nn.functional.mse_loss(model(x), x @ TARGET)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            diloco.step(samples=len(x), loss=loss.item())
        print(f"outer step {diloco.outer_step}, loss {loss.item():.4f}, θ_global {diloco.global_sha256[:16]}",
              flush=True)


if __name__ == "__main__":
    main()
