"""The edge client's persistent state in ``--state-dir``.

- ``client_state.json``: the ids of the tasks the device handled (so a restarted device
  does not train a redelivered task again) and the number of rounds done.
- ``model.npz``: the device's model after its last local training (numpy ``.npz``, one
  array per state_dict name, no pickle). Where only the head is shared (FedGen head
  mode) the feature extractor exists nowhere else, so a restarted device picks it up
  here instead of starting from its initial weights.
- ``unacked.msgpack``: the update sent and not yet acknowledged, as the msgpack envelope
  of docs/protocol.md (section 3): written before it is sent, removed when its ack
  comes, so a device killed in between sends the very same message again at its restart
  (the coordinator answers a duplicate ``duplicate``).
- ``learning_state.npz``: what the device's strategies keep in memory across rounds
  besides the model (FedKF's local image generator and its Adam moments), written with
  ``model.npz`` every time it is, so a restarted device's next update is bit-identical
  to an uninterrupted one's (:class:`SavedLearningState`). A numpy ``.npz``, no pickle:
  one array per tensor, named ``KEY/NAME`` (``KEY`` the piece of state, e.g.
  ``fedkf_generator/module/project.weight``, ``fedkf_generator/exp_avg/project.weight``),
  and ``meta.json``, a 0-d string array holding a JSON object: ``format`` (1),
  ``model`` (the fingerprint of the model saved with it, :func:`model_fingerprint`) and
  ``entries``, each key's small typed settings (e.g. the generator's build signature and
  its Adam step counts). A file that cannot be read, or that was saved with another
  model than ``model.npz`` (a crash between the two writes), is ignored with a warning
  and that state starts fresh. The uplink residual and the held base are
  :class:`~edge_client.train.transfer.TransferState`'s (``residual.npz``, ``base.npz``).

All are written atomically: a temporary file, fsync, rename, fsync of the directory.
:class:`DeviceStore` is a device's folder: what every shell of the device session (the
threaded client, the sim's fleet) reads when a device starts and writes as it goes, with
its failures logged, never raised. Numpy only; no torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import uuid
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field

from edge_client.config import ClientConfig
from edge_client.errors import ConfigError
from protocol.codec import Codec
from protocol.errors import DecodeError, EncodeError
from protocol.messages import Message

__all__ = [
    "LEARNING_STATE_FILE",
    "MODEL_FILE",
    "STATE_FILE",
    "UNACKED_FILE",
    "DeviceStore",
    "LearningStateEntry",
    "SavedLearningState",
    "SavedState",
    "fsync_dir",
    "model_fingerprint",
    "read_learning_state",
    "read_model",
    "read_state",
    "write_learning_state",
    "write_model",
    "write_state",
]

logger = logging.getLogger(__name__)

STATE_FILE = "client_state.json"
"""Name of the persisted state file inside ``ClientConfig.state_dir``."""
MODEL_FILE = "model.npz"
"""Name of the persisted model inside ``ClientConfig.state_dir``."""
UNACKED_FILE = "unacked.msgpack"
"""Name of the persisted unacknowledged update inside ``ClientConfig.state_dir``."""
LEARNING_STATE_FILE = "learning_state.npz"
"""Name of the persisted learning state (kept with the model) inside ``state_dir``."""
LEARNING_STATE_FORMAT = 1
"""The ``format`` of ``learning_state.npz`` this version writes and reads."""
_META = "meta.json"
"""The entry of ``learning_state.npz`` holding its JSON metadata."""

Setting = int | float | str | list[int] | list[float]
"""A typed scalar (or a short list of them) of a learning-state entry, stored as JSON."""


class SavedState(BaseModel):
    """The content of ``client_state.json`` (unknown keys are ignored)."""

    model_config = ConfigDict(extra="ignore")

    format: Literal[1] = 1
    fleet: str
    device_id: str
    rounds_done: int = Field(ge=0)
    handled_tasks: list[str]
    newest_task_ms: int = Field(default=0, ge=0)
    """Send time (Unix ms) of the newest task the device took: it refuses older ones."""


def write_state(path: Path, saved: SavedState, *, fsync: bool = True) -> None:
    """Replace ``path`` with ``saved`` atomically.

    Raises:
        OSError: the file cannot be written (the old one is left as it was).
    """
    _atomic_write(path, lambda f: f.write(saved.model_dump_json(indent=1).encode()), fsync)


def write_model(path: Path, arrays: Mapping[str, npt.NDArray[Any]], *, fsync: bool = True) -> None:
    """Replace ``path`` with the model state ``arrays`` (an ``.npz``) atomically.

    Raises:
        OSError: the file cannot be written (the old one is left as it was).
    """
    _atomic_write(path, lambda f: np.savez(f, **dict(arrays)), fsync)  # type: ignore[arg-type]


def read_model(path: Path) -> dict[str, npt.NDArray[Any]]:
    """The arrays of a model file written by :func:`write_model` (never unpickles).

    Raises:
        OSError: unreadable; ValueError: not an ``.npz`` of plain arrays.
    """
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except (EOFError, KeyError, ValueError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path} is not a model file: {exc}") from exc


@dataclass(frozen=True)
class LearningStateEntry:
    """One piece of a device's learning state as stored: numpy arrays and JSON values."""

    settings: Mapping[str, Setting]
    """Small typed values it is rebuilt from (build signature, step counts, ...)."""
    arrays: Mapping[str, npt.NDArray[Any]]
    """Its tensors by name (a name may hold ``/``, never start with it)."""


