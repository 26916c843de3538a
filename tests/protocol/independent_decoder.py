"""A decoder of the wire protocol written from docs/protocol.md alone.

It imports nothing of the ``protocol`` package (only msgpack, zstandard, numpy, hashlib,
hmac, struct and, for Ed25519, ``cryptography``; ``test_independent_decoder.py`` checks
that), so that the test can hold the
specification against the reference implementation: every rule here cites the section of
docs/protocol.md it comes from, and anything this module had to guess would be a gap in
the specification.

Everything it rejects raises :class:`RejectedError`.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Any, NamedTuple

import msgpack
import numpy as np
import zstandard
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

VERSION = 7  # section 2: the version byte; section 3: the envelope's "v"
MAGIC = b"FL"
MESSAGE_FRAME, CHUNK_FRAME, SIGNED_MESSAGE_FRAME, SIGNED_CHUNK_FRAME = 0x01, 0x02, 0x03, 0x04
AUTH_SIZE = {0x01: 32, 0x02: 32, 0x03: 64, 0x04: 64}  # section 2: a tag or a signature
ZSTD_MAGIC = bytes.fromhex("28b52ffd")  # section 2.1
CHUNK_FIELDS = struct.Struct(">16sIIQ32s")  # section 2.2: after the authentication field
ENVELOPE_KEYS = {"v", "kind", "fleet", "round", "sender", "id", "ts", "body"}  # section 3
KINDS = {"hello", "task", "model", "update", "ack", "device_status", "coord_status"}
RAW = {  # section 5: dtype -> little-endian layout (itemsize); bool is one byte, 0 or 1
    "float32": "<f4",
    "float64": "<f8",
    "int64": "<i8",
    "int32": "<i4",
    "int16": "<i2",
    "int8": "<i1",
    "uint8": "<u1",
    "bool": "<u1",
}
FLOAT_SIZES = {"fp32": 4, "fp16": 2, "bf16": 2}
INTEGER_ENCODINGS = {"int8", "int8_ch", "int4_ch"}


class RejectedError(ValueError):
    """The input breaks a rule of docs/protocol.md."""


class Tensor(NamedTuple):
    """A decoded tensor: its name, wire dtype token, shape and values (that dtype)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    values: np.ndarray


class Chunk(NamedTuple):
    """The header fields and data of one chunk frame (section 2.2)."""

    transfer_id: bytes
    index: int
    count: int
    total_size: int
    sha256: bytes
    data: bytes

    @property
    def sent_ms(self) -> int:
        """Section 2.2: the transfer's send time, the id's first 8 bytes (u64 BE, Unix ms)."""
        return struct.unpack(">Q", self.transfer_id[:8])[0]  # type: ignore[no-any-return]


# -- frames (section 2) -------------------------------------------------------------------


def frame_type(payload: bytes) -> int:
    """Check the 4-byte frame header; return the frame type."""
    if len(payload) < 4 or payload[:2] != MAGIC:
        raise RejectedError("bad magic")
    if payload[2] != VERSION:
        raise RejectedError(f"version {payload[2]}")
    if payload[3] not in AUTH_SIZE:
        raise RejectedError(f"frame type {payload[3]}")
    return payload[3]


def declared_content_size(zstd_frame: bytes) -> int:
    """Check the canonical zstd frame header of section 2.1 (RFC 8878, 3.1.1.1) and
    return its Frame_Content_Size."""
    if zstd_frame[:4] != ZSTD_MAGIC or len(zstd_frame) < 5:
        raise RejectedError("not one zstd frame")
    descriptor = zstd_frame[4]
    fcs_flag, single_segment = descriptor >> 6, (descriptor >> 5) & 1
    if not descriptor & 0b100:
        raise RejectedError("no content checksum")
    if descriptor & 0b11:
        raise RejectedError("a dictionary id")
    if fcs_flag == 0 and not single_segment:
        raise RejectedError("no content size")
    field = {0: 1, 1: 2, 2: 4, 3: 8}[fcs_flag]
    start = 5 + (0 if single_segment else 1)  # Window_Descriptor unless single segment
    raw = zstd_frame[start : start + field]
    if len(raw) != field:
        raise RejectedError("truncated zstd frame header")
    size = int.from_bytes(raw, "little")
    return size + 256 if field == 2 else size


