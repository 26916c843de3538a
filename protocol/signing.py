"""The coordinator's signature on fleet-wide frames (Ed25519).

Frames on a device's own topics carry an HMAC tag under the device's key
(:mod:`protocol.auth`). Fleet-wide topics (``broadcast/model``, ``coordinator/status``)
are read by every device, so no device key can authenticate them without letting every
device forge them: the coordinator signs them with its **signing key**, an Ed25519 key
pair (RFC 8032) whose private half only the coordinator holds, and every device verifies
with the public half, provisioned with it (docs/protocol.md, section 2.5)::

    digest    = SHA-256(u16 BE len(topic) || topic || frame[0:4] || frame[68:])
    signature = Ed25519-Sign(private key, b"edgefl-sign-v6" || digest)

A signed frame is a message frame of type 0x03 or a chunk frame of type 0x04: the layouts
of types 0x01 and 0x02 with a 64-byte signature where those carry their 32-byte tag. The
topic in the signed input keeps a status from being replayed as a broadcast model, or
into another fleet. Ed25519 signatures are deterministic: the same frame on the same
topic is signed with the same bytes. The frame is hashed first (SHA-256, streamed over
the frame without a copy) and the 46-byte label and digest signed: Ed25519 would hash a
long message twice with SHA-512 when signing and once when verifying, copied into one
buffer; the digest makes checking a broadcast model cost one SHA-256 pass over its
bytes and one verification of a short message.

Key files hold hex: the private key file the 32-byte seed (mode 0600), the public key
file the 32-byte public key (``python -m protocol keys --new-signing-key FILE`` writes
``FILE`` and ``FILE.pub``; a coordinator with a state dir makes its own at first start).
The library is PyNaCl (pyca's binding of libsodium), a small wheel that needs no torch: a
device that only serves inference verifies too, at about 60 us a signature on this
project's CPU (OpenSSL's Ed25519, through ``cryptography``, took 180 us).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import nacl.exceptions
import nacl.signing

from protocol.auth import AuthError, read_hex_file, write_secret_file
from protocol.codec import (
    FRAME_HEADER_SIZE,
    SIGNATURE_SIZE,
    read_frame_header,
)

__all__ = [
    "PUBLIC_KEY_SIZE",
    "SIGNATURE_SIZE",
    "SigningKey",
    "VerifyKey",
    "load_or_create_signing_key",
    "public_key_path",
]


PUBLIC_KEY_SIZE = 32
_SEED_SIZE = 32
_DOMAIN = b"edgefl-sign-v6"


def _signed_input(topic: str, frame: bytes | memoryview) -> bytes:
    """What the signature of ``frame`` on ``topic`` signs: the domain label and the
    SHA-256 of the topic and of every byte of the frame but the signature's."""
    name = topic.encode("utf-8")
    view = memoryview(frame)
    digest = hashlib.sha256(len(name).to_bytes(2, "big"))
    digest.update(name)
    digest.update(view[:FRAME_HEADER_SIZE])
    digest.update(view[FRAME_HEADER_SIZE + SIGNATURE_SIZE :])
    return _DOMAIN + digest.digest()