@dataclass(frozen=True)
class SavedLearningState:
    """The content of ``learning_state.npz``: the entries, and the model they go with."""

    model: str
    """:func:`model_fingerprint` of the model saved with this state."""
    entries: Mapping[str, LearningStateEntry]
    """The pieces of state by key (e.g. ``fedkf_generator``)."""


def model_fingerprint(arrays: Mapping[str, npt.NDArray[Any]]) -> str:
    """SHA-256 (hex) of a model's arrays: names, dtypes, shapes and bytes, by name."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        value = np.ascontiguousarray(arrays[name])
        header = json.dumps([name, value.dtype.str, list(value.shape)])
        digest.update(header.encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def write_learning_state(path: Path, saved: SavedLearningState, *, fsync: bool = True) -> None:
    """Replace ``path`` with ``saved`` (an ``.npz``, see the module docstring) atomically.

    Raises:
        OSError: the file cannot be written (the old one is left as it was).
        ValueError: a key or an array name has no place in the file's naming.
    """
    arrays: dict[str, npt.NDArray[Any]] = {}
    for key, entry in saved.entries.items():
        if not key or "/" in key:
            raise ValueError(f"learning-state key {key!r} is empty or holds '/'")
        for name, value in entry.arrays.items():
            if not name or name.startswith("/"):
                raise ValueError(f"array name {name!r} of {key!r} is empty or starts with '/'")
            arrays[f"{key}/{name}"] = np.asarray(value)
    meta = {
        "format": LEARNING_STATE_FORMAT,
        "model": saved.model,
        "entries": {key: dict(entry.settings) for key, entry in saved.entries.items()},
    }
    arrays[_META] = np.array(json.dumps(meta))
    _atomic_write(path, lambda f: np.savez(f, **arrays), fsync)  # type: ignore[arg-type]


def read_learning_state(path: Path) -> SavedLearningState:
    """The learning state of a file written by :func:`write_learning_state` (never
    unpickles).

    Raises:
        OSError: unreadable; ValueError: not a learning-state file of this format.
    """
    arrays = read_model(path)
    raw = arrays.pop(_META, None)
    if raw is None or raw.shape != () or raw.dtype.kind != "U":
        raise ValueError(f"{path} has no {_META}")
    meta = json.loads(str(raw))  # JSONDecodeError is a ValueError
    if not isinstance(meta, dict) or meta.get("format") != LEARNING_STATE_FORMAT:
        raise ValueError(f"{path} is not of format {LEARNING_STATE_FORMAT}")
    model, settings = meta.get("model"), meta.get("entries")
    if not isinstance(model, str) or not isinstance(settings, dict):
        raise ValueError(f"{path}: {_META} lacks its model or its entries")
    grouped: dict[str, dict[str, npt.NDArray[Any]]] = {key: {} for key in settings}
    for full_name, value in arrays.items():
        key, _, name = full_name.partition("/")
        if key not in grouped or not name:
            raise ValueError(f"{path}: array {full_name!r} belongs to no entry")
        grouped[key][name] = value
    entries = {}
    for key, values in settings.items():
        if not isinstance(values, dict):
            raise ValueError(f"{path}: the settings of {key!r} are not an object")
        entries[key] = LearningStateEntry(values, grouped[key])
    return SavedLearningState(model, entries)


def _atomic_write(path: Path, write: Callable[[IO[bytes]], object], fsync: bool) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with tmp.open("xb") as f:
            write(f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        with contextlib.suppress(OSError):  # make the rename durable where supported
            fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make the renames in ``folder`` durable (fsync of the folder).

    Raises:
        OSError: the folder cannot be opened or synced.
    """
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_state(path: Path) -> SavedState:
    """Read ``path``.

    Raises:
        OSError: unreadable; ValueError: not JSON or not a state file.
    """
    return SavedState.model_validate(json.loads(path.read_text(encoding="utf-8")))


