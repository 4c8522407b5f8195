"""Agreeing on a round's outcome: a peer applies the group's mean only if every groupmate got it too.

A round's result is local knowledge: when a reducer freezes, its groupmates time out and see a
partial round, while the frozen peer, once thawed, may find its own result complete. Applying on
local knowledge alone would leave the group split. So after the all-reduce each member publishes a
report on the DHT: the attempt token it announced in the group's gather, whether its result is
complete, and the sha256 of the mean it holds. A member commits only if every groupmate reported,
for this attempt, a complete result with the same sha256; it rolls back (applies nothing) as soon
as one reports a failure, or when `commit_timeout` passes without every report.

A peer that commits therefore holds the same mean as every other peer that commits in its group.

The reports also say what travelled (:mod:`p2p_diloco.sync.audit`): the digest of the encoded
parts each member sent each reducer, and of the averaged parts it got back. A reducer's report
states the digest of the averaged bytes it sent everyone; a member that got other bytes from it
holds proof, its own observation against the reducer's own signed word, that the reducer sent
different values to different peers: the round is void and that member bans the reducer
(:meth:`RoundReports.agree`). A groupmate cannot frame a reducer so: each member compares only what
it received itself. Once every report agrees, each reducer's auditor publishes its verdict in a
second version of its report, and every member waits for all of them (:meth:`RoundReports.audited`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Collection, Optional

from hivemind import DHT
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.polling import poll_intervals
from p2p_diloco.swarm.liveness import SilentPeers
from p2p_diloco.swarm.records import AUDIT_OK, RoundReport, RoundReportsValue, rounds_key, signed_records

logger = logging.getLogger(__name__)

REPORT_POLL_S = 0.2  # how often a member reads its groupmates' reports while it waits for them (at most)
FIRST_REPORT_POLL_S = 0.025  # the first reads come sooner: most reports are there within a few round trips


@dataclass(frozen=True)
class Void:
    """Why a round is void for this peer; `culprit`: the groupmate this peer's own observation convicts."""

    reason: str
    culprit: Optional[str] = None

    def __str__(self) -> str:
        return self.reason


def judge(reports: dict[str, RoundReport], expected: set[str], mean_sha256: str,
          received: dict[str, str], relayed: Collection[str] = ()) -> tuple[Optional[Void], bool]:
    """(why the round is void, or None; whether that is final) from the groupmates' reports found so far.

    `expected`: the groupmates whose reports count; `received`: for each reducer, the sha256 of the
    averaged parts this peer got from it (see :mod:`p2p_diloco.sync.audit`). An incomplete round or a
    reducer whose own report states other averaged bytes than this peer got is final at once; a
    different mean is final once every report is in, so that the reports still to come may name the
    reducer that caused it. A reducer in `relayed` (its parts reached this peer through a relay,
    :mod:`p2p_diloco.sync.relay`) is not the culprit of such a void: the relay may have changed them.
    """
    different = None
    for peer_id in sorted(reports):
        report = reports[peer_id]
        if not report.complete:
            return Void(f"groupmate {peer_id[-8:]} reported an incomplete round"), True
        if peer_id in received and report.outputs.get(peer_id) != received[peer_id]:
            stated = report.outputs.get(peer_id)
            return Void(f"reducer {peer_id[-8:]} sent this peer averaged parts of sha256 {received[peer_id][:12]} "
                        f"but states it sent {stated[:12] if stated else 'nothing'}: it sent different values to "
                        f"different peers{' (or its relay changed them)' if peer_id in relayed else ''}",
                        culprit=None if peer_id in relayed else peer_id), True
        if report.mean_sha256 != mean_sha256:
            different = different or Void(f"groupmate {peer_id[-8:]} holds a different mean")
    if different is not None:
        return different, set(reports) >= expected
    return None, set(reports) >= expected


