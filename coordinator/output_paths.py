"""Checks of the output paths a command line was given, made before its run starts.

A run writes its report only when it ends; a path it cannot write (a folder that is a
file, a read-only folder, a file name that is an existing folder) would otherwise fail
after all of it. :func:`check_file` and :func:`check_folder` find these problems at
once, without leaving anything behind: a folder that does not exist yet is not created,
its nearest existing ancestor is checked instead (each check creates and removes a
temporary file where the run will write, so it tells what the run will meet, read-only
file systems and the superuser's rights included). The coordinator's and the lab
emulator's command lines both check their outputs with them.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from coordinator.errors import ConfigError

__all__ = ["check_file", "check_folder", "check_distinct"]

_PROBE_PREFIX = ".edgefl-write-check-"


def check_file(flag: str, path: Path) -> None:
    """``path`` can be written as a file: it is not a folder or a special file, and its
    folder exists or can be created, and can be written.

    Raises:
        ConfigError: one line naming ``flag``, ``path`` and what is wrong.
    """
    try:
        if path.is_dir():
            raise ConfigError(f"{flag} {path}: is a folder; give a file name ({path / 'run.json'})")
        if path.exists() and not path.is_file():
            raise ConfigError(f"{flag} {path}: is not a regular file")
        _check_writable_folder(flag, path, path.parent)
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: {exc.strerror or exc}") from exc


def check_folder(flag: str, path: Path, files: Sequence[str] = ()) -> None:
    """``path`` can be used as an output folder: it is a folder that can be written, or
    does not exist and can be created; none of ``files`` (names in it that the run
    writes) is an existing folder.

    Raises:
        ConfigError: one line naming ``flag``, ``path`` and what is wrong.
    """
    try:
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{flag} {path}: is a file, not a folder")
        for name in files:
            if (path / name).is_dir():
                raise ConfigError(
                    f"{flag} {path}: {path / name} is a folder; the run writes a file there"
                )
        _check_writable_folder(flag, path, path)
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: {exc.strerror or exc}") from exc


def check_distinct(paths: Iterable[tuple[str, Path | None]]) -> None:
    """No two of the output ``paths`` (flag, path; None: not given) are the same path.

    Raises:
        ConfigError: naming both flags.
    """
    seen: dict[str, str] = {}
    for flag, path in paths:
        if path is None:
            continue
        key = os.path.abspath(path)
        if key in seen:
            raise ConfigError(f"{seen[key]} and {flag} name the same path: {path}")
        seen[key] = flag


def _check_writable_folder(flag: str, target: Path, folder: Path) -> None:
    """``folder`` (where ``target`` is written) is a folder that can be written, or the
    nearest of its ancestors that exists is one (the run creates the others).

    Raises:
        ConfigError: a path on the way is a file, or the folder cannot be written.
        OSError: the file system could not be asked.
    """
    existing = folder
    while not os.path.lexists(existing) and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{flag} {target}: {existing} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=_PROBE_PREFIX)
    except OSError as exc:
        reason = (exc.strerror or str(exc)).lower()
        raise ConfigError(f"{flag} {target}: cannot write in {existing}: {reason}") from exc
    os.close(fd)
    os.unlink(probe)
