"""What `p2p-diloco env` reports: this machine as a bug report needs it (like `accelerate env`).

Versions of p2p-diloco, Python and the libraries it trains with, the OS, CPU cores, the devices and
their memory, and whether the swarm can dial this machine back (the dial-back check a peer runs at
start-up, :mod:`p2p_diloco.swarm.reachability`). That check needs a swarm member to ask: without
``--initial-peers`` it is not run, and the report says how to run it.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata
from typing import Optional, Sequence

LIBRARIES = ("torch", "hivemind", "transformers", "bitsandbytes", "datasets")
GIB = 2**30


def package_version(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def devices() -> dict:
    """CPU cores (all, and those this process may use), RAM, and each CUDA device with its memory."""
    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not on every OS
        ram = None
    gpus = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            gpus.append(dict(index=index, name=props.name, memory_bytes=props.total_memory,
                             capability=f"{props.major}.{props.minor}"))
    return dict(cpu_cores=os.cpu_count(), cpu_cores_usable=usable, ram_bytes=ram, gpus=gpus)


def check_reachability(initial_peers: Sequence[str], host: str, port: int, announce_ip: Optional[str]) -> dict:
    """The dial-back check, from a node on `host`:`port` that joins the swarm through `initial_peers` and
    leaves at once. Raises ConnectionError or NodeAddressError (one line each)."""
    from p2p_diloco.stopping import shutdown_dht
    from p2p_diloco.swarm.identity import Identity
    from p2p_diloco.swarm.node import peer_ids_of, start_dht
    from p2p_diloco.swarm.reachability import probe
    from p2p_diloco.swarm.records import node_validators

    identity = Identity.load_or_create(None)
    dht = start_dht(host, port, identity, node_validators(identity), announce_ip, initial_peers)
    try:
        found = probe(dht, peer_ids_of(initial_peers))
    finally:
        shutdown_dht(dht)
    if found is None:
        return dict(checked=True, mode=None, detail="no initial peer answered the dial-back request")
    return dict(checked=True, mode=found.mode, detail=found.detail, summary=found.summary(port))


NOT_CHECKED = dict(checked=False, detail="not checked: it needs a swarm member to dial this machine back; run "
                                         "`p2p-diloco env --initial-peers MULTIADDR` (a bootstrap node's address, "
                                         "with the --port a peer here would use)")


def collect(reachability: dict) -> dict:
    """The whole report as a dict (the `--json` output); `reachability` from :func:`check_reachability`
    or NOT_CHECKED."""
    from p2p_diloco.version import __version__

    import torch

    versions = {"p2p-diloco": __version__, "python": platform.python_version()}
    versions.update({name: package_version(name) for name in LIBRARIES})
    versions["cuda"] = torch.version.cuda  # what torch was built with; None for a CPU build
    return dict(versions=versions, os=platform.platform(), python_executable=sys.executable, devices=devices(),
                reachability=reachability)


def format_report(report: dict) -> str:
    """The report as lines to paste into a bug report."""
    versions, hw = report["versions"], report["devices"]
    lines = ["Copy-and-paste the text below into your bug report.", ""]
    missing = {"cuda": "none (a CPU build of torch)"}
    lines += [f"- {name}: {version or missing.get(name, 'not installed')}" for name, version in versions.items()]
    lines.append(f"- OS: {report['os']}")
    lines.append(f"- Python executable: {report['python_executable']}")
    lines.append(f"- CPU cores: {hw['cpu_cores']} ({hw['cpu_cores_usable']} usable by this process)")
    lines.append(f"- RAM: {hw['ram_bytes'] / GIB:.1f} GiB" if hw["ram_bytes"] else "- RAM: unknown")
    if hw["gpus"]:
        lines += [f"- GPU {g['index']}: {g['name']}, {g['memory_bytes'] / GIB:.1f} GiB, compute capability "
                  f"{g['capability']}" for g in hw["gpus"]]
    else:
        lines.append("- GPUs: none visible to torch")
    reach = report["reachability"]
    if not reach["checked"]:
        lines.append(f"- Reachability: {reach['detail']}")
    else:
        lines.append(f"- Reachability: {reach.get('summary') or reach['detail']}")
    return "\n".join(lines)


def run_env(initial_peers: Sequence[str], host: str, port: int, announce_ip: Optional[str], as_json: bool) -> int:
    """The `env` command: print the report (text or JSON); exit status 0, or 2 or 3 (one line) when the
    dial-back check could not join the swarm."""
    from p2p_diloco.exit_codes import EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, fail
    from p2p_diloco.logs import setup_logging
    from p2p_diloco.swarm.node import NodeAddressError

    reachability = NOT_CHECKED
    if initial_peers:
        setup_logging(verbose=False)
        try:
            reachability = check_reachability(initial_peers, host, port, announce_ip)
        except NodeAddressError as e:
            return fail(str(e), EXIT_USAGE)
        except ConnectionError as e:
            return fail(str(e), EXIT_UNREACHABLE)
    report = collect(reachability)
    print(json.dumps(report, indent=2) if as_json else format_report(report))
    return EXIT_OK
