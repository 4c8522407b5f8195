"""A downloaded global state is checked against this peer's own before it replaces it.

The round plan (:func:`p2p_diloco.protocol.plans.plan_round`) sends a peer that is behind to the state
its progress records vouch for, and :mod:`p2p_diloco.sync.state_transfer` checks that the donor serves
exactly that state, well-formed. That alone would let ONE identity replace θ_global on every honest
peer: publish a record one step ahead of the swarm and serve a state of its own making under that
sha256, and no aggregation, no robust mean (:mod:`p2p_diloco.sync.robust`) and no update check
(:mod:`p2p_diloco.train.update_check`) is ever involved. So a state that is not this peer's own passes
one of two checks.

**One step ahead is verified** (:func:`step_problem`). The outer step t → t + 1 is DiLoCo's Nesterov
step on fragment f = t mod P (arXiv 2311.08105 Alg. 1 line 12; Streaming DiLoCo's schedule, arXiv
2501.18512 §2.1; :func:`p2p_diloco.train.outer.nesterov_step_`), in float32, one rounding per operation:

    b' = fl(fl(b·μ) + g),   d = fl(fl(b'·μ) + g),   θ' = fl(θ − fl(d·η))

From (θ, b) at t and the downloaded (θ', b') at t + 1 the peer checks that

* every other fragment is bit-identical in θ and in b (an outer step touches one fragment);
* the update the momentum implies, ĝ = b' − μ·b (float64), passes the check a round's mean must pass
  (:func:`~p2p_diloco.train.update_check.update_rejection`: ‖ĝ‖ ≤ max_update_growth × ‖b‖, or ‖θ‖ at the
  fragment's first step); with μ = 0 the momentum stays zero and ĝ = (θ − θ')/η;
* θ' = θ − η·(ĝ + μ·b') elementwise within the rounding of the float32 step (:func:`step_tolerance`).

The tolerance, with u = 2⁻²⁴ (float32's unit roundoff, round to nearest) and each fl() off by at most
u times its result: ĝ misses the float32 g by at most u·(|μb| + |b'|) (the roundings of b·μ and of
b'); d by that plus u·(|μb'| + |d|); d·η adds u·η|d|, and θ − s adds u·|θ'|. To first order:

    |θ' − (θ − η·(ĝ + μ·b'))| ≤ u·(|θ'| + η·(|μb| + (1 + μ)·|b'| + 2·|d̂|))

The check allows twice that (second-order terms and float64's own roundings, both below 2⁻²⁴ of it),
plus 2⁻¹⁴⁶ absolute for results in float32's subnormal range, where a rounding is off by up to
2⁻¹⁵⁰ whatever the magnitude. An honest transition is inside it on every CPU; what it leaves a liar is
two ulps of each element's own terms, the noise the float32 step makes anyway.

**Jumps of more than one step** cannot be verified (nobody keeps the intermediate means), and neither
can a one-step state that is not a step from this peer's state (this peer forked: its last round was
with a group the rest of the swarm did not follow). Such a state is taken on the word of the records
(:func:`choose_target` before a jump's download, :func:`unverified_step_trusted` after a one-step
state failed the check, which also asks for two vouchers at least): a state S at step T > t is trusted
when

    vouchers(S) ≥ vouchers(own state)   and   vouchers(S) > dissent(S)

where vouchers(S) counts the distinct identities whose live progress records (not "loading") claim S
at T, and dissent(S) the other records above t: those that claim another state, and those of peers
that load, or whose claim this peer set aside (it would not take that jump on so few vouchers, or
nobody served it), unless they claim S themselves. A tie with the dissent goes to a state a
former groupmate of this peer vouches for; else, when nothing above is trusted, the peer tries the
download of the tied state at the lowest step (:mod:`p2p_diloco.protocol.trust`), so that a liar's
claim one step above an honest state is then verified against it, and a claim nobody serves is struck
(waiting on the tie stalled a joiner for good, and two such joiners averaged from step 0). A peer
that loads vouches for no state yet, and a set-aside record only for a state that a live record
claims too (else a joiner that set aside an honest claim in a commit window leaves its groupmate's
twin claim tied with a liar's, and sets that aside too; a CI run's joiner, with every claim set
aside, saw nobody and averaged alone), but both count against other claims: left out, they would leave a liar's claim one step ahead of the swarm tied with the
honest peers still in step. And a tie is never taken on the records' word: a joiner's DHT read can miss the record
of one of 2 honest peers, and then the liar's claim one step ahead of them ties with the other's
(three CI runs' joiners took the poisoned state that one identity claimed one step ahead of 2 honest
peers, while ties went to the later step: the lowest step's tie is tried first now). vouchers(own) counts this peer, the live records
at t with its sha256, and the peers still committing the round that brought this peer to t (ready at t − 1: right after an outer step, a
groupmate's record may still say so); at t = 0 this peer alone (the initial state is every fresh
peer's, built from the seed: joiners that start together follow a peer that went ahead). A peer whose
state nobody else vouches for (a joiner at step 0, a restart from an old checkpoint, a straggler left
behind alone) thus trusts on first use the best-vouched state above it (one that a peer it has
averaged with vouches for first: a stranger's record costs a signature, a groupmate's took rounds of
averaging that passed robust aggregation), unless no claim above it outnumbers the others (while a
group commits a round, its records are split between two steps, and the peer waits a round); a peer in step with others past step 0
never follows one identity. When the plan's target (the highest step) is not trusted, the
best-vouched trusted state above this peer's step is loaded instead (a state one step ahead is always
worth a try: it is verified).

Catching up. A peer falls behind when its groupmates step without it (it trained more than
``swarm.round_wait_timeout`` longer, or froze). One step behind, its state is the parent of theirs:
verified. Further behind alone, nobody vouches for its state: it follows the best-vouched one. A tie
with its own state goes to the later step, so that two equal halves of a swarm (k stragglers that went on averaging together,
a healed partition) join again; only a group behind that is *larger* than every group ahead keeps its
own state, and then it is the swarm: the smaller group ahead is exactly what k Sybils look like.

What Sybils can still do: n identities that each sign a record of the same state outvote up to n
honest peers in step (and, with one identity, any peer alone in its step whose former groupmates
vouch for nothing above it: a joiner, every peer while the run is at step 0): a poisoned jump is
then accepted. A joiner fooled that way vouches for the poison in turn.
One identity never forges a single step (a state one step ahead that fails the check needs two
vouchers); a jump of two or more steps costs as many identities as the honest peers in step it
overrides. Sybils can also vouch for an honest peer's own state to keep it from following an honest
jump (liveness, not integrity).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from p2p_diloco.fixed_order import as_float32
from p2p_diloco.train.update_check import update_rejection

STATE_REFUSED = "state_refused"  # the metrics event of a state this peer would not adopt

UNIT_ROUNDOFF = 2.0 ** -24  # float32, round to nearest
ROUNDING_SLACK = 2.0  # the first-order bound above, twice
SUBNORMAL_FLOOR = 2.0 ** -146  # a few of float32's smallest roundings (2⁻¹⁵⁰ each, below 2⁻¹²⁶)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def _equal_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: the same float32 bits (bool, like `a`)."""
    return a.contiguous().view(torch.int32) == b.contiguous().view(torch.int32)


