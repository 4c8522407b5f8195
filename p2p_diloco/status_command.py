"""What `p2p-diloco status` does: join the DHT as a client, read the peers' status records, print them.

The node it starts stores nothing for others and trains nothing; it checks every record's signature
(a record in another peer's name is dropped by the DHT validators) and every status record's schema
(a malformed one is skipped with a warning). It also asks each peer that others can dial whether it
answers now: a peer whose record has not expired yet may have crashed.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from typing import Iterable, Optional, Sequence

from p2p_diloco.node_runner import (
    EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, fail, install_stop_handlers, setup_logging, shutdown_dht,
)

logger = logging.getLogger(__name__)

COLUMNS = ("peer", "step", "phase", "inner steps", "samples/s", "loss", "held-out", "reach", "answers", "device",
           "ranks", "version", "uptime", "shard", "settings")


def find_runs(dht) -> dict[str, int]:
    """Run name -> how many live peers announce it (``p2p_diloco_runs``), from the signed, valid records."""
    from p2p_diloco.swarm.records import RunAnnouncement, runs_key, signed_records

    return dict(Counter(record.run for _, record, _ in signed_records(dht, runs_key(), RunAnnouncement,
                                                                      "run announcement")))


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def run_rows(statuses: dict, answering: set[str]) -> list[dict]:
    """One dict per peer, for JSON, ordered by outer step (highest first), then peer ID."""
    rows = []
    for peer_id, status in statuses.items():
        row = status.as_dict()
        row["answers"] = (peer_id in answering) if status.record.reachability == "direct" else None
        rows.append(row)
    return sorted(rows, key=lambda r: (-r["outer_step"], r["peer_id"]))


def peer_cells(r: dict, main: Optional[str]) -> dict[str, str]:
    """A peer's row (as :func:`run_rows` has it) as the text of each of :data:`COLUMNS`; `main` is the run's
    most common settings fingerprint."""
    return dict(zip(COLUMNS, (
        r["peer_id"][-8:], str(r["outer_step"]), r["phase"], str(r["inner_steps"]), f"{r['samples_per_s']:.1f}",
        "-" if r["loss"] is None else f"{r['loss']:.3f}", held_out_cell(r),
        "direct" if r["reachability"] == "direct" else "NAT",
        {True: "yes", False: "NO", None: "-"}[r["answers"]], r["device"], str(r.get("ranks", 1)), r["version"],
        format_duration(r["uptime_s"]),
        "-" if r["data_shard"] is None else str(r["data_shard"]),
        r["fingerprint"][:8] + ("" if r["fingerprint"] == main else " (other)"),
    )))


def held_out_cell(r: dict) -> str:
    """``2.345@10``: the peer's latest held-out loss of θ_global and the outer step it measured it at (its claim:
    the record's schema bounds it, nobody checks it), or ``-``."""
    loss, step = r.get("eval_loss"), r.get("eval_step")
    return "-" if loss is None else f"{loss:.3f}" + ("" if step is None else f"@{step}")


def main_fingerprint(fingerprints: Iterable[str]) -> Optional[str]:
    """The settings fingerprint most of a run's live peers train with (None without peers)."""
    counts = Counter(fingerprints)
    return counts.most_common(1)[0][0] if counts else None


