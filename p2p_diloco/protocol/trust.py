"""Whose word a state above this peer's is taken on, before it is downloaded and after it failed the check.

A state one step ahead is verified against this peer's own (:func:`p2p_diloco.train.state_check.step_problem`);
a jump of more steps, or a step that is not one from this peer's state, is taken on the word of the records.
The rule, its reasons and what Sybils can still do are in :mod:`p2p_diloco.train.state_check`'s docstring:

    vouchers(S) ≥ vouchers(own state)   and   vouchers(S) > dissent(S)

A tie (vouchers(S) = dissent(S)) goes to a state a former groupmate vouches for; when nothing else settles it,
the peer tries the download of the tied state at the lowest step (:func:`choose_target` with `break_ties`, asked
by :func:`p2p_diloco.protocol.decide.next_move`), and a claim that nobody serves is struck
(:class:`~p2p_diloco.protocol.ledger.TrustLedger`). :func:`moved_past` says whether the run left a step by the
same rule.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

from p2p_diloco.protocol.view import LOADING, PeerProgress, own_vouchers, vouchers


def choose_target(records: dict[str, PeerProgress], peer_id: str, outer_step: int, sha256: str,
                  wanted: tuple[int, str], groupmates: frozenset = frozenset(),
                  set_aside: Optional[dict[str, PeerProgress]] = None,
                  break_ties: bool = False, by_count: bool = False) -> tuple[Optional[tuple[int, str]], str]:
    """The state above `outer_step` this peer may load: `wanted` (the plan's target) if trusted, else the
    best-vouched trusted one (see the module docstring); None if none is. Among trusted states, one that
    a former groupmate of this peer vouches for (`groupmates`: identities it averaged with) comes first.
    `set_aside` are the live records whose claims this peer set aside: they vouch only for a state that a
    live record claims too, and count against every other claim, as loading peers do. `break_ties`: a state as
    vouched for as it is disputed is trusted too, the lowest step first (:func:`p2p_diloco.protocol.decide.next_move`
    asks so when no state is trusted otherwise: its download decides, and a liar's claim one step above an honest
    state it ties with is then checked against that state, not taken on its word). `by_count`: a state one step
    ahead needs the vouchers of a jump too (it is otherwise taken to be checked once downloaded). Returns it and a
    one-line account of the counts."""
    ahead = [r for peer, r in records.items() if peer != peer_id and r.outer_step > outer_step]
    votes = Counter((r.outer_step, r.sha256) for r in ahead if r.phase != LOADING)
    aside = [r for peer, r in (set_aside or {}).items()
             if peer != peer_id and peer not in records and r.outer_step > outer_step]
    # a set-aside record still vouches for a state that a live record claims too: a groupmate's claim,
    # set aside in a commit window, would otherwise leave its twin tied with a liar's (in a CI run a
    # joiner set aside every honest claim so, one by one, and averaged alone)
    votes.update((r.outer_step, r.sha256) for r in aside if r.phase != LOADING and (r.outer_step, r.sha256) in votes)
    ahead += aside
    own = len(own_vouchers(records, peer_id, outer_step, sha256))
    known = {state: bool(vouchers(records, *state) & groupmates) for state in votes}

    def dissent(state: tuple[int, str]) -> int:
        # loading and set-aside peers count against every claim but the one they make themselves
        return sum((r.outer_step, r.sha256) != state for r in ahead)

    def trusted(state: tuple[int, str]) -> bool:
        outvotes = votes[state] > dissent(state) or (votes[state] == dissent(state) and (known[state] or break_ties))
        return (state[0] == outer_step + 1 and not by_count) or (votes[state] >= own and outvotes)

    counts = (f"its state at outer step {outer_step} is vouched for by {own} identit{'y' if own == 1 else 'ies'} "
              f"(this peer included), outer step {wanted[0]} ({wanted[1][:12]}) by {votes[wanted]}, and "
              f"{dissent(wanted)} other record(s) above outer step {outer_step} claim otherwise")
    candidates = [state for state in votes if trusted(state)]
    if not candidates:
        return None, counts
    if break_ties:  # the lowest step first: a claim one step above it is then verified (state_check.step_problem)
        return min(candidates, key=lambda state: (not known[state], state[0], -votes[state], state[1])), counts
    if wanted in candidates and (known[wanted] or not any(known[state] for state in candidates)):
        return wanted, counts
    return max(candidates, key=lambda state: (known[state], votes[state], state[0], state[1])), counts


def moved_past(records: dict[str, PeerProgress], peer_id: str, outer_step: int, sha256: str) -> bool:
    """Whether the run moved past `outer_step` by the records this peer trusts: a state above it that
    :func:`choose_target` would load (one step ahead, or a jump its vouchers carry). A round at the step is then
    over, and this peer catches up. A peer loading a later state holds none yet, and a liar's claim of a jump vouches
    for nothing: counted, one identity's claim three steps ahead ended the round of 16 peers whenever it claimed a
    new step (the simulation, 16 peers, seed 28), and the LOADING records of peers that tried a liar's claim one
    step ahead ended every round at the step for 70 s (seed 36)."""
    above = [(r.outer_step, r.sha256) for pid, r in records.items() if pid != peer_id and r.outer_step > outer_step]
    return bool(above) and choose_target(records, peer_id, outer_step, sha256, max(above))[0] is not None


def is_verifiable(outer_step: int, target_step: int) -> bool:
    """Whether a state at `target_step` can be checked step by step against this peer's at `outer_step`."""
    return target_step == outer_step + 1


def unverified_step_trusted(records: dict[str, PeerProgress], peer_id: str, outer_step: int, sha256: str,
                            target: tuple[int, str]) -> bool:
    """A state one step ahead that failed :func:`step_problem` is still taken when it is not one
    identity's word and at least as many identities vouch for it as for this peer's state: the swarm
    moved on from a state this peer does not hold (it forked), and a jump would be taken on that count."""
    count = len(vouchers(records, *target))
    return count >= 2 and count >= len(own_vouchers(records, peer_id, outer_step, sha256))
