"""A loop that ends on an exception while its overlapped sync waits does not leave the sync running.

A real in-process peer on 127.0.0.1 with the sync overlapped (τ = 2); a second real DHT node keeps a
progress record saying it still trains at the same outer step, so the peer's sync waits for it (up
to round_wait_timeout = 10 minutes). The peer's data then runs out during the overlap, an exception
in the loop: the peer must leave at once, its sync stopped, not wait out the sync.
"""

import threading

import pytest

from p2p_diloco.swarm.node import start_run_node, visible_maddrs
from p2p_diloco.swarm.progress import TRAINING, SwarmProgress
from tests.conftest import tiny_config
from tests.inprocess import fixed_batches, inprocess_peers

pytestmark = pytest.mark.timeout(240)

VOCAB = 64


def test_an_exception_during_an_overlapped_sync_stops_the_sync():
    cfg = tiny_config(outer={"sync_delay": 2}, swarm={"round_wait_timeout": 600.0, "progress_ttl": 600.0})
    steps = cfg.inner.steps_per_outer
    # the round's inner steps and one overlapped step: the next one finds no batch (StopIteration)
    (batches,) = fixed_batches(1, steps + 1, cfg.inner.batch_size, cfg.data.seq_len, VOCAB)
    with inprocess_peers(cfg, VOCAB, [batches]) as (peer,):
        other = start_run_node(cfg.run.name, "127.0.0.1", 0, initial_peers=visible_maddrs(peer.progress.dht))
        progress = SwarmProgress(other.dht, cfg.run.name, 600.0, other.identity.record_subkey, peer.fingerprint)
        try:
            progress.publish(0, peer.sha256, TRAINING)  # alive and answering: the peer's sync waits for it
            errors: list[BaseException] = []

            def run() -> None:
                try:
                    peer.run()
                except BaseException as e:  # the exception the loop ended on
                    errors.append(e)

            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            thread.join(120)  # far less than the 600 s the sync would wait
            assert not thread.is_alive(), "the peer waited for its overlapped sync instead of stopping it"
            assert len(errors) == 1 and isinstance(errors[0], StopIteration), errors
            assert peer.inner.steps_done == steps + 1
            assert peer.global_model.outer_step == 0  # the round it left applied nothing
        finally:
            peer.stop_event.set()
            progress.close()
            other.dht.shutdown()
