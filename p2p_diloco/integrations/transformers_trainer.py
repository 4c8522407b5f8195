"""A transformers ``Trainer`` that trains in a DiLoCo swarm: ``Trainer(..., callbacks=[DiLoCoCallback(...)])``.

The Trainer's loop is DiLoCo's inner loop: when training begins the callback makes a :class:`p2p_diloco.DiLoCo`
around the Trainer's model and optimizer and joins the swarm; after each optimizer step (``on_step_end``: after
``optimizer.step()``, the lr scheduler's step and ``zero_grad()``) it calls :meth:`DiLoCo.step` with the step's
samples, ``per_device_train_batch_size × gradient_accumulation_steps × world_size``; when training ends the peer
leaves. Every ``sync_every`` optimizer steps the swarm averages and the outer step changes the model's weights.
"""

from __future__ import annotations

from typing import Any, Optional

from transformers import TrainerCallback

from p2p_diloco.api import DiLoCo


class DiLoCoCallback(TrainerCallback):
    """Train a ``Trainer``'s model in a DiLoCo swarm (see the module).

    `run`, or `manifest` (a run manifest's path: :meth:`DiLoCo.from_manifest`), and `kwargs` are as for
    :class:`p2p_diloco.DiLoCo` (``initial_peers``, ``sync_every``, ``host``, ``outer``, ...). With
    `max_outer_steps` the Trainer stops once θ_global reaches that outer step. The peer is :attr:`diloco`
    while training runs.
    """

    def __init__(self, run: Optional[str] = None, manifest: Optional[str] = None,
                 max_outer_steps: Optional[int] = None, **kwargs: Any):
        self.run, self.manifest, self.max_outer_steps, self.kwargs = run, manifest, max_outer_steps, kwargs
        self.diloco: Optional[DiLoCo] = None
        self.samples_per_step = 0

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.samples_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * \
            max(args.world_size, 1)
        if self.manifest is not None:
            diloco = DiLoCo.from_manifest(self.manifest, model, optimizer, **self.kwargs)
        else:
            diloco = DiLoCo(model, optimizer, run=self.run, **self.kwargs)
        diloco.start()
        self.diloco = diloco

    def on_step_end(self, args, state, control, **kwargs):
        self.diloco.step(self.samples_per_step)
        if self.max_outer_steps is not None and self.diloco.outer_step >= self.max_outer_steps:
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        if self.diloco is not None:
            self.diloco.close()
