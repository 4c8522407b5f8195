"""Status records without a network: their schema, what a joiner concludes from them, the table."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

import pytest

from p2p_diloco.config import run_fingerprint, settings_differences, settings_fingerprint, shared_settings
from p2p_diloco.status_command import format_run
from p2p_diloco.swarm.identity import Identity
from p2p_diloco.swarm.records import RecordPublisher, StatusValue
from p2p_diloco.swarm.status import PeerStatus, StatusPublisher, choose_shard, parse_status, settings_mismatch
from p2p_diloco.swarm.status_report import run_rows
from tests.conftest import tiny_config

CFG = tiny_config()
SETTINGS = shared_settings(CFG, "a" * 64)
FINGERPRINT = settings_fingerprint(SETTINGS)
TTL = 60.0


def status_value(**change) -> dict:
    value = dict(outer_step=3, phase="training", inner_steps=30, samples_per_s=12.5, loss=4.25, reachability="direct",
                 version="0.1.0", device="cpu", uptime_s=95.0, data_shard=None, fingerprint=FINGERPRINT,
                 settings=SETTINGS, time=time.time())
    return {**value, **change}


def peer(peer_id: str, expires_in: float = TTL, **change) -> PeerStatus:
    """A status record as read from the DHT; by default just stored (it expires a ttl from now)."""
    status = parse_status(Identity.load_or_create(None).record_subkey, status_value(**change))
    assert status is not None
    return PeerStatus(peer_id, status.record, time.time() + expires_in)


def test_a_status_record_is_read_with_its_author():
    identity = Identity.load_or_create(None)
    status = parse_status(identity.record_subkey, status_value())
    assert status.peer_id == identity.peer_id and status.record.outer_step == 3 and status.settings_trusted
    assert run_fingerprint(CFG, "a" * 64) == FINGERPRINT  # the settings a peer publishes hash to its fingerprint


@pytest.mark.parametrize("change", [
    {"outer_step": "3"}, {"outer_step": -1}, {"loss": float("nan")}, {"samples_per_s": -1.0}, {"phase": "bogus"},
    {"device": "x" * 65}, {"data_shard": 2**21}, {"fingerprint": "not hex"}, {"extra": 1},
    {"settings": {f"s.k{i}": i for i in range(200)}}, {"settings": {"Bad Name": 1}}, {"settings": {"a.b": [1, 2]}},
    {"eval_loss": -0.5}, {"eval_loss": float("inf")}, {"eval_loss": "2.5"}, {"eval_step": -1},
])
def test_a_malformed_status_record_is_skipped(change):
    assert parse_status(Identity.load_or_create(None).record_subkey, status_value(**change)) is None


def test_unsigned_and_non_dict_records_are_skipped():
    assert parse_status(b"no owner", status_value()) is None
    assert parse_status(Identity.load_or_create(None).record_subkey, "garbage") is None


def test_settings_differences_name_the_keys():
    other = shared_settings(CFG.replace(inner={"lr": 5e-3}, outer={"codec": "int8"}), "a" * 64)
    assert settings_differences(other, SETTINGS) == ["inner.lr = 0.005 here, 0.003 there",
                                                     "outer.codec = 'int8' here, 'none' there"]
    assert settings_differences(SETTINGS, SETTINGS) == []


def test_a_joiner_on_other_settings_is_told_which_differ():
    mine = shared_settings(CFG.replace(model={"intermediate_size": 128}), "a" * 64)
    statuses = {"A": peer("A"), "B": peer("B")}
    message = settings_mismatch(statuses, "me", mine, settings_fingerprint(mine), "test", TTL)
    assert message.startswith("run 'test' is trained with other settings (2 of 2 live peers")
    assert "model.intermediate_size = 128 here, 64 there" in message
    # one peer on this peer's settings is a run it can train in; no other peer is a run of its own
    same = peer("C", fingerprint=settings_fingerprint(mine), settings=mine)
    assert settings_mismatch({**statuses, "C": same}, "me", mine, settings_fingerprint(mine), "test", TTL) is None
    assert settings_mismatch({"me": same}, "me", mine, settings_fingerprint(mine), "test", TTL) is None


def test_only_settled_peers_on_other_settings_stop_a_joiner():
    mine = shared_settings(CFG.replace(inner={"lr": 5e-3}), "a" * 64)
    starting = peer("A", phase="starting")  # the first peer of another run, say, starting beside this one
    stale = peer("B", expires_in=TTL / 3 - 1)  # not stored again for two thirds of the ttl: gone
    for statuses in ({"A": starting}, {"B": stale}, {"A": starting, "B": stale}):
        assert settings_mismatch(statuses, "me", mine, settings_fingerprint(mine), "test", TTL) is None
    settled = settings_mismatch({"A": starting, "B": stale, "C": peer("C")}, "me", mine, settings_fingerprint(mine),
                                "test", TTL)
    assert settled.startswith("run 'test' is trained with other settings (1 of 1 live peers")


def test_settings_that_do_not_hash_to_their_fingerprint_are_not_quoted():
    lying = peer("A", settings={**SETTINGS, "inner.lr": 123.0})
    mine = shared_settings(CFG.replace(inner={"lr": 5e-3}), "a" * 64)
    message = settings_mismatch({"A": lying}, "me", mine, settings_fingerprint(mine), "test", TTL)
    assert "123" not in message and "publish no settings that match their fingerprint" in message


def test_peers_that_start_together_take_different_free_shards():
    starting = {pid: peer(pid, data_shard=None, phase="starting") for pid in ("Qa", "Qb", "Qc")}
    reading = {"Qz": peer("Qz", data_shard=0)}
    statuses = {**starting, **reading}
    chosen = [choose_shard(statuses, pid, 4, FINGERPRINT) for pid in starting]
    assert sorted(chosen) == [1, 2, 3]
    # every shard read: it shares one, the same each time it asks
    full = {f"Q{i}": peer(f"Q{i}", data_shard=i) for i in range(4)}
    assert choose_shard(full, "Qnew", 4, FINGERPRINT) == choose_shard(full, "Qnew", 4, FINGERPRINT) in range(4)
    assert choose_shard({}, "Qalone", 1, FINGERPRINT) == 0


def test_claims_of_peers_on_other_settings_do_not_move_the_shard_choice():
    other = settings_fingerprint({**SETTINGS, "data.shards": 8})
    strangers = {f"Qs{i}": peer(f"Qs{i}", data_shard=i, fingerprint=other) for i in range(3)}
    strangers["Qs9"] = peer("Qs9", data_shard=None, phase="starting", fingerprint=other)
    assert choose_shard({**strangers, "Qz": peer("Qz", data_shard=0)}, "Qnew", 4, FINGERPRINT) == 1
    assert choose_shard(strangers, "Qnew", 4, FINGERPRINT) == 0


def test_the_status_table_shows_each_peer_and_other_settings():
    other = settings_fingerprint({**SETTINGS, "inner.lr": 1.0})
    statuses = {"QmPeerA1234567": peer("QmPeerA1234567"), "QmPeerB7654321": peer("QmPeerB7654321", outer_step=2),
                "QmPeerC0000000": peer("QmPeerC0000000", fingerprint=other, reachability="unreachable")}
    rows = run_rows(statuses, answering={"QmPeerA1234567"})
    assert [r["answers"] for r in rows] == [True, None, False]  # sorted by outer step; NAT peers are not asked
    table = format_run("test", rows)
    assert table.splitlines()[0] == f"run test: 3 live peer(s), outer step 3, settings {FINGERPRINT[:12]} " \
                                    f"(1 peer(s) on other settings: they never average with the others)"
    assert "A1234567" in table and "(other)" in table and "NAT" in table


def column_of(rows: list[dict], name: str) -> dict[str, str]:
    """The cells of the status table's column `name`, by the peer's short ID."""
    header, *lines = format_run("test", rows).splitlines()[1:]
    column = header.index(name)
    return {line.split()[0]: line[column:].split()[0] for line in lines}


def test_the_status_table_shows_the_ranks_of_an_island_peer():
    rows = run_rows({"QmIsland1234567": peer("QmIsland1234567", ranks=8), "QmSingle7654321": peer("QmSingle7654321")},
                    answering=set())
    assert column_of(rows, "ranks") == {"d1234567": "8", "e7654321": "1"}


def test_the_status_table_shows_each_peers_claimed_samples_and_what_its_groups_counted():
    rows = run_rows({"QmIsland1234567": peer("QmIsland1234567", samples=800, counted_samples=800),
                     "QmLiarxx7654321": peer("QmLiarxx7654321", samples=2**48, counted_samples=400),
                     "QmOldxxx0000000": peer("QmOldxxx0000000", samples=400)}, answering=set())
    assert column_of(rows, "claimed") == {"d1234567": "800", "x7654321": str(2**48), "x0000000": "400"}
    assert column_of(rows, "counted") == {"d1234567": "800", "x7654321": "400", "x0000000": "-"}
    assert {r["peer_id"]: (r["samples"], r["counted_samples"]) for r in rows} == {  # JSON
        "QmIsland1234567": (800, 800), "QmLiarxx7654321": (2**48, 400), "QmOldxxx0000000": (400, None)}


def test_a_peer_reports_what_its_groups_counted_of_its_samples():
    from p2p_diloco.train.peer_view import PeerView

    class Status:
        fields: dict = {}

        def update(self, **fields):
            self.fields = {**self.fields, **fields}

    view = PeerView(Status())
    view.applied(800, 3, 0, 0.5)
    assert view.status.fields["samples"] == 800 and view.status.fields["counted_samples"] is None  # not reported
    view.applied(800, 3, 0, 0.5, counted_samples=400)
    view.applied(800, 1, 0, 0.5, counted_samples=800)
    assert view.status.fields["samples"] == 2400 and view.status.fields["counted_samples"] == 1200


def test_the_status_table_shows_each_peers_latest_held_out_loss_and_its_step():
    rows = run_rows({"QmEvaluated1234": peer("QmEvaluated1234", eval_loss=2.3456, eval_step=10),
                     "QmNotYet7654321": peer("QmNotYet7654321")}, answering=set())
    assert column_of(rows, "held-out") == {"ated1234": "2.346@10", "t7654321": "-"}
    assert {r["peer_id"]: r["eval_step"] for r in rows} == {"QmEvaluated1234": 10, "QmNotYet7654321": None}  # JSON


class FakeDHT:
    """What a RecordPublisher calls: store, which can be made to block like a slow network."""

    def __init__(self):
        self.stored: list[dict] = []
        self.release = threading.Event()
        self.release.set()
        self.storing = threading.Event()

    def store(self, key, value, subkey, expiration_time) -> bool:
        self.storing.set()
        self.release.wait(10)
        self.stored.append(value)
        return True


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_non_finite_loss_is_published_as_none_and_never_raises(caplog):
    dht = FakeDHT()
    publisher = StatusPublisher(dht, "test", Identity.load_or_create(None).record_subkey, TTL,
                                fingerprint=FINGERPRINT, settings=SETTINGS, reachability="direct", device="cpu")
    try:
        publisher.update(inner_steps=5, samples_per_s=float("inf"), loss=float("nan"))  # a diverging run

        def statuses() -> list[dict]:  # the run announcement's publisher stores on the same DHT
            return [value for value in dht.stored if "phase" in value]

        publisher.publish(phase="training", loss=float("inf"))
        wait_for(lambda: statuses() and statuses()[-1]["phase"] == "training")
        last = statuses()[-1]
        assert last["loss"] is None and last["samples_per_s"] == 0.0 and last["inner_steps"] == 5
        StatusValue.parse_obj(last)  # what other nodes accept
        publisher.publish(loss=2.5, eval_loss=float("nan"), eval_step=4)  # a held-out loss that diverged too
        wait_for(lambda: statuses()[-1]["loss"] == 2.5)
        assert statuses()[-1]["eval_loss"] is None
        StatusValue.parse_obj(statuses()[-1])
        # a value the schema refuses (a bug) is logged once and not stored; the training loop goes on
        publisher.publish(phase="bogus")
        publisher.publish(phase="bogus")
        publisher.publish(phase="left")  # a last word: stored before publish returns, after anything before it
        assert all(value["phase"] != "bogus" for value in statuses()) and statuses()[-1]["phase"] == "left"
        assert len([r for r in caplog.records if "not publishing this peer's status record" in r.message]) == 1
    finally:
        publisher.close()


@contextlib.contextmanager
def publisher_on_fake_dht(ttl: float) -> Iterator[tuple[FakeDHT, RecordPublisher]]:
    dht = FakeDHT()
    records = RecordPublisher(dht, "test_status", b"subkey", ttl=ttl, what="test")  # refreshed every ttl / 3
    try:
        yield dht, records
    finally:
        records.close()


def test_an_update_never_waits_for_a_store_and_a_last_word_stays_last():
    with publisher_on_fake_dht(ttl=0.3) as (dht, records):
        dht.release.clear()  # the network is slow: the refresh holds the store
        records.update({"n": 1})
        assert dht.storing.wait(5)
        records.update({"n": 2})  # neither waits for the store in progress (it would hang here until released)
        records.publish({"n": 3})
        dht.release.set()
        wait_for(lambda: {"n": 3} in dht.stored)
        assert {"n": 2} not in dht.stored  # replaced before its turn came: the newer value says more
        records.publish({"n": 4}, keep_fresh=False)  # a last word: stored now, never refreshed over
        stored = len(dht.stored)
        assert dht.stored[-1] == {"n": 4}
        time.sleep(0.35)
        assert len(dht.stored) == stored and dht.stored[-1] == {"n": 4}


def test_a_published_record_is_stored_at_once_not_at_the_next_refresh():
    with publisher_on_fake_dht(ttl=600.0) as (dht, records):  # refreshed every 200 s
        records.publish({"phase": "ready"})
        wait_for(lambda: dht.stored == [{"phase": "ready"}])  # within wait_for's 5 s, far before the refresh


def test_a_status_record_as_a_peer_publishes_it_passes_every_nodes_schema_check():
    """hivemind's SchemaValidator (on every DHT node of the run) refuses a record that parsing would change, a
    field filled in with its default included: a status record without ``stored_step`` was refused everywhere."""
    import time

    from hivemind.dht.routing import DHTID
    from hivemind.dht.schema import SchemaValidator
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer, get_dht_time

    from p2p_diloco.swarm.records import RunRecords
    from p2p_diloco.swarm.status import first_status

    validator = SchemaValidator(RunRecords, allow_extra_keys=True, prefix="run")
    value = dict(first_status("a" * 64, {}, "direct", "cpu"), uptime_s=1.0, time=time.time())

    def record(value: dict) -> DHTRecord:
        return DHTRecord(key=DHTID.generate(source="run_status").to_bytes(),
                         subkey=MSGPackSerializer.dumps(b"[owner:key]"), value=MSGPackSerializer.dumps(value),
                         expiration_time=get_dht_time() + 10)

    assert validator.validate(record(value))
    assert validator.validate(record(dict(value, stored_step=3, phase="keeping")))
    assert validator.validate(record(dict(value, eval_loss=4.0833, eval_step=9)))  # its latest held-out loss
    assert not validator.validate(record({k: v for k, v in value.items() if k != "stored_step"}))


def test_an_assistance_request_as_a_peer_publishes_it_passes_every_nodes_schema_check(tmp_path):
    """The same trap for an unreachable peer's assistance request: one without the claim cap and the norm clip (left
    to their defaults) was refused by every node, so no assistant ever reduced for a run nobody can dial."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.schema import SchemaValidator
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer, get_dht_time

    from p2p_diloco.config import load_config
    from p2p_diloco.swarm.records import SHARED_PREFIX, SharedRecords
    from p2p_diloco.sync.assistant import assistance_request
    from tests.swarm_helpers import tiny_config_file

    validator = SchemaValidator(SharedRecords, allow_extra_keys=True, prefix=SHARED_PREFIX)
    cfg = load_config(tiny_config_file(tmp_path, outer={"claim_cap": 2, "norm_clip": 1.5}))  # TOML integers too
    value = assistance_request(cfg, "a" * 64, [(300, 32), (32,)], [[0, 1]], time.time())

    def record(value: dict) -> DHTRecord:
        return DHTRecord(key=DHTID.generate(source=f"{SHARED_PREFIX}_assistance").to_bytes(),
                         subkey=MSGPackSerializer.dumps(b"[owner:key]"), value=MSGPackSerializer.dumps(value),
                         expiration_time=get_dht_time() + 10)

    assert validator.validate(record(value))
    assert not validator.validate(record({k: v for k, v in value.items() if k != "claim_cap"}))
