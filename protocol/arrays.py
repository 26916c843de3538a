"""Operations on named arrays (``dict[str, ndarray]``, a model's state): fingerprints
and deltas. Numpy only."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from protocol.errors import DecodeError, EncodeError

__all__ = ["apply_delta", "architecture_fingerprint", "content_fingerprint", "delta_arrays"]

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
    """Fingerprint of tensor values (names, dtypes, shapes and bytes, in order).

    16 hex digits of SHA-256; used to name the base a delta is taken against, so a
    receiver can tell whether it holds exactly that base.
    """
    h = hashlib.sha256()
    for name, value in arrays.items():
        arr = np.ascontiguousarray(value)
        le = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        h.update(f"{name}|{le.dtype.str}|{arr.shape}\n".encode())
        h.update(le.tobytes())
    return h.hexdigest()[:16]


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
