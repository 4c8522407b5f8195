"""A node's identity: one RSA key that names it on the network and signs what it writes to the DHT.

libp2p derives a node's peer ID from its identity key (for RSA keys: the multihash of the encoded
public key). hivemind protects a DHT record against writers other than its owner when the record's
subkey carries the owner's public key (``[owner:ssh-rsa ...]``) and the value a signature by that key
(:class:`hivemind.dht.crypto.RSASignatureValidator`). Using the *same* key for both binds the two:
from a record's subkey a reader derives the peer ID of the only node that could have written it, so a
stranger can neither overwrite another peer's record nor publish one in its name.

hivemind writes identity files as a protobuf ``PrivateKey`` holding an RSA key in DER form. Without
``--identity-path`` a node gets a fresh key, written to a private temporary file only while p2pd
starts (:meth:`Identity.key_file`).
"""

from __future__ import annotations

import hashlib
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator, Optional

import multihash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey


class IdentityError(ValueError):
    """An identity file cannot be read or holds a key of another kind, or another node of the swarm runs with its
    key; one line for the user."""


def _load_private_key(path: Path) -> RSAPrivateKey:
    try:
        key_data = crypto_pb2.PrivateKey.FromString(path.read_bytes()).data
        private_key = serialization.load_der_private_key(key_data, password=None)
    except OSError as e:
        raise IdentityError(f"--identity-path {str(path)!r} cannot be read: {e.strerror}") from None
    except Exception:
        raise IdentityError(
            f"--identity-path {str(path)!r} is not a hivemind identity file; remove it to create a new one"
        ) from None
    if not isinstance(private_key, rsa.RSAPrivateKey):
        raise IdentityError(
            f"--identity-path {str(path)!r} holds a {type(private_key).__name__}; p2p-diloco needs an RSA key "
            f"(the kind hivemind creates): remove the file to create a new one"
        )
    key = RSAPrivateKey.__new__(RSAPrivateKey)  # hivemind's wrapper has no constructor from an existing key
    key._private_key = private_key
    return key


def peer_id_of_public_key(public_key: RSAPublicKey) -> str:
    """The libp2p peer ID (base58) of a node whose identity key has this public half."""
    der = public_key._public_key.public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
    )
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


@lru_cache(maxsize=4096)
def owner_peer_id(subkey: bytes) -> Optional[str]:
    """The peer ID of the node that owns a protected DHT subkey (``[owner:<public key>]``), or None.

    The signature validator has checked, before a record reaches the application, that its value is
    signed by this key; so the peer ID returned is the record's real author.
    """
    if not isinstance(subkey, bytes):
        return None
    keys = RSASignatureValidator._PUBLIC_KEY_RE.findall(subkey)
    if len(set(keys)) != 1:
        return None
    try:
        return peer_id_of_public_key(RSAPublicKey.from_bytes(keys[0]))
    except Exception:  # not a parseable RSA key: nobody can have signed for it
        return None


@dataclass
class Identity:
    """This node's RSA identity key: it names the node on the network and signs its DHT records."""

    private_key: RSAPrivateKey
    path: Optional[Path]  # the identity file the user named, or None: a fresh key for this run only
    is_new: bool  # created just now: hivemind need not ask the swarm whether another node already uses it

    @classmethod
    def load_or_create(cls, identity_path: Optional[str]) -> "Identity":
        """The key in `identity_path` (created there if missing), or a fresh one for this run."""
        if identity_path is None:
            return cls(RSAPrivateKey(), None, is_new=True)
        path = Path(identity_path)
        is_new = not path.exists()
        if is_new:
            if not path.parent.is_dir():
                raise IdentityError(
                    f"--identity-path {identity_path!r}: the directory {str(path.parent)!r} does not exist"
                )
            P2P.generate_identity(str(path))
        return cls(_load_private_key(path), path, is_new=is_new)

    @contextmanager
    def key_file(self) -> Iterator[Path]:
        """The identity file for p2pd to read at start-up: the user's, or a private temporary one that is
        deleted afterwards (p2pd has read it by then)."""
        if self.path is not None:
            yield self.path
            return
        with tempfile.TemporaryDirectory(prefix="p2p-diloco-identity-") as directory:
            path = Path(directory) / "identity.key"
            path.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=self.private_key.to_bytes())
                             .SerializeToString())
            path.chmod(0o400)
            yield path

    @property
    def peer_id(self) -> str:
        return peer_id_of_public_key(self.private_key.get_public_key())

    def signature_validator(self) -> RSASignatureValidator:
        """hivemind's validator, signing with this identity's key."""
        return RSASignatureValidator(self.private_key)

    @property
    def record_subkey(self) -> bytes:
        """The DHT subkey under which only this node can write (its records carry its signature)."""
        return self.signature_validator().local_public_key