def decode_message_frame(frame: bytes, max_message_bytes: int = 64 << 20) -> dict[str, Any]:
    """A message frame (signed or not) -> its envelope (sections 2.1, 2.5 and 3), checked."""
    kind = frame_type(frame)
    if kind not in (MESSAGE_FRAME, SIGNED_MESSAGE_FRAME):
        raise RejectedError("not a message frame")
    body = frame[4 + AUTH_SIZE[kind] :]  # after the header and the tag or signature
    size = declared_content_size(body)
    if size > max_message_bytes:
        raise RejectedError("content too large")
    try:
        raw = zstandard.ZstdDecompressor().decompress(
            body, max_output_size=size, allow_extra_data=False
        )
    except zstandard.ZstdError as exc:  # checksum mismatch, corrupt, trailing bytes
        raise RejectedError(str(exc)) from None
    if len(raw) != size:
        raise RejectedError("content size mismatch")
    return decode_envelope(raw)


def tag(key: bytes, topic: str, frame: bytes) -> bytes:
    """Section 2.3: HMAC-SHA256 over the domain string, the topic (u16 BE length, then
    UTF-8) and the frame without its tag bytes 4-35."""
    name = topic.encode("utf-8")
    data = b"edgefl-auth-v4" + struct.pack(">H", len(name)) + name + frame[:4] + frame[36:]
    return hmac.new(key, data, hashlib.sha256).digest()


def derived_key(token: bytes, device_id: str) -> bytes:
    """Section 2.4: a device's key derived from the fleet token: HMAC-SHA256 over the
    15-byte label, one zero byte and the device id (UTF-8)."""
    return hmac.new(
        token, b"edgefl-enrol-v1\x00" + device_id.encode("utf-8"), hashlib.sha256
    ).digest()


def check_tag(key: bytes, topic: str, frame: bytes) -> None:
    """Section 2.3: a frame on a device's topic is refused unless its tag verifies."""
    if len(frame) < 36 or not hmac.compare_digest(frame[4:36], tag(key, topic, frame)):
        raise RejectedError("bad authentication tag")


def check_signature(public_key: bytes, topic: str, frame: bytes) -> None:
    """Section 2.5: a frame on a fleet-wide topic is refused unless it is of a signed type
    (0x03, 0x04) and its Ed25519 signature (bytes 4-67) verifies under the coordinator's
    public key over the domain string and the SHA-256 of the topic (u16 BE length, UTF-8)
    and the frame without its signature."""
    if frame_type(frame) not in (SIGNED_MESSAGE_FRAME, SIGNED_CHUNK_FRAME) or len(frame) < 68:
        raise RejectedError("not a signed frame")
    name = topic.encode("utf-8")
    digest = hashlib.sha256(struct.pack(">H", len(name)) + name + frame[:4] + frame[68:])
    try:
        key = Ed25519PublicKey.from_public_bytes(public_key)
        key.verify(frame[4:68], b"edgefl-sign-v6" + digest.digest())
    except InvalidSignature:
        raise RejectedError("bad coordinator signature") from None


def _no_extensions(code: int, data: bytes) -> Any:
    raise RejectedError("msgpack extension type")