def step_tolerance(new_params: torch.Tensor, old_momentum: torch.Tensor, new_momentum: torch.Tensor,
                   direction: torch.Tensor, lr: float, momentum: float) -> torch.Tensor:
    """The elementwise bound on |θ' − (θ − η·d̂)| that float32 rounding allows (float64; see the module
    docstring): u·(|θ'| + η·(|μb| + (1 + μ)|b'| + 2|d̂|)), twice, plus the subnormal floor."""
    terms = new_params.abs() + lr * (momentum * old_momentum.abs() + (1 + momentum) * new_momentum.abs()
                                     + 2 * direction.abs())
    return ROUNDING_SLACK * UNIT_ROUNDOFF * terms + SUBNORMAL_FLOOR


def step_problem(params: Sequence[torch.Tensor], momentum_buffer: Sequence[torch.Tensor],
                 new_state: Sequence[torch.Tensor], fragments: Sequence[Sequence[int]], fragment: int,
                 lr: float, momentum: float, max_update_growth: float, sparse: bool = False) -> Optional[str]:
    """None if `new_state` (θ' then b', as :meth:`GlobalModel.state_tensors` gives them) is one outer step
    on `fragment` from (`params`, `momentum_buffer`); else why not, in one line.

    `lr` and `momentum` are ``outer.lr`` and ``outer.momentum``; `max_update_growth` the update check's
    (:func:`~p2p_diloco.train.update_check.update_rejection`). `sparse`: the run's codec sends a subset of the
    values each round (a shared mask), so a value the round did not carry keeps its θ and b
    (:meth:`~p2p_diloco.train.outer.GlobalModel.apply`): a value whose θ and b are both the same bits as before
    passes as such, with g = 0 there. That leaves a liar nothing a round's mask could not have done."""
    count = len(params)
    new_params, new_momentum = list(new_state[:count]), list(new_state[count:])
    moved = set(fragments[fragment])
    for i in range(count):
        if i not in moved and not (_same_bits(params[i], new_params[i]) and _same_bits(momentum_buffer[i],
                                                                                          new_momentum[i])):
            return (f"tensor {i} changed, but an outer step from this peer's state changes only fragment "
                    f"{fragment} (tensors {sorted(moved)})")
    lr32, mu32 = as_float32(lr), as_float32(momentum)
    indices = list(fragments[fragment])
    old_p = [params[i].to(torch.float64) for i in indices]
    old_b = [momentum_buffer[i].to(torch.float64) for i in indices]
    new_p = [new_params[i].to(torch.float64) for i in indices]
    new_b = [new_momentum[i].to(torch.float64) for i in indices]
    if mu32 == 0:  # plain SGD: the momentum stays zero and θ' = θ − g·η is the whole step
        if not all(_same_bits(momentum_buffer[i], new_momentum[i]) for i in indices):
            return "the outer momentum changed, but with outer.momentum = 0 it stays zero"
        implied = [(p - q) / lr32 for p, q in zip(old_p, new_p)]
    else:
        implied = [nb - mu32 * ob for nb, ob in zip(new_b, old_b)]
    # the values a sparse round did not carry: θ and b unchanged, no update there (a dense run has none)
    kept = [_equal_bits(params[i], new_params[i]) & _equal_bits(momentum_buffer[i], new_momentum[i])
            for i in indices] if sparse else [None] * len(indices)
    implied = [g if k is None else torch.where(k, 0.0, g) for k, g in zip(kept, implied)]
    rejection = update_rejection(implied, [momentum_buffer[i] for i in indices], [params[i] for i in indices],
                                 max_update_growth)
    if rejection is not None:
        return f"the update its momentum implies fails the update check: {rejection}"
    if mu32 == 0:
        return None
    for i, p, ob, np_, nb, g, k in zip(indices, old_p, old_b, new_p, new_b, implied, kept):
        direction = g + mu32 * nb
        error = (np_ - (p - lr32 * direction)).abs()
        if k is not None:
            error = torch.where(k, 0.0, error)
        excess = error - step_tolerance(np_, ob, nb, direction, lr32, mu32)
        if bool((excess > 0).any()):
            at = int(excess.argmax())
            return (f"θ' of tensor {i} is not θ − η·(g + μ·b') for the g its momentum implies: off by "
                    f"{float(error.flatten()[at]):.3g} at element {at}, beyond the float32 rounding of the step")
    return None


__all__ = ["STATE_REFUSED", "step_problem", "step_tolerance"]
