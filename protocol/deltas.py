"""Models as deltas on the wire: what a sender encodes and what its receiver ends up with.

A delta set (:class:`~protocol.tensorset.TensorSet` with ``mode="delta"``) carries
``target - base`` for the float tensors of a model (other tensors travel as their new
value); the receiver adds the decoded values to the base it holds
(:func:`apply_delta_set`). The set's ``base`` names that base (see docs/protocol.md):

* ``"set:NAME"``: the set ``NAME`` of the same message, as the receiver decoded it (FedKF
  sends the teacher as a delta against the student);
* 16 hex digits: the content fingerprint (:func:`protocol.arrays.content_fingerprint`) of
  the decoded model the receiver holds from an earlier transfer.

Integer-coded deltas use a *zero-centred* grid: per channel ``scale = max|x| / s`` with
``s = levels / 2 - 1`` (127 for int8, 7 for int4) and ``offset = -(levels / 2) * scale``,
so code ``levels / 2`` decodes to exactly 0 and ``|x - x_hat| <= scale / 2``. These are
ordinary ``int8_ch`` / ``int4_ch`` tensors (any decoder reads them); the grid is the
encoder's choice, made because most of a delta is near zero, which then compresses well.
A sender may also zero the smallest elements (``keep`` < 1): the FedKF teacher is fitted
into a byte budget this way (:func:`fit_delta`).

Every function returns, besides the tensor set, exactly what the receiver will decode
(``received``), so a sender can name it, store it and keep its residual (error feedback).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import zstandard

from protocol import quant
from protocol.arrays import apply_delta, content_fingerprint, delta_arrays
from protocol.errors import DecodeError, EncodeError
from protocol.tensors import EncodedTensor, Encoding, Precision, encode_array, encoding_for
from protocol.tensorset import TensorSet, encode_tensors

__all__ = [
    "SET_BASE_PREFIX",
    "Encoded",
    "UnknownBaseError",
    "apply_delta_set",
    "compressed_size",
    "decode_sets",
    "encode_delta",
    "encode_full",
    "fit_delta",
    "set_base",
    "shared_fingerprint",
]

Array = npt.NDArray[Any]
Arrays = Mapping[str, Array]

SET_BASE_PREFIX = "set:"
"""Prefix of a delta's ``base`` that names another set of the same message."""

KEEP_STEPS: tuple[float, ...] = (1.0, 0.5, 0.3, 0.2, 0.1, 0.05, 0.02, 0.01)
"""Fractions of a delta's elements :func:`fit_delta` tries to keep, best first."""

_LEVELS = {Encoding.INT8_CH: 256, Encoding.INT4_CH: 16}


def set_base(name: str) -> str:
    """The ``base`` of a delta taken against the set ``name`` of the same message."""
    return SET_BASE_PREFIX + name


@dataclass(frozen=True)
class Encoded:
    """A model or delta ready to send, and what its receiver will decode."""

    tensors: TensorSet
    received: dict[str, Array]
    """The arrays the receiver ends up with (float32 floats), base included for deltas."""
    residual: dict[str, Array] = field(default_factory=dict)
    """For a delta, what the encoding lost: sent values minus decoded values (zeros for
    exact tensors); a sender with error feedback adds it to its next delta. Empty for a
    full set."""

    @functools.cached_property
    def fingerprint(self) -> str:
        """Content fingerprint of :attr:`received` (how a later delta names it; computed
        once: an encoding sent to many devices is named for each)."""
        return content_fingerprint(self.received)


def encode_full(arrays: Arrays, precision: Precision | str) -> Encoded:
    """A full set of ``arrays`` at ``precision`` (round to nearest).

    Raises:
        EncodeError: as :func:`protocol.tensorset.encode_tensors`.
    """
    tensors = encode_tensors(arrays, precision)
    return Encoded(tensors, tensors.to_arrays())