class VerifyKey:
    """The coordinator's public key: checks the signature of fleet-wide frames.

    Args:
        public: the 32-byte Ed25519 public key.

    Raises:
        ValueError: ``public`` is not a valid 32-byte public key.
    """

    def __init__(self, public: bytes) -> None:
        if len(public) != PUBLIC_KEY_SIZE:
            raise ValueError(f"a public key is {PUBLIC_KEY_SIZE} bytes, not {len(public)}")
        try:
            self._key = nacl.signing.VerifyKey(bytes(public))
        except (nacl.exceptions.CryptoError, TypeError, ValueError) as exc:
            raise ValueError(f"not an Ed25519 public key: {exc}") from None
        self.public = bytes(public)

    @property
    def fingerprint(self) -> str:
        """The public key's first 8 bytes in hex: what a log names the key by."""
        return self.public[:8].hex()

    def verify(self, topic: str, frame: bytes | memoryview) -> None:
        """Check the signature of ``frame`` (a signed message or chunk frame) on ``topic``.

        Raises:
            AuthError: not a signed frame (an unsigned one on a fleet-wide topic is
                refused), too short, or the signature does not verify (another key, another
                topic, any byte changed).
        """
        try:
            header = read_frame_header(bytes(frame[:FRAME_HEADER_SIZE]))
        except ValueError as exc:
            raise AuthError(f"unsigned input on {topic}: {exc}") from None
        if not header.signed:
            raise AuthError(f"unsigned frame on {topic} (fleet-wide frames must be signed)")
        if len(frame) < FRAME_HEADER_SIZE + SIGNATURE_SIZE:
            raise AuthError(f"frame too short for a signature ({len(frame)} bytes)")
        signature = bytes(frame[FRAME_HEADER_SIZE : FRAME_HEADER_SIZE + SIGNATURE_SIZE])
        try:
            self._key.verify(_signed_input(topic, frame), signature)
        except nacl.exceptions.BadSignatureError:
            raise AuthError(f"bad coordinator signature on {topic}") from None

    @classmethod
    def load(cls, path: Path) -> VerifyKey:
        """Read a public key file (64 hex digits).

        Raises:
            ValueError: unreadable, or not a 32-byte public key.
        """
        return cls(read_hex_file(path, "coordinator public key file", "key", secret=False))

    def save(self, path: Path) -> None:
        """Write the public key file (64 hex digits and a newline; not secret, mode 0644)."""
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(self.public.hex() + "\n", encoding="utf-8")
        os.chmod(tmp, 0o644)
        tmp.replace(path)


class SigningKey:
    """The coordinator's private key: signs fleet-wide frames.

    Args:
        seed: the 32-byte Ed25519 private key (RFC 8032's seed).
    """

    def __init__(self, seed: bytes) -> None:
        if len(seed) != _SEED_SIZE:
            raise ValueError(f"a signing key is {_SEED_SIZE} bytes, not {len(seed)}")
        self._key = nacl.signing.SigningKey(bytes(seed))
        self._seed = bytes(seed)
        self.verify_key = VerifyKey(bytes(self._key.verify_key))

    @classmethod
    def generate(cls) -> SigningKey:
        """A new key from the operating system's CSPRNG."""
        return cls(os.urandom(_SEED_SIZE))

    def sign(self, topic: str, frame: bytes) -> bytes:
        """``frame`` (a signed message or chunk frame, signature bytes whatever they are)
        with its signature set for ``topic``.

        Raises:
            ValueError: ``frame`` is not of a signed type.
        """
        if not read_frame_header(frame[:FRAME_HEADER_SIZE]).signed:
            raise ValueError("only frames of a signed type (0x03, 0x04) carry a signature")
        signature = self._key.sign(_signed_input(topic, frame)).signature
        return b"".join(
            (
                frame[:FRAME_HEADER_SIZE],
                signature,
                memoryview(frame)[FRAME_HEADER_SIZE + SIGNATURE_SIZE :],
            )
        )

    def seed_hex(self) -> str:
        """The key file's text: the 32-byte private key as hex, and a newline."""
        return self._seed.hex() + "\n"

    def verify(self, topic: str, frame: bytes | memoryview) -> None:
        """:meth:`VerifyKey.verify` with this key's public half."""
        self.verify_key.verify(topic, frame)

    @classmethod
    def load(cls, path: Path) -> SigningKey:
        """Read a signing key file (64 hex digits); warns when others can read it.

        Raises:
            ValueError: unreadable, or not a 32-byte key.
        """
        return cls(read_hex_file(path, "signing key file", "key"))

    def save(self, path: Path) -> None:
        """Write the key file (mode 0600, atomically) and the public key beside it
        (:func:`public_key_path`)."""
        write_secret_file(path, self.seed_hex())
        self.verify_key.save(public_key_path(path))


def public_key_path(path: Path) -> Path:
    """Where the public key of the signing key file ``path`` is written: ``path`` +
    ``.pub``."""
    return path.with_name(path.name + ".pub")


def load_or_create_signing_key(path: Path) -> tuple[SigningKey, bool]:
    """The signing key in ``path``, made (with its ``.pub``) when there is none yet;
    returns it and whether it was made.

    Raises:
        ValueError: the file exists but cannot be read or is not a key.
        OSError: a new key cannot be written.
    """
    if path.exists():
        key = SigningKey.load(path)
        pub = public_key_path(path)
        if not pub.exists():
            key.verify_key.save(pub)
        return key, False
    key = SigningKey.generate()
    key.save(path)
    return key, True
