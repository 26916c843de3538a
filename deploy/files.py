"""Writing the kit's files: secrets readable by their owner only, nothing replaced by accident.

A file is written to a temporary name in its folder and renamed into place, so a crash
leaves the old file or the new one, never half of one, and a private key never exists,
even for a moment, with wider permissions than 0600 (it is created with them).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from deploy.errors import KitExistsError

__all__ = ["PRIVATE_MODE", "PUBLIC_MODE", "make_folder", "write_file"]

PRIVATE_MODE = 0o600
"""Private keys, passwords and the password file: the owner reads and writes them."""
PUBLIC_MODE = 0o644
"""Certificates, the broker configuration and the ACL."""
_FOLDER_MODE = 0o700
"""Every folder of the kit: some of them hold private keys."""


def make_folder(path: Path) -> None:
    """Create ``path`` and missing parents with mode 0700 (kept as it is if it exists)."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for folder in reversed(missing):
        folder.mkdir(mode=_FOLDER_MODE)
        folder.chmod(_FOLDER_MODE)  # mkdir's mode is reduced by the umask


def write_file(path: Path, data: bytes, *, private: bool, replace: bool) -> Path:
    """Write ``data`` to ``path`` atomically with mode 0600 (``private``) or 0644.

    Raises:
        KitExistsError: ``path`` exists and ``replace`` is false.
        OSError: the file cannot be written.
    """
    if path.exists() and not replace:
        raise KitExistsError(f"{path} exists")
    make_folder(path.parent)
    mode = PRIVATE_MODE if private else PUBLIC_MODE
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb") as out:
            os.fchmod(out.fileno(), mode)  # mkstemp creates 0600; public files widen it
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    return path