def decode_envelope(raw: bytes) -> dict[str, Any]:
    """A msgpack envelope (section 3) -> a map whose tensor sets are checked."""
    try:
        env = msgpack.unpackb(raw, raw=False, strict_map_key=True, ext_hook=_no_extensions)
    except RejectedError:
        raise
    except Exception as exc:  # malformed msgpack, trailing bytes
        raise RejectedError(str(exc)) from None
    if not isinstance(env, dict) or set(env) != ENVELOPE_KEYS:
        raise RejectedError("envelope keys")
    if env["v"] != VERSION or env["kind"] not in KINDS or not isinstance(env["body"], dict):
        raise RejectedError("envelope values")
    if not isinstance(env["id"], bytes) or len(env["id"]) != 16:
        raise RejectedError("message id")
    for tensor_set in tensor_sets(env).values():
        decode_set(tensor_set)
    return env


def tensor_sets(env: dict[str, Any]) -> dict[str, Any]:
    """The ``sets`` of a model or update body (section 4), else nothing."""
    if env["kind"] in ("model", "update"):
        sets = env["body"]["sets"]
        if not isinstance(sets, dict):
            raise RejectedError("sets")
        return sets
    return {}


# -- chunks (section 2.2) ------------------------------------------------------------------


def read_chunk(payload: bytes) -> Chunk:
    """Section 2.2: the fields after the tag (type 0x02) or the signature (0x04)."""
    kind = frame_type(payload)
    start = 4 + AUTH_SIZE[kind]
    if kind not in (CHUNK_FRAME, SIGNED_CHUNK_FRAME) or len(payload) < start + CHUNK_FIELDS.size:
        raise RejectedError("not a chunk frame")
    tid, index, count, total, digest = CHUNK_FIELDS.unpack_from(payload, start)
    if count < 2 or index >= count:
        raise RejectedError("chunk index")
    return Chunk(tid, index, count, total, digest, payload[start + CHUNK_FIELDS.size :])


def reassemble(payloads: list[bytes]) -> bytes:
    """The chunks of one transfer, in any order, duplicates allowed -> the message frame."""
    chunks = [read_chunk(p) for p in payloads]
    first = chunks[0]
    parts: dict[int, bytes] = {}
    for chunk in chunks:
        if (chunk.transfer_id, chunk.count, chunk.total_size, chunk.sha256) != (
            first.transfer_id,
            first.count,
            first.total_size,
            first.sha256,
        ):
            raise RejectedError("chunks disagree")
        parts.setdefault(chunk.index, chunk.data)  # a repeated index is ignored
    if len(parts) != first.count:
        raise RejectedError("incomplete transfer")
    frame = b"".join(parts[i] for i in range(first.count))
    if len(frame) != first.total_size or hashlib.sha256(frame).digest() != first.sha256:
        raise RejectedError("reassembled frame fails its size or SHA-256")
    return frame


# -- tensors (section 5) -------------------------------------------------------------------


def decode_set(tensor_set: Any) -> list[Tensor]:
    if not isinstance(tensor_set, dict) or set(tensor_set) != {"mode", "base", "tensors"}:
        raise RejectedError("tensor set keys")
    mode, base = tensor_set["mode"], tensor_set["base"]
    if mode not in ("full", "delta", "partial") or (mode == "delta") != (base is not None):
        raise RejectedError("tensor set mode / base")
    if base is not None and not (isinstance(base, str) and 1 <= len(base) <= 128):
        raise RejectedError("tensor set base")
    tensors = [decode_tensor(t) for t in tensor_set["tensors"]]
    if len({t.name for t in tensors}) != len(tensors):
        raise RejectedError("duplicate tensor names")
    return tensors


def _unshuffle(data: bytes, size: int, count: int) -> bytes:
    """Byte ``j`` of element ``i`` sits at ``j * count + i``."""
    if size == 1:
        return data
    planes = np.frombuffer(data, dtype=np.uint8).reshape(size, count)
    return planes.T.tobytes()


