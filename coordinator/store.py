"""The coordinator's persistent state: records of JSON metadata plus numpy arrays.

A :class:`Store` maps keys (``"run"``, ``"updates/dev-003/r000012"``) to records. A record
is a JSON-able ``dict`` of metadata and a ``dict`` of named numpy arrays (possibly empty).
Each :meth:`Store.write` replaces one record atomically: after a crash at any point a
reader sees either the old record or the new one, never a mix. The coordinator's crash
safety is built from that single guarantee (see :mod:`coordinator.state`).

:class:`FileStore` keeps one ``.npz`` file per record under a directory (written to a
temporary file, flushed with fsync, then renamed over the old one; the directory is
fsynced too). :class:`MemoryStore` is its in-memory twin for tests and throw-away runs.
Arrays are never pickled: object arrays are refused on write and on read.
"""

from __future__ import annotations

import abc
import copy
import io
import json
import os
import re
import threading
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from coordinator.errors import StoreError

__all__ = ["FileStore", "MemoryStore", "Record", "Store"]

Array = npt.NDArray[Any]
_META = "__meta__"
_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,79}$")  # ':': a model's import path
_SUFFIX = ".npz"


@dataclass(frozen=True)
class Record:
    """One stored record: JSON metadata and named arrays."""

    meta: dict[str, Any]
    arrays: dict[str, Array] = field(default_factory=dict)


def check_key(key: str) -> str:
    """Return ``key`` if it is 1-8 ``/``-separated segments of ``A-Z a-z 0-9 _ . : -``
    (``:``: an architecture group named by a user model's import path).

    Raises:
        StoreError: the key is malformed.
    """
    parts = key.split("/")
    if not 1 <= len(parts) <= 8 or not all(_SEGMENT.match(p) for p in parts):
        raise StoreError(f"invalid store key {key!r}")
    if parts[-1].endswith(_SUFFIX) or any(p.startswith(".") for p in parts):
        raise StoreError(f"invalid store key {key!r}")
    return key


def _check_arrays(key: str, arrays: Mapping[str, Array]) -> None:
    for name, array in arrays.items():
        if name == _META or not isinstance(array, np.ndarray) or array.dtype.hasobject:
            raise StoreError(f"record {key!r}: {name!r} is not a plain numeric array")


class Store(abc.ABC):
    """Keyed records, each replaced atomically. Implementations are thread-safe."""

    @abc.abstractmethod
    def read(self, key: str) -> Record | None:
        """The record under ``key``, or None if there is none.

        Raises:
            StoreError: the key is malformed or the stored record is corrupt.
        """

    @abc.abstractmethod
    def write(self, key: str, meta: Mapping[str, Any], arrays: Mapping[str, Array] = {}) -> None:
        """Replace the record under ``key`` atomically.

        Raises:
            StoreError: bad key, metadata that is not JSON, object arrays, or an I/O error.
        """

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the record under ``key``; nothing happens if there is none."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether a record is stored under ``key`` (without reading it)."""

    @abc.abstractmethod
    def keys(self, prefix: str = "") -> list[str]:
        """Sorted keys of the records below ``prefix`` (``"updates"`` lists
        ``"updates/..."``), or all keys for ``""``."""

    def read_meta(self, key: str) -> dict[str, Any] | None:
        """Only the metadata of the record under ``key``, or None."""
        record = self.read(key)
        return None if record is None else record.meta


