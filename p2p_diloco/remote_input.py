"""Checks for everything that comes from another peer, before it is used.

A public run lets strangers write to the DHT, join averaging groups and serve state. Whatever they
send (DHT records, the metadata gathered in a group, a downloaded state, all-reduce parts) is
checked here for type, range, shape and dtype. A bad value is logged once per sender and reason,
with the sender's peer ID, and then ignored or the round voided: it never raises into the DiLoCo
loop.

The schemas are pydantic (v1 API, as hivemind's :class:`~hivemind.dht.schema.SchemaValidator` uses)
with strict types only: a string "9" is not an outer step, and a float is not a sample count.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional, Sequence, Type, TypeVar

import pydantic.v1 as pydantic
import torch

logger = logging.getLogger(__name__)

MAX_OUTER_STEP = 2**31 - 1  # one outer step a second for 68 years
MAX_COUNT = 2**48  # samples and inner steps
MAX_TENSORS = 4096  # averaged tensors of a model (and so its fragments)

OuterStep = pydantic.conint(strict=True, ge=0, le=MAX_OUTER_STEP)
Count = pydantic.conint(strict=True, ge=0, le=MAX_COUNT)
Sha256Hex = pydantic.constr(strict=True, regex=r"^[0-9a-f]{64}$")
Token = pydantic.constr(strict=True, regex=r"^[0-9a-f]{16}$")
FiniteFloat = pydantic.confloat(strict=True, allow_inf_nan=False)


class StrictModel(pydantic.BaseModel):
    """A record from another peer: no unknown fields, no type conversions."""

    class Config:
        extra = pydantic.Extra.forbid
        allow_mutation = False


Model = TypeVar("Model", bound=StrictModel)


def parse(model: Type[Model], value: Any) -> tuple[Optional[Model], Optional[str]]:
    """(the parsed record, None), or (None, why it is malformed) in one line."""
    try:
        return model.parse_obj(value), None
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "value"
        return None, f"{where}: {first['msg']}"
    except Exception as e:  # parse_obj on a value that is not a mapping at all
        return None, f"not a record: {type(value).__name__} ({e})"


_reported: set[tuple[str, str]] = set()
_reported_lock = threading.Lock()


def warn_once(sender: str, what: str, detail: str = "") -> None:
    """Log a bad input once per (sender, what): a hostile peer must not flood the log."""
    with _reported_lock:
        if (sender, what) in _reported:
            return
        _reported.add((sender, what))
    logger.warning("ignoring %s from peer %s%s", what, sender, f": {detail}" if detail else "")


def tensor_problem(tensor: Any, shape: Sequence[int], what: str) -> Optional[str]:
    """None if `tensor` is a finite fp32 tensor of `shape`; else what is wrong with it, in one line."""
    if not isinstance(tensor, torch.Tensor):
        return f"{what} is a {type(tensor).__name__}, not a tensor"
    if tensor.dtype != torch.float32:
        return f"{what} has dtype {tensor.dtype}, expected torch.float32"
    if tuple(tensor.shape) != tuple(shape):
        return f"{what} has shape {tuple(tensor.shape)}, expected {tuple(shape)}"
    if not bool(torch.isfinite(tensor).all()):
        return f"{what} holds NaN or infinite values"
    return None
