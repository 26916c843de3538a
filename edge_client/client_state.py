"""The edge client's persistent state file, ``client_state.json`` in ``--state-dir``.

It holds the ids of the tasks the device handled (so a restarted device does not train
a redelivered task again) and the number of rounds done. Written atomically: a temporary
file, fsync, rename, fsync of the directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["STATE_FILE", "SavedState", "read_state", "write_state"]

STATE_FILE = "client_state.json"
"""Name of the persisted state file inside ``ClientConfig.state_dir``."""


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
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with tmp.open("x", encoding="utf-8") as f:
            f.write(saved.model_dump_json(indent=1))
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
