"""Reducing for a run's unreachable peers: the one thing they cannot do for each other.

A peer that nobody can dial averages as hivemind's client: it dials the reducers and reduces
nothing. A group made only of such peers has nobody to reduce. A circuit relay cannot carry their
parts to each other either: hivemind 1.1.12's p2pd caps every relayed connection at 128 KiB and two
minutes (its daemon restarts the relay service with libp2p's defaults, whatever its relay flags say;
docs/network.md has the measurement). So a reachable node reduces for them instead: an *assistant*
is hivemind's auxiliary averager, which takes parts to reduce and sends none of its own. The
bootstrap node runs assistants by default, and it needs to know no run for that:

* an unreachable peer keeps an :class:`~p2p_diloco.swarm.records.AssistanceRequest` on the key that
  all runs share (the run, the fingerprint of its settings, the shapes of the averaged tensors, the
  timeouts);
* :class:`AssistantPool` reads those requests and runs one :class:`Assistant` per (run, fingerprint),
  as long as somebody asks and within a budget of parameters (an assistant holds one fp32 copy);
* an :class:`Assistant` joins the round of an outer step at which every live peer is ready and
  unreachable (:func:`step_needing_help`). It gathers the agreed state, no samples and the role
  "assistant": the peers leave it out of the group's size, samples and commit reports (it holds no
  mean; a reducer that failed shows as a partial round on the peers).

What it costs the node: per outer step it receives every peer's whole pseudo-gradient and sends each
the averaged one back (2·N·S bytes for N peers and S bytes of parameters), and it sums them.
"""

from __future__ import annotations

import concurrent.futures
import logging
import secrets
import threading
import time
from collections import defaultdict
from math import prod
from typing import Optional, Sequence

import torch
from hivemind import DHT
from hivemind.averaging.control import AveragingStage

from p2p_diloco.remote_input import warn_once
from p2p_diloco.schedule import fragment_at
from p2p_diloco.protocol.plans import agreed_sha256
from p2p_diloco.protocol.view import READY, PeerProgress, averages
from p2p_diloco.swarm.progress import read_progress
from p2p_diloco.swarm.reachability import UNREACHABLE
from p2p_diloco.swarm.records import AssistanceRequest, assistance_key, progress_key, signed_records
from p2p_diloco.sync.codecs import CODECS
from p2p_diloco.sync.robust import aggregation_rule
from p2p_diloco.sync.outer_sync import (
    SwarmAverager, averager_prefix, averager_timeouts, group_bits, round_timeout,
)

logger = logging.getLogger(__name__)

POLL_S = 0.5  # how often an assistant reads its run's progress
REQUESTS_POLL_S = 5.0  # how often the pool reads the assistance requests


Publication = tuple[str, int, float]  # (peer, step, time) of a progress record: one per round a peer is ready for


def publication(record: PeerProgress) -> Publication:
    return record.peer_id, record.outer_step, record.time


def step_needing_help(records: Sequence[PeerProgress], spent: frozenset[Publication] = frozenset()) -> Optional[int]:
    """The latest outer step at which every live peer is ready to average and unreachable (a keeper, which never
    averages, left out), and at least two of them are ready for a round not joined yet: a record in `spent`
    is one the assistant's last round was for, still "ready" until its peer publishes again."""
    by_step: dict[int, list[PeerProgress]] = defaultdict(list)
    for record in records:
        if averages(record):
            by_step[record.outer_step].append(record)
    steps = [step for step, peers in by_step.items()
             if all(r.phase == READY and r.reachability == UNREACHABLE for r in peers)
             and sum(publication(r) not in spent for r in peers) >= 2]
    return max(steps, default=None)


class RoundsToAssist:
    """The rounds an assistant joins: each outer step that needs help, once per publication of the
    peers' "ready" records. The records of a round just tried still say "ready" until their peers publish
    again (those of a round reduced say "committing" once committed): joining another round for them
    would find no group and hold the assistant for a whole matchmaking timeout. So would a round for
    them and one peer that came to their step after it (a joiner on its way to load the next state: a
    CI run of the NAT test, whose three peers then waited 35 s for a reducer at the next step). A peer
    publishes anew (with a new time) for each round it is ready for, a retry included."""

    def __init__(self):
        self._last: frozenset[Publication] = frozenset()  # the records of the last round joined, at its step

    def next_round(self, records: Sequence[PeerProgress]) -> Optional[int]:
        """The step of the next round to join, if one needs help; remembers its records as joined."""
        step = step_needing_help(records, self._last)
        if step is not None:
            self._last = frozenset(publication(r) for r in records if r.outer_step == step)
        return step

    def overtaken(self, records: Sequence[PeerProgress], joined_step: int) -> Optional[int]:
        """A later step than `joined_step` that needs help while the assistant still looks for that round's
        group: its peers moved on (or others are ahead), and the round it waits for may never form."""
        step = step_needing_help(records, self._last)
        return step if step is not None and step > joined_step else None


