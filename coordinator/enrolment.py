"""Enrolment with a fleet token: the coordinator's keyring that grows by itself, within bounds.

A device flashed with the fleet token (or with the key derived from it for its id) signs
its frames with ``derive_device_key(token, device_id)`` (docs/protocol.md, section 2.4).
:class:`FleetKeys` is the coordinator's :class:`~protocol.auth.KeySource`: a device of the
operator's keyring (``--device-keys``) is checked with its registered key; any other id,
with the coordinator holding the token (``--fleet-token-file``), with the key derived for
it. Only once a frame *verifies* under that derived key is the device enrolled: its key
is added to ``STATE_DIR/enrolled-keys.json`` (a keyring, written atomically with mode
0600) before the frame goes on, the enrolment is logged and counted. A frame that fails
verification changes nothing. Enrolled devices keep working after the token is withdrawn
from the coordinator: their keys are in the state dir.

Bounds and revocation:

* ``--max-enrolled N``: past N enrolled devices (over every run of the state dir) new ids
  are refused, so a leaked token cannot grow the keyring without bound.
* ``python -m coordinator revoke --state-dir DIR ID ...`` writes the ids to
  ``STATE_DIR/revoked-devices.json`` (a JSON list). At its next start the coordinator
  drops their enrolled keys and refuses them for good: their registered keys (an id of
  ``--device-keys`` too) and the token are not used for them. Delete an id from that file
  to let it enrol again.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from protocol.auth import AuthError, Keyring, derive_device_key, topic_device, write_secret_file
from protocol.topics import valid_identifier

__all__ = [
    "ENROLLED_FILE",
    "REVOKED_FILE",
    "FleetKeys",
    "read_revoked",
    "revoke",
]

log = logging.getLogger(__name__)

ENROLLED_FILE = "enrolled-keys.json"
"""The keyring of the devices enrolled with the fleet token, in the state dir."""
REVOKED_FILE = "revoked-devices.json"
"""The ids an operator revoked (a JSON list), in the state dir."""


def read_revoked(state_dir: Path) -> frozenset[str]:
    """The ids revoked in ``state_dir`` (none when the file does not exist).

    Raises:
        ValueError: the file cannot be read or is not a JSON list of device ids.
    """
    path = state_dir / REVOKED_FILE
    if not path.exists():
        return frozenset()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, list) or not all(
        isinstance(d, str) and valid_identifier(d) for d in data
    ):
        raise ValueError(f"{path} must hold a JSON list of device ids")
    return frozenset(data)


def revoke(state_dir: Path, device_ids: Iterable[str]) -> frozenset[str]:
    """Add ``device_ids`` to the revoked ids of ``state_dir`` (atomic write, mode 0600);
    returns them all. A running coordinator applies them when it next starts.

    Raises:
        ValueError: an invalid device id, or an unreadable revoked file (nothing written).
        OSError: the file cannot be written.
    """
    ids = list(device_ids)
    bad = [d for d in ids if not valid_identifier(d)]
    if bad:
        raise ValueError(f"invalid device id(s): {', '.join(map(repr, bad))}")
    if not state_dir.is_dir():
        raise ValueError(f"no state dir {state_dir}")
    revoked = read_revoked(state_dir) | set(ids)
    _write_json(state_dir / REVOKED_FILE, sorted(revoked))
    return revoked


def _write_json(path: Path, value: object) -> None:
    write_secret_file(path, json.dumps(value, indent=2) + "\n")


class FleetKeys:
    """The coordinator's keys: the operator's keyring, the enrolled devices' keys, and
    the fleet token that enrols new ones (:class:`~protocol.auth.KeySource`).

    Args:
        registered: the operator's keyring (``--device-keys``); it wins over the rest.
        token: the fleet token; None: nobody new enrols (the enrolled keep working).
        state_dir: where the enrolled keyring and the revoked ids live; None: enrolments
            are kept in memory only (they are lost with the process).
        max_enrolled: devices enrolled at most (those already enrolled are kept).

    Raises:
        ValueError: an enrolled keyring or revoked file that cannot be read, or one that
            cannot be rewritten without the revoked ids.
    """

    def __init__(
        self,
        registered: Keyring,
        *,
        token: bytes | None = None,
        state_dir: Path | None = None,
        max_enrolled: int = 1024,
    ) -> None:
        self._token = token
        self._path = None if state_dir is None else state_dir / ENROLLED_FILE
        self._max = max_enrolled
        self._lock = threading.Lock()
        revoked = frozenset() if state_dir is None else read_revoked(state_dir)
        self.revoked = revoked
        """Ids refused for good (``revoke``), whatever key they have."""
        enrolled = Keyring()
        if self._path is not None and self._path.exists():
            enrolled = Keyring.load(self._path)
        kept = enrolled.without(revoked)
        if self._path is not None and len(kept) != len(enrolled):
            dropped = sorted(set(enrolled) - set(kept))
            try:
                self._save(kept)
            except OSError as exc:
                raise ValueError(f"cannot drop revoked devices from {self._path}: {exc}") from exc
            log.warning("revoked enrolled device(s) dropped: %s", ", ".join(dropped))
        for device_id in sorted(revoked & set(registered)):
            log.warning("%s is in the device keys but revoked: refused", device_id)
        self._registered = registered.without(revoked)
        self._enrolled = kept
        self.enrolments = 0
        """Devices enrolled by this process."""
        if len(kept) > max_enrolled:
            log.warning(
                "%d devices enrolled, more than --max-enrolled %d: no new ones will be",
                len(kept),
                max_enrolled,
            )

    @staticmethod
    def enrolled_ids(state_dir: Path) -> frozenset[str]:
        """The ids enrolled in ``state_dir`` (read only).

        Raises:
            ValueError: the enrolled keyring cannot be read.
        """
        path = state_dir / ENROLLED_FILE
        return frozenset(Keyring.load(path)) if path.exists() else frozenset()

    @property
    def enrolled(self) -> Keyring:
        """The keys of the devices enrolled with the token (a snapshot)."""
        with self._lock:
            return self._enrolled

    @property
    def enrols(self) -> bool:
        """Whether new devices can enrol (the coordinator holds the token)."""
        return self._token is not None

    def __contains__(self, device_id: object) -> bool:
        with self._lock:
            return device_id in self._registered or device_id in self._enrolled

    def __iter__(self) -> Iterator[str]:
        """The ids of the registered and enrolled devices, sorted (a snapshot)."""
        with self._lock:
            return iter(sorted({*self._registered, *self._enrolled}))

    def __len__(self) -> int:
        with self._lock:
            return len({*self._registered, *self._enrolled})

    def _known(self, device_id: str) -> bytes | None:
        key = self._registered.get(device_id)
        return key if key is not None else self._enrolled.get(device_id)

    def key_for(self, topic: str) -> bytes | None:
        """The key of the registered or enrolled device ``topic`` names, or None."""
        device_id = topic_device(topic)
        if device_id is None:
            return None
        with self._lock:
            return self._known(device_id)

    def receive_key(self, device_id: str) -> bytes:
        """The registered or enrolled key of ``device_id``; else, with the token, the key
        derived for it (enrolment follows only if the frame verifies).

        Raises:
            AuthError: revoked, unknown without a token, or the enrolment cap reached.
        """
        if device_id in self.revoked:
            raise AuthError(f"device {device_id!r} is revoked", device_id)
        with self._lock:
            key = self._known(device_id)
            full = len(self._enrolled) >= self._max
        if key is not None:
            return key
        if self._token is None:
            raise AuthError(f"no key for device {device_id!r} (not registered)", device_id)
        if full:
            raise AuthError(
                f"device {device_id!r} not enrolled: --max-enrolled {self._max} reached",
                device_id,
            )
        try:
            return derive_device_key(self._token, device_id)
        except ValueError as exc:  # not a valid id: the topic parser lets none through
            raise AuthError(str(exc), device_id) from None

    def authenticated(self, device_id: str) -> None:
        """Enrol ``device_id`` if its frame verified under its derived key: its key is
        persisted before this returns.

        Raises:
            AuthError: revoked, the cap was reached meanwhile, or the enrolled keyring
                cannot be written (the device is not enrolled; its frame is refused).
        """
        if device_id in self.revoked:
            raise AuthError(f"device {device_id!r} is revoked", device_id)
        with self._lock:
            if self._known(device_id) is not None or self._token is None:
                return
            if len(self._enrolled) >= self._max:
                raise AuthError(
                    f"device {device_id!r} not enrolled: --max-enrolled {self._max} reached",
                    device_id,
                )
            enrolled = self._enrolled.with_key(device_id, derive_device_key(self._token, device_id))
            try:
                self._save(enrolled)
            except OSError as exc:
                log.error("could not record the enrolment of %s: %s", device_id, exc)
                raise AuthError(
                    f"device {device_id!r} not enrolled: cannot write {self._path}: {exc}",
                    device_id,
                ) from None
            self._enrolled = enrolled
            self.enrolments += 1
            count = len(enrolled)
        log.info(
            "enrolled %s with the fleet token (%d of at most %d enrolled)",
            device_id,
            count,
            self._max,
        )

    def _save(self, enrolled: Keyring) -> None:
        """Write the enrolled keyring (a state dir not made yet is made).

        Raises:
            OSError: it cannot be written (the previous file is left as it was).
        """
        if self._path is not None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            enrolled.save(self._path)
