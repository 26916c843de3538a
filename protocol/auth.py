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
:func:`hmac.compare_digest`; a failure raises :class:`AuthError` (a ``DecodeError``).
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

from protocol.codec import FRAME_HEADER_SIZE, TAG_SIZE
from protocol.errors import DecodeError
from protocol.topics import parse_topic, valid_identifier

__all__ = [
    "KEY_SIZE",
    "TAG_OFFSET",
    "TAG_SIZE",
    "ZERO_TAG",
    "AuthError",
    "Keyring",
    "frame_tag",
    "new_key",
    "read_key_file",
    "seal",
    "topic_device",
    "verify",
    "write_key_file",
]

log = logging.getLogger(__name__)

KEY_SIZE = 32
TAG_OFFSET = FRAME_HEADER_SIZE
"""The tag follows the 4-byte frame header."""
ZERO_TAG = bytes(TAG_SIZE)
"""The tag of a frame that is not authenticated (fleet-wide topics, insecure mode)."""
_DOMAIN = b"edgefl-auth-v4"


class AuthError(DecodeError):
    """A frame's tag does not verify, or there is no key for the device its topic names.

    ``device_id`` is the device the topic names (None when it names none)."""

    def __init__(self, message: str, device_id: str | None = None) -> None:
        super().__init__(message)
        self.device_id = device_id


def new_key() -> bytes:
    """32 random bytes from the operating system's CSPRNG."""
    return secrets.token_bytes(KEY_SIZE)


def frame_tag(key: bytes, topic: str, frame: bytes) -> bytes:
    """The HMAC-SHA256 tag of message ``frame`` on ``topic`` (whatever its tag bytes)."""
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
    """Check the tag of message ``frame`` on ``topic``.

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


def _parse_key(device_id: str, value: object) -> bytes:
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


class Keyring(Mapping[str, bytes]):
    """Device id -> 32-byte key. Read from / written to a JSON file ``{"id": "hex"}``."""

    def __init__(self, keys: Mapping[str, bytes] | None = None) -> None:
        self._keys: dict[str, bytes] = {}
        for device_id, key in (keys or {}).items():
            self._keys[device_id] = _parse_key(device_id, key.hex())

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
        keys = {str(k): _parse_key(str(k), v) for k, v in data.items()}
        return cls(keys)

    def save(self, path: Path) -> None:
        """Write the keyring atomically with mode 0600."""
        text = json.dumps({k: v.hex() for k, v in sorted(self._keys.items())}, indent=2)
        _write_secret(path, text + "\n")


def _write_secret(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, 0o600)
    tmp.replace(path)


def read_key_file(path: Path) -> bytes:
    """Read a device's key file: 64 hex digits (surrounding whitespace ignored).

    Raises:
        ValueError: unreadable, or not a 32-byte hex key.
    """
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read key file {path}: {exc}") from None
    _warn_if_readable(path)
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"key file {path} must hold 64 hex digits") from None
    if len(key) != KEY_SIZE:
        raise ValueError(f"key file {path} must hold a {KEY_SIZE}-byte key, not {len(key)}")
    return key


def write_key_file(path: Path, key: bytes) -> None:
    """Write a device's key file (64 hex digits and a newline) atomically, mode 0600."""
    _write_secret(path, key.hex() + "\n")
