"""Private runs: a manifest's run.allowed_peers lists the only identities whose records and groups its peers take.

The swarm test runs, on 127.0.0.1, a bootstrap node and two listed `p2p-diloco peer` processes, and
beside them two hostile processes (tests/hostile.py) on the run's own manifest with keys nobody
listed: the project's own peer with its start-up check skipped, which publishes the run's records,
joins its rounds and downloads its state as a listed peer would, and a process writing malformed,
forged and well-formed records under the run's keys. The listed peers must train as a pair with one
θ_global, and refuse both strangers' records and the peer's group membership, each logged with its
peer ID.
"""

import re
import subprocess
import sys

import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey

from p2p_diloco.config import ConfigError, check_member, run_fingerprint
from p2p_diloco.metrics import read_metrics
from p2p_diloco.swarm.identity import Identity
from p2p_diloco.swarm.node import start_run_node
from p2p_diloco.swarm.records import ProgressValue, RunMembers, progress_key, signed_records
from p2p_diloco.sync.group_screen import GroupScreen
from tests.conftest import REPO, tiny_config
from tests.swarm_helpers import (
    FAST_TIMEOUTS, assert_consistent, outer_steps, start_bootstrap, start_peer, tiny_config_file, wait_for_steps,
    wait_until,
)

RUN = "test"


def new_identity(directory, name: str) -> tuple[str, str]:
    """(the path of a new identity file, its peer ID)."""
    path = directory / f"{name}.key"
    return str(path), Identity.load_or_create(str(path)).peer_id


def fresh_peer_id() -> str:
    return Identity(RSAPrivateKey(), None, is_new=True).peer_id


# ----- config -------------------------------------------------------------------------------------
def test_allowed_peers_are_checked_and_part_of_the_fingerprint():
    a, b = fresh_peer_id(), fresh_peer_id()
    public = run_fingerprint(tiny_config(), "tok")
    private = run_fingerprint(tiny_config(run={"allowed_peers": [a, b]}), "tok")
    assert private != public
    assert run_fingerprint(tiny_config(run={"allowed_peers": [b, a, b]}), "tok") == private  # order, repeats
    assert run_fingerprint(tiny_config(run={"allowed_peers": [a]}), "tok") != private
    for bad in ("", "Qm0OIl", a[:-1], "12D3 not base58"):
        with pytest.raises(ConfigError, match=r"^config: run.allowed_peers\[1\] = .* is not a peer ID; copy"):
            tiny_config(run={"allowed_peers": [a, bad]})
    with pytest.raises(ConfigError, match="must be a list of peer IDs"):
        tiny_config(run={"allowed_peers": a})
    check_member(tiny_config(), a)  # a public run takes anyone
    check_member(tiny_config(run={"allowed_peers": [a]}), a)
    with pytest.raises(ConfigError, match=f"identity {b} is not in run.allowed_peers"):
        check_member(tiny_config(run={"allowed_peers": [a]}), b)


