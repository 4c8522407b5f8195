"""`p2p-diloco env`: this machine's setup for a bug report, from the real CLI (in this process: without
--initial-peers it starts no node). Its dial-back check, which needs a swarm, runs in test_bootstrap.py
against the bootstrap node started there."""

import json
import os
import subprocess
import sys

import pytest

from p2p_diloco.env_report import LIBRARIES
from tests.cli_run import invoke_cli

pytestmark = pytest.mark.timeout(120)


def env_cli(*args: str) -> subprocess.CompletedProcess:
    return invoke_cli("env", *args)


def test_env_reports_versions_devices_and_how_to_check_reachability():
    import torch

    result = env_cli("--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    versions = report["versions"]
    assert versions["torch"] == torch.__version__ and versions["cuda"] == torch.version.cuda
    assert versions["python"] == ".".join(map(str, sys.version_info[:3]))
    assert versions["p2p-diloco"] and versions["hivemind"] and versions["transformers"]
    assert set(LIBRARIES) <= set(versions)
    assert report["devices"]["cpu_cores"] == os.cpu_count() and report["devices"]["ram_bytes"] > 0
    assert len(report["devices"]["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert report["reachability"]["checked"] is False

    text = env_cli()
    assert text.returncode == 0, text.stderr
    for name, version in versions.items():
        assert f"- {name}: " in text.stdout and (version is None or version in text.stdout), name
    assert f"- CPU cores: {os.cpu_count()} " in text.stdout and "- RAM: " in text.stdout
    assert "- Reachability: not checked" in text.stdout and "p2p-diloco env --initial-peers MULTIADDR" in text.stdout