def _encode_meta(key: str, meta: Mapping[str, Any]) -> bytes:
    try:
        return json.dumps(meta, sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise StoreError(f"record {key!r}: metadata is not JSON: {exc}") from exc


class MemoryStore(Store):
    """In-memory :class:`Store`; records are copied in and out, like a real store."""

    def __init__(self) -> None:
        self._records: dict[str, tuple[bytes, dict[str, Array]]] = {}
        self._lock = threading.Lock()

    def read(self, key: str) -> Record | None:
        check_key(key)
        with self._lock:
            entry = self._records.get(key)
        if entry is None:
            return None
        meta, arrays = entry
        return Record(json.loads(meta), {k: v.copy() for k, v in arrays.items()})

    def write(self, key: str, meta: Mapping[str, Any], arrays: Mapping[str, Array] = {}) -> None:
        check_key(key)
        _check_arrays(key, arrays)
        encoded = _encode_meta(key, meta)
        copied = {k: np.array(v, copy=True) for k, v in arrays.items()}
        with self._lock:
            self._records[key] = (encoded, copied)

    def delete(self, key: str) -> None:
        check_key(key)
        with self._lock:
            self._records.pop(key, None)

    def exists(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            return key in self._records

    def keys(self, prefix: str = "") -> list[str]:
        start = f"{prefix}/" if prefix else ""
        with self._lock:
            return sorted(k for k in self._records if k.startswith(start))

    def snapshot(self) -> MemoryStore:
        """A deep copy, e.g. to compare states in tests."""
        other = MemoryStore()
        with self._lock:
            other._records = copy.deepcopy(self._records)
        return other


class FileStore(Store):
    """A :class:`Store` in a directory: one ``KEY.npz`` per record.

    Args:
        root: the directory (created if missing).
        fsync: flush files and directories to disk before renaming (keep it on unless
            the state is throw-away; without it a power cut may lose recent writes).

    Raises:
        StoreError: the directory cannot be created.
    """

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.root = Path(root)
        self._fsync = fsync
        self._lock = threading.Lock()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create state directory {self.root}: {exc}") from exc
        self._remove_temporaries()

    def _path(self, key: str) -> Path:
        *folders, name = check_key(key).split("/")
        return self.root.joinpath(*folders, name + _SUFFIX)

    def _remove_temporaries(self) -> None:
        try:
            for tmp in self.root.rglob(".tmp-*"):
                tmp.unlink(missing_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot clean the state directory {self.root}: {exc}") from exc

    def read(self, key: str) -> Record | None:
        return self._read(key, arrays=True)

    def read_meta(self, key: str) -> dict[str, Any] | None:
        """Only the metadata: the record's arrays are not decoded (a round's close reads
        the metadata of every update it aggregated)."""
        record = self._read(key, arrays=False)
        return None if record is None else record.meta

    def _read(self, key: str, *, arrays: bool) -> Record | None:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc}") from exc
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as npz:
                names = npz.files if arrays else [_META]
                loaded = {name: npz[name] for name in names}
            meta = json.loads(loaded.pop(_META).tobytes())
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
            raise StoreError(f"corrupt state record {path}: {exc}") from exc
        if not isinstance(meta, dict):
            raise StoreError(f"corrupt state record {path}: metadata is not an object")
        return Record(meta, loaded)

    def write(self, key: str, meta: Mapping[str, Any], arrays: Mapping[str, Array] = {}) -> None:
        path = self._path(key)
        _check_arrays(key, arrays)
        payload = {_META: np.frombuffer(_encode_meta(key, meta), dtype=np.uint8)}
        payload.update({name: np.ascontiguousarray(a) for name, a in arrays.items()})
        tmp = path.with_name(f".tmp-{path.name}")
        try:
            with self._lock:  # a delete may remove an emptied folder: not this one now
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(tmp, "wb") as handle:
                    np.savez(handle, **payload)  # type: ignore[arg-type]
                    if self._fsync:
                        handle.flush()
                        os.fsync(handle.fileno())
                os.replace(tmp, path)
            self._sync_dir(path.parent)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"cannot write {path}: {exc}") from exc

    def delete(self, key: str) -> None:
        """Delete the record; folders it leaves empty (``models/rNNNNNN/G``, ...) go too."""
        path = self._path(key)
        with self._lock:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                raise StoreError(f"cannot delete {path}: {exc}") from exc
            folder = path.parent
            while folder != self.root and self.root in folder.parents:
                try:
                    folder.rmdir()
                except OSError:  # not empty (or gone): what is above stays too
                    break
                folder = folder.parent
        self._sync_dir(folder)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def keys(self, prefix: str = "") -> list[str]:
        base = self.root.joinpath(*prefix.split("/")) if prefix else self.root
        if prefix:
            check_key(prefix)
        found = [
            p.relative_to(self.root).with_suffix("").as_posix()
            for p in base.rglob(f"*{_SUFFIX}")
            if not p.name.startswith(".")
        ]
        return sorted(found)

    def _sync_dir(self, directory: Path) -> None:
        if not self._fsync:
            return
        try:
            fd = os.open(directory, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)
