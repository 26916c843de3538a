"""Operations on named arrays (``dict[str, ndarray]``, a model's state): fingerprints
and deltas. Numpy only."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from protocol.errors import DecodeError, EncodeError
from protocol.limits import ALL_DTYPES

__all__ = [
    "apply_delta",
    "architecture_fingerprint",
    "content_fingerprint",
    "delta_arrays",
    "fingerprint_bytes",
]

Array = npt.NDArray[Any]


def architecture_fingerprint(shapes: Mapping[str, Sequence[int]]) -> str:
    """Stable fingerprint of a model architecture from its tensor names and shapes.

    The first 16 hex digits of SHA-256 over the UTF-8 text made of one line
    ``name:d0xd1x...`` per tensor (``name:`` for a scalar), sorted by name, each line
    ending in ``\\n``. Insertion order does not matter; any change of a name or shape
    changes it. Devices announce it in their hello message.
    """
    lines = sorted(f"{n}:{'x'.join(str(int(d)) for d in shape)}\n" for n, shape in shapes.items())
    return hashlib.sha256("".join(lines).encode("utf-8")).hexdigest()[:16]


def content_fingerprint(arrays: Mapping[str, npt.ArrayLike]) -> str:
    """Fingerprint of tensor values: names, dtypes, shapes and values, in order.

    The first 16 hex digits (lowercase) of SHA-256 over :func:`fingerprint_bytes`; used
    to name the base a delta is taken against, so a receiver can tell whether it holds
    exactly that base (docs/protocol.md, section 6).

    Raises:
        EncodeError: an array's dtype is not one of :data:`protocol.limits.ALL_DTYPES`.
    """
    h = hashlib.sha256()
    for name, value in arrays.items():
        h.update(_tensor_record(name, value))
    return h.hexdigest()[:16]


def fingerprint_bytes(arrays: Mapping[str, npt.ArrayLike]) -> bytes:
    """The canonical byte string :func:`content_fingerprint` hashes.

    One record per tensor, in the mapping's order, concatenated::

        u32 LE   length of the name in UTF-8 bytes
        bytes    the name, UTF-8
        u8       length of the dtype token
        ASCII    the dtype token: float32 float64 int64 int32 int16 int8 uint8 bool
        u8       ndim (0 for a scalar)
        u64 LE   each dim, ndim times
        bytes    the values, C order, each little-endian in its dtype (bool: 0 or 1)

    Raises:
        EncodeError: as :func:`content_fingerprint`.
    """
    return b"".join(_tensor_record(name, value) for name, value in arrays.items())


def _tensor_record(name: str, value: npt.ArrayLike) -> bytes:
    arr = np.asarray(value)
    token = arr.dtype.name
    if token not in ALL_DTYPES:
        raise EncodeError(f"tensor {name!r}: dtype {token} has no fingerprint token")
    le = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    name_bytes = name.encode("utf-8")
    head = struct.pack(
        f"<I{len(name_bytes)}sB{len(token)}sB{arr.ndim}Q",
        len(name_bytes),
        name_bytes,
        len(token),
        token.encode("ascii"),
        arr.ndim,
        *arr.shape,
    )
    return head + le.tobytes()


def delta_arrays(current: Mapping[str, Array], base: Mapping[str, Array]) -> dict[str, Array]:
    """``current - base`` for float tensors (float32); other tensors are copied as is.

    Raises:
        EncodeError: the two sets differ in names or shapes.
    """
    return _elementwise(np.subtract, current, base, EncodeError)


def apply_delta(base: Mapping[str, Array], delta: Mapping[str, Array]) -> dict[str, Array]:
    """``base + delta`` for float tensors (float32); other tensors take the delta's value.

    Raises:
        DecodeError: the two sets differ in names or shapes.
    """
    return _elementwise(np.add, delta, base, DecodeError)


def _elementwise(
    op: Callable[..., Array],
    first: Mapping[str, Array],
    second: Mapping[str, Array],
    error: type[Exception],
) -> dict[str, Array]:
    """``op(first, second)`` per float tensor in float32; other tensors copy ``first``."""
    if first.keys() != second.keys():
        raise error(f"tensor names differ: {sorted(set(first) ^ set(second))[:5]}")
    out: dict[str, Array] = {}
    for name, value in first.items():
        other = second[name]
        if np.shape(value) != np.shape(other):
            raise error(f"tensor {name!r}: shape {np.shape(value)} != {np.shape(other)}")
        if value.dtype.kind == "f":
            out[name] = op(value, other, dtype=np.float32)
        else:
            out[name] = np.array(value, copy=True)
    return out
