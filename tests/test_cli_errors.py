"""The CLI refuses bad input with one clear line and a non-zero exit; every --help works.

An error found before the command starts a node (its flags, config, manifest, device, data files) is
checked in this process, through the CLI's own code (:func:`~tests.cli_run.invoke_cli`): a process for
each would pay seconds of imports to print one line. What needs a process of its own runs as one
(:func:`run_cli`): a node's DHT and p2pd, its signal handlers, a model built at start-up.
"""

import os
import socket
import subprocess
import sys

import pytest

from tests.cli_run import invoke_cli
from tests.conftest import REPO, TINY, Processes, read_first_line, write_toml

pytestmark = pytest.mark.timeout(120)


def run_cli(*args, timeout=90):
    """The CLI of this checkout (PYTHONPATH), in a process of its own."""
    return subprocess.run([sys.executable, "-m", "p2p_diloco.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


def cli_for(command: str):
    """How a test runs `command` up to an error it finds before it starts a node: `peer` and `join` find it
    first, in this process (:func:`~tests.cli_run.invoke_cli`); `bootstrap` installs its signal handlers
    and starts its process watcher first, in a process of its own (:func:`run_cli`)."""
    return run_cli if command == "bootstrap" else invoke_cli


@pytest.mark.parametrize("command", [[], ["bootstrap"], ["peer"], ["join"], ["status"], ["demo"], ["env"]])
def test_help_of_every_command(command):
    result = run_cli(*command, "--help")
    assert result.returncode == 0
    assert "Usage:" in result.stdout


def test_help_documents_the_shared_network_flags():
    for command in ("bootstrap", "peer", "join"):
        out = run_cli(command, "--help").stdout
        for flag in ("--host", "--port", "--announce-ip", "--identity-path", "--initial-peers"):
            assert flag in out, (command, flag)
    for command, flags in (("peer", ["--config"]), ("join", ["--state-dir"])):
        out = run_cli(command, "--help").stdout
        for flag in (*flags, "--metrics-file", "--max-outer-steps", "--device", "--tensorboard", "--wandb",
                     "--wait-for-peers"):
            assert flag in out, (command, flag)
    out = run_cli("status", "--help").stdout
    for flag in ("--initial-peers", "--run", "--json"):
        assert flag in out


def test_a_manifest_without_a_bootstrap_node_or_with_a_bad_one_is_a_clear_error(tmp_path):
    raw = {name: dict(values) for name, values in TINY.items()}
    manifest = write_toml(tmp_path / "run.toml", raw)
    result = invoke_cli("join", str(manifest), "--host", "127.0.0.1", "--state-dir", str(tmp_path / "state"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {manifest} names no bootstrap node (swarm.initial_peers): pass --initial-peers")
    raw["swarm"]["initial_peers"] = ["/ip4/127.0.0.1/tcp/31337"]
    write_toml(manifest, raw)
    result = invoke_cli("join", str(manifest), "--host", "127.0.0.1", "--state-dir", str(tmp_path / "state"))
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: swarm.initial_peers in {manifest}: '/ip4/127.0.0.1/tcp/31337' is not a peer")


def test_bad_config_value_exits_nonzero_naming_the_key(tmp_path):
    raw = {name: dict(values) for name, values in TINY.items()}
    raw["inner"]["lr"] = -0.5
    config = write_toml(tmp_path / "bad.toml", raw)
    result = invoke_cli("peer", "--config", str(config), "--host", "127.0.0.1")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: config: inner.lr = -0.5 is invalid: must be a number > 0"
    )


def test_unknown_config_key_exits_nonzero(tmp_path):
    config = tmp_path / "typo.toml"
    config.write_text("[outer]\nlearning_rate = 0.7\n")
    result = invoke_cli("peer", "--config", str(config))
    assert result.returncode == 2
    assert "unknown key outer.learning_rate" in result.stderr


@pytest.mark.parametrize("maddr", ["/ip4/127.0.0.1/tcp/31337", "not-a-multiaddr", "/ip4/999.1.1.1/tcp/1/p2p/x"])
def test_bad_multiaddr_exits_nonzero(maddr):
    for command in (["bootstrap", "--host", "127.0.0.1", "--port", "0"],
                    ["peer", "--config", str(REPO / "peers" / "demo.toml"), "--host", "127.0.0.1"]):
        result = cli_for(command[0])(*command, "--initial-peers", maddr)
        assert result.returncode == 2, result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("error: --initial-peers") and "is not a peer multiaddr" in last


def test_announce_ip_needs_a_fixed_port():
    result = run_cli("bootstrap", "--host", "127.0.0.1", "--port", "0", "--announce-ip", "127.0.0.1")
    assert result.returncode == 2
    assert "--announce-ip needs a fixed --port" in result.stderr


def test_unreachable_initial_peer_is_a_clear_error():
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWKXws21AxPSSvaJ2Z9MtftqvxNKLssc8Z3LRXZsbsejk1"
    result = run_cli("bootstrap", "--host", "127.0.0.1", "--port", "0", "--initial-peers", dead)
    assert_one_line_error(result, 3, f"could not join the swarm through {dead}: ",
                          "nothing listens at /ip4/127.0.0.1/tcp/9 (connection refused)")


def tiny_config_with(tmp_path, **sections):
    raw = {name: dict(values) for name, values in TINY.items()}
    for name, values in sections.items():
        raw[name].update(values)
    return write_toml(tmp_path / "run.toml", raw)


def assert_one_line_error(result, code: int, *fragments: str) -> None:
    assert result.returncode == code, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "Traceback" not in result.stderr, result.stderr[-2000:]
    for fragment in fragments:
        assert fragment in last, last


@pytest.mark.parametrize("device, message", [
    ("cuda:3", "--device cuda:3: "),  # no such GPU here, whether or not the machine has CUDA
    ("tpu", "--device 'tpu' is not a torch device"),
    ("mps", "--device mps: cannot use it on this machine"),
])
def test_a_device_this_machine_lacks_is_one_line(tmp_path, device, message):
    if device == "mps" and __import__("torch").backends.mps.is_available():
        pytest.skip("this machine has an MPS device")
    result = invoke_cli("peer", "--config", str(tiny_config_with(tmp_path)), "--host", "127.0.0.1", "--device", device)
    assert_one_line_error(result, 2, message)


def test_a_corpus_too_small_for_one_batch_is_one_line_at_start_up(tmp_path):
    paragraphs = [f"Paragraph {i} says a few plain words about river stones and morning light." for i in range(40)]
    (tmp_path / "tiny.txt").write_text("\n\n".join(paragraphs))  # some sequences, fewer than a batch
    config = tiny_config_with(tmp_path, data={"source": "files", "paths": ["tiny.txt"], "max_documents": 0},
                              inner={"batch_size": 64})
    result = run_cli("peer", "--config", str(config), "--host", "127.0.0.1")
    assert_one_line_error(result, 2, "inner.batch_size = 64")


def test_a_missing_data_file_is_one_line(tmp_path):
    config = tiny_config_with(tmp_path, data={"source": "files", "paths": ["nowhere.txt"]})
    result = invoke_cli("peer", "--config", str(config), "--host", "127.0.0.1")
    assert_one_line_error(result, 2, str(tmp_path / "nowhere.txt"), "does not exist")


def test_a_shipped_manifest_is_found_by_name_with_or_without_toml_from_any_directory(tmp_path, monkeypatch):
    # the template names no bootstrap node: the error says which file `join` found
    monkeypatch.chdir(tmp_path)
    result = invoke_cli("join", "llama-150m-c4.toml", "--host", "127.0.0.1", "--state-dir", str(tmp_path / "state"))
    assert_one_line_error(result, 2, f"{REPO / 'peers' / 'llama-150m-c4.toml'} names no bootstrap node")


def test_shipped_manifests_are_found_where_a_wheel_installs_them(tmp_path, monkeypatch):
    import sysconfig

    from p2p_diloco import manifest

    installed = tmp_path / "prefix" / "share" / "p2p-diloco" / "peers"  # pyproject's data-files
    installed.mkdir(parents=True)
    (installed / "demo.toml").write_text((REPO / "peers" / "demo.toml").read_text())
    monkeypatch.setattr(manifest, "CHECKOUT", tmp_path / "site-packages")  # no source checkout around the package
    monkeypatch.setattr(sysconfig, "get_path", lambda name, scheme=None: str(tmp_path / "prefix"))
    monkeypatch.chdir(tmp_path)
    assert manifest.find_manifest("demo") == manifest.find_manifest("demo.toml") == installed / "demo.toml"
    assert manifest.shipped_manifests() == ["demo"]
    (tmp_path / "demo.toml").write_text("")  # a file of that name here is what the user means
    assert manifest.find_manifest("demo.toml").resolve() == tmp_path / "demo.toml"
    with pytest.raises(manifest.ManifestError, match="no run manifest 'other': .* one of: demo$"):
        manifest.find_manifest("other")


def test_a_bad_demo_config_value_is_one_line(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text('[inner]\nbatch_size = "sixteen"\n')
    result = invoke_cli("demo", "--config", str(config), "--out", str(tmp_path / "out"))
    assert_one_line_error(result, 2, "config: inner.batch_size = 'sixteen' is invalid")
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def bootstrap_node(tmp_path_factory):
    """A real bootstrap node on 127.0.0.1 for this module's tests that need one: its multiaddr and identity key."""
    directory = tmp_path_factory.mktemp("bootstrap")
    procs = Processes(directory)
    key = directory / "bootstrap.key"
    proc = procs.start("bootstrap", "bootstrap", "--host", "127.0.0.1", "--port", "0", "--identity-path", str(key))
    try:
        yield read_first_line(proc), key
    finally:
        procs.stop_all()


def node_command(command: str, tmp_path, *args: str) -> list[str]:
    """`command` (bootstrap, peer or join) on 127.0.0.1 with a tiny run config, then `args`."""
    if command == "bootstrap":
        return ["bootstrap", "--host", "127.0.0.1", *args]
    config = tiny_config_with(tmp_path)
    if command == "peer":
        return ["peer", "--config", str(config), "--host", "127.0.0.1", *args]
    return ["join", str(config), "--state-dir", str(tmp_path / "state"), "--host", "127.0.0.1", *args]


@pytest.mark.parametrize("command", ["bootstrap", "join"])  # join runs peer's code after its manifest's
def test_a_port_in_use_is_one_line(tmp_path, command):
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWKXws21AxPSSvaJ2Z9MtftqvxNKLssc8Z3LRXZsbsejk1"  # never dialed
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = cli_for(command)(*node_command(command, tmp_path, "--port", str(port), "--initial-peers", dead))
    assert_one_line_error(result, 2, f"--port {port}: another program (another node?) listens on 127.0.0.1:{port}")


def test_the_port_of_a_running_bootstrap_node_is_in_use(bootstrap_node):
    """p2pd listens with SO_REUSEPORT: without the check, a second node would share the first one's port."""
    maddr, _ = bootstrap_node
    port = maddr.split("/tcp/")[1].split("/")[0]
    result = run_cli("bootstrap", "--host", "127.0.0.1", "--port", port)
    assert_one_line_error(result, 2, f"listens on 127.0.0.1:{port}")


@pytest.mark.parametrize("command", [["bootstrap", "--host", "127.0.0.1", "--port", "0"], ["status"]])
def test_another_peer_id_at_the_bootstrap_address_is_named(bootstrap_node, command):
    maddr, _ = bootstrap_node
    host_port, real_id = maddr.split("/p2p/")
    wrong_id = "QmQ5QhQ8zchZMjsF6A6VRfLySo6f431zqYaYywHr4uTsHX"
    result = run_cli(*command, "--initial-peers", f"{host_port}/p2p/{wrong_id}")
    assert_one_line_error(result, 3, f"the node at {host_port} answers with another peer ID than the address's "
                                     f"{wrong_id} (got {real_id}): copy the address the bootstrap node printed")


@pytest.mark.parametrize("command", ["bootstrap", "peer"])
def test_an_identity_in_use_is_one_line(bootstrap_node, tmp_path, command):
    maddr, key = bootstrap_node
    result = run_cli(*node_command(command, tmp_path, "--port", "0", "--identity-path", str(key),
                                   "--initial-peers", maddr))
    assert_one_line_error(result, 2, f"--identity-path {str(key)!r}: a node with this key's peer ID "
                                     f"{maddr.split('/p2p/')[1]} is already in the swarm",
                          "another --identity-path")
