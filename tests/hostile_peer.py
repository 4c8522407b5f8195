"""A hostile training peer: the project's own `p2p-diloco peer`, with what it sends altered.

    python -m tests.hostile_peer --attack ATTACK [--collude-dir DIR --colluders F --workers N] -- PEER_ARGS

PEER_ARGS are the arguments of `p2p-diloco peer` (the same config and flags as an honest peer). The
project's code has no attack hooks: this process patches a few of its methods before the peer starts,
and then runs the `peer` command itself. It is a volunteer with the run's own settings who changes
what its peer sends (issue 19), not a stranger with malformed input (that is tests/hostile.py).

Sender attacks alter the pseudo-gradient and the sample count that :meth:`OuterSync.average
<p2p_diloco.sync.outer_sync.OuterSync.average>` hands the all-reduce, in the peer's main process
(the averager's process reads the tensors from shared memory, after this copy):

* ``scale:K``: K·Δ (the issue measured K = 3, 10, 100);
* ``flip`` or ``flip:K``: −Δ, or −K·Δ;
* ``noise:K``: Gaussian noise instead of Δ, of norm K·‖Δ‖ (‖·‖ over the whole fragment);
* ``samples`` or ``samples:K``: Δ itself, weighted by the largest sample count a peer may gather
  (:data:`~p2p_diloco.remote_input.MAX_COUNT`, 2^48), or by K × its real count;
* ``alie``: "A Little Is Enough" (Baruch et al., arXiv 1902.06156): μ − z·σ, coordinate-wise, where
  μ and σ are the mean and the standard deviation of the colluders' honest Δ at this outer step.
  Each colluder writes its Δ to ``--collude-dir`` and reads the others' (it waits at most
  :data:`COLLUDE_WAIT_S` for ``--colluders`` of them), so colluders estimate μ and σ from their own
  data, as the paper's attacker does, not from the honest peers'. z is the paper's z_max for
  n = ``--workers`` peers of which f = ``--colluders`` collude: s = ⌊n/2 + 1⌋ − f, z = Φ⁻¹((n − s)/n)
  (n = 5: z = 0.25 for f = 1, 0.84 for f = 2). With one colluder (or when the others are late) σ
  cannot be estimated from one sample; the fallback takes |Δ| itself as each coordinate's spread,
  so it sends Δ − z·|Δ|.

Attacks joined by ``+`` act together: ``samples+flip`` sends −Δ with the weight of 2^48 (the issue:
"a peer does not even need a large Δ"). The peer keeps no error-feedback residual of what it altered:
its residual is that of an honest Δ sent exactly, so the alteration does not compound round to round.

Reducer attacks alter what this peer returns as the reducer of its share of the parts, in the
averager's process (the patch is made before that process forks):

* ``garbage-reducer``: 100 × the averaged part plus noise of 100 × its RMS, the same bytes to every
  sender and to itself (:meth:`ExactAllReduceRunner._encode_averaged`);
* ``equivocating-reducer``: the averaged part times (i + 2) to the sender of index i, a different
  value to each sender (:meth:`ExactAllReduceRunner._accumulate_parts_streaming`; its own copy is honest);
* ``misquoting-reducer``: reduces honestly, but serves its auditor the parts of its senders in another
  order (each sender's chunks as the next sender's: :meth:`ReducerAudit.served_inputs`), so that the
  results recomputed from them are wrong, and the parts are not what their senders state they sent;
* ``tampering-relay``: as a relay of a round in groups (:mod:`p2p_diloco.sync.relay`), the averaged
  parts it forwards back to a sender, times 3 (:meth:`ExactAllReduceRunner.rpc_relay_part`).

It prints ``attacked outer step N (ATTACK)`` for each round toward outer step N in which a sender
attack altered what it sent, and ``attacked a round as reducer (ATTACK)`` for each all-reduce in
which a reducer attack altered a part, so a test can check that the attack happened.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

SENDER_ATTACKS = ("scale", "flip", "noise", "samples", "alie")
REDUCER_ATTACKS = ("garbage-reducer", "equivocating-reducer", "misquoting-reducer")
GARBAGE_FACTOR = 100.0  # the garbage reducer's averaged part ×100, plus noise of 100 × its RMS
COLLUDE_WAIT_S = 10.0  # how long an ALIE colluder waits for the others' Δ of this outer step
COLLUDE_POLL_S = 0.2
STEP_WAIT_S = 120.0  # how long a sender attack waits for the Δ of a round matched ahead of it (its lead, at most)


def say(line: str) -> None:
    print(line, flush=True)


@dataclass(frozen=True)
class Attack:
    """One attack of ``--attack``: its kind and its factor K, if it takes one."""

    kind: str
    factor: Optional[float] = None


def parse_attacks(spec: str) -> list[Attack]:
    """'samples+flip:3' -> [Attack('samples'), Attack('flip', 3.0)]; raises ValueError for an unknown one."""
    attacks = []
    for item in spec.split("+"):
        kind, _, factor = item.strip().partition(":")
        if kind not in SENDER_ATTACKS + REDUCER_ATTACKS:
            raise ValueError(f"unknown attack {kind!r}; known: {', '.join(SENDER_ATTACKS + REDUCER_ATTACKS)}")
        if kind in ("scale", "noise") and not factor:
            raise ValueError(f"{kind} needs a factor, e.g. {kind}:100")
        attacks.append(Attack(kind, float(factor) if factor else None))
    return attacks


# ----- sender attacks: what this peer sends ----------------------------------------------------------
def global_norm(tensors: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


def gaussian_like(tensors: Sequence[torch.Tensor], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=generator, dtype=torch.float32) for t in tensors]


def noise_of_norm(delta: Sequence[torch.Tensor], factor: float, seed: int) -> list[torch.Tensor]:
    """Gaussian noise with the shapes of `delta` and the norm factor·‖delta‖."""
    noise = gaussian_like(delta, seed)
    scale = factor * global_norm(delta) / max(global_norm(noise), 1e-30)
    return [n * scale for n in noise]


def alie_z(workers: int, colluders: int) -> float:
    """z_max of "A Little Is Enough" (arXiv 1902.06156, §4): s = ⌊n/2 + 1⌋ − f peers must be won over,
    z = Φ⁻¹((n − s)/n); (n − s)/n is kept inside (0, 1) for a majority of colluders."""
    s = math.floor(workers / 2 + 1) - colluders
    quantile = min(max((workers - s) / workers, 1e-6), 1 - 1e-6)
    return statistics.NormalDist().inv_cdf(quantile)


class Colluders:
    """The honest Δ of each ALIE colluder at an outer step, shared through a directory they all see."""

    def __init__(self, directory: Path, count: int, workers: int):
        self.directory, self.count = directory, count
        self.z = alie_z(workers, count)

    def shift(self, peer_id: str, step: int, delta: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """μ − z·σ of the colluders' Δ at `step`, coordinate-wise (with one Δ: Δ − z·|Δ|, see the module)."""
        deltas = self.exchange(peer_id, step, delta)
        if len(deltas) < 2:
            return [d - self.z * d.abs() for d in delta]
        shifted = []
        for coordinates in zip(*deltas):
            stacked = torch.stack(coordinates)
            shifted.append(stacked.mean(0) - self.z * stacked.std(0))
        return shifted

    def exchange(self, peer_id: str, step: int, delta: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Publish this colluder's Δ of `step`; return every colluder's that arrived within COLLUDE_WAIT_S."""
        folder = self.directory / f"step-{step}"
        folder.mkdir(parents=True, exist_ok=True)
        temporary = folder / f".{peer_id}.tmp"
        torch.save([d.clone() for d in delta], temporary)
        temporary.rename(folder / f"{peer_id}.pt")  # whole or absent for a reader
        deadline = time.monotonic() + COLLUDE_WAIT_S
        while len(list(folder.glob("*.pt"))) < self.count and time.monotonic() < deadline:
            time.sleep(COLLUDE_POLL_S)
        return [torch.load(path) for path in sorted(folder.glob("*.pt"))]


def alter_delta(attack: Attack, delta: list[torch.Tensor], step: int, peer_id: str,
                colluders: Optional[Colluders]) -> list[torch.Tensor]:
    """What a sender attack sends instead of `delta` at outer step `step` (`samples` leaves it as it is)."""
    if attack.kind == "scale":
        return [attack.factor * d for d in delta]
    if attack.kind == "flip":
        return [-(attack.factor or 1.0) * d for d in delta]
    if attack.kind == "noise":
        return noise_of_norm(delta, attack.factor, seed=step)
    if attack.kind == "alie":
        return colluders.shift(peer_id, step, delta)
    return delta


def claimed_samples(attacks: Sequence[Attack], samples: int) -> int:
    from p2p_diloco.remote_input import MAX_COUNT

    for attack in attacks:
        if attack.kind == "samples":
            return MAX_COUNT if attack.factor is None else min(MAX_COUNT, int(attack.factor * samples))
    return samples


def attacked_average(honest_average: Callable, spec: str, attacks: Sequence[Attack],
                     colluders: Optional[Colluders]) -> Callable:
    """OuterSync.average, altered: the group averages the altered Δ with the claimed weight."""
    from p2p_diloco.sync.outer_sync import PendingDelta

    def average(self, pseudo_gradient, samples, outer_step, *args, **kwargs):
        if isinstance(pseudo_gradient, PendingDelta):  # a round matched ahead of its Δ: altered once it is here
            pseudo_gradient.wait(STEP_WAIT_S)
            if pseudo_gradient.tensors is None:  # the peer stopped first: the honest round ends it
                return honest_average(self, pseudo_gradient, samples, outer_step, *args, **kwargs)
            pseudo_gradient = pseudo_gradient.tensors
        sent = [t.detach().clone() for t in pseudo_gradient]
        for attack in attacks:
            sent = alter_delta(attack, sent, outer_step, self.peer_id, colluders)
        say(f"attacked outer step {outer_step + 1} ({spec})")
        result = honest_average(self, sent, claimed_samples(attacks, samples), outer_step, *args, **kwargs)
        if result.sent is not None:  # error feedback: owe nothing for the alteration
            result.sent = [t.detach().clone() for t in pseudo_gradient]
        return result

    return average


def patch_sender(spec: str, attacks: Sequence[Attack], colluders: Optional[Colluders]) -> None:
    """Every OuterSync of this process sends as `attacked_average` says."""
    from p2p_diloco.sync.outer_sync import OuterSync

    OuterSync.average = attacked_average(OuterSync.average, spec, attacks, colluders)


def sender_attacks(spec: str) -> list[Attack]:
    """The attacks of `spec` if each alters what a peer sends (only those alter one peer of several in a
    process); raises ValueError otherwise."""
    attacks = parse_attacks(spec)
    if any(a.kind not in SENDER_ATTACKS for a in attacks):
        raise ValueError(f"{spec}: only sender attacks ({', '.join(SENDER_ATTACKS)}) alter one peer of a process; "
                         f"a reducer attack needs a process of its own (benchmarks/hostile.py)")
    return attacks


def make_hostile(sync, spec: str, colluders: Optional[Colluders] = None) -> None:
    """One OuterSync (one peer of several in a process) sends as `attacked_average` says: sender attacks only."""
    import types

    from p2p_diloco.sync.outer_sync import OuterSync

    attacks = sender_attacks(spec)
    if any(a.kind == "alie" for a in attacks) and colluders is None:
        raise ValueError("alie needs its colluders")
    sync.average = types.MethodType(attacked_average(OuterSync.average, spec, attacks, colluders), sync)


# ----- reducer attacks: what this peer returns as a reducer ----------------------------------------
def garbage(averaged_part: torch.Tensor, part_index: int) -> torch.Tensor:
    """100 × the part plus noise of 100 × its RMS: finite, well-formed, and wrong (the same for every caller)."""
    rms = float(averaged_part.double().square().mean().sqrt()) if averaged_part.numel() else 0.0
    noise = torch.randn(averaged_part.shape, generator=torch.Generator().manual_seed(part_index))
    return GARBAGE_FACTOR * averaged_part + GARBAGE_FACTOR * rms * noise


def say_once_per_round(runner, spec: str) -> None:
    if not getattr(runner, "_attack_said", False):
        runner._attack_said = True
        say(f"attacked a round as reducer ({spec})")


def patch_garbage_reducer(spec: str) -> None:
    from p2p_diloco.sync.exact_allreduce import ExactAllReduceRunner

    honest_encode = ExactAllReduceRunner._encode_averaged

    async def _encode_averaged(self, part_index, averaged_part, *args, **kwargs):
        say_once_per_round(self, spec)
        return await honest_encode(self, part_index, garbage(averaged_part, part_index), *args, **kwargs)

    ExactAllReduceRunner._encode_averaged = _encode_averaged


def patch_equivocating_reducer(spec: str) -> None:
    from hivemind.proto import averaging_pb2, runtime_pb2

    from p2p_diloco.sync.exact_allreduce import ExactAllReduceRunner

    honest_stream = ExactAllReduceRunner._accumulate_parts_streaming

    async def _accumulate_parts_streaming(self, stream, sender_index, *args, **kwargs):
        factor, part_index = float(sender_index + 2), 0
        async for message in honest_stream(self, stream, sender_index, *args, **kwargs):
            if message.code == averaging_pb2.AVERAGED_PART:
                numel = self.tensor_part_reducer.part_shapes[part_index].numel()
                averaged = self.codec.decode(message.tensor_part.buffer, numel)
                message = averaging_pb2.AveragingData(
                    code=averaging_pb2.AVERAGED_PART,
                    tensor_part=runtime_pb2.Tensor(buffer=self.codec.encode(factor * averaged), dtype="float32"))
                part_index += 1
                say_once_per_round(self, spec)
            yield message

    ExactAllReduceRunner._accumulate_parts_streaming = _accumulate_parts_streaming


def patch_misquoting_reducer(spec: str) -> None:
    """Each sender's hash list and chunks served to the auditor as the next sender's (the last sender's as
    the first's)."""
    from p2p_diloco.sync.audit import ReducerAudit

    honest_serve = ReducerAudit.served_inputs

    def served_inputs(self, ledger, sample):
        served = honest_serve(self, ledger, sample)
        say(f"attacked a round as reducer ({spec})")
        return served[-1:] + served[:-1]

    ReducerAudit.served_inputs = served_inputs


def numel_of(codec, nbytes: int) -> int:
    """The smallest part size that `codec` encodes to `nbytes` bytes (encoded sizes grow with the size)."""
    low, high = 1, 16 * nbytes + 16  # no codec takes less than half a byte a value
    while low < high:
        middle = (low + high) // 2
        if codec.encoded_size(middle) < nbytes:
            low = middle + 1
        else:
            high = middle
    return low


def patch_tampering_relay(spec: str) -> None:
    """As a relay (p2p_diloco.sync.relay): the averaged parts it forwards back to a sender, times 3."""
    from hivemind.proto import averaging_pb2, runtime_pb2

    from p2p_diloco.sync.exact_allreduce import ExactAllReduceRunner

    honest_relay = ExactAllReduceRunner.rpc_relay_part

    async def rpc_relay_part(self, stream, context):
        async for message in honest_relay(self, stream, context):
            if message.code == averaging_pb2.AVERAGED_PART:
                # this peer's own list of the reducer's parts is consumed as it sends its own: the part's size
                # comes from its bytes (the smallest that encodes to as many; any other size is tampering too)
                numel = numel_of(self.codec, len(message.tensor_part.buffer))
                averaged = self.codec.decode(message.tensor_part.buffer, numel)
                message = averaging_pb2.AveragingData(
                    code=averaging_pb2.AVERAGED_PART,
                    tensor_part=runtime_pb2.Tensor(buffer=self.codec.encode(3 * averaged), dtype="float32"))
                say_once_per_round(self, spec)
            yield message

    ExactAllReduceRunner.rpc_relay_part = rpc_relay_part


PATCHES: dict[str, Callable[[str], None]] = {
    "garbage-reducer": patch_garbage_reducer,
    "equivocating-reducer": patch_equivocating_reducer,
    "misquoting-reducer": patch_misquoting_reducer,
    "tampering-relay": patch_tampering_relay,
}


def patch(spec: str, collude_dir: Optional[str], colluders: int, workers: int) -> None:
    """Patch the project's code for the attacks of `spec`, before anything of the peer starts."""
    attacks = parse_attacks(spec)
    if any(a.kind in SENDER_ATTACKS for a in attacks):
        alie = any(a.kind == "alie" for a in attacks)
        if alie and not collude_dir:
            raise ValueError("alie needs --collude-dir (or P2P_DILOCO_COLLUDE_DIR): a directory every colluder sees")
        patch_sender(spec, attacks, Colluders(Path(collude_dir), colluders, workers) if alie else None)
    for attack in attacks:
        if attack.kind in PATCHES:
            PATCHES[attack.kind](spec)


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, peer_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     usage="python -m tests.hostile_peer --attack ATTACK [options] -- PEER_ARGS")
    parser.add_argument("--attack", required=True, help="e.g. scale:100, flip, noise:100, samples+flip, alie, "
                                                        "garbage-reducer, equivocating-reducer")
    parser.add_argument("--collude-dir", default=os.environ.get("P2P_DILOCO_COLLUDE_DIR"),
                        help="alie: the directory where colluders share their Δ")
    parser.add_argument("--colluders", type=int, default=1, help="alie: f, the colluding peers (this one included)")
    parser.add_argument("--workers", type=int, default=5, help="alie: n, the peers of the run, for z")
    args = parser.parse_args(ours)
    try:
        patch(args.attack, args.collude_dir, args.colluders, args.workers)
    except ValueError as e:
        parser.error(str(e))
    from p2p_diloco.cli import main as cli

    cli.main(args=["peer", *peer_args], prog_name="p2p-diloco")


if __name__ == "__main__":
    main()
