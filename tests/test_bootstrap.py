"""The bootstrap node: copyable multiaddrs, a stable identity, a clean stop with its p2pd daemon, and the
dial-back check it answers (`p2p-diloco env --initial-peers`)."""

import json
import signal
import subprocess
import sys

import pytest

from p2p_diloco.process_tree import is_running
from tests.conftest import descendants, read_first_line

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(180)]


def p2pd_descendants(pid: int) -> list[int]:
    """hivemind runs the DHT in a child process, which runs the p2pd daemon."""
    found = []
    for child in descendants(pid):
        try:
            cmdline = open(f"/proc/{child}/cmdline", "rb").read().decode(errors="replace")
        except FileNotFoundError:
            continue
        if "p2pd" in cmdline:
            found.append(child)
    return found


def test_identity_file_keeps_the_peer_id_and_sigterm_stops_p2pd(processes, tmp_path):
    key = tmp_path / "bootstrap.key"
    first = processes.start("bootstrap-1", "bootstrap", "--host", "127.0.0.1", "--port", "0",
                            "--identity-path", str(key))
    maddr_1 = read_first_line(first)
    daemons = p2pd_descendants(first.pid)
    assert daemons, "the bootstrap node should run a p2pd daemon"
    first.send_signal(signal.SIGTERM)
    assert first.wait(10) == 0
    for pid in daemons:
        assert not is_running(pid), f"p2pd {pid} still runs after the bootstrap node stopped"

    second = processes.start("bootstrap-2", "bootstrap", "--host", "127.0.0.1", "--port", "0",
                             "--identity-path", str(key))
    maddr_2 = read_first_line(second)
    assert maddr_1.split("/p2p/")[1] == maddr_2.split("/p2p/")[1]
    # `env`'s dial-back check, through this bootstrap node: on loopback, it dials this machine back
    result = subprocess.run([sys.executable, "-m", "p2p_diloco.cli", "env", "--initial-peers", maddr_2, "--host",
                             "127.0.0.1", "--json"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    reachability = json.loads(result.stdout)["reachability"]
    assert reachability["checked"] and reachability["mode"] == "direct", reachability
    assert "1 peer(s) dialed TCP port(s)" in reachability["detail"]
    second.send_signal(signal.SIGINT)
    assert second.wait(10) == 0
