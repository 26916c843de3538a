"""Mosquitto's password file, written without ``mosquitto_passwd``.

Each line is ``user:$7$ITERATIONS$SALT$HASH``: ``7`` names PBKDF2-HMAC-SHA512, SALT is 12
random bytes and HASH the 64-byte derived key, both in standard base64 with padding. This
is the format Mosquitto 2.0 reads and ``mosquitto_passwd`` 2.0 writes (101 iterations);
tests/deploy checks a hash from ``mosquitto_passwd`` with :func:`verify` and a real
broker with :func:`hash_password`'s output.

Written here rather than by calling ``mosquitto_passwd -b`` so that the provisioning
machine needs no Mosquitto, and no password ever appears on a command line (where ``ps``
shows it). The passwords are random (:func:`new_password`, 192 bits), so the iteration
count, which only slows the guessing of weak passwords, can stay at Mosquitto's own.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets

from deploy.errors import KitStateError, KitUsageError

__all__ = [
    "ITERATIONS",
    "hash_password",
    "new_password",
    "parse_password_file",
    "render_password_file",
    "verify",
]

ITERATIONS = 101
"""PBKDF2 iterations: ``mosquitto_passwd`` 2.0's count (the hash says it, so any works)."""
_SALT_BYTES = 12
_HASH = "sha512"
_TYPE = "7"


def new_password() -> str:
    """A random password: 32 URL-safe characters, 192 bits."""
    return secrets.token_urlsafe(24)


def hash_password(password: str, *, iterations: int = ITERATIONS, salt: bytes | None = None) -> str:
    """The ``$7$...`` hash of ``password`` with a fresh random salt (or ``salt``)."""
    salt = secrets.token_bytes(_SALT_BYTES) if salt is None else salt
    digest = hashlib.pbkdf2_hmac(_HASH, password.encode(), salt, iterations)
    encoded = (base64.b64encode(part).decode("ascii") for part in (salt, digest))
    return f"${_TYPE}${iterations}${'$'.join(encoded)}"


def verify(password: str, hashed: str) -> bool:
    """Whether ``hashed`` (a ``$7$...`` hash) is the hash of ``password``.

    Raises:
        KitStateError: ``hashed`` is not a ``$7$`` hash.
    """
    try:
        empty, kind, iterations, salt, digest = hashed.split("$")
        if empty or kind != _TYPE:
            raise ValueError(f"hash type {kind!r}, not {_TYPE}")
        expected = base64.b64decode(digest, validate=True)
        actual = hashlib.pbkdf2_hmac(
            _HASH, password.encode(), base64.b64decode(salt, validate=True), int(iterations)
        )
    except (ValueError, binascii.Error) as exc:
        raise KitStateError(f"not a Mosquitto PBKDF2-SHA512 hash: {exc}") from exc
    return hmac.compare_digest(actual, expected)


def parse_password_file(text: str) -> dict[str, str]:
    """User name -> hash, in file order, of a password file's text (blank lines skipped).

    Raises:
        KitStateError: a line without ``user:hash``, or a user named twice.
    """
    entries: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        user, colon, hashed = line.partition(":")
        if not colon or not user or not hashed:
            raise KitStateError(f"password file line {number} is not user:hash")
        if user in entries:
            raise KitStateError(f"password file names {user!r} twice")
        entries[user] = hashed
    return entries


def render_password_file(entries: dict[str, str]) -> str:
    """The text of a password file holding ``entries`` (user name -> hash).

    Raises:
        KitUsageError: a user name with a colon or a line break, which the file cannot hold.
    """
    for user in entries:
        if not user or any(c in user for c in ":\r\n"):
            raise KitUsageError(f"{user!r} cannot be a user name in a password file")
    return "".join(f"{user}:{hashed}\n" for user, hashed in entries.items())