class DeviceStore:
    """A device's state folder: its handled tasks and rounds done, its trained model and
    the learning state saved with it, and its unacknowledged update.

    Reads and writes never raise: a file that cannot be read is ignored and one that
    cannot be written left as it was, with a warning, and ``on_error`` (if given) is told
    of every write that failed.

    Args:
        state_dir: the folder (it exists).
        fsync: make every write durable (fsync of the file and its folder).
        on_error: called with the error of each failed write.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        fsync: bool = True,
        on_error: Callable[[OSError], None] | None = None,
    ) -> None:
        self.state_dir = state_dir
        self._fsync = fsync
        self._on_error = on_error

    @classmethod
    def of(
        cls, config: ClientConfig, on_error: Callable[[OSError], None] | None = None
    ) -> DeviceStore | None:
        """The store of ``config.state_dir`` (created if missing); None without one.

        Raises:
            ConfigError: the folder cannot be created.
        """
        if config.state_dir is None:
            return None
        try:
            config.state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create state dir {config.state_dir}: {exc}") from exc
        return cls(config.state_dir, fsync=config.fsync_state, on_error=on_error)

    @property
    def state_path(self) -> Path:
        """Where the handled tasks and rounds done live."""
        return self.state_dir / STATE_FILE

    @property
    def model_path(self) -> Path:
        """Where the trained model lives."""
        return self.state_dir / MODEL_FILE

    def load_state(self) -> SavedState | None:
        """The state an earlier run saved; None if there is none or it is unreadable."""
        path = self.state_path
        if not path.exists():
            return None
        try:
            return read_state(path)
        except (OSError, ValueError) as exc:  # ValidationError and JSONDecodeError too
            logger.warning("ignored the unreadable client state %s: %s", path, exc)
            return None

    def load_model(self) -> dict[str, npt.NDArray[Any]] | None:
        """The model an earlier run saved; None if there is none or it is unreadable."""
        path = self.model_path
        if not path.exists():
            return None
        try:
            return read_model(path)
        except (OSError, ValueError) as exc:
            logger.warning("ignored the saved model %s: %s", path, exc)
            return None

    @property
    def learning_state_path(self) -> Path:
        """Where the learning state saved with the model lives."""
        return self.state_dir / LEARNING_STATE_FILE

    def load_learning_state(
        self, model: Mapping[str, npt.NDArray[Any]]
    ) -> SavedLearningState | None:
        """The learning state an earlier run saved with the model ``model`` (the arrays
        of :meth:`load_model`); None if there is none, or it is unreadable or was saved
        with another model (a warning says which)."""
        path = self.learning_state_path
        if not path.exists():
            return None
        try:
            saved = read_learning_state(path)
        except (OSError, ValueError) as exc:
            logger.warning("ignored the saved learning state %s: %s", path, exc)
            return None
        if saved.model != model_fingerprint(model):
            logger.warning(
                "ignored the saved learning state %s: it goes with another model than %s",
                path,
                self.model_path,
            )
            return None
        return saved

    @property
    def unacked_path(self) -> Path:
        """Where the unacknowledged update lives."""
        return self.state_dir / UNACKED_FILE

    def load_unacked(self, fleet: str, device_id: str) -> Message | None:
        """The update an earlier run sent and never saw acknowledged; None if there is
        none, or it is unreadable or not an update of this device."""
        path = self.unacked_path
        if not path.exists():
            return None
        try:
            message = Codec().decode_envelope(path.read_bytes())
        except (OSError, DecodeError) as exc:
            logger.warning("ignored the unreadable unacknowledged update %s: %s", path, exc)
            return None
        if (message.kind, message.fleet, message.sender) != ("update", fleet, device_id):
            logger.warning("ignored %s: not an update of %s/%s", path, fleet, device_id)
            return None
        return message

    def save_unacked(self, message: Message | None) -> None:
        """Persist the update ``message`` until it is acknowledged (None: it was; the file
        is removed)."""
        path = self.unacked_path
        try:
            if message is None:
                path.unlink(missing_ok=True)
                return
            packed = Codec().pack(message)
            _atomic_write(path, lambda f: f.write(packed), self._fsync)
        except (OSError, EncodeError) as exc:
            logger.warning("could not save the unacknowledged update to %s: %s", path, exc)
            if isinstance(exc, OSError):
                self._failed(exc)

    def save_state(self, saved: SavedState) -> None:
        """Persist ``saved``."""
        try:
            write_state(self.state_path, saved, fsync=self._fsync)
        except OSError as exc:
            logger.warning("could not save the client state to %s: %s", self.state_path, exc)
            self._failed(exc)

    def save_model(
        self,
        arrays: Mapping[str, npt.NDArray[Any]],
        learning_state: Mapping[str, LearningStateEntry] | None = None,
    ) -> None:
        """Persist the trained model's state ``arrays`` and then, once it is saved, the
        device's ``learning_state`` with it (none or empty: the file is removed)."""
        try:
            write_model(self.model_path, arrays, fsync=self._fsync)
        except OSError as exc:
            logger.warning("could not save the model to %s: %s", self.model_path, exc)
            self._failed(exc)
            return
        path = self.learning_state_path
        try:
            if not learning_state:
                path.unlink(missing_ok=True)
                return
            saved = SavedLearningState(model_fingerprint(arrays), learning_state)
            write_learning_state(path, saved, fsync=self._fsync)
        except OSError as exc:
            logger.warning("could not save the learning state to %s: %s", path, exc)
            self._failed(exc)

    def _failed(self, error: OSError) -> None:
        if self._on_error is not None:
            self._on_error(error)
