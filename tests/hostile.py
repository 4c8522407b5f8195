"""A hostile process for the tests: it joins a run's DHT and sends what no honest peer would.

    python -m tests.hostile records|markup|donor|groupmate --config RUN.toml --initial-peers MADDR

* ``records``: writes malformed, unsigned, forged and lying records under the run's DHT keys from a
  node that stores anything, and keeps them fresh;
* ``markup``: keeps a well-formed, signed status record fresh whose device and version are markup;
* ``donor``: one identity per state of :data:`STATE_VARIANTS` (malformed, or sound and unvouched),
  each declared the best state donor of the run and serving its state to every peer that downloads
  from it: a peer that loads the state is offered them all, one after the other, before an honest
  donor's state;
* ``poisoned-donor``: signs a progress record one outer step ahead of the honest peers (kept one
  step ahead as they move) with the sha256 of a well-formed poisoned state, declares itself the best
  donor and serves that state: what a single identity needs to replace θ_global, were a state one
  step ahead not checked against the peer's own (p2p_diloco/train/state_check.py);
* ``groupmate``: joins the run's averaging groups with the malformed metadata or tensors of
  :data:`GROUPMATE_VARIANTS`, one identity per kind (an honest peer bans an identity after one offence),
  ``--lanes`` identities at a time; it asks the leaders that the honest peers' membership plan names
  (p2p_diloco/sync/membership.py, computed from their progress records, as any stranger can);
* ``unlisted-peer``: a real ``p2p-diloco peer`` on a private run's manifest that does not list its
  identity, with the start-up check of its own identity skipped: it publishes the run's records,
  joins its rounds and downloads its state as a listed peer would.

It prints one line per action (``wrote``, ``served``, ``identity``) and runs until SIGTERM. It uses
hivemind directly, never the project's validators: it is what a stranger on the DHT can do.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import multiprocessing
import os
import signal
import sys
import threading
import time
from types import SimpleNamespace
from typing import AsyncIterator

import hivemind.averaging.averager
import hivemind.dht.dht
import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import CompressionInfo
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.streaming import split_for_streaming
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.config import load_config, run_fingerprint
from p2p_diloco.event_loop import keep_tasks_in
from p2p_diloco.hashing import tensors_sha256
from p2p_diloco.process_tree import children_exit_with_this_process
from p2p_diloco.swarm.identity import owner_peer_id
from p2p_diloco.swarm.progress import read_progress
from p2p_diloco.swarm.records import progress_key, rounds_key, runs_key, status_key
from p2p_diloco.swarm.status import first_status
from p2p_diloco.sync.group_screen import GroupScreen
from p2p_diloco.protocol.membership import plan_membership
from p2p_diloco.sync.membership import PlannedMatchmaking
from p2p_diloco.sync.outer_sync import averager_prefix, group_bits
from p2p_diloco.train.data import TextData, tokenizer_sha256
from p2p_diloco.train.model import build_model, trainable_parameters

LIE_STEP = 10**6  # a well-formed progress claim of a state that nobody has


class StoresAnything(RSASignatureValidator):
    """Signs what it writes under its own key, and keeps whatever anybody sends it."""

    def validate(self, record) -> bool:
        return True


def say(line: str) -> None:
    """One line on stdout in one write: the groupmate's lanes say theirs at once, and print's two writes (the text,
    then the newline) from two threads ran together into one line (CI, once)."""
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def run_parameters(config_path: str):
    """The fingerprint and the initial parameters of the run, computed as a peer does."""
    cfg = load_config(config_path)
    data = TextData(cfg.data)
    model = build_model(cfg.model, data.vocab_size, cfg.run.seed)
    params = [p.detach().clone() for p in trainable_parameters(model)]
    return cfg, run_fingerprint(cfg, tokenizer_sha256(data.tokenizer)), params


def start_dht(initial_peers, await_ready: bool = True) -> tuple[DHT, StoresAnything]:
    """A DHT node that stores anything; it strips the run's signatures from what it reads, like any node.
    Without `await_ready`, call its ``wait_until_ready`` before use."""
    signer = StoresAnything(RSAPrivateKey())
    dht = DHT(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=[signer],
              start=True, await_ready=await_ready)
    return dht, signer


def honest_state(dht: DHT, run_name: str, exclude_sha256: str = "") -> tuple[int, str]:
    """The highest outer step an honest-looking progress record claims (none of `exclude_sha256`, this
    process's own), and that record's state sha256."""
    found = dht.get(progress_key(run_name), latest=True)
    best = (0, "ab" * 32)
    for item in (found.value.values() if found is not None and isinstance(found.value, dict) else ()):
        value = getattr(item, "value", None)
        if (isinstance(value, dict) and isinstance(value.get("outer_step"), int) and value["outer_step"] < LIE_STEP
                and value.get("sha256") != exclude_sha256 and value.get("phase") != "loading"):
            best = max(best, (value["outer_step"], str(value.get("sha256"))))
    return best


# ----- records ------------------------------------------------------------------------------------
def write_records(args, stop: threading.Event) -> None:
    cfg, fingerprint, _ = run_parameters(args.config)
    dht, signer = start_dht(args.initial_peers)
    mine = signer.local_public_key
    say(f"records signed as {owner_peer_id(mine)}")
    victim_key = RSASignatureValidator(RSAPrivateKey()).local_public_key  # a marker this node cannot sign for
    good = dict(outer_step=1, sha256="ab" * 32, phase="training", samples=0, time=time.time(), fingerprint=fingerprint,
                reachability="direct", leader="")
    progress = {
        b"no owner": good,  # unsigned: nobody can tell whose it is
        mine + b"#string-step": {**good, "outer_step": "9"},
        mine + b"#negative-step": {**good, "outer_step": -1},
        mine + b"#huge-step": {**good, "outer_step": 2**63 - 1},
        mine + b"#float-samples": {**good, "samples": 1.5},
        mine + b"#bad-sha": {**good, "sha256": "not a sha"},
        mine + b"#bad-phase": {**good, "phase": "bogus"},
        mine + b"#extra-field": {**good, "extra": 1},
        mine + b"#missing-field": {k: v for k, v in good.items() if k != "phase"},
        mine + b"#not-a-dict": "garbage",
        victim_key: {**good, "phase": "left"},  # another peer's key, not signed by it
        mine + b"#other-settings": {**good, "fingerprint": "cd" * 32},  # well-formed, another run's settings
        mine + b"#lie": {**good, "outer_step": LIE_STEP},  # well-formed and signed: a state nobody serves
    }
    report = dict(outer_step=1, token="00" * 8, complete=False, mean_sha256=None)
    rounds = {
        mine + b"#bad-token": dict(reports=[{**report, "token": "x"}]),
        mine + b"#three-reports": dict(reports=[report] * 3),
        victim_key: dict(reports=[report]),  # a forged failure report in another peer's name
        b"no owner": dict(reports=[report]),
    }
    well_formed = dict(outer_step=1, phase="training", inner_steps=5, samples_per_s=1.0, loss=None,
                       reachability="direct", version="0", device="cpu", uptime_s=1.0, data_shard=None,
                       fingerprint=fingerprint, settings={}, time=time.time())
    status = {  # malformed or forged: `p2p-diloco status` must skip each, and show the honest peers
        mine + b"#string-step": {**well_formed, "outer_step": "9"},
        mine + b"#nan-loss": {**well_formed, "loss": float("nan")},
        mine + b"#too-many-settings": {**well_formed, "settings": {f"s.k{i}": i for i in range(1000)}},
        mine + b"#long-device": {**well_formed, "device": "x" * 10_000},
        mine + b"#not-a-dict": "garbage",
        victim_key: well_formed,  # in another peer's name
        b"no owner": well_formed,
    }
    runs = {mine + b"#bad-run-name": dict(run="no spaces allowed", fingerprint=fingerprint, time=time.time())}
    keys = ((progress_key(cfg.run.name), progress), (rounds_key(cfg.run.name), rounds),
            (status_key(cfg.run.name), status), (runs_key(), runs))
    try:
        while not stop.is_set():
            for key, values in keys:
                for subkey, value in values.items():
                    if isinstance(value, dict) and "time" in value:
                        value = {**value, "time": time.time()}
                    dht.store(key, value, get_dht_time() + 30, subkey=subkey)
            say("wrote records")
            stop.wait(3)
    finally:
        dht.shutdown()


MARKUP = '<img src=x onerror="document.title=1">'  # a device name, as a stranger may claim one


def write_markup(args, stop: threading.Event) -> None:
    """A well-formed, signed status record of the run whose strings are markup: pages show them as text."""
    cfg, fingerprint, _ = run_parameters(args.config)
    dht, signer = start_dht(args.initial_peers)
    record = {**first_status(fingerprint, {}, "unreachable", MARKUP), "version": "<b>0</b><script>1</script>"}
    say(f"markup signed as {owner_peer_id(signer.local_public_key)}")
    try:
        while not stop.is_set():
            dht.store(status_key(cfg.run.name), {**record, "time": time.time()}, get_dht_time() + 30,
                      subkey=signer.local_public_key)
            stop.wait(3)
    finally:
        dht.shutdown()


# ----- donor --------------------------------------------------------------------------------------
def state_variants(params: list[torch.Tensor]):
    """(name, metadata, tensors) of each malformed state, and of a sound state nobody vouches for."""
    state = [*params, *[torch.zeros_like(p) for p in params]]
    sha = tensors_sha256(state)
    meta = dict(outer_step=1, sha256=sha, inner_steps=10)
    wrong_shape = [*state]
    wrong_shape[len(params)] = torch.zeros(3, 3)
    nan = [t.clone() for t in state]
    nan[0][0] = float("nan")
    return [
        ("string outer step", {**meta, "outer_step": "9"}, state),
        ("inner steps 10**15", {**meta, "inner_steps": 10**15}, state),
        ("momentum of another shape", {**meta, "sha256": tensors_sha256(wrong_shape)}, wrong_shape),
        ("NaN parameters", {**meta, "sha256": tensors_sha256(nan)}, nan),
        ("another sha256", {**meta, "sha256": "ab" * 32}, state),
        ("oversized", meta, [*state, torch.zeros(2_000_000)]),
        ("a sound state nobody vouches for", {**meta, "outer_step": LIE_STEP}, state),
    ]


STATE_VARIANTS = [name for name, _, _ in state_variants([torch.zeros(1)])]


class SwarmAverager(DecentralizedAverager):
    """Named like the peers' averager (hivemind names its network handlers after the class); serves
    `variant` (name, metadata, tensors) to each peer that downloads from it; with `claimed_step` (a shared
    integer), as the state at that outer step."""

    matchmaking = None  # hivemind's Matchmaking unless set before the averager process starts

    def __init__(self, *args, variant=None, claimed_step=None, **kwargs):
        self.variant, self.claimed_step = variant, claimed_step
        super().__init__(*args, **kwargs)

    def _run_internal(self):  # in the averager's process, where hivemind builds its Matchmaking by name
        if self.matchmaking is not None:
            hivemind.averaging.averager.Matchmaking = self.matchmaking
        super()._run_internal()

    async def rpc_download_state(  # runs in the averager's process
        self, _request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        name, metadata, tensors = self.variant
        say(f"served {name} to {context.remote_id.to_base58()}")
        if self.claimed_step is not None:
            metadata = {**metadata, "outer_step": self.claimed_step.value}
        metadata = self.serializer.dumps(metadata)
        for tensor in tensors:
            info = CompressionInfo.from_tensor(tensor)
            for part in split_for_streaming(self.state_compression.compress(tensor, info, allow_inplace=False)):
                yield averaging_pb2.DownloadData(tensor_part=part, metadata=metadata or b"")
                metadata = None


def serve_states(args, stop: threading.Event) -> None:
    cfg, fingerprint, params = run_parameters(args.config)
    variants = state_variants(params)
    # one identity per state, its DHT node and averager started beside the others' (each takes seconds)
    nodes = [start_dht(args.initial_peers, await_ready=False)[0] for _ in variants]
    donors = []
    try:
        for dht in nodes:
            dht.wait_until_ready(timeout=60)
        for dht, variant in zip(nodes, variants):
            donor = SwarmAverager([torch.zeros(1)], dht, prefix=averager_prefix(cfg.run.name, fingerprint),
                                  start=False, allow_state_sharing=True, declare_state_period=2.0, variant=variant)
            donors.append(donor)
            donor.run_in_background(await_ready=False)
            donor.state_sharing_priority = 1e12  # above any honest peer: it is asked first
        for dht, donor, (name, _, _) in zip(nodes, donors, variants):
            donor.wait_until_ready(timeout=60)
            say(f"donor of {name} ready as {dht.peer_id.to_base58()}")
        say("donors ready")
        stop.wait()
    finally:
        for donor in donors:
            donor.shutdown()
        for dht in nodes:
            dht.shutdown()


# ----- poisoned donor -----------------------------------------------------------------------------
def poisoned_state(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """θ_global flipped and tripled, with zero momentum: finite, of the right shapes, and ruinous."""
    return [*(-3 * p for p in params), *(torch.zeros_like(p) for p in params)]


def serve_poisoned_state(args, stop: threading.Event) -> None:
    cfg, fingerprint, params = run_parameters(args.config)
    state = poisoned_state(params)
    sha = tensors_sha256(state)
    dht, signer = start_dht(args.initial_peers)
    claimed_step = multiprocessing.Value("q", 0)  # the step its record claims now, read by the averager's process
    variant = ("a well-formed poisoned state", dict(outer_step=0, sha256=sha, inner_steps=10), state)
    donor = SwarmAverager([torch.zeros(1)], dht, prefix=averager_prefix(cfg.run.name, fingerprint), start=True,
                          allow_state_sharing=True, declare_state_period=2.0, variant=variant,
                          claimed_step=claimed_step)
    donor.state_sharing_priority = 1e12  # above any honest peer: it is asked first
    say(f"poisoned donor ready as {dht.peer_id.to_base58()}, records signed as "
        f"{owner_peer_id(signer.local_public_key)}, poisoned state {sha}")
    try:
        while not stop.is_set():
            # one step ahead of the honest peers, and never back (a DHT read may miss their records)
            step = max(claimed_step.value, honest_state(dht, cfg.run.name, exclude_sha256=sha)[0] + 1)
            if step != claimed_step.value:
                claimed_step.value = step
                say(f"claims outer step {step}")
            record = dict(outer_step=step, sha256=sha, phase="training", samples=0, time=time.time(),
                          fingerprint=fingerprint, reachability="direct", leader="")
            dht.store(progress_key(cfg.run.name), record, get_dht_time() + 30, subkey=signer.local_public_key)
            stop.wait(0.5)
    finally:
        donor.shutdown()
        dht.shutdown()


# ----- groupmate ----------------------------------------------------------------------------------
GATHER = dict(outer_step=0, global_sha256="ab" * 32, samples=16, token="00" * 8, role="peer")  # step, state: the swarm's
GROUPMATE_VARIANTS = {  # name -> (the metadata it gathers, the value of every tensor element it sends)
    "string outer step": ({**GATHER, "outer_step": "9"}, 0.0),
    "negative samples": ({**GATHER, "samples": -5}, 0.0),
    "huge samples": ({**GATHER, "samples": 2**62}, 0.0),
    "bad token": ({**GATHER, "token": "zz"}, 0.0),
    "extra field": ({**GATHER, "extra": True}, 0.0),
    "not a dict": ("garbage", 0.0),
    "NaN parts": (GATHER, float("nan")),  # well-formed metadata, then poisoned tensors
}


def as_the_swarm(gather, step: int, sha256: str):
    """The metadata with the swarm's outer step and state where it holds GATHER's placeholders."""
    if not isinstance(gather, dict):
        return gather
    swarm = dict(outer_step=step, global_sha256=sha256)
    return {**gather, **{key: value for key, value in swarm.items() if gather.get(key) == GATHER[key]}}


def join_groups(args, stop: threading.Event) -> None:
    """One identity per variant of GROUPMATE_VARIANTS, `args.lanes` of them in the swarm at a time."""
    run = run_parameters(args.config)
    variants = list(GROUPMATE_VARIANTS.items())
    lanes = [threading.Thread(target=join_groups_as, args=(run, variants[lane::args.lanes], args, stop))
             for lane in range(args.lanes)]
    for lane in lanes:
        lane.start()
    for lane in lanes:
        lane.join()


class PlanFollowingMatchmaking(PlannedMatchmaking):
    """A stranger that asks the leaders of the swarm's membership plan, whatever its own metadata holds:
    its lane reads them from the honest peers' progress records and writes them, comma-separated, into
    `shared_leaders` (shared with the averager process) before each step."""

    def __init__(self, *args, shared_leaders, **kwargs):
        super().__init__(*args, **kwargs)
        self.shared_leaders = shared_leaders

    def _plan(self):
        leaders = [leader for leader in self.shared_leaders.value.decode().split(",") if leader]
        return SimpleNamespace(leaders=leaders, expected=0) if self.step_control is not None and leaders else None


def swarm_leaders(dht: DHT, cfg, fingerprint: str, step: int, sha256: str) -> str:
    """The leaders that the honest peers at `step` plan for their round, comma-separated ("" if none)."""
    records = {r.peer_id: r for r in read_progress(dht, progress_key(cfg.run.name), fingerprint)}
    honest = next((peer for peer, r in records.items() if r.outer_step == step and r.sha256 == sha256), None)
    plan = None if honest is None else plan_membership(records, step, sha256, honest, records[honest].reachability)
    return "" if plan is None else ",".join(plan.leaders)


def join_groups_as(run, variants, args, stop: threading.Event) -> None:
    """Each of `variants` in turn, under an identity of its own, for `args.seconds_per_identity`."""
    cfg, fingerprint, params = run
    for name, (gather, fill) in variants:
        if stop.is_set():
            break
        dht, _ = start_dht(args.initial_peers)
        leaders = multiprocessing.Array(ctypes.c_char, 4096)
        # next_chunk_timeout as the run's peers set it: a group whose honest members dropped this identity (they
        # ban it on its first malformed input) falls silent, and without it the lane sat in that dead round for
        # the whole control.result bound below (36 s of the test's 88 in a run), past the identity's time
        averager = SwarmAverager([torch.full_like(p, fill) for p in params], dht, start=False,
                                 prefix=averager_prefix(cfg.run.name, fingerprint), min_group_size=2,
                                 min_matchmaking_time=cfg.swarm.matchmaking_time,
                                 request_timeout=cfg.swarm.request_timeout,
                                 next_chunk_timeout=cfg.swarm.next_chunk_timeout,
                                 reducer_timeout=2 * cfg.swarm.next_chunk_timeout)
        averager.matchmaking = functools.partial(PlanFollowingMatchmaking, shared_leaders=leaders, screen=GroupScreen())
        averager.start()  # not hivemind's run_in_background, which sets a signal handler: a lane is no main thread
        averager.wait_until_ready()
        say(f"identity {dht.peer_id.to_base58()} sends {name}")
        try:
            deadline = time.monotonic() + args.seconds_per_identity
            while time.monotonic() < deadline and not stop.is_set():
                step, sha256 = honest_state(dht, cfg.run.name)
                planned = swarm_leaders(dht, cfg, fingerprint, step, sha256)
                if planned.encode() != leaders.value:
                    say(f"outer step {step}: the swarm's leaders are {planned or 'none'}")
                leaders.value = planned.encode()
                averager.set_group_bits(group_bits(step))
                control = averager.step(gather=as_the_swarm(gather, step, sha256), weight=1.0, wait=False,
                                        timeout=cfg.swarm.matchmaking_time * 3, allow_retries=False)
                try:
                    # and never past the identity's time: a lane whose round fell silent all the same sat in it for
                    # this whole bound (36 s of the test's 60, in one run), long after its identity's 10 s
                    bound = cfg.swarm.matchmaking_time * 3 + cfg.swarm.allreduce_timeout
                    control.result(timeout=max(0.5, min(bound, deadline - time.monotonic())))
                except Exception as e:  # rejected, timed out, or the group broke up: try again
                    control.cancel()
                    say(f"round failed: {type(e).__name__}")
        finally:
            averager.shutdown()
            dht.shutdown()


# ----- unlisted peer -----------------------------------------------------------------------------
def run_unlisted_peer(args, stop: threading.Event) -> None:
    """The project's own peer, minus the check that stops a peer whose identity the run does not list."""
    import p2p_diloco.config
    from p2p_diloco.node_runner import PeerOptions, run_peer

    p2p_diloco.config.check_member = lambda cfg, peer_id: None  # run_peer imports it when it runs
    # a stranger that asks the plan's leaders to take it in, never leads: when it ranked first it led a group that
    # no listed peer asks to join, and the test waited in vain for their refusal (1 CI run in 4)
    import p2p_diloco.train.round_sync as round_sync
    planned = round_sync.plan_membership

    def asking_to_join(records, step, sha256, peer_id, reachability, attempt=1, among=None):  # never leads
        plan = planned(records, step, sha256, peer_id, reachability, attempt, among)
        if plan is None or plan.leaders[:1] != (peer_id,) or len(plan.leaders) == 1:
            return plan
        return dataclasses.replace(plan, leaders=plan.leaders[1:])

    round_sync.plan_membership = asking_to_join
    options = PeerOptions(host="127.0.0.1", initial_peers=args.initial_peers, identity_path=args.identity_path,
                          metrics_file=args.metrics_file, wait_for_peers=args.wait_for_peers)
    say(f"unlisted peer exited with {run_peer(args.config, options)}")  # it stops on its own SIGTERM handler


MODES = {"records": write_records, "markup": write_markup, "donor": serve_states, "poisoned-donor": serve_poisoned_state,
         "groupmate": join_groups,
         "unlisted-peer": run_unlisted_peer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=sorted(MODES))
    parser.add_argument("--config", required=True)
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--seconds-per-identity", type=float, default=15.0)
    parser.add_argument("--lanes", type=int, default=1, help="groupmate: identities in the swarm at a time")
    parser.add_argument("--identity-path", help="unlisted-peer: its identity file")
    parser.add_argument("--metrics-file", help="unlisted-peer: its metrics file")
    parser.add_argument("--wait-for-peers", type=int, default=1, help="unlisted-peer: as `p2p-diloco peer` takes it")
    args = parser.parse_args()
    children_exit_with_this_process()  # its DHT, averager and p2pd go when it goes, however it goes
    for module in (hivemind.dht.dht, hivemind.averaging.averager):  # forked from here, their loops keep their
        keep_tasks_in(module)  # tasks, as the project's do (p2p_diloco/event_loop.py): no request lost mid-call
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    MODES[args.mode](args, stop)
    say("stopped")
    sys.exit(0)


if __name__ == "__main__":
    main()
