"""When Streaming DiLoCo syncs which fragment (Douillard et al., arXiv 2501.18512, §2.1–2.2).

Every peer counts the same outer steps, so the schedule is a function of the outer step alone:
outer step t syncs fragment t mod P after H/P inner steps. Each fragment is then synced every
H inner steps, fragment p at offset (p + 1)·H/P, one fragment in flight at a time. A fragment is a
list of tensor indices; which parameters form it is the model's business
(:func:`p2p_diloco.train.fragments.model_fragments`). This module knows no model, so both ``train``
(the DiLoCo loop) and ``sync`` (the bootstrap's assistant, which reduces for peers) read it.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def fragment_at(outer_step: int, num_fragments: int) -> int:
    """The fragment that outer step `outer_step` syncs: every member of a round, assistants included, agrees."""
    return outer_step % num_fragments


class FragmentSchedule:
    """Which fragment outer step t syncs, after how many inner steps, and how many more inner steps run
    while it syncs (arXiv 2501.18512, §2: H/P and τ).

    Streaming DiLoCo fixes τ: the outer step is applied τ inner steps after the Δ, and the loop waits there
    for a sync that is slower. With a fixed τ, a sync that ends after one step leaves its mean τ − 1 steps
    stale, and one that outlasts τ steps idles the compute. Unless `fixed_delay`, τ = `sync_delay` is the
    most: the outer step is applied after the first inner step that ends with the sync done. The paper
    measures the loss within 0.2 % of τ = 1 up to τ = 10 (its ablation of the overlap); θ_global is the
    same on every peer whatever each one's τ, since only the merge into a peer's own θ_local comes after
    those steps.
    """

    def __init__(self, fragments: list[list[int]], steps_per_outer: int, sync_delay: int, fixed_delay: bool = False):
        """`sync_delay` is τ (the most, unless `fixed_delay`), or -1 for the longest overlap the schedule allows;
        `fixed_delay` is ``outer.fixed_sync_delay``, with its default."""
        self.fragments = fragments
        self.fixed_delay = fixed_delay
        self.steps_per_sync = steps_per_outer // len(fragments)  # H / P
        # τ < H/P: one fragment in flight at a time, and each round trains at least one step of its own
        longest = self.steps_per_sync - 1
        self.sync_delay = longest if sync_delay < 0 else min(sync_delay, longest)
        if self.sync_delay < sync_delay:
            logger.info("outer.sync_delay = %d is lowered to %d: at most steps_per_outer / fragments - 1 inner steps "
                        "run while a fragment syncs", sync_delay, self.sync_delay)

    def overlaps(self, steps_ahead: int, sync_done: bool) -> bool:
        """Whether one more inner step runs beside the sync in flight, after `steps_ahead` of them ran since
        its Δ was taken: τ of them with a fixed delay; otherwise until one ends with the sync done, at
        least one (the sync began with the Δ) and τ at most."""
        if steps_ahead >= self.sync_delay:
            return False
        return self.fixed_delay or steps_ahead == 0 or not sync_done

    def fragment_at(self, outer_step: int) -> int:
        return fragment_at(outer_step, len(self.fragments))
