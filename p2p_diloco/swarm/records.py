"""The run's DHT records, their schemas, and the validators that keep strangers' records out.

A run keeps two keys on the DHT, each a dictionary with one subkey per peer:

* ``<run>_progress``: where each peer is (:mod:`p2p_diloco.swarm.progress`);
* ``<run>_rounds``: each peer's reports on its last averaging rounds (:mod:`p2p_diloco.sync.commit`).

Every subkey is a peer's *owner marker* (``[owner:<its RSA public key>]``) and every value is signed
by that key. Each node of a run checks every record it is asked to store or receives in a reply
with two hivemind validators (``hivemind/dht/validation.py`` says when they run):

* :class:`LoggedSignatureValidator` (hivemind's ``RSASignatureValidator``): a record under a
  peer's marker must carry that peer's signature, so nobody can write another peer's record;
* :class:`LoggedSchemaValidator` (hivemind's ``SchemaValidator``): the subkey must be an owner
  marker (unsigned records are refused) and the value must match the schema below, with strict types.

A refused record never reaches the application; it is logged once per author and kind. The author
of an accepted record is the peer whose key signed it (:func:`~p2p_diloco.swarm.identity.owner_peer_id`),
never a peer ID written inside the value.
"""

from __future__ import annotations

from typing import Dict, Literal, Optional

import pydantic.v1 as pydantic
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from p2p_diloco.remote_input import Count, FiniteFloat, OuterStep, Sha256Hex, StrictModel, Token, warn_once
from p2p_diloco.swarm.identity import Identity, owner_peer_id

TRAINING, READY, LOADING, LEFT = "training", "ready", "loading", "left"


class ProgressValue(StrictModel):
    """A peer's progress record (see :class:`p2p_diloco.swarm.progress.PeerProgress`)."""

    outer_step: OuterStep
    sha256: Sha256Hex
    phase: Literal["training", "ready", "loading", "left"]
    samples: Count
    time: FiniteFloat
    fingerprint: Sha256Hex


class RoundReport(StrictModel):
    """A peer's report on one averaging round (see :mod:`p2p_diloco.sync.commit`)."""

    outer_step: OuterStep
    token: Token
    complete: pydantic.StrictBool
    mean_sha256: Optional[Sha256Hex]


class RoundReportsValue(StrictModel):
    """A peer's reports on its latest rounds, newest first (two: a slow groupmate may still read the older)."""

    reports: pydantic.conlist(RoundReport, min_items=1, max_items=2)


class RunRecords(pydantic.BaseModel):
    """The schema of a run's DHT keys, as hivemind's SchemaValidator takes it (prefix: the run name)."""

    progress: Dict[BytesWithPublicKey, ProgressValue]
    rounds: Dict[BytesWithPublicKey, RoundReportsValue]

    class Config:
        extra = pydantic.Extra.forbid


def progress_key(run_name: str) -> str:
    return f"{run_name}_progress"


def rounds_key(run_name: str) -> str:
    return f"{run_name}_rounds"


def _author(record: DHTRecord) -> str:
    return owner_peer_id(record.subkey) or "(unsigned)"


class LoggedSignatureValidator(RSASignatureValidator):
    """hivemind's signature check, which logs (once per owner) a record that fails it."""

    def validate(self, record: DHTRecord) -> bool:
        if super().validate(record):
            return True
        warn_once(_author(record), "a DHT record under this peer's key that it did not sign",
                  "somebody else tried to write it")
        return False


class LoggedSchemaValidator(SchemaValidator):
    """hivemind's schema check, which logs (once per author and key) a record that fails it."""

    def __init__(self, schema, prefix: str):
        super().__init__(schema, allow_extra_keys=True, prefix=prefix)
        self._key_names = {DHTID.generate(source=f"{prefix}_{name}").to_bytes(): f"{prefix}_{name}"
                           for name in schema.__fields__}

    def validate(self, record: DHTRecord) -> bool:
        if super().validate(record):
            return True
        key = self._key_names.get(record.key, "a run key")
        warn_once(_author(record), f"a malformed {key} record", "it does not match the record schema")
        return False

    def merge_with(self, other: RecordValidatorBase) -> bool:
        merged = super().merge_with(other)
        if merged and isinstance(other, LoggedSchemaValidator):
            self._key_names.update(other._key_names)
        return merged


def node_validators(identity: Identity) -> list[RecordValidatorBase]:
    """What every node checks, whatever run it serves (a bootstrap node knows no run)."""
    return [LoggedSignatureValidator(identity.private_key)]


def run_validators(identity: Identity, run_name: str) -> list[RecordValidatorBase]:
    """What a peer of run `run_name` checks: signatures and the schema of the run's records."""
    return [*node_validators(identity), LoggedSchemaValidator(RunRecords, prefix=run_name)]
