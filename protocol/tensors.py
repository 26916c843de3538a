"""Tensors on the wire: encodings and encoded tensors.

An :class:`EncodedTensor` is one named array in one :class:`Encoding`. Encoding is
explicit (:func:`encode_array`, with :func:`encoding_for` as the per-precision policy);
decoding back to numpy is :meth:`EncodedTensor.to_array`. Wire validation (shapes,
sizes, dtypes, limits) happens when a tensor is read from the wire
(:meth:`EncodedTensor.from_wire`), so a tensor object always holds consistent bytes.
Groups of tensors are :class:`protocol.tensorset.TensorSet`; fingerprints and deltas of
plain arrays live in :mod:`protocol.arrays`.

Error bounds, per element, for a finite float32 input ``x`` (see docs/protocol.md):

========  ==============================================================================
fp32      exact
fp16      round to nearest: relative error <= 2**-11 for 6.1e-5 <= |x| <= 65504,
          absolute error <= 2**-25 below; |x| > 65504 raises EncodeError
bf16      round to nearest: relative error <= 2**-8 for |x| >= 1.2e-38 (float32
          normal range), absolute error <= 2**-134 below
int8      per tensor, 256 codes: |x - x_hat| <= scale / 2, scale = (max - min) / 255
int8_ch   the same per channel (rows along axis 0)
int4_ch   per channel, 16 codes: |x - x_hat| <= scale / 2, scale = (max - min) / 15
========  ==============================================================================

Integer codes with stochastic rounding are unbiased with ``|x - x_hat| < scale``; all
bounds hold up to float32 rounding of the reconstruction (about 2**-23 * max |x|).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np
import numpy.typing as npt

from protocol import quant
from protocol.errors import DecodeError, EncodeError
from protocol.limits import ALL_DTYPES, DecodeLimits

__all__ = ["EncodedTensor", "Encoding", "Precision", "encode_array", "encoding_for"]

Array = npt.NDArray[Any]


class Encoding(str, Enum):
    """How one tensor's values are stored (the ``encoding`` field on the wire)."""

    RAW = "raw"  # the tensor's own dtype, little-endian (integer buffers, masks)
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"  # affine, one offset/scale for the whole tensor
    INT8_CH = "int8_ch"  # affine, one offset/scale per channel (axis 0)
    INT4_CH = "int4_ch"  # affine per channel, 16 codes, two per byte