class Assistant:
    """Reduces for the unreachable peers of one run, in the rounds where nobody of them can."""

    def __init__(self, dht: DHT, request: AssistanceRequest):
        self.dht = dht
        self.request = request
        self.averager = SwarmAverager(
            [torch.zeros(shape) for shape in request.shapes],
            dht,
            start=True,
            auxiliary=True,
            prefix=averager_prefix(request.run, request.fingerprint),
            allow_state_sharing=False,
            state_provider=lambda: ({}, []),  # it holds no state to serve
            codec=request.codec,
            aggregation=aggregation_rule(request),
            fragments=request.fragment_indices,
            **averager_timeouts(request),
        )
        self._rounds = RoundsToAssist()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._assist_while_needed, name=f"assistant-{request.run}", daemon=True)
        self._thread.start()

    @property
    def name(self) -> str:
        return f"run {self.request.run!r} (settings {self.request.fingerprint[:12]})"

    def _read_records(self) -> Optional[list[PeerProgress]]:
        try:
            return read_progress(self.dht, progress_key(self.request.run), self.request.fingerprint)
        except Exception as e:  # the DHT is shutting down, or a request failed: try again later
            logger.debug("assistant for %s could not read the progress: %r", self.name, e)
            return None

    def _assist_while_needed(self) -> None:
        while not self._stop.wait(POLL_S):
            records = self._read_records()
            step = None if records is None else self._rounds.next_round(records)
            if step is not None:
                self.reduce_round(step, agreed_sha256({r.peer_id: r for r in records}, step),
                                  sum(averages(r) and r.outer_step == step for r in records))

    def reduce_round(self, outer_step: int, global_sha256: str, peers: int) -> None:
        """Join the round toward outer step `outer_step` + 1 of the `peers` peers that start from
        `global_sha256`, and reduce for them; bounded by the round's timeouts, and never raises. While
        its group forms, the records are read every :data:`POLL_S`: once a later step needs help
        (:meth:`RoundsToAssist.overtaken`), the assistant leaves this round for it."""
        self.averager.set_group_bits(group_bits(outer_step))
        timeout = round_timeout(self.request)
        gather = dict(outer_step=outer_step, global_sha256=global_sha256, samples=0, token=secrets.token_hex(8),
                      role="assistant", fragment=fragment_at(outer_step, len(self.request.fragment_indices)))
        control = self.averager.step(gather=gather, timeout=timeout, allow_retries=False, wait=False)
        deadline = time.monotonic() + timeout + self.request.allreduce_timeout
        while True:
            try:
                control.result(timeout=max(0.0, min(POLL_S, deadline - time.monotonic())))
                break
            except concurrent.futures.TimeoutError:
                pass
            except Exception as e:  # no group formed, a sender failed: the peers see it and try again
                logger.info("%s: no round at outer step %d (%s)", self.name, outer_step + 1, e)
                return
            if self._stop.is_set():
                control.cancel()
                return
            if time.monotonic() >= deadline:
                control.cancel()
                logger.warning("%s: the round of outer step %d did not end in time", self.name, outer_step + 1)
                return
            later = self._later_step_needing_help(control, outer_step)
            if later is not None:
                control.cancel()  # hivemind stops the matchmaking; no group holds this assistant yet
                logger.info("%s: left the round of outer step %d, whose group had not formed: the peers need a "
                            "reducer at outer step %d", self.name, outer_step + 1, later + 1)
                return
        logger.info("%s: reduced outer step %d for %d unreachable peer(s)", self.name, outer_step + 1, peers)

    def _later_step_needing_help(self, control, outer_step: int) -> Optional[int]:
        """A later step that needs help, while this round still looks for its group (once the group formed,
        the assistant reduces for it to the end: its members count on its parts)."""
        if control.stage not in (AveragingStage.IDLE, AveragingStage.AWAITING_TRIGGER,
                                 AveragingStage.LOOKING_FOR_GROUP):
            return None
        records = self._read_records()
        return None if records is None else self._rounds.overtaken(records, outer_step)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        if self.averager.is_alive():
            self.averager.shutdown()