def test_an_unlisted_identity_stops_at_start_up(tmp_path):
    identity_path, peer_id = new_identity(tmp_path, "unlisted")
    config = tiny_config_file(tmp_path, run={"allowed_peers": [fresh_peer_id()]})
    result = subprocess.run([sys.executable, "-m", "p2p_diloco.cli", "peer", "--config", str(config),
                             "--identity-path", identity_path, "--host", "127.0.0.1"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2, result.stderr
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"error: this peer's identity {peer_id} is not in run.allowed_peers"), last_line


# ----- the validator and the screen, in this process ------------------------------------------------
def record_of(key: str, author: RSAPrivateKey, value: dict) -> DHTRecord:
    """A DHT record as a validator sees it once the signature is stripped: under `author`'s owner marker."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.routing import DHTID

    marker = RSASignatureValidator(author).local_public_key
    return DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(marker),
                     MSGPackSerializer.dumps(value), 0.0)


def test_run_members_refuse_the_run_records_of_unlisted_authors():
    listed, stranger = RSAPrivateKey(), RSAPrivateKey()
    members = RunMembers(RUN, [Identity(listed, None, False).peer_id])
    assert members.validate(record_of(progress_key(RUN), listed, {}))
    assert not members.validate(record_of(progress_key(RUN), stranger, {}))
    assert not members.validate(record_of("p2p_diloco_assistance", stranger, {"run": RUN}))  # names the run
    assert members.validate(record_of("p2p_diloco_assistance", stranger, {"run": "another"}))  # another run's
    assert members.validate(record_of("another_progress", stranger, {}))  # not a key of the run


def test_the_screen_refuses_unlisted_peers():
    listed, stranger = PeerID.from_base58(fresh_peer_id()), PeerID.from_base58(fresh_peer_id())
    assert not GroupScreen().refuses(stranger)  # a public run
    screen = GroupScreen(members=frozenset({listed.to_base58()}))
    assert not screen.refuses(listed) and screen.refuses(stranger)
    assert not screen.admits(stranger, b"")


# ----- a real swarm ------------------------------------------------------------------------------
def start_hostile(processes, mode: str, config, maddr: str, *extra: str):
    return processes.start(f"hostile-{mode}", mode, "--config", str(config), "--initial-peers", maddr, *extra,
                           module="tests.hostile")


def progress_authors(maddr: str, allowed_peers) -> set[str]:
    """The authors of the run's progress records that a node of the run (listing `allowed_peers`) reads."""
    node = start_run_node(RUN, "127.0.0.1", 0, initial_peers=[maddr], allowed_peers=allowed_peers)
    try:
        return {author for author, _, _ in signed_records(node.dht, progress_key(RUN), ProgressValue, "progress")}
    finally:
        node.dht.shutdown()


def events(metrics, name: str) -> list[dict]:
    return [r for r in read_metrics(metrics) if r["event"] == name] if metrics.exists() else []


@pytest.mark.long  # CI checks each refusal in-process above: the screen, the records, an unlisted identity at start-up
@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_a_private_run_refuses_every_identity_it_does_not_list(processes, tmp_path):
    (path_a, a), (path_b, b), (path_u, unlisted) = (new_identity(tmp_path, n) for n in ("a", "b", "unlisted"))
    config = tiny_config_file(tmp_path / "private", run={"allowed_peers": [a, b]}, inner={"steps_per_outer": 10},
                              swarm=FAST_TIMEOUTS)
    maddr = start_bootstrap(processes)
    # the three start training together, at outer step 0. The listed peers sleep 0.2 s per inner step and, as
    # reducers, hold back their first round's averaged parts 1.5 s; the unlisted peer does neither. It is ready
    # first, waits for them (it reads their records), and asks their leader to take it in while their records
    # still say outer step 0. Without these, a round of the tiny model took 0.5 s, and the unlisted peer, slow
    # on a loaded machine, once found the pair past outer step 0 before it asked: it then only asked for the
    # state (1 CI run).
    unlisted_metrics = processes.log_dir / "unlisted.jsonl"
    start_hostile(processes, "unlisted-peer", config, maddr, "--identity-path", path_u,
                  "--metrics-file", str(unlisted_metrics), "--wait-for-peers", "2")
    wait_until(lambda: "waiting for 2 peers" in processes.log("hostile-unlisted-peer"), 120, "the unlisted peer")
    listed = [start_peer(processes, f"peer{i}", config, maddr, "--identity-path", path, "--wait-for-peers", "2",
                         faults="inner_step_delay=0.2,allreduce_delay=1.5") for i, path in enumerate((path_a, path_b))]
    start_hostile(processes, "records", config, maddr)
    wait_for_steps(listed, 2)
    logs = lambda: "".join(processes.log(f"peer{i}") for i in range(2))  # noqa: E731
    refused_groups = f"ignoring an offer to average from peer {unlisted}: this identity is not in run.allowed_peers"
    wait_until(lambda: refused_groups in logs(), 120, "the listed peers to refuse the unlisted peer's groups")
    # left behind by the rounds it was refused, it asks for the state
    state_events = lambda: events(unlisted_metrics, "state_loaded") + events(unlisted_metrics, "state_load_failed")  # noqa: E731
    wait_until(state_events, 120, "the unlisted peer to ask for the state")
    (writer,) = re.findall(r"records signed as (\w+)", processes.log("hostile-records"))

    for stranger in (unlisted, writer):  # refused by the validators of the listed peers' DHT nodes
        assert f"ignoring records of private run '{RUN}' from peer {stranger}: this identity is not in " \
               f"run.allowed_peers" in logs()
    assert logs().count(refused_groups) <= 2  # once per listed peer at most
    # what a node of the run reads of the run's progress: the listed peers' records alone
    assert progress_authors(maddr, [a, b]) == {a, b}
    # the listed peers trained as a pair, with one θ_global
    assert_consistent(listed)
    for path in listed:
        assert {r["group_size"] for r in outer_steps(path)} == {2}, outer_steps(path)
    assert all(r["group_size"] == 1 for r in outer_steps(unlisted_metrics)), outer_steps(unlisted_metrics)
    assert all(p.poll() is None for p in processes.procs), [(p.name, p.returncode) for p in processes.procs]
    # the unlisted peer has the run's fingerprint, but no listed peer serves it the state
    donors = {r.get("donor") for r in state_events()}
    assert not donors & {a, b}, f"the unlisted peer downloaded the run's state from {sorted(donors & {a, b})}"
