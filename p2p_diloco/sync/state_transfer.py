"""Global state transfer: what a joiner downloads, and the checks before it is used.

The state is θ_global and the outer momentum (fp32), with metadata: the outer step, the sha256 of
θ_global and the inner step count (a joiner aligns its lr schedule to it). A download is accepted
only if the tensors hash to the sha256 the sender announced, and, when the caller asks for a
specific state (the one the swarm agrees on), only if it is that one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from p2p_diloco.sync.outer_sync import OuterSync
from p2p_diloco.hashing import tensors_sha256

logger = logging.getLogger(__name__)


@dataclass
class GlobalState:
    outer_step: int
    sha256: str
    inner_steps: int
    tensors: list[torch.Tensor]  # θ_global then the outer momentum


def download_global_state(
    sync: OuterSync,
    num_params: int,
    min_step: int,
    want_sha256: Optional[str],
    timeout: float,
    should_stop: Callable[[], bool] = lambda: False,
    attempts: int = 3,
) -> Optional[GlobalState]:
    """Download the state of a peer at outer step >= min_step; at exactly min_step, only want_sha256's."""
    deadline = time.monotonic() + timeout
    for attempt in range(attempts):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or should_stop():
            break
        downloaded = sync.download_state(timeout=remaining, should_stop=should_stop)
        if downloaded is None:
            logger.info("state download attempt %d: no peer served its state", attempt + 1)
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            continue
        metadata, tensors = downloaded
        problem = _check(metadata, tensors, num_params, min_step, want_sha256)
        if problem is None:
            return GlobalState(metadata["outer_step"], metadata["sha256"], metadata["inner_steps"], list(tensors))
        logger.warning("state download attempt %d rejected: %s", attempt + 1, problem)
    return None


def _check(metadata, tensors, num_params: int, min_step: int, want_sha256: Optional[str]) -> Optional[str]:
    if not isinstance(metadata, dict) or not {"outer_step", "sha256", "inner_steps"} <= set(metadata):
        return f"malformed metadata {metadata!r}"
    if len(tensors) != 2 * num_params:
        return f"{len(tensors)} tensors where {2 * num_params} were expected"
    if metadata["outer_step"] < min_step:
        return f"the state is at outer step {metadata['outer_step']}, older than {min_step}"
    actual = tensors_sha256(tensors[:num_params])
    if actual != metadata["sha256"]:
        return "the parameters do not match the sha256 their sender announced"
    if want_sha256 is not None and metadata["outer_step"] == min_step and actual != want_sha256:
        return f"a state other than the agreed one ({want_sha256[:12]})"
    return None
