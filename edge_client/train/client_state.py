"""The edge client's persistent state in ``--state-dir``.

- ``client_state.json``: the ids of the tasks the device handled (so a restarted device
  does not train a redelivered task again) and the number of rounds done.
- ``model.npz``: the device's model after its last local training (numpy ``.npz``, one
  array per state_dict name, no pickle). Where only the head is shared (FedGen head
  mode) the feature extractor exists nowhere else, so a restarted device picks it up
  here instead of starting from its initial weights.

Both are written atomically: a temporary file, fsync, rename, fsync of the directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "MODEL_FILE",
    "STATE_FILE",
    "SavedState",
    "read_model",
    "read_state",
    "write_model",
    "write_state",
]

STATE_FILE = "client_state.json"
"""Name of the persisted state file inside ``ClientConfig.state_dir``."""
MODEL_FILE = "model.npz"
"""Name of the persisted model inside ``ClientConfig.state_dir``."""


class SavedState(BaseModel):
    """The content of ``client_state.json`` (unknown keys are ignored)."""

    model_config = ConfigDict(extra="ignore")

    format: Literal[1] = 1
    fleet: str
    device_id: str
    rounds_done: int = Field(ge=0)
    handled_tasks: list[str]


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
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)


def read_state(path: Path) -> SavedState:
    """Read ``path``.

    Raises:
        OSError: unreadable; ValueError: not JSON or not a state file.
    """
    return SavedState.model_validate(json.loads(path.read_text(encoding="utf-8")))
