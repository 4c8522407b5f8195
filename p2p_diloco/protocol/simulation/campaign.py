"""Many seeds at once: each a random schedule run to its end, and a summary of what they found.

``python benchmarks/simulate.py`` prints :func:`summary`'s JSON; the test suite runs the same seeds.
"""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from p2p_diloco.protocol.simulation.invariants import INVARIANTS
from p2p_diloco.protocol.simulation.schedule import SCENARIOS, Schedule, describe, random_schedule
from p2p_diloco.protocol.simulation.swarm import SimReport, SimSettings, SimSwarm


@dataclass(frozen=True)
class Trial:
    seed: int
    peers: int
    settings: SimSettings = SimSettings()
    checked: tuple[str, ...] = INVARIANTS
    scenario: Optional[str] = None  # a named scenario instead of the seed's random schedule

    def schedule(self) -> Schedule:
        return SCENARIOS[self.scenario]() if self.scenario else random_schedule(self.seed, self.peers)

    def run(self) -> SimReport:
        return SimSwarm(self.seed, self.schedule(), self.settings, self.checked).run()


def _run(trial: Trial) -> SimReport:
    report = trial.run()
    report.transcript = report.transcript if report.violations else []  # only failures are read
    return report


def run_trials(trials: Sequence[Trial], workers: int = 1,
               progress: Optional[Callable[[int, int], None]] = None) -> list[SimReport]:
    """Each trial's report, in order; in `workers` processes (the simulation is deterministic either way).
    `progress(done, total)` is called as reports come in."""
    if workers <= 1 or len(trials) < 2:
        reports = []
        for trial in trials:
            reports.append(_run(trial))
            if progress is not None:
                progress(len(reports), len(trials))
        return reports
    # spawned, not forked: a test process may hold other threads (a DHT's, a logger's) whose locks a fork copies
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        reports = []
        for report in pool.imap(_run, trials, chunksize=max(1, min(8, len(trials) // (4 * workers)))):
            reports.append(report)
            if progress is not None:
                progress(len(reports), len(trials))
        return reports


def summary(reports: Sequence[SimReport]) -> dict:
    """What a campaign found: the violations by invariant and the failing seeds, and how the runs went."""
    failing = sorted({r.seed for r in reports if r.violations})
    by_invariant: dict[str, int] = {}
    observed: dict[str, int] = {}
    for report in reports:
        for violation in report.violations:
            by_invariant[violation.invariant] = by_invariant.get(violation.invariant, 0) + 1
        for name, count in report.observed.items():
            observed[name] = observed.get(name, 0) + count
    count = max(len(reports), 1)
    return dict(schedules=len(reports), violations=sum(len(r.violations) for r in reports), failing_seeds=failing,
                by_invariant=by_invariant, observed=observed,
                outer_steps_mean=round(sum(r.honest_steps for r in reports) / count, 1),
                counted_share=round(sum(r.counted_share for r in reports) / count, 4),
                dropped_share=round(sum(r.dropped_share for r in reports) / count, 4),
                messages_per_peer=round(sum(r.messages_per_peer for r in reports) / count, 1),
                longest_void_streak=max((r.longest_void_streak for r in reports), default=0))


def replay(trial: Trial) -> list[str]:
    """A trial's schedule, its violations and its transcript, as lines: a failing seed, replayed exactly."""
    report = trial.run()
    return (describe(trial.schedule()) + [f"violation: {v}" for v in report.violations] + ["transcript:"]
            + report.transcript)
