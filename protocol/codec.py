"""Codec: :class:`~protocol.messages.Message` <-> frame bytes (msgpack envelope + zstd).

A *frame* is what travels as one MQTT payload. Four frame types share a 4-byte header::

    offset  size  field
    0       2     magic b"FL" (0x46 0x4C)
    2       1     version (PROTOCOL_VERSION, 7)
    3       1     type: 0x01 message, 0x02 chunk (see protocol.chunking), 0x03 signed
                  message, 0x04 signed chunk
    4       32    types 0x01, 0x02: authentication tag (HMAC-SHA256, see protocol.auth;
                  zero bytes where the frame is not authenticated: the codec and the
                  splitter write zeros, :class:`~protocol.channel.Channel` seals and
                  checks it)
    4       64    types 0x03, 0x04: the coordinator's Ed25519 signature (protocol.signing;
                  fleet-wide topics)

A signed frame is its unsigned twin with the wider authentication field: the same
message or chunk after it.

A message frame continues with exactly one zstd frame
(content size and content checksum present, no dictionary; a decoder rejects any other)
whose content is one msgpack map, the envelope::

    {"v": PROTOCOL_VERSION, "kind": str, "fleet": str, "round": int, "sender": str,
     "id": bin(16), "ts": int (unix ms), "body": map}

``docs/protocol.md`` describes every body and tensor layout. Decoding is bounded by
:class:`~protocol.limits.DecodeLimits` and raises only :class:`~protocol.errors.DecodeError`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import msgpack
import zstandard
from pydantic import ValidationError

from protocol.errors import DecodeError, EncodeError
from protocol.limits import DecodeLimits
from protocol.messages import BODY_KINDS, PROTOCOL_VERSION, Message

__all__ = [
    "FRAME_CHUNK",
    "FRAME_HEADER_SIZE",
    "FRAME_MAGIC",
    "FRAME_MESSAGE",
    "FRAME_SIGNED_CHUNK",
    "FRAME_SIGNED_MESSAGE",
    "MESSAGE_PREFIX_SIZE",
    "SIGNATURE_SIZE",
    "ZSTD_MAGIC",
    "Codec",
    "FrameHeader",
    "auth_size",
    "read_frame_header",
    "signed_twin",
]

FRAME_MAGIC = b"FL"
FRAME_MESSAGE = 0x01
FRAME_CHUNK = 0x02
FRAME_SIGNED_MESSAGE = 0x03
FRAME_SIGNED_CHUNK = 0x04
FRAME_HEADER_SIZE = 4
TAG_SIZE = 32
SIGNATURE_SIZE = 64
MESSAGE_PREFIX_SIZE = FRAME_HEADER_SIZE + TAG_SIZE
"""A message frame's zstd frame starts after the header and the 32-byte tag (a signed
message frame's after the 64-byte signature: :func:`auth_size`)."""
_AUTH_SIZES = {
    FRAME_MESSAGE: TAG_SIZE,
    FRAME_CHUNK: TAG_SIZE,
    FRAME_SIGNED_MESSAGE: SIGNATURE_SIZE,
    FRAME_SIGNED_CHUNK: SIGNATURE_SIZE,
}
_SIGNED_TWIN = {FRAME_MESSAGE: FRAME_SIGNED_MESSAGE, FRAME_CHUNK: FRAME_SIGNED_CHUNK}
ZSTD_MAGIC = bytes.fromhex("28b52ffd")
"""The first 4 bytes of a zstd frame (RFC 8878 magic number 0xFD2FB528, little-endian)."""
_CONTENT_CHECKSUM_FLAG = 0b0000_0100  # bits of the zstd Frame_Header_Descriptor
_DICTIONARY_ID_FLAG = 0b0000_0011
_ENVELOPE_KEYS = frozenset({"v", "kind", "fleet", "round", "sender", "id", "ts", "body"})


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """The 4-byte header every frame starts with."""

    version: int
    frame_type: int

    @property
    def signed(self) -> bool:
        """A signed frame (types 0x03, 0x04): a 64-byte signature after the header."""
        return self.frame_type in (FRAME_SIGNED_MESSAGE, FRAME_SIGNED_CHUNK)

    @property
    def chunk(self) -> bool:
        """A chunk frame (types 0x02, 0x04)."""
        return self.frame_type in (FRAME_CHUNK, FRAME_SIGNED_CHUNK)


