"""Numeric kernels behind the tensor encodings: half floats, affine integer codes, nibbles.

Everything here is numpy only, pure and single-threaded. The encodings that use these
kernels, and their error bounds, are described in :mod:`protocol.tensors` and in
``docs/protocol.md``.

Affine integer codes (int8 and int4) use the *offset + scale* form::

    q = round((x - lo) / scale)          q in [0, levels - 1]
    x_hat = lo + scale * q               (float32 arithmetic)

with ``lo = min(x)`` and ``scale = (max(x) - min(x)) / (levels - 1)`` per channel (rows
of a 2-D view). With round-to-nearest, ``|x - x_hat| <= scale / 2`` up to float32
rounding; with stochastic rounding ``q = floor((x - lo) / scale + u)``, ``u ~ U[0, 1)``,
the code is unbiased (``E[x_hat] = x``) and ``|x - x_hat| < scale``.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from protocol.errors import EncodeError

__all__ = [
    "FP16_MAX",
    "affine_params",
    "bf16_to_fp32",
    "dequantize_affine",
    "fp32_to_bf16",
    "fp32_to_fp16",
    "pack_nibbles",
    "quantize_affine",
    "quantize_symmetric",
    "shuffle_bytes",
    "unpack_nibbles",
    "unshuffle_bytes",
]

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]

FP16_MAX = 65504.0
"""Largest finite IEEE binary16 value; finite inputs beyond it cannot be sent as fp16."""


def shuffle_bytes(data: npt.NDArray[np.generic]) -> bytes:
    """Byte-shuffle an array: all first bytes of every element, then all second bytes...

    Floats compress better this way (exponent bytes cluster). The inverse is
    :func:`unshuffle_bytes`. Element bytes are taken in the array's memory order, which
    callers make little-endian.
    """
    itemsize = data.dtype.itemsize
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if itemsize == 1:
        return flat.tobytes()
    return flat.reshape(-1, itemsize).T.tobytes()


def unshuffle_bytes(buf: bytes, itemsize: int) -> U8:
    """Invert :func:`shuffle_bytes`; returns the elements' bytes in natural order."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    if itemsize == 1:
        return raw.copy()
    return np.ascontiguousarray(raw.reshape(itemsize, -1).T).reshape(-1)


def fp32_to_fp16(x: F32) -> npt.NDArray[np.float16]:
    """Convert to IEEE half precision (round to nearest even).

    Raises:
        EncodeError: a finite input lies outside the fp16 range (``|x| > 65504``), which
            would silently become infinity. NaN and infinities are carried as they are.
    """
    with np.errstate(over="ignore"):
        half = x.astype("<f2")
    if not np.isfinite(half).all():
        overflow = ~np.isfinite(half) & np.isfinite(x)
        if overflow.any():
            worst = float(np.max(np.abs(x[overflow])))
            raise EncodeError(f"value {worst:g} is outside the fp16 range (|x| <= {FP16_MAX:g})")
    return half


