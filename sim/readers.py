"""Readers for the official files of the standard releases, numpy only.

IDX files (MNIST, Fashion-MNIST, EMNIST; gzip-compressed or plain) and CIFAR-10 python
batches, the latter loaded with an unpickler that resolves only numpy array
reconstruction, so a crafted file cannot run code.
"""

from __future__ import annotations

import codecs
import gzip
import io
import os
import pickle
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from sim.arrays import describe
from sim.errors import DatasetError

__all__ = ["read_cifar_batch", "read_idx_images", "read_idx_labels"]

_IDX_IMAGES_MAGIC = 2051  # 0x00000803: uint8 data, 3 dims (count, rows, cols)
_IDX_LABELS_MAGIC = 2049  # 0x00000801: uint8 data, 1 dim (count)
_reconstruct: Any = np.empty(0).__reduce__()[0]  # numpy's array unpickling helper

# --------------------------------------------------------------------------- IDX files


def _open_maybe_gzip(path: Path) -> io.BufferedIOBase:
    with path.open("rb") as probe:
        gz = probe.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gz else path.open("rb")


def _read_idx(path: Path, magic: int, ndim: int) -> np.ndarray:
    try:
        with _open_maybe_gzip(path) as f:
            found = int.from_bytes(f.read(4), "big")
            if found != magic:
                raise DatasetError(f"{path}: IDX magic {found}, expected {magic}")
            header = f.read(4 * ndim)
            if len(header) < 4 * ndim:
                raise DatasetError(f"{path}: truncated IDX header")
            dims = tuple(int.from_bytes(header[4 * i : 4 * i + 4], "big") for i in range(ndim))
            expected = int(np.prod(dims, dtype=np.int64))
            data = f.read(expected + 1)  # bounded: never more than the header declares
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise DatasetError(f"{path}: cannot read IDX file: {exc}") from exc
    if len(data) != expected:
        state = "truncated" if len(data) < expected else "has trailing data"
        raise DatasetError(f"{path}: {state}; header {dims} declares {expected} bytes")
    return np.frombuffer(data, dtype=np.uint8).reshape(dims)


def read_idx_images(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX image file (gzip-compressed or plain, magic 2051).

    Returns:
        uint8 array of shape (count, rows, cols), as stored.

    Raises:
        DatasetError: unreadable file, wrong magic, truncated or oversized data.
    """
    return _read_idx(Path(path), _IDX_IMAGES_MAGIC, 3)


def read_idx_labels(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX label file (gzip-compressed or plain, magic 2049).

    Returns:
        uint8 array of shape (count,).

    Raises:
        DatasetError: unreadable file, wrong magic, truncated or oversized data.
    """
    return _read_idx(Path(path), _IDX_LABELS_MAGIC, 1)


# ----------------------------------------------------------------- CIFAR-10 batches

# The only globals a CIFAR-10 python batch (or a numpy array pickled by numpy 1 or 2)
# needs. Anything else (os.system, builtins.eval, ...) is refused.
_PICKLE_ALLOWED = frozenset(
    {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # bytes pickled by Python 3 at protocol < 3
    }
)


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that resolves only the globals a CIFAR-10 batch needs."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _PICKLE_ALLOWED:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        if module.startswith("numpy"):  # numpy 2 renamed numpy.core to numpy._core
            return getattr(np, name) if module == "numpy" else _reconstruct
        return codecs.encode


def read_cifar_batch(path: str | os.PathLike[str]) -> tuple[np.ndarray, np.ndarray]:
    """Read one CIFAR-10 python batch (``data_batch_N`` or ``test_batch``).

    The file is a pickle; it is loaded with an unpickler that allows only numpy array
    reconstruction, so a crafted file cannot run code.

    Returns:
        (images uint8 (N, 3, 32, 32), labels int64 (N,)).

    Raises:
        DatasetError: unreadable file, a forbidden global, or unexpected contents.
    """
    p = Path(path)
    try:
        with p.open("rb") as f:
            obj = _RestrictedUnpickler(f, encoding="bytes").load()
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError) as exc:
        raise DatasetError(f"{p}: not a readable CIFAR-10 batch: {exc}") from exc
    if not isinstance(obj, dict) or b"data" not in obj or b"labels" not in obj:
        raise DatasetError(f"{p}: expected a dict with b'data' and b'labels'")
    data, labels = obj[b"data"], np.asarray(obj[b"labels"])
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2:
        raise DatasetError(f"{p}: b'data' must be a uint8 (N, 3072) array, got {describe(data)}")
    if data.shape[1] != 3 * 32 * 32 or labels.shape != (len(data),):
        raise DatasetError(f"{p}: expected (N, 3072) data and N labels, got {data.shape}")
    if labels.dtype.kind not in "iu":
        raise DatasetError(f"{p}: labels must be integers")
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)