def auth_size(frame_type: int) -> int:
    """Bytes of the authentication field after the header: 32 (a tag) or 64 (a
    signature)."""
    return _AUTH_SIZES[frame_type]


def signed_twin(frame: bytes) -> bytes:
    """An unsigned message or chunk frame (types 0x01, 0x02) as its signed type (0x03,
    0x04), with a zero signature to fill in (:class:`protocol.signing.SigningKey`).

    Raises:
        ValueError: ``frame`` is not an unsigned frame.
    """
    twin = _SIGNED_TWIN.get(read_frame_header(frame[:FRAME_HEADER_SIZE]).frame_type)
    if twin is None:
        raise ValueError("the frame is signed already")
    return b"".join(
        (
            frame[:3],
            bytes((twin,)),
            bytes(SIGNATURE_SIZE),
            memoryview(frame)[FRAME_HEADER_SIZE + TAG_SIZE :],
        )
    )


def read_frame_header(frame: bytes) -> FrameHeader:
    """Parse and check a frame's header.

    Raises:
        DecodeError: too short, wrong magic, unsupported version or unknown type.
    """
    if len(frame) < FRAME_HEADER_SIZE:
        raise DecodeError(f"frame too short ({len(frame)} bytes)")
    if frame[:2] != FRAME_MAGIC:
        raise DecodeError("not a frame of this protocol (bad magic)")
    version, frame_type = frame[2], frame[3]
    if version != PROTOCOL_VERSION:
        raise DecodeError(
            f"unsupported protocol version {version} (this build speaks {PROTOCOL_VERSION})"
        )
    if frame_type not in _AUTH_SIZES:
        raise DecodeError(f"unknown frame type 0x{frame_type:02x}")
    return FrameHeader(version, frame_type)


def _check_zstd_header(body: bytes) -> int:
    """Check the zstd frame header of a message frame; return its declared content size.

    The canonical zstd frame of this protocol (docs/protocol.md, section 2.1) starts with
    the zstd magic number and its Frame_Header_Descriptor (RFC 8878, 3.1.1.1.1) declares
    the content size, sets Content_Checksum_flag and has a Dictionary_ID_flag of 0.

    Raises:
        DecodeError: any of these is not so, or the header is malformed.
    """
    if len(body) < 5 or body[:4] != ZSTD_MAGIC:
        raise DecodeError("a message frame must hold one zstd frame (bad zstd magic)")
    descriptor = body[4]
    try:
        size = zstandard.frame_content_size(body)
    except zstandard.ZstdError as exc:
        raise DecodeError(f"bad zstd frame: {exc}") from None
    if size < 0:
        raise DecodeError("zstd frame must declare its content size")
    if not descriptor & _CONTENT_CHECKSUM_FLAG:
        raise DecodeError("zstd frame must carry a content checksum")
    if descriptor & _DICTIONARY_ID_FLAG:
        raise DecodeError("zstd frame must not name a dictionary")
    return int(size)


def _reject_ext(code: int, data: bytes) -> Any:
    raise DecodeError(f"msgpack extension types are not allowed (type {code})")


