"""What `p2p-diloco status` does: join the DHT as a client, read the peers' status records, print them.

The node it starts stores nothing for others and trains nothing; it checks every record's signature
(a record in another peer's name is dropped by the DHT validators) and every status record's schema
(a malformed one is skipped with a warning). It also asks each peer that others can dial whether it
answers now: a peer whose record has not expired yet may have crashed. The reading, and each peer's row,
is :mod:`p2p_diloco.swarm.status_report`'s (the run's page reads the same); this module prints the table.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from typing import Optional, Sequence

from p2p_diloco.exit_codes import EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, fail
from p2p_diloco.logs import setup_logging
from p2p_diloco.stopping import install_stop_handlers, shutdown_dht
from p2p_diloco.swarm.status_report import COLUMNS, main_fingerprint, peer_cells, read_runs

logger = logging.getLogger(__name__)


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