def encode_delta(
    target: Arrays,
    base: Arrays,
    base_ref: str,
    precision: Precision | str,
    *,
    residual: Arrays | None = None,
    keep: float = 1.0,
) -> Encoded:
    """``target - base`` (plus ``residual``) as a delta set against ``base_ref``.

    Float tensors of rank >= 2 take the precision's encoding on the zero-centred grid
    (int8 / int4) or its float encoding; smaller float tensors as
    :func:`protocol.tensors.encoding_for` says; others travel as their target value.

    Args:
        target: the model the receiver should end up with.
        base: what the receiver holds (same names and shapes).
        base_ref: the set's ``base`` (a fingerprint, or :func:`set_base`).
        precision: the transfer precision.
        residual: error feedback: values the previous encoding lost, added to the delta.
        keep: fraction of each integer-coded tensor's elements to send (the largest in
            magnitude); the rest travel as exact zeros.

    Raises:
        EncodeError: names or shapes differ, or a value cannot be encoded.
    """
    if not 0 < keep <= 1:
        raise EncodeError(f"keep must be in (0, 1], got {keep}")
    delta = delta_arrays(target, base)
    if residual is not None:
        for name, value in residual.items():
            if name not in delta or np.shape(value) != delta[name].shape:
                raise EncodeError(f"residual {name!r} does not fit the delta")
            if delta[name].dtype.kind == "f":
                delta[name] = delta[name] + value
    tensors = tuple(_encode_one(name, value, precision, keep) for name, value in delta.items())
    encoded = TensorSet(mode="delta", base=base_ref, tensors=tensors)
    decoded = encoded.to_arrays()
    lost = {name: _loss(delta[name], decoded[name]) for name in decoded}
    return Encoded(encoded, apply_delta(base, decoded), lost)


def fit_delta(
    target: Arrays,
    base: Arrays,
    base_ref: str,
    precision: Precision | str,
    budget_bytes: int,
    *,
    keep_steps: Sequence[float] = KEEP_STEPS,
) -> Encoded:
    """The best delta of ``target - base`` whose compressed tensor bytes fit the budget.

    Tries, best first, a delta two precision steps below ``precision`` (fp32 -> int8,
    fp16 / bf16 -> int4, int8 / int4 -> int4), then the same keeping ever fewer of the
    largest elements (``keep_steps``); returns the first whose zstd-compressed tensor
    data fits in ``budget_bytes``, else the last one tried.

    Raises:
        EncodeError: as :func:`encode_delta`.
    """
    coarse = _coarser(Precision(precision))
    steps = [s for s in keep_steps if 0 < s <= 1] or [1.0]
    best: Encoded | None = None
    for keep in steps:
        best = encode_delta(target, base, base_ref, coarse, keep=keep)
        if compressed_size(best.tensors) <= budget_bytes:
            break
    assert best is not None
    return best


def apply_delta_set(tensors: TensorSet, base: Arrays) -> dict[str, Array]:
    """The arrays a delta set describes, given the ``base`` it names.

    Raises:
        DecodeError: the set is not a delta, or its names or shapes differ from the base.
    """
    if tensors.mode != "delta":
        raise DecodeError(f"a {tensors.mode} set is not a delta")
    return apply_delta(base, tensors.to_arrays())


class UnknownBaseError(DecodeError):
    """A delta names a base the receiver does not hold."""


def decode_sets(
    sets: Mapping[str, TensorSet],
    names: Sequence[str] | None = None,
    held: Mapping[str, Array] | None = None,
    *,
    shared: bool = False,
    held_fingerprint: str | None = None,
) -> dict[str, dict[str, Array]]:
    """Decode the sets ``names`` (all, in order, if None) of one message, resolving deltas.

    A delta against ``set:NAME`` takes the decoded set ``NAME`` (which must come earlier
    in ``names``); a delta against a fingerprint takes ``held`` if its content
    fingerprint matches.

    With ``shared``, each set is decoded once per :class:`TensorSet` object while that
    object lives, and every caller gets the same read-only arrays: many emulated devices
    that receive one message share its decoded model (:func:`shared_fingerprint` is its
    fingerprint, computed once too). A delta's result is the set's alone: its base is
    another set of the message or named by content; a caller without that base still
    gets :class:`UnknownBaseError`. Without ``shared``, every array is new and writable.
    ``held_fingerprint``: ``held``'s content fingerprint where the caller knows it (else
    it is computed when a delta names a fingerprint).

    Raises:
        UnknownBaseError: a delta's base is not available.
        DecodeError: a set is missing, or a delta does not fit its base.
    """
    out: dict[str, dict[str, Array]] = {}
    for name in names if names is not None else tuple(sets):
        tensors = sets.get(name)
        if tensors is None:
            raise DecodeError(f"the message has no set {name!r} (has {sorted(sets)})")
        if tensors.mode != "delta":
            out[name] = (
                dict(_shared(tensors, tensors.to_arrays).arrays) if shared else tensors.to_arrays()
            )
            continue
        ref = tensors.base or ""
        base: Mapping[str, Array] | None
        if ref.startswith(SET_BASE_PREFIX):
            base = out.get(ref.removeprefix(SET_BASE_PREFIX))
        elif held is not None:
            known = held_fingerprint or content_fingerprint(held)
            base = held if ref == known else None
        else:
            base = None
        if base is None:
            raise UnknownBaseError(f"set {name!r} is a delta against {ref!r}, not held here")
        if shared:
            decode = functools.partial(apply_delta_set, tensors, base)
            out[name] = dict(_shared(tensors, decode).arrays)
        else:
            out[name] = apply_delta_set(tensors, base)
    return out