def assistance_request(cfg, fingerprint: str, shapes: Sequence[Sequence[int]], fragments: list[list[int]],
                       now: float) -> dict:
    """The request an unreachable peer of a run with settings `cfg` (a :class:`~p2p_diloco.config.Config`)
    publishes at `now`: every field of :class:`~p2p_diloco.swarm.records.AssistanceRequest`, none left to a
    default (hivemind's schema check refuses a record that parsing would change)."""
    swarm, outer = cfg.swarm, cfg.outer
    return dict(run=cfg.run.name, fingerprint=fingerprint, time=now, shapes=[list(shape) for shape in shapes],
                matchmaking_time=swarm.matchmaking_time, request_timeout=swarm.request_timeout,
                allreduce_timeout=swarm.allreduce_timeout, next_chunk_timeout=swarm.next_chunk_timeout,
                codec=outer.codec, fragments=fragments, aggregation=outer.aggregation, clip_factor=outer.clip_factor,
                clip_iterations=outer.clip_iterations, trim_fraction=outer.trim_fraction, claim_cap=outer.claim_cap,
                norm_clip=outer.norm_clip, drop_opposed=outer.drop_opposed)


def read_assistance_requests(dht: DHT) -> dict[tuple[str, str], AssistanceRequest]:
    """The latest well-formed request for each (run, fingerprint), from the peers that signed them."""
    requests: dict[tuple[str, str], AssistanceRequest] = {}
    for author, request, _ in signed_records(dht, assistance_key(), AssistanceRequest, "assistance request"):
        if request.codec not in CODECS:
            warn_once(author, "an assistance request", f"unknown codec {request.codec!r}")
            continue
        try:
            aggregation_rule(request)
        except ValueError as e:
            warn_once(author, "an assistance request", str(e))
            continue
        key = (request.run, request.fingerprint)
        if key not in requests or request.time > requests[key].time:
            requests[key] = request
    return requests


class AssistantPool:
    """A node's assistants: one per (run, fingerprint) that asks for one, within `max_params` in all."""

    def __init__(self, dht: DHT, max_params: int):
        self.dht = dht
        self.max_params = max_params
        self.assistants: dict[tuple[str, str], Assistant] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow_requests, name="assistant-pool", daemon=True)
        self._thread.start()

    def _params_in_use(self) -> int:
        return sum(prod(shape) for a in self.assistants.values() for shape in a.request.shapes)

    def _follow_requests(self) -> None:
        while not self._stop.wait(REQUESTS_POLL_S):
            try:
                requests = read_assistance_requests(self.dht)
            except Exception as e:  # the DHT is shutting down, or a request failed: try again later
                logger.debug("could not read the assistance requests: %r", e)
                continue
            for key in [k for k in self.assistants if k not in requests]:  # nobody asks any more
                logger.info("no more assisting %s: no peer asks", self.assistants[key].name)
                self.assistants.pop(key).close()
            for key, request in requests.items():
                if key not in self.assistants:
                    self._start(key, request)

    def _start(self, key: tuple[str, str], request: AssistanceRequest) -> None:
        params = sum(prod(shape) for shape in request.shapes)
        if self._params_in_use() + params > self.max_params:
            warn_once(f"{request.run}/{request.fingerprint[:12]}", "an assistance request",
                      f"its {params:,} parameters exceed what is left of --assist-max-params {self.max_params:,}")
            return
        try:
            self.assistants[key] = Assistant(self.dht, request)
        except Exception as e:  # an averager that cannot start (e.g. out of shared memory): say so, go on
            logger.warning("could not start an assistant for run %r: %r", request.run, e)
            return
        logger.info("assisting %s: its unreachable peers asked for a reducer (%s parameters)",
                    self.assistants[key].name, f"{params:,}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=REQUESTS_POLL_S + 30)
        for assistant in self.assistants.values():
            assistant.close()
        self.assistants.clear()
