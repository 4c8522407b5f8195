"""A record whose claim nobody served is set aside until its author publishes another state, or until this
peer holds that state (it loaded it, from a keeper say): then the record counts again, and its author is a
groupmate, not a peer this one cannot see (issue 20's keeper test: a joiner that stepped alone).

A record also stays in the run's history once it expired: a peer that the run left behind does not take
the run's next steps alone because the peers that took them have gone (CI: a NATed peer whose round failed).

Two real DHT nodes on 127.0.0.1 with signed progress records.
"""

import functools
import hashlib

import pytest

from p2p_diloco.swarm.liveness import answering
from p2p_diloco.swarm.progress import READY, TRAINING
from tests.swarm_helpers import progress_pair, wait_until

pytestmark = pytest.mark.timeout(120)

FINGERPRINT = hashlib.sha256(b"settings").hexdigest()


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_a_set_aside_claim_counts_again_once_this_peer_holds_its_state_or_its_author_moves_on():
    with progress_pair(FINGERPRINT) as (nodes, (mine, theirs)):
        author = nodes[1].dht.peer_id.to_base58()
        mine.publish(3, sha("step 3"), TRAINING)
        theirs.publish(4, sha("step 4"), TRAINING)
        wait_until(lambda: len(mine.fetch()) == 2, 30, "both progress records")

        declined = "this peer does not take that jump on so few vouchers"
        mine.set_aside({author: (4, sha("step 4"))}, declined)
        assert author not in mine.fetch() and author in mine.set_aside_records

        mine.served(4, sha("another step 4"))  # another state: the claim stays aside
        assert author not in mine.fetch()
        mine.served(4, sha("step 4"))
        assert mine.fetch()[author].sha256 == sha("step 4") and not mine.set_aside_records

        # a claim nobody served is a strike, and is asked for again; the second in a row sets it aside
        mine.set_aside({author: (4, sha("step 4"))})
        assert author in mine.fetch()
        mine.set_aside({author: (4, sha("step 4"))})
        assert author not in mine.fetch() and author in mine.set_aside_records
        mine.served(4, sha("step 4"))  # served after all: forgiven
        assert author in mine.fetch()

        mine.set_aside({author: (4, sha("step 4"))}, declined)
        theirs.publish(5, sha("step 5"), TRAINING)  # its author moved on: its new claim counts
        wait_until(lambda: author in mine.fetch() and mine.fetch()[author].outer_step == 5, 30, "the new claim")


def test_the_runs_history_outlives_the_records_it_was_read_from():
    with progress_pair(FINGERPRINT, ttl=3.0) as (nodes, (mine, theirs)):
        author = nodes[1].dht.peer_id.to_base58()
        mine.publish(1, sha("step 1"), TRAINING)
        theirs.publish(4, sha("step 4"), TRAINING)
        wait_until(lambda: author in mine.fetch(), 30, "the other peer's record")
        assert mine.history().outer_step == 4
        theirs.close()  # it stops keeping its record fresh: it expires within the TTL
        wait_until(lambda: author not in mine.fetch(), 30, "the record to expire")
        history = mine.history()
        assert history is not None and (history.outer_step, history.peers) == (4, 1)
        assert history.age_s >= 3.0  # and it says how old


def test_a_planned_member_that_does_not_answer_counts_in_no_plan_until_it_writes_again():
    """A crashed member's READY record stands until it expires, and every round planned with it failed to form
    (the simulation, 3 peers, seed 156). After a round that formed no group, the planned members that do not answer
    twice count in no plan until they write another record (SwarmProgress.drop_silent)."""
    with progress_pair(FINGERPRINT) as (nodes, (mine, theirs)):
        mine.answering = functools.partial(answering, nodes[0].dht)
        author = nodes[1].dht.peer_id.to_base58()
        for progress in (mine, theirs):
            progress.publish(3, sha("step 3"), TRAINING)
            progress.publish(3, sha("step 3"), READY)
        wait_until(lambda: len(mine.fetch()) == 2 and mine.fetch()[author].phase == READY, 30, "both READY records")
        records = mine.fetch()
        assert mine.drop_silent(records, [author]) == [] and author in mine.fetch()  # it answers
        nodes[1].dht.shutdown()  # it crashed: its READY record stands on the first node until the TTL
        assert mine.drop_silent(records, [author]) == [author]
        assert author not in mine.fetch() and author not in mine.set_aside_records
