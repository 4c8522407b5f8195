"""Agreeing on a round's outcome: a peer applies the group's mean only if every groupmate got it too.

A round's result is local knowledge: when a reducer freezes, its groupmates time out and see a
partial round, while the frozen peer, once thawed, may find its own result complete. Applying on
local knowledge alone would leave the group split. So after the all-reduce each member publishes a
report on the DHT: the attempt token it announced in the group's gather, whether its result is
complete, and the sha256 of the mean it holds. A member commits only if every groupmate reported,
for this attempt, a complete result with the same sha256; it rolls back (applies nothing) as soon
as one reports a failure, or when `commit_timeout` passes without every report.

A peer that commits therefore holds the same mean as every other peer that commits in its group.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from hivemind import DHT
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.swarm.records import RoundReport, RoundReportsValue, rounds_key, signed_records

logger = logging.getLogger(__name__)


class RoundReports:
    """Round outcome reports under ``<run>_rounds``: one signed subkey per peer, holding its two latest
    reports (a groupmate that is slow to read must still find the report on the round it waits for,
    after this peer has moved on to the next one)."""

    def __init__(self, dht: DHT, run_name: str, ttl: float, record_subkey: bytes):
        self.dht = dht
        self.key = rounds_key(run_name)
        self.ttl = ttl
        self.record_subkey = record_subkey
        self._published: list[dict] = []  # newest first

    def publish(self, outer_step: int, token: str, complete: bool, mean_sha256: Optional[str]) -> None:
        report = dict(outer_step=outer_step, token=token, complete=complete, mean_sha256=mean_sha256)
        self._published = [report, *self._published[:1]]
        try:
            self.dht.store(self.key, value=dict(reports=self._published), subkey=self.record_subkey,
                           expiration_time=get_dht_time() + self.ttl)
        except Exception as e:  # the report is best effort: silence makes groupmates roll back
            logger.warning("could not publish the round report: %r", e)

    def _fetch(self) -> dict[str, list[RoundReport]]:
        """Each reporting peer's latest reports, by the peer ID of the key that signed them."""
        return {author: list(value.reports)
                for author, value, _ in signed_records(self.dht, self.key, RoundReportsValue, "round report")}

    def agree(
        self, outer_step: int, tokens: dict[str, str], mean_sha256: str, timeout: float, stop: threading.Event
    ) -> Optional[str]:
        """None if every groupmate reported the same complete mean; else why the round is void.

        `tokens` maps each groupmate's peer ID (as the all-reduce group knows it) to the attempt token
        it gathered; a report counts only if that peer signed it and it names this step and token.
        """
        deadline = time.monotonic() + timeout
        while True:
            reports = self._fetch()
            missing = []
            for peer_id, token in tokens.items():
                report = next((r for r in reports.get(peer_id, ()) if (r.outer_step, r.token) == (outer_step, token)),
                              None)
                if report is None:
                    missing.append(peer_id)
                elif not report.complete:
                    return f"groupmate {peer_id[-8:]} reported an incomplete round"
                elif report.mean_sha256 != mean_sha256:
                    return f"groupmate {peer_id[-8:]} holds a different mean"
            if not missing:
                return None
            if time.monotonic() >= deadline:
                return f"no report from {len(missing)} groupmate(s) within {timeout:.0f} s"
            if stop.wait(0.2):
                return "this peer is stopping"
