"""A record whose claim nobody served is set aside until its author publishes another state, or until this
peer holds that state (it loaded it, from a keeper say): then the record counts again, and its author is a
groupmate, not a peer this one cannot see (issue 20's keeper test: a joiner that stepped alone).

Two real DHT nodes on 127.0.0.1 with signed progress records.
"""

import hashlib

import pytest

from p2p_diloco.swarm.progress import TRAINING
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

        mine.set_aside({author: (4, sha("step 4"))})
        assert author not in mine.fetch() and author in mine.set_aside_records

        mine.served(4, sha("another step 4"))  # another state: the claim stays aside
        assert author not in mine.fetch()
        mine.served(4, sha("step 4"))
        assert mine.fetch()[author].sha256 == sha("step 4") and not mine.set_aside_records

        mine.set_aside({author: (4, sha("step 4"))})
        theirs.publish(5, sha("step 5"), TRAINING)  # its author moved on: its new claim counts
        wait_until(lambda: author in mine.fetch() and mine.fetch()[author].outer_step == 5, 30, "the new claim")
