"""What a run's page remembers: one point per outer step of a few series, in bounded memory.

Each reading of the run's status records (:func:`p2p_diloco.swarm.status_report.read_runs`) gives the
run's current outer step and, from the records of the peers on the run's settings, one value per
series. The records are the peers' claims (signed, schema-checked, never verified), so a series
takes the *median* over the peers, which one stranger cannot move far; only the throughput and
the tokens trained are sums, of claims each bounded by the record schema.

A :class:`Series` keeps at most ``MAX_POINTS`` points: when it is full, every other point of it
goes, so a run of weeks keeps its whole span at a coarser step while the memory stays bounded.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

from p2p_diloco.swarm.status_report import main_fingerprint

MAX_POINTS = 1024  # per series: thinned by half when full
MAX_TRACKED_PEERS = 10_000  # peers whose samples the run's token count follows; older ones are folded in
KEEPING = "keeping"

SERIES = {  # name: (title, unit), in the page's order
    "loss": ("training loss", ""),
    "eval_loss": ("held-out loss of θ_global", ""),
    "group_size": ("group size", " peers"),
    "sync_bytes": ("bytes per outer step", "B"),
    "utilization": ("compute utilization", ""),
    "peers": ("live peers", ""),
    "tokens_per_s": ("swarm throughput", " tokens/s"),
}


@dataclass
class Series:
    """(outer step, value) points, steps increasing, at most `max_points` of them."""

    max_points: int = MAX_POINTS
    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def record(self, step: int, value: Optional[float]) -> None:
        """The value at `step`: replaces a value of the same step (a newer reading of it); a step older than
        the newest point (a record from a peer behind the run) is ignored."""
        if value is None:
            return
        if self.steps and step == self.steps[-1]:
            self.values[-1] = value
        elif not self.steps or step > self.steps[-1]:
            self.steps.append(step)
            self.values.append(value)
            if len(self.steps) > self.max_points:
                self._thin()

    def _thin(self) -> None:
        """Every other point goes; the newest stays."""
        keep = range(len(self.steps) - 1, -1, -2)
        self.steps = [self.steps[i] for i in reversed(keep)]
        self.values = [self.values[i] for i in reversed(keep)]

    def as_dict(self) -> dict[str, list]:
        return dict(steps=list(self.steps), values=list(self.values))


class TokenCount:
    """The tokens a run's peers trained, from the running ``samples`` count of each peer's status record.

    A count that goes down is a restarted peer (its process counts from zero again): its new count is
    added. Peers seen longest ago are folded into one total past ``MAX_TRACKED_PEERS``.
    """

    def __init__(self, max_peers: int = MAX_TRACKED_PEERS):
        self.max_peers = max_peers
        self._last: OrderedDict[str, int] = OrderedDict()  # peer -> its last samples count, least recent first
        self.samples = 0

    def observe(self, peer_id: str, samples: int) -> None:
        last = self._last.pop(peer_id, 0)
        self.samples += samples - last if samples >= last else samples
        self._last[peer_id] = samples
        while len(self._last) > self.max_peers:
            self._last.popitem(last=False)


def _median(values: list) -> Optional[float]:
    values = [v for v in values if v is not None]
    return float(statistics.median(values)) if values else None


class RunHistory:
    """The page's memory of one run: its series, its token count and the latest summary."""

    def __init__(self, run: str, max_points: int = MAX_POINTS):
        self.run = run
        self.series = {name: Series(max_points) for name in SERIES}
        self.tokens = TokenCount()
        self.summary: dict[str, Any] = {}

    def observe(self, rows: list[dict], tokens_per_sample: int, now: float) -> None:
        """One reading of the run's live peers (`rows`, as ``status --json`` has them)."""
        fingerprint = main_fingerprint(r["fingerprint"] for r in rows)
        ours = [r for r in rows if r["fingerprint"] == fingerprint]
        trainers = [r for r in ours if r["phase"] != KEEPING]
        keepers = [r for r in ours if r["phase"] == KEEPING]
        newest = self.series["peers"].steps
        step = max((r["outer_step"] for r in ours), default=newest[-1] if newest else 0)  # all gone: where it was
        for r in trainers:
            self.tokens.observe(r["peer_id"], r.get("samples", 0))
        tokens_per_s = sum(r["samples_per_s"] for r in trainers) * tokens_per_sample
        applied = [r for r in trainers if r.get("group_size")]  # peers that applied an outer step
        point = dict(
            loss=_median([r["loss"] for r in trainers]),
            group_size=_median([r["group_size"] for r in applied]),
            sync_bytes=_median([r["sync_bytes"] for r in applied]),
            utilization=_median([r.get("utilization") for r in applied]),
            peers=float(len(trainers)),
            tokens_per_s=tokens_per_s,
        )
        for name, value in point.items():
            self.series[name].record(step, value)
        self._observe_evaluations(ours)
        self.summary = dict(
            run=self.run, time=now, fingerprint=fingerprint, outer_step=step, live_peers=len(trainers),
            keepers=len(keepers), other_settings=len(rows) - len(ours),
            tokens_trained=self.tokens.samples * tokens_per_sample, tokens_per_s=tokens_per_s,
            loss=point["loss"], eval_loss=(self.series["eval_loss"].values or [None])[-1],
        )

    def _observe_evaluations(self, rows: list[dict]) -> None:
        """The held-out loss of θ_global that the peers and keepers of the run's settings last measured
        (p2p_diloco.train.heldout): at the (lower) median of the outer steps they claim to have measured at,
        the median of the losses claimed at that step. Peers of one schedule (``eval.every``) measure at the
        same steps; a stranger's step far ahead moves the median by one place, and its loss is one of many."""
        evaluated = [(r["eval_step"], r["eval_loss"]) for r in rows
                     if r.get("eval_loss") is not None and r.get("eval_step") is not None]
        if evaluated:
            step = sorted(s for s, _ in evaluated)[(len(evaluated) - 1) // 2]
            self.series["eval_loss"].record(step, _median([loss for s, loss in evaluated if s == step]))

    def as_dict(self) -> dict[str, Any]:
        return dict(summary=self.summary, history={name: s.as_dict() for name, s in self.series.items()})
