"""Frame authentication: per-device keys and the HMAC-SHA256 tag of every message frame.

Every message frame (docs/protocol.md, section 2.1) carries a 32-byte tag after its
4-byte header::

    tag = HMAC-SHA256(key, b"edgefl-auth-v4" || u16 BE len(topic) || topic (UTF-8)
                           || frame[0:4] || frame[36:])

``key`` is the 32-byte key of the device the topic names: the device's own topics
(``fl/{fleet}/devices/{device}/...``) and those the coordinator writes to it
(``fl/{fleet}/to/{device}/...``) share that key, and the topic inside the MAC input keeps
a message from being moved to another device's topic, to another fleet or from one
direction to the other. A chunked message is authenticated once, as the whole frame the
chunks reassemble to (the tag travels in that frame).

Fleet-wide topics (``broadcast/model``, ``coordinator/status``) have no device key; their
frames carry 32 zero bytes and are not authenticated (docs/protocol.md, section 2.3).

A :class:`Keyring` maps device ids to keys; the coordinator's holds the fleet's devices
(the operator's registration), a device's its own key. Checking happens in
:class:`~protocol.channel.Channel` after chunk reassembly and before decompression, with
:func:`hmac.compare_digest`; a failure raises :class:`AuthError` (a ``DecodeError``). A
channel asks a :class:`KeySource` for its keys: a :class:`Keyring` is one, and so is the
coordinator's enrolling keyring (:mod:`coordinator.enrolment`).

Enrolment with a fleet token (docs/protocol.md, section 2.4): a 32-byte fleet secret from
which each device's key is derived, ``key = HMAC-SHA256(token, b"edgefl-enrol-v1" || 0x00
|| device id (UTF-8))`` (:func:`derive_device_key`). The wire does not change: a device so
provisioned signs its frames with its derived key like any other.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Protocol

from protocol.codec import FRAME_HEADER_SIZE, TAG_SIZE
from protocol.errors import DecodeError
from protocol.topics import parse_topic, valid_identifier

__all__ = [
    "KEY_SIZE",
    "TAG_OFFSET",
    "TAG_SIZE",
    "ZERO_TAG",
    "AuthError",
    "KeySource",
    "Keyring",
    "derive_device_key",
    "frame_tag",
    "new_key",
    "parse_key",
    "read_fleet_token",
    "read_hex_file",
    "read_key_file",
    "seal",
    "topic_device",
    "verify",
    "write_fleet_token",
    "write_secret_file",
    "write_key_file",
]

log = logging.getLogger(__name__)

KEY_SIZE = 32
TAG_OFFSET = FRAME_HEADER_SIZE
"""The tag follows the 4-byte frame header."""
ZERO_TAG = bytes(TAG_SIZE)
"""The tag of a frame that is not authenticated (fleet-wide topics, insecure mode)."""
_DOMAIN = b"edgefl-auth-v4"
_ENROL_DOMAIN = b"edgefl-enrol-v1\x00"
"""The label before the device id in a derived key's HMAC input (section 2.4)."""


class AuthError(DecodeError):
    """A frame's tag does not verify, or there is no key for the device its topic names.

    ``device_id`` is the device the topic names (None when it names none)."""

    def __init__(self, message: str, device_id: str | None = None) -> None:
        super().__init__(message)
        self.device_id = device_id


def new_key() -> bytes:
    """32 random bytes from the operating system's CSPRNG."""
    return secrets.token_bytes(KEY_SIZE)


def derive_device_key(token: bytes, device_id: str) -> bytes:
    """The 32-byte key of ``device_id`` derived from a fleet ``token``:
    ``HMAC-SHA256(token, b"edgefl-enrol-v1" || 0x00 || device_id (UTF-8))``.

    Raises:
        ValueError: ``token`` is not 32 bytes, or ``device_id`` is not a valid identifier.
    """
    if len(token) != KEY_SIZE:
        raise ValueError(f"a fleet token is {KEY_SIZE} bytes, not {len(token)}")
    if not valid_identifier(device_id):
        raise ValueError(f"invalid device id {device_id!r}")
    return hmac.new(token, _ENROL_DOMAIN + device_id.encode("utf-8"), hashlib.sha256).digest()