class Codec:
    """Encodes messages to frames and decodes frames back, within limits.

    Args:
        level: zstd compression level, 1 to 3 (3 by default; higher levels are too slow
            for the training loop and are refused).
        limits: decoder bounds; the defaults suit trusted peers and model sizes up to
            tens of MB. Also applied to :meth:`encode` so nothing is sent that a peer
            with the same limits would refuse.

    A codec is safe to share between threads.
    """

    def __init__(self, *, level: int = 3, limits: DecodeLimits | None = None) -> None:
        if not 1 <= level <= 3:
            raise ValueError(f"zstd level must be 1, 2 or 3, not {level}")
        self.level = level
        self.limits = limits or DecodeLimits()
        self._local = threading.local()

    def _compressor(self) -> zstandard.ZstdCompressor:
        comp = getattr(self._local, "comp", None)
        if comp is None:
            comp = zstandard.ZstdCompressor(
                level=self.level, write_checksum=True, write_content_size=True
            )
            self._local.comp = comp
        return comp

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        dec = getattr(self._local, "dec", None)
        if dec is None:
            dec = zstandard.ZstdDecompressor()
            self._local.dec = dec
        return dec

    # -- encode ------------------------------------------------------------------------

    def envelope(self, message: Message) -> dict[str, Any]:
        """The envelope map of ``message`` before packing (for tools and tests)."""
        body = message.body.model_dump(mode="python", exclude={"kind"})
        return {
            "v": PROTOCOL_VERSION,
            "kind": message.kind,
            "fleet": message.fleet,
            "round": message.round,
            "sender": message.sender,
            "id": bytes.fromhex(message.message_id),
            "ts": message.sent_at_ms,
            "body": body,
        }

    def pack(self, message: Message) -> bytes:
        """The uncompressed msgpack envelope of ``message``."""
        try:
            return msgpack.packb(self.envelope(message), use_bin_type=True)  # type: ignore[no-any-return]
        except (TypeError, ValueError, OverflowError) as exc:
            raise EncodeError(f"cannot pack {message.kind} message: {exc}") from exc

    def encode(self, message: Message) -> bytes:
        """Encode one message as a message frame (with a zero tag: see protocol.auth).

        Raises:
            EncodeError: the message is larger than ``limits.max_message_bytes`` (or
                its frame than ``limits.max_frame_bytes``) or holds unpackable values.
        """
        packed = self.pack(message)
        if len(packed) > self.limits.max_message_bytes:
            raise EncodeError(
                f"{message.kind} message is {len(packed)} bytes, "
                f"limit {self.limits.max_message_bytes}"
            )
        header = FRAME_MAGIC + bytes((PROTOCOL_VERSION, FRAME_MESSAGE)) + bytes(TAG_SIZE)
        frame = header + self._compressor().compress(packed)
        if len(frame) > self.limits.max_frame_bytes:
            raise EncodeError(f"frame is {len(frame)} bytes, limit {self.limits.max_frame_bytes}")
        return frame

    # -- decode ------------------------------------------------------------------------

    def decompress(self, frame: bytes) -> bytes:
        """Check a message frame's header and size and return its msgpack envelope.

        Raises:
            DecodeError: a bad header, a chunk frame, more than ``max_frame_bytes``,
                not a zstd frame (a skippable frame, say), a zstd frame without content
                size or content checksum or with a dictionary id, one larger than
                ``max_message_bytes``, corrupt, failing its checksum, or followed by
                trailing bytes.
        """
        limits = self.limits
        if len(frame) > limits.max_frame_bytes:
            raise DecodeError(f"frame is {len(frame)} bytes, limit {limits.max_frame_bytes}")
        header = read_frame_header(frame)
        if header.chunk:
            raise DecodeError("a chunk frame must be reassembled before decoding")
        prefix = FRAME_HEADER_SIZE + auth_size(header.frame_type)
        if len(frame) < prefix:
            raise DecodeError(f"message frame too short ({len(frame)} bytes)")
        body = frame[prefix:]
        size = _check_zstd_header(body)
        if size > limits.max_message_bytes:
            raise DecodeError(
                f"message would decompress to {size} bytes, limit {limits.max_message_bytes}"
            )
        try:
            raw = self._decompressor().decompress(
                body, max_output_size=size, allow_extra_data=False
            )
        except zstandard.ZstdError as exc:
            raise DecodeError(f"bad zstd frame: {exc}") from None
        if len(raw) != size:
            raise DecodeError("zstd frame content size does not match its data")
        return raw

    def unpack(self, raw: bytes) -> dict[str, Any]:
        """Unpack a msgpack envelope within limits and check its top-level shape."""
        limits = self.limits
        try:
            env = msgpack.unpackb(
                raw,
                raw=False,
                use_list=True,
                strict_map_key=True,
                max_str_len=limits.max_message_bytes,
                max_bin_len=limits.max_message_bytes,
                max_array_len=limits.max_array_len,
                max_map_len=limits.max_map_len,
                max_ext_len=0,
                ext_hook=_reject_ext,
            )
        except DecodeError:
            raise
        except Exception as exc:  # msgpack raises many types (ValueError, ExtraData, ...)
            raise DecodeError(f"bad msgpack envelope: {type(exc).__name__}: {exc}") from None
        if not isinstance(env, dict) or set(env) != _ENVELOPE_KEYS:
            raise DecodeError(f"envelope must be a map with keys {sorted(_ENVELOPE_KEYS)}")
        if env["v"] != PROTOCOL_VERSION or isinstance(env["v"], bool):
            raise DecodeError(
                f"unsupported protocol version {env['v']!r} (this build speaks {PROTOCOL_VERSION})"
            )
        if env["kind"] not in BODY_KINDS:
            raise DecodeError(f"unknown message kind {env['kind']!r}")
        if not isinstance(env["body"], dict) or "kind" in env["body"]:
            raise DecodeError("body must be a map without a 'kind' key")
        if not isinstance(env["id"], bytes) or len(env["id"]) != 16:
            raise DecodeError("message id must be 16 bytes")
        return env

    def decode(self, frame: bytes) -> Message:
        """Decode one message frame.

        Raises:
            DecodeError: anything wrong with the frame, the envelope, the body or its
                tensors, or a bound of ``limits`` exceeded. Nothing partial is returned.
        """
        return self.decode_envelope(self.decompress(frame))

    def decode_envelope(self, raw: bytes) -> Message:
        """Decode a decompressed msgpack envelope (what :meth:`decompress` returns).

        Raises:
            DecodeError: as :meth:`decode`. Where the envelope itself was sound, the
                error's ``message_id`` and ``round`` name the message.
        """
        env = self.unpack(raw)
        try:
            return self._validate(env)
        except DecodeError as exc:  # name the message, so a receiver can reject it by id
            exc.message_id = env["id"].hex()
            number = env["round"]
            if isinstance(number, int) and not isinstance(number, bool) and -1 <= number < 2**31:
                exc.round = number
            raise

    def _validate(self, env: dict[str, Any]) -> Message:
        self._precheck_counts(env["body"])
        kind = env["kind"]
        candidate = {
            "fleet": env["fleet"],
            "sender": env["sender"],
            "round": env["round"],
            "message_id": env["id"].hex(),
            "sent_at_ms": env["ts"],
            "body": {"kind": kind, **env["body"]},
        }
        try:
            message = Message.model_validate(
                candidate, strict=False, context={"limits": self.limits}
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise DecodeError(f"invalid {kind} message: {where}: {first['msg']}") from None
        self._check_total_elements(message)
        return message

    def _precheck_counts(self, body: dict[str, Any]) -> None:
        """Refuse too many sets or tensors before any of them is validated."""
        sets = body.get("sets")
        if not isinstance(sets, dict):
            return
        if len(sets) > self.limits.max_tensor_sets:
            raise DecodeError(f"{len(sets)} tensor sets, limit {self.limits.max_tensor_sets}")
        count = sum(
            len(s["tensors"])
            for s in sets.values()
            if isinstance(s, dict) and isinstance(s.get("tensors"), list)
        )
        if count > self.limits.max_tensors:
            raise DecodeError(f"{count} tensors, limit {self.limits.max_tensors}")

    def _check_total_elements(self, message: Message) -> None:
        """Set and tensor counts were checked before validation; elements need shapes."""
        elements = sum(s.numel for s in message.tensor_sets().values())
        limit = self.limits.max_total_elements
        if elements > limit:
            raise DecodeError(f"{elements} elements in total, limit {limit}")
