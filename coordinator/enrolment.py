"""Enrolment with a fleet token: the coordinator's keyring that grows by itself, within bounds.

A device flashed with the fleet token (or with the key derived from it for its id) signs
its frames with ``derive_device_key(token, device_id)`` (docs/protocol.md, section 2.4).
:class:`FleetKeys` is the coordinator's :class:`~protocol.auth.KeySource`: a device of the
operator's keyring (``--device-keys``) is checked with its registered key; any other id,
with the coordinator holding the token (``--fleet-token-file``), with the key derived for
it. Only once a frame *verifies* under that derived key is the device enrolled: its key
is appended to ``STATE_DIR/enrolled-keys.journal`` (one JSON line ``{"id", "key"}``,
fsynced, mode 0600: O(1) per enrolment, where rewriting the whole keyring made the
1,024th enrolment cost 27 ms) before the frame goes on, the enrolment is logged and
counted. At each start the journal is folded into ``STATE_DIR/enrolled-keys.json`` (a
keyring, written atomically) and emptied; a line a crash cut short is ignored (its
device had not been told anything: its frame was not taken). A frame that fails
verification changes nothing. Enrolled devices keep working after the token is withdrawn
from the coordinator: their keys are in the state dir.

Bounds and revocation:

* ``--max-enrolled N``: past N enrolled devices (over every run of the state dir) new ids
  are refused, so a leaked token cannot grow the keyring without bound.
* ``python -m coordinator revoke --state-dir DIR ID ...`` writes the ids to
  ``STATE_DIR/revoked-devices.json`` (a JSON list). A running coordinator reads the file
  again within a second of it changing (it looks when a frame arrives) and from then on
  refuses those ids for good: their enrolled keys are dropped (at the next start from the
  files too), their registered keys (an id of ``--device-keys`` too) and the token are not
  used for them. Delete an id from that file to let it enrol again.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from protocol.auth import (
    AuthError,
    Keyring,
    derive_device_key,
    parse_key,
    topic_device,
    write_secret_file,
)
from protocol.topics import valid_identifier

__all__ = [
    "ENROLLED_FILE",
    "ENROLLED_JOURNAL",
    "REVOKED_FILE",
    "FleetKeys",
    "read_enrolled",
    "read_revoked",
    "revoke",
]

log = logging.getLogger(__name__)

ENROLLED_FILE = "enrolled-keys.json"
"""The keyring of the devices enrolled with the fleet token, in the state dir (as of the
coordinator's last start; :data:`ENROLLED_JOURNAL` holds those enrolled since)."""
ENROLLED_JOURNAL = "enrolled-keys.journal"
"""The enrolments since the last start, one JSON line each, appended."""
REVOKED_CHECK_S = 1.0
"""How often (at most) a running coordinator looks whether the revoked file changed."""
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
    returns them all. A running coordinator applies them within a second.

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


def read_enrolled(state_dir: Path) -> Keyring:
    """The keys enrolled in ``state_dir``: the keyring as of the last start and the
    journal since (a last line cut short by a crash ignored), less nothing: revoked ids
    are the caller's to drop.

    Raises:
        ValueError: the keyring or a complete journal line cannot be read.
    """
    path = state_dir / ENROLLED_FILE
    keys = dict(Keyring.load(path)) if path.exists() else {}
    journal = state_dir / ENROLLED_JOURNAL
    if not journal.exists():
        return Keyring(keys)
    try:
        data = journal.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {journal}: {exc}") from None
    lines = data.split(b"\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            device_id, key = str(entry["id"]), parse_key(str(entry["id"]), entry["key"])
        except (ValueError, KeyError, TypeError) as exc:
            if number == len(lines):  # the last line, without its newline: cut short
                log.warning("ignored the last line of %s, cut short by a crash", journal)
                break
            raise ValueError(f"{journal}, line {number}: {exc}") from None
        keys[device_id] = key
    return Keyring(keys)


class FleetKeys:
    """The coordinator's keys: the operator's keyring, the enrolled devices' keys, and
    the fleet token that enrols new ones (:class:`~protocol.auth.KeySource`).

    Args:
        registered: the operator's keyring (``--device-keys``); it wins over the rest.
        token: the fleet token; None: nobody new enrols (the enrolled keep working).
        state_dir: where the enrolled keyring, its journal and the revoked ids live;
            None: enrolments are kept in memory only (they are lost with the process).
        max_enrolled: devices enrolled at most (those already enrolled are kept).
        clock: monotonic seconds, for the look at the revoked file.

    Raises:
        ValueError: an enrolled keyring, journal or revoked file that cannot be read, or
            that cannot be folded and rewritten without the revoked ids.
    """

    def __init__(
        self,
        registered: Keyring,
        *,
        token: bytes | None = None,
        state_dir: Path | None = None,
        max_enrolled: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._token = token
        self._state_dir = state_dir
        self._max = max_enrolled
        self._clock = clock
        self._lock = threading.Lock()
        revoked = frozenset() if state_dir is None else read_revoked(state_dir)
        self.revoked = revoked
        """Ids refused for good (``revoke``), whatever key they have."""
        self._revoked_stamp = self._stamp()
        self._revoked_checked = clock()
        enrolled = Keyring() if state_dir is None else read_enrolled(state_dir)
        kept = enrolled.without(revoked)
        if state_dir is not None:
            try:
                self._fold(kept)
            except OSError as exc:
                raise ValueError(f"cannot rewrite the enrolled keyring: {exc}") from exc
        if len(kept) != len(enrolled):
            dropped = sorted(set(enrolled) - set(kept))
            log.warning("revoked enrolled device(s) dropped: %s", ", ".join(dropped))
        for device_id in sorted(revoked & set(registered)):
            log.warning("%s is in the device keys but revoked: refused", device_id)
        self._all_registered = registered
        self._registered = registered.without(revoked)
        self._enrolled: dict[str, bytes] = dict(kept)
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
            ValueError: the enrolled keyring or its journal cannot be read.
        """
        return frozenset(read_enrolled(state_dir))

    @property
    def enrolled(self) -> Keyring:
        """The keys of the devices enrolled with the token (a snapshot)."""
        with self._lock:
            return Keyring(self._enrolled)

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
        self._check_revoked()
        with self._lock:
            return None if device_id in self.revoked else self._known(device_id)

    def receive_key(self, device_id: str) -> bytes:
        """The registered or enrolled key of ``device_id``; else, with the token, the key
        derived for it (enrolment follows only if the frame verifies).

        Raises:
            AuthError: revoked, unknown without a token, or the enrolment cap reached.
        """
        self._check_revoked()
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
        appended to the journal (fsynced) before this returns.

        Raises:
            AuthError: revoked, the cap was reached meanwhile, or the journal cannot be
                written (the device is not enrolled; its frame is refused).
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
            key = derive_device_key(self._token, device_id)
            try:
                self._append(device_id, key)
            except OSError as exc:
                log.error("could not record the enrolment of %s: %s", device_id, exc)
                raise AuthError(
                    f"device {device_id!r} not enrolled: cannot write its enrolment: {exc}",
                    device_id,
                ) from None
            self._enrolled[device_id] = key
            self.enrolments += 1
            count = len(self._enrolled)
        log.info(
            "enrolled %s with the fleet token (%d of at most %d enrolled)",
            device_id,
            count,
            self._max,
        )

    # -- revocation while running --------------------------------------------------------

    def _stamp(self) -> tuple[int, int] | None:
        """The revoked file's (mtime ns, size); None without one."""
        if self._state_dir is None:
            return None
        try:
            info = (self._state_dir / REVOKED_FILE).stat()
        except OSError:
            return None
        return info.st_mtime_ns, info.st_size

    def _check_revoked(self) -> None:
        """Read the revoked ids again when the file changed (looked at once a second at
        most: one stat, not one per frame)."""
        now = self._clock()
        if self._state_dir is None or now - self._revoked_checked < REVOKED_CHECK_S:
            return
        self._revoked_checked = now
        stamp = self._stamp()
        if stamp == self._revoked_stamp:
            return
        try:
            revoked = read_revoked(self._state_dir)
        except ValueError as exc:
            log.error("kept the revoked devices as they were: %s", exc)
            return
        self._revoked_stamp = stamp
        with self._lock:
            added = sorted(revoked - self.revoked)
            self.revoked = revoked
            self._registered = self._all_registered.without(revoked)
            for device_id in added:
                self._enrolled.pop(device_id, None)
        if added:
            log.warning("revoked while running: %s (refused from now on)", ", ".join(added))

    # -- files -------------------------------------------------------------------------

    def _fold(self, enrolled: Keyring) -> None:
        """Write ``enrolled`` as the keyring and empty the journal (a state dir not made
        yet is made).

        Raises:
            OSError: they cannot be written (the previous files are left as they were).
        """
        assert self._state_dir is not None
        self._state_dir.mkdir(parents=True, exist_ok=True)
        path, journal = self._state_dir / ENROLLED_FILE, self._state_dir / ENROLLED_JOURNAL
        stale = Keyring.load(path) != enrolled if path.exists() else bool(enrolled)
        if stale:
            enrolled.save(path)
        journal.unlink(missing_ok=True)

    def _append(self, device_id: str, key: bytes) -> None:
        """One line on the journal, fsynced (in memory only without a state dir).

        Raises:
            OSError: it cannot be written.
        """
        if self._state_dir is None:
            return
        self._state_dir.mkdir(parents=True, exist_ok=True)
        path = self._state_dir / ENROLLED_JOURNAL
        new = not path.exists()
        line = json.dumps({"id": device_id, "key": key.hex()}).encode() + b"\n"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            written = os.write(fd, line)
            if written != len(line):
                raise OSError(f"short write to the enrolment journal ({written} bytes)")
            os.fsync(fd)
        finally:
            os.close(fd)
        if new:  # the file's name must survive a crash too
            folder = os.open(self._state_dir, os.O_RDONLY)
            try:
                os.fsync(folder)
            finally:
                os.close(folder)
