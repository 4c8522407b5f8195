"""DiLoCo in a Hugging Face Trainer script: the model of plain_loop.py, so the two examples can share a run.

    python examples/trainer_script.py --initial-peers ADDRESS   # beside plain_loop.py peers of run plain-loop
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn
from transformers import Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plain_loop import TARGET, make_model  # noqa: E402  (the same model and task as the plain loop)

from p2p_diloco.integrations import DiLoCoCallback  # noqa: E402


class Samples(torch.utils.data.Dataset):
    """Random inputs and the map's outputs for them, drawn once from `seed`."""

    def __init__(self, seed: int, size: int = 100_000):
        self.x = torch.randn(size, 16, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.x[i] @ TARGET}


class RegressionTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        return nn.functional.mse_loss(model(inputs["x"]), inputs["y"])


def main() -> None:
    parser = argparse.ArgumentParser(description="Train plain_loop.py's MLP with a Trainer, in a DiLoCo swarm.")
    parser.add_argument("--initial-peers", nargs="*", default=[], help="multiaddrs of running peers")
    parser.add_argument("--run", default="plain-loop", help="the run's name (plain_loop.py's by default)")
    parser.add_argument("--outer-steps", type=int, default=5, help="stop at this outer step")
    parser.add_argument("--sync-every", type=int, default=20, help="inner steps per outer step (H)")
    parser.add_argument("--data-seed", type=int, default=0, help="this peer's data")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--metrics-file", default=None, help="JSON-lines metrics of every outer step")
    parser.add_argument("--wait-for-peers", type=int, default=1, help="start once this many peers are in the run")
    args = parser.parse_args()

    callback = DiLoCoCallback(run=args.run, initial_peers=args.initial_peers, sync_every=args.sync_every,
                              host=args.host, metrics_file=args.metrics_file, max_outer_steps=args.outer_steps,
                              wait_for_peers=args.wait_for_peers)
    with tempfile.TemporaryDirectory() as output_dir:
        training = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=32, learning_rate=3e-3,
                                     lr_scheduler_type="constant", max_steps=100_000, use_cpu=True,
                                     report_to="none", save_strategy="no", logging_strategy="no",
                                     remove_unused_columns=False, disable_tqdm=True)
        RegressionTrainer(model=make_model(), args=training, train_dataset=Samples(args.data_seed),
                          callbacks=[callback]).train()
    print(f"outer step {callback.diloco.outer_step}, θ_global {callback.diloco.global_sha256[:16]}", flush=True)


if __name__ == "__main__":
    main()