def format_run(run: str, rows: list[dict]) -> str:
    """The table of one run, with a line that says how many peers train with which settings."""
    fingerprints = Counter(r["fingerprint"] for r in rows)
    main = main_fingerprint(fingerprints.elements())
    step = max((r["outer_step"] for r in rows if r["fingerprint"] == main), default=0)
    header = f"run {run}: {len(rows)} live peer(s), outer step {step}"
    keepers = [r for r in rows if r["phase"] == "keeping"]
    if keepers:
        header += f", kept by {', '.join(r['peer_id'][-8:] for r in keepers)}"
    stored = max((r.get("stored_step") or 0 for r in rows), default=0)
    if stored:
        header += f", newest checkpoint in the store: outer step {stored}"
    if main is not None:
        header += f", settings {main[:12]}"
    if len(fingerprints) > 1:
        header += f" ({sum(fingerprints.values()) - fingerprints[main]} peer(s) on other settings: they never average " \
                  f"with the others)"
    cells = [list(peer_cells(r, main).values()) for r in rows]
    widths = [max(len(c) for c in column) for column in zip(COLUMNS, *cells)]
    lines = [header, "  ".join(h.ljust(w) for h, w in zip(COLUMNS, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def tokens_per_sample(statuses: dict) -> int:
    """``data.seq_len`` of the run's most common settings, from a record whose settings match its fingerprint
    (1 when none does)."""
    main = main_fingerprint(s.record.fingerprint for s in statuses.values())
    trusted = next((s for s in statuses.values() if s.record.fingerprint == main and s.settings_trusted), None)
    seq_len = None if trusted is None else trusted.record.settings.get("data.seq_len")
    return seq_len if isinstance(seq_len, int) and seq_len > 0 else 1


def read_runs(dht, run: Optional[str] = None, max_runs: Optional[int] = None) -> list[dict]:
    """Each run the swarm announces (or only `run`; at most `max_runs`, those with the most peers): its name,
    its live peers as :func:`run_rows` has them, and the tokens in one of its samples."""
    from p2p_diloco.swarm.liveness import answering
    from p2p_diloco.swarm.status import read_status

    report = []
    names = [run] if run else sorted(name for name, _ in Counter(find_runs(dht)).most_common(max_runs))
    for name in names:
        statuses = read_status(dht, name)
        direct = [pid for pid, s in statuses.items() if s.record.reachability == "direct"]
        report.append(dict(run=name, peers=run_rows(statuses, answering(dht, direct)),
                           tokens_per_sample=tokens_per_sample(statuses)))
    return report


def start_client(initial_peers: Sequence[str]):
    """A DHT client node of the swarm, or the exit status of a one-line error (bad address, nobody answers)."""
    from p2p_diloco.swarm.identity import Identity
    from p2p_diloco.swarm.node import NodeAddressError, start_dht
    from p2p_diloco.swarm.records import node_validators

    identity = Identity.load_or_create(None)
    try:
        return start_dht("127.0.0.1", 0, identity, node_validators(identity), initial_peers=initial_peers,
                         client_mode=True)
    except NodeAddressError as e:
        return fail(str(e), EXIT_USAGE)
    except ConnectionError as e:
        return fail(str(e), EXIT_UNREACHABLE)


def run_status(initial_peers: Sequence[str], run: Optional[str], as_json: bool, verbose: bool) -> int:
    setup_logging(verbose)
    dht = start_client(initial_peers)
    if isinstance(dht, int):
        return dht
    try:
        report = read_runs(dht, run)
    finally:
        shutdown_dht(dht)
    if as_json:
        print(json.dumps(dict(time=time.time(), runs=report), indent=2))
    elif not report:
        print("no run found on this swarm: no peer announces one (peers started moments ago may not show yet)")
    else:
        print("\n\n".join(format_run(r["run"], r["peers"]) if r["peers"] else f"run {r['run']}: no live peer"
                          for r in report))
    return EXIT_OK


def serve_status(initial_peers: Sequence[str], run: Optional[str], host: str, port: int, refresh_s: float,
                 verbose: bool) -> int:
    """`status --serve`: a DHT client that serves the run's page (p2p_diloco.run_page) until SIGINT or SIGTERM."""
    setup_logging(verbose)
    from p2p_diloco.run_page.server import serve_run_page

    stop = install_stop_handlers()
    dht = start_client(initial_peers)
    if isinstance(dht, int):
        return dht
    try:
        try:
            page = serve_run_page(dht, host, port, run, refresh_s)
        except OSError as e:
            return fail(str(e), EXIT_USAGE)
        print(page.url, flush=True)
        stop.wait()
        page.close()
    finally:
        shutdown_dht(dht)
    return EXIT_OK
