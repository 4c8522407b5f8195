"""The round protocol's deterministic simulation: K seeds of N peers, invariants checked after every event.

    python benchmarks/simulate.py --peers 4 --seeds 200                  # the CI campaign, ~1 min on 2 cores
    python benchmarks/simulate.py --peers 4 --seeds 200 --update-check void   # the rule before issue 42
    python benchmarks/simulate.py --replay 37 --peers 4                  # one seed: its schedule and transcript
    python benchmarks/simulate.py --scenario stall_at_step_2 --update-check void
    python benchmarks/simulate.py --peers 1000 --seeds 1 --end 60 --arrival together   # many peers

Each seed is a schedule (:mod:`p2p_diloco.protocol.simulation.schedule`: arrivals together, 1 or 2 s apart or
minutes apart; read and store delays, missed reads, crashes, freezes, partitions, a liar or a scaler), run by
peers that decide with the real protocol core (:mod:`p2p_diloco.protocol`). The last line is one JSON object:
``{"schedules": K, "violations": V, "failing_seeds": [...], "by_invariant": {...}, ...}``; with
``--check NAME,...`` only those invariants count as violations (the others are still counted, under
``observed``). A failing seed replays exactly with ``--replay SEED``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from p2p_diloco.protocol.simulation.campaign import Trial, replay, run_trials, summary  # noqa: E402
from p2p_diloco.protocol.simulation.invariants import INVARIANTS  # noqa: E402
from p2p_diloco.protocol.simulation.schedule import ARRIVALS, SCENARIOS, random_schedule  # noqa: E402
from p2p_diloco.protocol.simulation.swarm import SimSettings, SimSwarm  # noqa: E402


def report_progress(done: int, total: int, began: float) -> None:
    """A line on stderr every tenth of the campaign (a campaign of many peers takes minutes): stdout stays JSON."""
    if done == total or done % max(1, total // 10) == 0:
        print(f"{done} of {total} schedules, {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4, help="honest peers per schedule")
    parser.add_argument("--seeds", type=int, default=200, help="schedules to run")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--update-check", choices=("clip", "void"), default="clip",
                        help="clip: the rule of issue 42; void: the rule before it")
    parser.add_argument("--check", default=",".join(INVARIANTS),
                        help=f"invariants that count as violations (of {', '.join(INVARIANTS)})")
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), help="run one named scenario")
    parser.add_argument("--replay", type=int, help="print one seed's schedule, violations and transcript")
    parser.add_argument("--end", type=float, help="virtual seconds to run (default: the schedule's)")
    parser.add_argument("--arrival", choices=ARRIVALS, help="how the peers arrive (default: each seed draws it)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    checked = tuple(name for name in args.check.split(",") if name)
    unknown = set(checked) - set(INVARIANTS)
    if unknown:
        parser.error(f"--check: unknown invariant(s) {', '.join(sorted(unknown))}; one of {', '.join(INVARIANTS)}")
    settings = SimSettings(update_check=args.update_check)
    if args.replay is not None or args.scenario:
        trial = Trial(args.replay or 0, args.peers, settings, checked, args.scenario)
        print("\n".join(replay(trial)))
        return
    began = time.monotonic()
    # at once, on stderr: 100 seeds of 16 peers take minutes, and the first progress line comes after a tenth of them
    print(f"simulating {args.seeds} schedules of {args.peers} peers (about {args.peers * args.seeds / 15:.0f} s on "
          f"2 cores)", file=sys.stderr, flush=True)
    if args.end is not None or args.arrival:  # a long or large run: its own schedules, in this process
        args.end = args.end or random_schedule(0, args.peers).end
        reports = []
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            schedule = replace(random_schedule(seed, args.peers, arrival=args.arrival), end=args.end)
            reports.append(SimSwarm(seed, schedule, settings, checked).run())
    else:
        trials = [Trial(seed, args.peers, settings, checked)
                  for seed in range(args.first_seed, args.first_seed + args.seeds)]
        reports = run_trials(trials, args.workers, progress=lambda done, total: report_progress(done, total, began))
    result = summary(reports)
    result.update(peers=args.peers, update_check=args.update_check, checked=list(checked),
                  seconds=round(time.monotonic() - began, 1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
