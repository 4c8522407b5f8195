"""A peer's node that dials another node at an agreed moment and asks it whether it is alive: two of them,
each dialing the other, dial each other at once, as every pair of an all-reduce's group does when it begins.

    python -m tests.dial_at_once --ip IP --dir DIR --name NAME --dial OTHER

Writes DIR/NAME.maddr once its node runs (alone: it joins no swarm, so it has not spoken to OTHER), waits for
DIR/OTHER.maddr and DIR/go (a Unix time), dials OTHER's address at that time, asks it
(:func:`p2p_diloco.swarm.liveness.answering`) and writes DIR/NAME.result: "answered" or "silent: " and what
the dial found (:func:`p2p_diloco.swarm.join_failure.dial`). Runs until SIGTERM or SIGINT, then shuts its node down.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from functools import partial
from pathlib import Path
from typing import Optional

WAIT_S = 120.0  # for the other's address and the start
ANSWER_TIMEOUT_S = 20.0  # for the liveness request once connected


def _wait_for(path: Path, stop: threading.Event) -> str:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if stop.wait(0.05) or time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {WAIT_S:.0f} s")
    return path.read_text()


def _write(path: Path, text: str) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(text)
    temporary.replace(path)


async def _dial(_dht, node, maddr: str) -> Optional[str]:
    """None once this node is connected to the node at `maddr`, else what went wrong."""
    from p2p_diloco.swarm.join_failure import dial

    return await dial(node.p2p, maddr)


def main() -> None:
    from hivemind.utils.multiaddr import Multiaddr

    from p2p_diloco.swarm.liveness import answering
    from p2p_diloco.swarm.node import start_run_node, visible_maddrs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ip", required=True)
    parser.add_argument("--dir", required=True, type=Path)
    parser.add_argument("--name", required=True)
    parser.add_argument("--dial", required=True)
    args = parser.parse_args()
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    node = start_run_node("dial-at-once", args.ip, 0)
    try:
        _write(args.dir / f"{args.name}.maddr", visible_maddrs(node.dht)[0])
        maddr = _wait_for(args.dir / f"{args.dial}.maddr", stop)
        start = float(_wait_for(args.dir / "go", stop))
        time.sleep(max(0.0, start - time.time()))
        error = node.dht.run_coroutine(partial(_dial, maddr=maddr))
        other = Multiaddr(maddr).value_for_protocol("p2p")
        answered = not error and other in answering(node.dht, [other], timeout=ANSWER_TIMEOUT_S)
        _write(args.dir / f"{args.name}.result", "answered" if answered else f"silent: {error}")
        stop.wait(WAIT_S * 10)
    finally:
        node.dht.shutdown()


if __name__ == "__main__":
    main()