def decode_tensor(obj: Any) -> Tensor:
    if not isinstance(obj, list) or len(obj) != 7:
        raise RejectedError("a tensor is an array of 7")
    name, shape, dtype, encoding, flags, data, params = obj
    if not isinstance(name, str) or not 1 <= len(name.encode("utf-8")) <= 256:
        raise RejectedError("name")
    if not isinstance(shape, list) or len(shape) > 8:
        raise RejectedError("shape")
    if any(type(d) is not int or d < 0 for d in shape):
        raise RejectedError("dims")
    if dtype not in RAW or not isinstance(data, bytes):
        raise RejectedError("dtype or data")
    if type(flags) is not int or flags not in (0, 1):
        raise RejectedError("flags")
    n = 1
    for d in shape:
        n *= d
    shuffled = flags == 1
    if encoding == "raw":
        values = _raw(dtype, data, n, shuffled, params)
    elif encoding in FLOAT_SIZES:
        values = _float(encoding, dtype, data, n, shuffled, params)
    elif encoding in INTEGER_ENCODINGS:
        values = _affine(encoding, dtype, shape, data, n, shuffled, params)
    else:
        raise RejectedError("encoding")
    return Tensor(name, dtype, tuple(shape), values.reshape(shape))


def _raw(dtype: str, data: bytes, n: int, shuffled: bool, params: Any) -> np.ndarray:
    layout = np.dtype(RAW[dtype])
    if params is not None or len(data) != n * layout.itemsize:
        raise RejectedError("raw data length or params")
    plain = _unshuffle(data, layout.itemsize, n) if shuffled else data
    values = np.frombuffer(plain, dtype=layout)
    if dtype == "bool":
        if values.size and values.max() > 1:
            raise RejectedError("bool byte other than 0 or 1")
        return values.astype(np.bool_)
    return values.astype(layout.newbyteorder("="))


def _float(
    encoding: str, dtype: str, data: bytes, n: int, shuffled: bool, params: Any
) -> np.ndarray:
    size = FLOAT_SIZES[encoding]
    if dtype != "float32" or params is not None or len(data) != n * size:
        raise RejectedError("float encoding dtype, params or data length")
    plain = _unshuffle(data, size, n) if shuffled else data
    if encoding == "fp32":
        return np.frombuffer(plain, dtype="<f4").astype(np.float32)
    if encoding == "fp16":
        return np.frombuffer(plain, dtype="<f2").astype(np.float32)
    upper = np.frombuffer(plain, dtype="<u2").astype(np.uint32) << np.uint32(16)
    return upper.view(np.float32)  # bf16: the upper 16 bits of a binary32