def frame_tag(key: bytes, topic: str, frame: bytes) -> bytes:
    """The HMAC-SHA256 tag of ``frame`` (a message or a chunk frame) on ``topic``
    (whatever its tag bytes)."""
    name = topic.encode("utf-8")
    mac = hmac.new(key, _DOMAIN, hashlib.sha256)
    mac.update(len(name).to_bytes(2, "big"))
    mac.update(name)
    mac.update(frame[:TAG_OFFSET])
    mac.update(frame[TAG_OFFSET + TAG_SIZE :])
    return mac.digest()


def seal(key: bytes, topic: str, frame: bytes) -> bytes:
    """``frame`` with its tag set for ``topic``."""
    return frame[:TAG_OFFSET] + frame_tag(key, topic, frame) + frame[TAG_OFFSET + TAG_SIZE :]


def verify(key: bytes, topic: str, frame: bytes) -> None:
    """Check the tag of ``frame`` (a message or a chunk frame) on ``topic``.

    Raises:
        AuthError: the tag does not verify (wrong key, other topic, any byte changed).
    """
    if len(frame) < TAG_OFFSET + TAG_SIZE:
        raise AuthError(f"frame too short for a tag ({len(frame)} bytes)")
    tag = frame[TAG_OFFSET : TAG_OFFSET + TAG_SIZE]
    if not hmac.compare_digest(tag, frame_tag(key, topic, frame)):
        raise AuthError(f"bad authentication tag on {topic}", topic_device(topic))


def topic_device(topic: str) -> str | None:
    """The device id a ``devices/`` or ``to/`` topic names; None for any other topic."""
    try:
        info = parse_topic(topic)
    except DecodeError:
        return None
    return info.device_id if info.role in ("device", "to") else None


def parse_key(device_id: str, value: object) -> bytes:
    """``device_id``'s key from its hex form (a keyring entry).

    Raises:
        ValueError: an invalid device id, or a value that is not 64 hex digits.
    """
    if not valid_identifier(device_id):
        raise ValueError(f"invalid device id {device_id!r}")
    if not isinstance(value, str):
        raise ValueError(f"key of {device_id!r} must be a hex string")
    try:
        key = bytes.fromhex(value)
    except ValueError:
        raise ValueError(f"key of {device_id!r} is not hex") from None
    if len(key) != KEY_SIZE:
        raise ValueError(f"key of {device_id!r} must be {KEY_SIZE} bytes, not {len(key)}")
    return key


def _warn_if_readable(path: Path) -> None:
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s holds secret keys but is readable by others (chmod 600 it)", path)


class KeySource(Protocol):
    """Where a :class:`~protocol.channel.Channel` gets its keys (a :class:`Keyring`, or the
    coordinator's enrolling keyring). Called from the transport's thread and the sender's:
    implementations are thread-safe."""

    def key_for(self, topic: str) -> bytes | None:
        """The key to seal a frame on ``topic`` with; None: ``topic`` names no device
        this source has a key of (or none at all)."""

    def receive_key(self, device_id: str) -> bytes:
        """The key to check a frame of ``device_id``'s topics with.

        Raises:
            AuthError: no key for ``device_id`` (the frame is refused before any work).
        """

    def authenticated(self, device_id: str) -> None:
        """Called once a frame of ``device_id`` verified under :meth:`receive_key`'s key,
        before it is decoded.

        Raises:
            AuthError: the frame must still be refused (nothing of it is kept).
        """


