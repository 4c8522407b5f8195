"""The swarm's runs as a reader of the status records sees them (``p2p-diloco status`` and the run's page,
p2p_diloco.run_page): the runs announced, each run's live peers as rows, and each row's cells as text.

The records come from :mod:`p2p_diloco.swarm.status`, signed and schema-checked; a row adds whether the
peer answers now (:mod:`p2p_diloco.swarm.liveness`): a peer whose record has not expired yet may have
crashed. The DHT modules are imported only when the swarm is read: the rows and cells alone (the page's
history, the command's table) import without hivemind.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable, Optional

COLUMNS = ("peer", "step", "phase", "inner steps", "samples/s", "loss", "claimed", "counted", "held-out", "reach",
           "answers", "device", "ranks", "version", "uptime", "shard", "settings")


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
        "-" if r["loss"] is None else f"{r['loss']:.3f}", str(r.get("samples", 0)), counted_cell(r), held_out_cell(r),
        "direct" if r["reachability"] == "direct" else "NAT",
        {True: "yes", False: "NO", None: "-"}[r["answers"]], r["device"], str(r.get("ranks", 1)), r["version"],
        format_duration(r["uptime_s"]),
        "-" if r["data_shard"] is None else str(r["data_shard"]),
        r["fingerprint"][:8] + ("" if r["fingerprint"] == main else " (other)"),
    )))


def counted_cell(r: dict, number: Callable[[int], str] = str) -> str:
    """``800 (100 %)``: of the samples the peer claims it trained in its applied outer steps, how many its groups'
    robust rule counted (the weight of its Δ: sync/robust.py fair_weights), or ``-`` if it reports none."""
    counted, samples = r.get("counted_samples"), r.get("samples", 0)
    if counted is None:
        return "-"
    return number(counted) + (f" ({100 * counted / samples:.0f} %)" if samples else "")


def held_out_cell(r: dict) -> str:
    """``2.345@10``: the peer's latest held-out loss of θ_global and the outer step it measured it at (its claim:
    the record's schema bounds it, nobody checks it), or ``-``."""
    loss, step = r.get("eval_loss"), r.get("eval_step")
    return "-" if loss is None else f"{loss:.3f}" + ("" if step is None else f"@{step}")


def main_fingerprint(fingerprints: Iterable[str]) -> Optional[str]:
    """The settings fingerprint most of a run's live peers train with (None without peers)."""
    counts = Counter(fingerprints)
    return counts.most_common(1)[0][0] if counts else None


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