def _affine(
    encoding: str,
    dtype: str,
    shape: list[int],
    data: bytes,
    n: int,
    shuffled: bool,
    params: Any,
) -> np.ndarray:
    if dtype != "float32" or shuffled:
        raise RejectedError("integer encodings decode to float32, unshuffled")
    if not (isinstance(params, list) and len(params) == 2):
        raise RejectedError("params")
    scale_bytes, offset_bytes = params
    if not (isinstance(scale_bytes, bytes) and isinstance(offset_bytes, bytes)):
        raise RejectedError("params are bin")
    if n == 0:
        channels = 0
    elif encoding == "int8" or len(shape) < 2:
        channels = 1
    else:
        channels = shape[0]
    if len(scale_bytes) != 4 * channels or len(offset_bytes) != 4 * channels:
        raise RejectedError("params length")
    scale = np.frombuffer(scale_bytes, dtype="<f4").astype(np.float32)
    offset = np.frombuffer(offset_bytes, dtype="<f4").astype(np.float32)
    if not (np.isfinite(scale).all() and np.isfinite(offset).all() and (scale >= 0).all()):
        raise RejectedError("scale or offset")
    if encoding == "int4_ch":
        if len(data) != (n + 1) // 2:
            raise RejectedError("int4 data length")
        packed = np.frombuffer(data, dtype=np.uint8)
        if n % 2 and packed[-1] >> 4:
            raise RejectedError("int4 padding nibble")
        codes = np.stack([packed & 0x0F, packed >> 4], axis=1).reshape(-1)[:n]
    else:
        if len(data) != n:
            raise RejectedError("int8 data length")
        codes = np.frombuffer(data, dtype=np.uint8)
    if n == 0:
        return np.zeros(0, dtype=np.float32)
    rows = codes.astype(np.float32).reshape(channels, n // channels)
    # x = offset[c] + scale[c] * q, in float32 arithmetic
    return (offset[:, None] + scale[:, None] * rows).astype(np.float32)


# -- fingerprints (section 6) ----------------------------------------------------------------


def fingerprint_bytes(tensors: list[Tensor]) -> bytes:
    """The canonical byte string of section 6: one record per tensor, in order."""
    out = b""
    for t in tensors:
        name = t.name.encode("utf-8")
        token = t.dtype.encode("ascii")
        out += struct.pack("<I", len(name)) + name
        out += struct.pack("<B", len(token)) + token
        out += struct.pack("<B", len(t.shape))
        out += b"".join(struct.pack("<Q", d) for d in t.shape)
        out += np.ascontiguousarray(t.values, dtype=np.dtype(RAW[t.dtype])).tobytes()
    return out


def content_fingerprint(tensors: list[Tensor]) -> str:
    """The first 16 lowercase hex digits of SHA-256 over :func:`fingerprint_bytes`."""
    return hashlib.sha256(fingerprint_bytes(tensors)).hexdigest()[:16]


# -- hello (section 4) ---------------------------------------------------------------------

WEIGHT_FORMATS = {"float", "int8", "binary"}  # section 4, hello's weight_format


def weight_format(env: dict[str, Any]) -> str:
    """The number format a hello's device runs its weights at: the optional key
    ``weight_format`` (section 4), ``float`` when absent."""
    if env["kind"] != "hello":
        raise RejectedError("not a hello")
    value = env["body"].get("weight_format", "float")
    if value not in WEIGHT_FORMATS:
        raise RejectedError("weight_format")
    return str(value)


# -- hello's model description (sections 4 and 6) ----------------------------------------------


def architecture_fingerprint(layout: dict[str, list[int]]) -> str:
    """Section 6: SHA-256 over one ``name:d0xd1...\\n`` line per tensor, sorted by name
    (byte order), the first 16 lowercase hex digits."""
    lines = sorted(f"{name}:{'x'.join(str(d) for d in dims)}\n" for name, dims in layout.items())
    lines.sort(key=lambda line: line.encode("utf-8"))
    return hashlib.sha256("".join(lines).encode("utf-8")).hexdigest()[:16]


def _ints(value: Any, low: int, most: int, what: str) -> list[int]:
    if not isinstance(value, list) or len(value) > most:
        raise RejectedError(what)
    if not all(type(d) is int and low <= d <= 2**31 - 1 for d in value):
        raise RejectedError(what)
    return list(value)


def model_description(
    env: dict[str, Any],
) -> tuple[list[int] | None, int | None, dict[str, list[int]] | None]:
    """A hello's optional ``input_shape``, ``num_classes`` and ``layout`` (section 4),
    each None when absent; the layout must give the hello's ``fingerprint``."""
    if env["kind"] != "hello":
        raise RejectedError("not a hello")
    body = env["body"]
    shape = body.get("input_shape")
    if shape is not None:
        shape = _ints(shape, 1, 8, "input_shape")
        if not shape:
            raise RejectedError("input_shape")
    classes = body.get("num_classes")
    if classes is not None and not (type(classes) is int and 1 <= classes <= 2**31 - 1):
        raise RejectedError("num_classes")
    layout = body.get("layout")
    if layout is not None:
        if not isinstance(layout, dict) or not 1 <= len(layout) <= 1024:
            raise RejectedError("layout")
        for name in layout:
            if not isinstance(name, str) or not 1 <= len(name) <= 256:
                raise RejectedError("layout")
        layout = {name: _ints(dims, 0, 8, "layout") for name, dims in layout.items()}
        if architecture_fingerprint(layout) != body["fingerprint"]:
            raise RejectedError("layout does not give the fingerprint")
    return shape, classes, layout