class Precision(str, Enum):
    """Transfer precision of a model, as negotiated in hello and task messages."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"
    INT4 = "int4"


_FLOAT_ENCODINGS = {Encoding.FP32: 4, Encoding.FP16: 2, Encoding.BF16: 2}
_INT_LEVELS = {Encoding.INT8: 256, Encoding.INT8_CH: 256, Encoding.INT4_CH: 16}
_RAW_DTYPES = {name: np.dtype(name).newbyteorder("<") for name in ALL_DTYPES}
_FLAG_SHUFFLED = 1
_WIRE_FIELDS = 7


@dataclass(frozen=True, slots=True)
class EncodedTensor:
    """One named tensor in one encoding, as it travels.

    Attributes:
        name: the tensor's name (a state-dict key such as ``head.weight``).
        shape: the decoded array's shape.
        dtype: the decoded array's dtype name (``float32`` for every float and integer
            encoding; the raw dtype for ``raw``).
        encoding: how ``data`` is laid out.
        data: the encoded values (see docs/protocol.md for each layout).
        shuffled: ``data`` is byte-shuffled (float and raw encodings only).
        scale: float32 little-endian scales, one per channel (integer encodings).
        offset: float32 little-endian offsets, one per channel (integer encodings).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    encoding: Encoding
    data: bytes
    shuffled: bool = False
    scale: bytes = b""
    offset: bytes = b""

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Encoded size: data plus quantization parameters, in bytes."""
        return len(self.data) + len(self.scale) + len(self.offset)

    def to_array(self) -> Array:
        """Decode to a new, writable, C-contiguous numpy array of ``shape``."""
        enc = self.encoding
        if enc is Encoding.RAW:
            dt = _RAW_DTYPES[self.dtype]
            raw = self._unshuffled(dt.itemsize)
            return (
                np.frombuffer(raw, dtype=dt)
                .astype(dt.newbyteorder("="), copy=True)
                .reshape(self.shape)
            )
        if enc in _FLOAT_ENCODINGS:
            raw = self._unshuffled(_FLOAT_ENCODINGS[enc])
            if enc is Encoding.FP32:
                out = np.frombuffer(raw, dtype="<f4").astype(np.float32, copy=True)
            elif enc is Encoding.FP16:
                out = np.frombuffer(raw, dtype="<f2").astype(np.float32)
            else:
                out = quant.bf16_to_fp32(np.frombuffer(raw, dtype="<u2")).astype(np.float32)
            return out.reshape(self.shape)
        scale = np.frombuffer(self.scale, dtype="<f4").astype(np.float32)
        offset = np.frombuffer(self.offset, dtype="<f4").astype(np.float32)
        if self.numel == 0:
            return np.zeros(self.shape, dtype=np.float32)
        if enc is Encoding.INT4_CH:
            codes = quant.unpack_nibbles(self.data, self.numel)
        else:
            codes = np.frombuffer(self.data, dtype=np.uint8)
        rows = codes.reshape(scale.size, -1)
        return quant.dequantize_affine(rows, offset, scale).reshape(self.shape)

    def _unshuffled(self, itemsize: int) -> bytes | npt.NDArray[np.uint8]:
        return quant.unshuffle_bytes(self.data, itemsize) if self.shuffled else self.data

    # -- wire form ---------------------------------------------------------------------

    def to_wire(self) -> list[Any]:
        """The msgpack array form: ``[name, shape, dtype, encoding, flags, data, params]``."""
        params = None if self.encoding not in _INT_LEVELS else [self.scale, self.offset]
        flags = _FLAG_SHUFFLED if self.shuffled else 0
        return [
            self.name,
            list(self.shape),
            self.dtype,
            self.encoding.value,
            flags,
            self.data,
            params,
        ]

    @classmethod
    def from_wire(cls, obj: Any, limits: DecodeLimits) -> EncodedTensor:
        """Validate a decoded msgpack value and build the tensor.

        Raises:
            DecodeError: wrong structure or types, unknown encoding or dtype, a shape
                over the limits, or data whose length does not match the shape.
        """
        if not isinstance(obj, list) or len(obj) != _WIRE_FIELDS:
            raise DecodeError(f"a tensor must be an array of {_WIRE_FIELDS} fields")
        name, shape_obj, dtype, enc_name, flags, data, params = obj
        if not isinstance(name, str) or not name:
            raise DecodeError("tensor name must be a non-empty string")
        if len(name.encode("utf-8")) > limits.max_name_bytes:
            raise DecodeError(f"tensor name longer than {limits.max_name_bytes} bytes")
        shape = _check_shape(name, shape_obj, limits)
        if not isinstance(dtype, str) or dtype not in limits.allowed_dtypes:
            raise DecodeError(f"tensor {name!r}: dtype {dtype!r} is not allowed")
        try:
            enc = Encoding(enc_name)
        except ValueError:
            raise DecodeError(f"tensor {name!r}: unknown encoding {enc_name!r}") from None
        if not isinstance(flags, int) or isinstance(flags, bool) or flags & ~_FLAG_SHUFFLED:
            raise DecodeError(f"tensor {name!r}: bad flags {flags!r}")
        if not isinstance(data, bytes):
            raise DecodeError(f"tensor {name!r}: data must be binary")
        numel = math.prod(shape)
        if enc is not Encoding.RAW and dtype != "float32":
            raise DecodeError(f"tensor {name!r}: encoding {enc.value} decodes to float32")
        shuffled = bool(flags & _FLAG_SHUFFLED)
        if shuffled and enc in _INT_LEVELS:
            raise DecodeError(f"tensor {name!r}: byte shuffle applies to float encodings only")
        scale = offset = b""
        if enc in _INT_LEVELS:
            scale, offset = _check_params(name, enc, shape, params)
            expected = (numel + 1) // 2 if enc is Encoding.INT4_CH else numel
        else:
            if params is not None:
                raise DecodeError(f"tensor {name!r}: encoding {enc.value} takes no parameters")
            itemsize = _RAW_DTYPES[dtype].itemsize if enc is Encoding.RAW else _FLOAT_ENCODINGS[enc]
            expected = numel * itemsize
        if len(data) != expected:
            raise DecodeError(
                f"tensor {name!r}: {len(data)} data bytes, expected {expected} for shape {shape}"
            )
        _check_canonical(name, enc, dtype, data, numel)
        return cls(name, shape, dtype, enc, data, shuffled, scale, offset)


def _check_canonical(name: str, enc: Encoding, dtype: str, data: bytes, numel: int) -> None:
    """Refuse bytes no encoder writes: one value, one encoding (docs/protocol.md, 5)."""
    if enc is Encoding.INT4_CH and numel % 2 and data[-1] >> 4:
        raise DecodeError(f"tensor {name!r}: int4 padding nibble must be zero")
    if dtype == "bool" and data and np.frombuffer(data, dtype=np.uint8).max() > 1:
        raise DecodeError(f"tensor {name!r}: bool bytes must be 0 or 1")


def _check_shape(name: str, shape_obj: Any, limits: DecodeLimits) -> tuple[int, ...]:
    if not isinstance(shape_obj, list):
        raise DecodeError(f"tensor {name!r}: shape must be an array")
    if len(shape_obj) > limits.max_dims:
        raise DecodeError(f"tensor {name!r}: {len(shape_obj)} dims, limit {limits.max_dims}")
    for dim in shape_obj:
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
            raise DecodeError(f"tensor {name!r}: dims must be non-negative integers")
    numel = math.prod(shape_obj)
    if numel > limits.max_elements:
        raise DecodeError(f"tensor {name!r}: {numel} elements, limit {limits.max_elements}")
    return tuple(shape_obj)


def _check_params(
    name: str, enc: Encoding, shape: tuple[int, ...], params: Any
) -> tuple[bytes, bytes]:
    if not (isinstance(params, list) and len(params) == 2):
        raise DecodeError(f"tensor {name!r}: {enc.value} needs [scale, offset] parameters")
    scale, offset = params
    if not (isinstance(scale, bytes) and isinstance(offset, bytes)):
        raise DecodeError(f"tensor {name!r}: scale and offset must be binary")
    numel = math.prod(shape)
    channels = _channels(enc, shape) if numel else 0
    if len(scale) != 4 * channels or len(offset) != 4 * channels:
        raise DecodeError(
            f"tensor {name!r}: expected {channels} float32 scales and offsets "
            f"({4 * channels} bytes each)"
        )
    s = np.frombuffer(scale, dtype="<f4")
    o = np.frombuffer(offset, dtype="<f4")
    if not (np.isfinite(s).all() and np.isfinite(o).all() and (s >= 0).all()):
        raise DecodeError(f"tensor {name!r}: scales must be finite and >= 0, offsets finite")
    return scale, offset


def _channels(enc: Encoding, shape: tuple[int, ...]) -> int:
    """Rows of the affine view: axis 0 for per-channel encodings of rank >= 2, else 1."""
    if enc is Encoding.INT8 or len(shape) < 2:
        return 1
    return shape[0]


def encoding_for(precision: Precision | str, array: Array) -> Encoding:
    """The encoding a tensor gets when a model is sent at ``precision``.

    Non-float tensors (integer buffers, masks) travel ``raw``. Float tensors of rank
    >= 2 get the precision's encoding (int8 -> ``int8_ch``, int4 -> ``int4_ch``);
    rank 0 and 1 float tensors (biases, norm scales: few bytes, sensitive) travel as
    fp16 under int8 / int4. Any tensor sent as fp16 whose values exceed the fp16 range
    travels as fp32 instead.
    """
    prec = Precision(precision)
    if array.dtype.kind != "f":
        return Encoding.RAW
    if prec is Precision.FP32:
        return Encoding.FP32
    if prec is Precision.BF16:
        return Encoding.BF16
    if prec is Precision.FP16 or array.ndim < 2:
        big = array.size and float(np.max(np.abs(array))) > quant.FP16_MAX
        return Encoding.FP32 if big else Encoding.FP16
    return Encoding.INT8_CH if prec is Precision.INT8 else Encoding.INT4_CH


def encode_array(
    name: str,
    array: npt.ArrayLike,
    encoding: Encoding | str,
    *,
    shuffle: bool = False,
    rng: np.random.Generator | None = None,
) -> EncodedTensor:
    """Encode one array.

    Args:
        name: tensor name.
        array: values; float encodings take any real float array (converted to float32).
        encoding: target encoding.
        shuffle: byte-shuffle float / raw data (better compression, a little slower).
        rng: for integer encodings, draw stochastic-rounding noise from it (unbiased);
            None rounds to nearest.

    Raises:
        EncodeError: NaN or infinity into an integer encoding, fp16 overflow, a raw
            dtype outside the allow-list, or a non-float array into a float encoding.
    """
    enc = Encoding(encoding)
    arr = np.asarray(array)
    shape = tuple(int(d) for d in arr.shape)
    if enc is Encoding.RAW:
        name_of = np.dtype(arr.dtype).name
        if name_of not in _RAW_DTYPES:
            raise EncodeError(f"tensor {name!r}: dtype {name_of} cannot travel raw")
        le = np.ascontiguousarray(arr, dtype=_RAW_DTYPES[name_of])
        data = quant.shuffle_bytes(le) if shuffle else le.tobytes()
        return EncodedTensor(name, shape, name_of, enc, data, shuffled=shuffle and le.itemsize > 1)
    if arr.dtype.kind != "f":
        raise EncodeError(f"tensor {name!r}: encoding {enc.value} needs a float array")
    x = np.ascontiguousarray(arr, dtype=np.float32)
    if enc in _FLOAT_ENCODINGS:
        if enc is Encoding.FP32:
            values: npt.NDArray[Any] = x.astype("<f4", copy=False)
        elif enc is Encoding.FP16:
            values = quant.fp32_to_fp16(x)
        else:
            values = quant.fp32_to_bf16(x)
        data = quant.shuffle_bytes(values) if shuffle else values.tobytes()
        return EncodedTensor(name, shape, "float32", enc, data, shuffled=shuffle)
    if x.size == 0:
        return EncodedTensor(name, shape, "float32", enc, b"", scale=b"", offset=b"")
    rows = x.reshape(_channels(enc, shape), -1)
    levels = _INT_LEVELS[enc]
    try:
        offset, scale = quant.affine_params(rows, levels)
    except EncodeError as exc:
        raise EncodeError(f"tensor {name!r}: {exc}") from None
    codes = quant.quantize_affine(rows, offset, scale, levels, rng)
    data = quant.pack_nibbles(codes) if enc is Encoding.INT4_CH else codes.tobytes()
    return EncodedTensor(
        name,
        shape,
        "float32",
        enc,
        data,
        scale=scale.astype("<f4").tobytes(),
        offset=offset.astype("<f4").tobytes(),
    )