class Keyring(Mapping[str, bytes]):
    """Device id -> 32-byte key. Read from / written to a JSON file ``{"id": "hex"}``.

    A :class:`KeySource` of fixed keys: a device id without a key is refused."""

    def __init__(self, keys: Mapping[str, bytes] | None = None) -> None:
        self._keys: dict[str, bytes] = {}
        for device_id, key in (keys or {}).items():
            self._keys[device_id] = parse_key(device_id, key.hex())

    def __getitem__(self, device_id: str) -> bytes:
        return self._keys[device_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def key_for(self, topic: str) -> bytes | None:
        """The key of the device ``topic`` names, or None (no such device, or a
        fleet-wide topic)."""
        device_id = topic_device(topic)
        return None if device_id is None else self._keys.get(device_id)

    def receive_key(self, device_id: str) -> bytes:
        """``device_id``'s key.

        Raises:
            AuthError: no key for ``device_id`` (not registered).
        """
        key = self._keys.get(device_id)
        if key is None:
            raise AuthError(f"no key for device {device_id!r} (not registered)", device_id)
        return key

    def authenticated(self, device_id: str) -> None:
        """Nothing to do: a keyring's keys are fixed."""

    def without(self, device_ids: set[str] | frozenset[str]) -> Keyring:
        """A copy without the keys of ``device_ids``."""
        return Keyring({k: v for k, v in self._keys.items() if k not in device_ids})

    def with_key(self, device_id: str, key: bytes) -> Keyring:
        """A copy with ``device_id``'s key set."""
        return Keyring({**self._keys, device_id: key})

    @classmethod
    def load(cls, path: Path) -> Keyring:
        """Read a keyring file (a JSON object of device id -> 64 hex digits); warns when
        the file is readable by group or others.

        Raises:
            ValueError: the file cannot be read or is not a valid keyring (OSError's
                message included).
        """
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read keyring {path}: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"keyring {path} must hold a JSON object of device id -> hex key")
        _warn_if_readable(path)
        keys = {str(k): parse_key(str(k), v) for k, v in data.items()}
        return cls(keys)

    def save(self, path: Path) -> None:
        """Write the keyring atomically with mode 0600."""
        text = json.dumps({k: v.hex() for k, v in sorted(self._keys.items())}, indent=2)
        write_secret_file(path, text + "\n")


def write_secret_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary file, fsync, rename, fsync of the
    folder), mode 0600.

    Raises:
        OSError: the file cannot be written (the old one, if any, is left as it was).
    """
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, 0o600)
    tmp.replace(path)
    try:
        folder = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return  # a platform without directory handles: the rename is what counts
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def read_hex_file(path: Path, what: str, noun: str, *, secret: bool = True) -> bytes:
    """The 32 bytes a file holds as 64 hex digits (surrounding whitespace ignored); a
    ``secret`` one warns when group or others can read it.

    Raises:
        ValueError: unreadable, or not 32 bytes of hex (``what`` and ``noun`` name them).
    """
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {what} {path}: {exc}") from None
    if secret:
        _warn_if_readable(path)
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{what} {path} must hold 64 hex digits") from None
    if len(key) != KEY_SIZE:
        raise ValueError(f"{what} {path} must hold a {KEY_SIZE}-byte {noun}, not {len(key)}")
    return key


def read_key_file(path: Path) -> bytes:
    """Read a device's key file: 64 hex digits (surrounding whitespace ignored).

    Raises:
        ValueError: unreadable, or not a 32-byte hex key.
    """
    return read_hex_file(path, "key file", "key")


def read_fleet_token(path: Path) -> bytes:
    """Read a fleet token file: 64 hex digits (surrounding whitespace ignored); warns when
    the file is readable by group or others.

    Raises:
        ValueError: unreadable, or not a 32-byte hex token.
    """
    return read_hex_file(path, "fleet token file", "token")


def write_fleet_token(path: Path, token: bytes) -> None:
    """Write a fleet token file (64 hex digits and a newline) atomically, mode 0600.

    Raises:
        ValueError: ``token`` is not 32 bytes.
        OSError: the file cannot be written.
    """
    if len(token) != KEY_SIZE:
        raise ValueError(f"a fleet token is {KEY_SIZE} bytes, not {len(token)}")
    write_secret_file(path, token.hex() + "\n")


def write_key_file(path: Path, key: bytes) -> None:
    """Write a device's key file (64 hex digits and a newline) atomically, mode 0600."""
    write_secret_file(path, key.hex() + "\n")