class RoundReports:
    """Round outcome reports under ``<run>_rounds``: one signed subkey per peer, holding its two latest
    reports (a groupmate that is slow to read must still find the report on the round it waits for,
    after this peer has moved on to the next one)."""

    def __init__(self, dht: DHT, run_name: str, ttl: float, record_subkey: bytes,
                 answering: Optional[Callable[[list[str]], set[str]]] = None):
        self.dht = dht
        self.key = rounds_key(run_name)
        self.ttl = ttl
        self.record_subkey = record_subkey
        self.answering = answering  # which of some peers answer on the network (p2p_diloco.swarm.liveness)
        self._published: list[dict] = []  # newest first

    def publish(self, outer_step: int, token: str, complete: bool, mean_sha256: Optional[str],
                inputs: Optional[dict[str, str]] = None, outputs: Optional[dict[str, str]] = None,
                audits: Optional[dict[str, str]] = None) -> None:
        """Store this peer's report on the round (`outer_step`, `token`); a second report on the same
        round (with the audits' verdicts) replaces the first, so the record still holds the round before."""
        report = dict(outer_step=outer_step, token=token, complete=complete, mean_sha256=mean_sha256,
                      inputs=dict(inputs or {}), outputs=dict(outputs or {}), audits=dict(audits or {}))
        earlier = [r for r in self._published if (r["outer_step"], r["token"]) != (outer_step, token)]
        self._published = [report, *earlier[:1]]
        try:
            self.dht.store(self.key, value=dict(reports=self._published), subkey=self.record_subkey,
                           expiration_time=get_dht_time() + self.ttl)
        except Exception as e:  # the report is best effort: silence makes groupmates roll back
            logger.warning("could not publish the round report: %r", e)

    def _fetch(self) -> dict[str, list[RoundReport]]:
        """Each reporting peer's latest reports, by the peer ID of the key that signed them."""
        return {author: list(value.reports)
                for author, value, _ in signed_records(self.dht, self.key, RoundReportsValue, "round report")}

    def _wait(self, outer_step: int, tokens: dict[str, str],
              verdict: Callable[[dict[str, RoundReport]], tuple[Optional[Void], bool]], timeout: float,
              stop: threading.Event, dialable: Collection[str] = ()) -> tuple[Optional[Void], dict[str, RoundReport]]:
        """Read the reports of the groupmates in `tokens` (peer ID -> the attempt token it gathered; a
        report counts only if that peer signed it and it names this step and token) until `verdict`
        of those found is final, or `timeout`: (why the round is void or None, the reports found).

        A groupmate in `dialable` (others can dial it) whose report is missing and that does not answer on the
        network twice in a row (:class:`~p2p_diloco.swarm.liveness.SilentPeers`) left or crashed: the round is
        void at once, not at the timeout (a member SIGKILLed mid-round cost the others ``commit_timeout``, then
        more: issue 42's churn check measured 23 s)."""
        deadline = time.monotonic() + timeout
        intervals = poll_intervals(FIRST_REPORT_POLL_S, REPORT_POLL_S)
        silent = SilentPeers(self.answering)
        while True:
            found = {}
            for peer_id, reports in self._fetch().items():
                if peer_id in tokens:
                    report = next((r for r in reports if (r.outer_step, r.token) == (outer_step, tokens[peer_id])),
                                  None)
                    if report is not None:
                        found[peer_id] = report
            void, final = verdict(found)
            if final:
                return void, found
            gone = silent.check(sorted(set(tokens) - set(found) & set(dialable)))
            if gone:
                return Void(f"groupmate {gone[0][-8:]} does not answer on the network: it left or crashed"), found
            if time.monotonic() >= deadline:
                missing = len(set(tokens) - set(found))
                return void or Void(f"no report from {missing} groupmate(s) within {timeout:.0f} s"), found
            if stop.wait(next(intervals)):
                return Void("this peer is stopping"), found

    def agree(
        self, outer_step: int, tokens: dict[str, str], mean_sha256: str, timeout: float, stop: threading.Event,
        received: Optional[dict[str, str]] = None, relayed: Collection[str] = (), dialable: Collection[str] = (),
    ) -> tuple[Optional[Void], dict[str, RoundReport]]:
        """(None if every groupmate reported the same complete mean, else why the round is void; the
        groupmates' reports on the round, by peer ID).

        `tokens` maps each groupmate's peer ID (as the all-reduce group knows it) to the attempt token
        it gathered. `received`: for each reducer, the sha256 of the averaged parts this peer got from
        it; a reducer whose report states others is the void's culprit unless it is in `relayed` (see
        :func:`judge`). `dialable`: the groupmates whose silence on the network says they are gone (:meth:`_wait`).
        """
        return self._wait(outer_step, tokens,
                          lambda found: judge(found, set(tokens), mean_sha256, received or {}, relayed), timeout, stop,
                          dialable)

    def audited(self, outer_step: int, tokens: dict[str, str], auditors: dict[str, str], timeout: float,
                stop: threading.Event, dialable: Collection[str] = ()) -> Optional[Void]:
        """None once every reducer's auditor has reported it sound; else why the round is void.

        `auditors` maps each audited reducer to its auditor (groupmates in `tokens`); an auditor's
        verdict is the ``audits`` entry of its report on this round. A verdict other than "ok", or none
        within `timeout`, voids the round.
        """
        def verdict(found: dict[str, RoundReport]) -> tuple[Optional[Void], bool]:
            waiting = False
            for reducer, auditor in sorted(auditors.items()):
                said = found[auditor].audits.get(reducer) if auditor in found else None
                if said is None:
                    waiting = True
                elif said != AUDIT_OK:
                    return Void(f"the audit of reducer {reducer[-8:]} by {auditor[-8:]} found: {said}"), True
            return (Void(f"no verdict on {len(auditors)} reducer(s) in time") if waiting else None), not waiting

        return self._wait(outer_step, {a: tokens[a] for a in auditors.values()}, verdict, timeout, stop, dialable)[0]