def shared_fingerprint(tensors: TensorSet) -> str | None:
    """The content fingerprint of ``tensors``' shared decoding (:func:`decode_sets` with
    ``shared``), computed once; None if it is not decoded and shared now."""
    with _SHARED_LOCK:
        entry = _SHARED.get(id(tensors))
    if entry is None or entry.owner() is not tensors:
        return None
    if entry.fingerprint is None:
        entry.fingerprint = content_fingerprint(entry.arrays)
    return entry.fingerprint


@dataclass
class _Shared:
    """One set's shared decoding, alive while the set object is."""

    owner: weakref.ref[TensorSet]
    arrays: dict[str, Array]
    fingerprint: str | None = None


_SHARED: dict[int, _Shared] = {}
_SHARED_LOCK = threading.RLock()  # re-entrant: a collected set's callback may run inside


def _shared(tensors: TensorSet, decode: Callable[[], dict[str, Array]]) -> _Shared:
    """``tensors``' shared decoding, made by ``decode`` once (read-only arrays)."""
    key = id(tensors)
    with _SHARED_LOCK:
        entry = _SHARED.get(key)
    if entry is not None and entry.owner() is tensors:
        return entry
    arrays = decode()
    for array in arrays.values():
        array.setflags(write=False)

    def forget(_: object) -> None:
        with _SHARED_LOCK:
            if _SHARED.get(key) is made:
                del _SHARED[key]

    made = _Shared(weakref.ref(tensors, forget), arrays)
    with _SHARED_LOCK:
        entry = _SHARED.get(key)
        if entry is not None and entry.owner() is tensors:  # another thread was first
            return entry
        _SHARED[key] = made
    return made


# -- internals ---------------------------------------------------------------------------


def _encode_one(name: str, value: Array, precision: Precision | str, keep: float) -> EncodedTensor:
    encoding = encoding_for(precision, value)
    if encoding in _LEVELS:
        return _zero_centred(name, value, _LEVELS[encoding], encoding, keep)
    return encode_array(name, value, encoding)


def _zero_centred(
    name: str, value: Array, levels: int, encoding: Encoding, keep: float
) -> EncodedTensor:
    x = np.ascontiguousarray(value, dtype=np.float32)
    if x.size == 0:
        return encode_array(name, x, encoding)
    if not np.isfinite(x).all():
        raise EncodeError(f"tensor {name!r}: NaN or infinite values cannot be encoded")
    rows = x.reshape(x.shape[0], -1)
    zero = levels // 2
    steps = zero - 1
    amax = np.abs(rows).max(axis=1)
    scale = (amax / np.float32(steps)).astype(np.float32)
    q = quant.quantize_symmetric(rows, scale, steps)
    if keep < 1:
        cut = float(np.quantile(np.abs(rows), 1.0 - keep))
        q[np.abs(rows) < cut] = 0
    codes = (q + zero).astype(np.uint8)
    data = quant.pack_nibbles(codes) if levels == 16 else codes.tobytes()
    offset = (np.float32(-zero) * scale).astype("<f4")
    return EncodedTensor(
        name,
        tuple(int(d) for d in x.shape),
        "float32",
        encoding,
        data,
        scale=scale.astype("<f4").tobytes(),
        offset=offset.tobytes(),
    )


def _coarser(precision: Precision) -> Precision:
    if precision is Precision.FP32:
        return Precision.INT8
    return Precision.INT4


def compressed_size(tensors: TensorSet) -> int:
    """Bytes of the set's tensor data (codes, scales, offsets) after zstd level 3: about
    what the set adds to a compressed message."""
    compressor = zstandard.ZstdCompressor(level=3)
    return len(compressor.compress(b"".join(t.data + t.scale + t.offset for t in tensors)))


def _loss(sent: Array, decoded: Array) -> Array:
    if decoded.dtype.kind != "f":
        return np.zeros(decoded.shape, dtype=decoded.dtype)
    return np.subtract(sent, decoded, dtype=np.float32)