def fp32_to_bf16(x: F32) -> npt.NDArray[np.uint16]:
    """Convert float32 to bfloat16 bit patterns (round to nearest, ties to even).

    NaN stays a (quiet) NaN; values that round beyond the largest bfloat16 become
    infinity, as IEEE rounding prescribes.
    """
    bits = np.ascontiguousarray(x, dtype="<f4").view("<u4")
    rounding = ((bits >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
    out: npt.NDArray[np.uint16] = ((bits + rounding) >> np.uint32(16)).astype("<u2")
    nan = np.isnan(x)
    if nan.any():
        out[nan.reshape(out.shape)] = np.uint16(0x7FC0)
    return out


def bf16_to_fp32(bits: npt.NDArray[np.uint16]) -> F32:
    """Expand bfloat16 bit patterns to float32 (exact)."""
    return (bits.astype("<u4") << np.uint32(16)).view("<f4")


def affine_params(rows: F32, levels: int) -> tuple[F32, F32]:
    """Per-row offset (the minimum) and scale for ``levels`` integer codes.

    Args:
        rows: a 2-D float32 array (channels, elements per channel); no empty rows.
        levels: number of codes, 256 for int8 or 16 for int4.

    Returns:
        ``(offset, scale)``, each float32 of shape (channels,); scale is 0 for a
        constant row.

    Raises:
        EncodeError: a row holds NaN or an infinity (integer codes cannot carry them).
    """
    lo = rows.min(axis=1)
    hi = rows.max(axis=1)
    if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
        raise EncodeError("NaN or infinite values cannot be encoded as integer codes")
    span = hi.astype(np.float64) - lo.astype(np.float64)
    scale = (span / (levels - 1)).astype(np.float32)
    return lo.astype(np.float32), scale


def quantize_affine(
    rows: F32,
    offset: F32,
    scale: F32,
    levels: int,
    rng: np.random.Generator | None = None,
) -> U8:
    """Map each row to integer codes in ``[0, levels - 1]`` (uint8).

    Round to nearest when ``rng`` is None, else stochastic rounding with uniform
    noise drawn from ``rng`` (unbiased). Rows with scale 0 map to code 0.
    """
    inv = np.zeros_like(scale)
    with np.errstate(over="ignore"):
        np.divide(np.float32(1.0), scale, out=inv, where=scale > 0)
    tiny = np.isinf(inv)  # subnormal scales: 1/scale overflows, so divide those rows
    inv[tiny] = 0
    t = np.subtract(rows, offset[:, None])
    np.multiply(t, inv[:, None], out=t)
    if tiny.any():
        t[tiny] = (rows[tiny] - offset[tiny, None]) / scale[tiny, None]
    if rng is None:
        np.rint(t, out=t)
    else:
        t += rng.random(t.shape, dtype=np.float32)
        np.floor(t, out=t)
    np.clip(t, 0, levels - 1, out=t)
    return t.astype(np.uint8)


def quantize_symmetric(rows: F32, scale: F32, steps: int) -> npt.NDArray[np.int16]:
    """Signed codes ``round(x / scale)`` in ``[-steps, steps]`` per row (round to nearest).

    The zero-centred grid of deltas (see :mod:`protocol.deltas`): ``scale`` is
    ``max|row| / steps``, so no code clips and ``|x - scale * q| <= scale / 2``. Rows
    with scale 0 map to code 0.
    """
    inv = np.zeros_like(scale)
    with np.errstate(over="ignore"):
        np.divide(np.float32(1.0), scale, out=inv, where=scale > 0)
    tiny = np.isinf(inv)  # subnormal scales: divide those rows instead
    inv[tiny] = 0
    t = np.multiply(rows, inv[:, None], dtype=np.float32)
    if tiny.any():
        t[tiny] = rows[tiny] / scale[tiny, None]
    np.rint(t, out=t)
    np.clip(t, -steps, steps, out=t)
    return t.astype(np.int16)


def dequantize_affine(codes: U8, offset: F32, scale: F32) -> F32:
    """Inverse of :func:`quantize_affine`: ``offset + scale * q`` per row, float32."""
    out = codes.astype(np.float32)
    out *= scale[:, None]
    out += offset[:, None]
    return out


def pack_nibbles(codes: U8) -> bytes:
    """Pack 4-bit codes two per byte: element 2i in the low nibble, 2i+1 in the high.

    An odd count is padded with a zero high nibble in the last byte.
    """
    flat = codes.reshape(-1)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, dtype=np.uint8)])
    packed = flat[0::2] | (flat[1::2] << np.uint8(4))
    return packed.tobytes()


def unpack_nibbles(buf: bytes, count: int) -> U8:
    """Invert :func:`pack_nibbles`, returning ``count`` codes."""
    packed = np.frombuffer(buf, dtype=np.uint8)
    out = np.empty(packed.size * 2, dtype=np.uint8)
    np.bitwise_and(packed, np.uint8(0x0F), out=out[0::2])
    np.right_shift(packed, np.uint8(4), out=out[1::2])
    return out[:count]
