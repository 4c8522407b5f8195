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

logger = logging.getLogger(__name__)


class RoundReports:
    """Round outcome reports under ``<run>_round_<step>``, one subkey per peer."""

    def __init__(self, dht: DHT, run_name: str, ttl: float):
        self.dht = dht
        self.run_name = run_name
        self.ttl = ttl
        self.peer_id = dht.peer_id.to_base58()

    def _key(self, outer_step: int) -> str:
        return f"{self.run_name}_round_{outer_step}"

    def publish(self, outer_step: int, token: str, complete: bool, mean_sha256: Optional[str]) -> None:
        value = dict(token=token, complete=complete, mean_sha256=mean_sha256)
        try:
            self.dht.store(self._key(outer_step), value=value, subkey=self.peer_id,
                           expiration_time=get_dht_time() + self.ttl)
        except Exception as e:  # the report is best effort: silence makes groupmates roll back
            logger.warning("could not publish the round report: %r", e)

    def _fetch(self, outer_step: int) -> dict[str, dict]:
        found = self.dht.get(self._key(outer_step), latest=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        return {subkey: item.value for subkey, item in found.value.items() if isinstance(item.value, dict)}

    def agree(
        self, outer_step: int, tokens: dict[str, str], mean_sha256: str, timeout: float, stop: threading.Event
    ) -> Optional[str]:
        """None if every groupmate reported the same complete mean; else why the round is void."""
        deadline = time.monotonic() + timeout
        while True:
            reports = self._fetch(outer_step)
            missing = []
            for peer_id, token in tokens.items():
                report = reports.get(peer_id)
                if report is None or report.get("token") != token:
                    missing.append(peer_id)
                elif not report.get("complete"):
                    return f"groupmate {peer_id[-8:]} reported an incomplete round"
                elif report.get("mean_sha256") != mean_sha256:
                    return f"groupmate {peer_id[-8:]} holds a different mean"
            if not missing:
                return None
            if time.monotonic() >= deadline:
                return f"no report from {len(missing)} groupmate(s) within {timeout:.0f} s"
            if stop.wait(0.2):
                return "this peer is stopping"
