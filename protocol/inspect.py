"""Summaries of captured payloads, for ``python -m protocol inspect``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import zstandard

from protocol.chunking import Reassembler, chunk_header_size, read_chunk_header
from protocol.codec import (
    FRAME_CHUNK,
    FRAME_HEADER_SIZE,
    FRAME_MAGIC,
    FRAME_SIGNED_CHUNK,
    Codec,
    auth_size,
    read_frame_header,
)
from protocol.errors import DecodeError
from protocol.limits import DecodeLimits
from protocol.messages import Message
from protocol.tensors import EncodedTensor

__all__ = ["bytes_after_frame", "json_values", "summarize", "summarize_message"]


def json_values(tensor: EncodedTensor) -> Any:
    """A tensor's decoded values (dequantized for integer encodings) as JSON-ready nested
    lists of its shape (a bare number for a scalar). Non-finite floats become the strings
    ``"nan"``, ``"inf"`` and ``"-inf"``, so the output stays strict JSON."""
    return _finite_or_text(tensor.to_array().tolist())


def _finite_or_text(value: Any) -> Any:
    if isinstance(value, list):
        return [_finite_or_text(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _tensor_summary(tensor: EncodedTensor, values: bool) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "name": tensor.name,
        "shape": list(tensor.shape),
        "dtype": tensor.dtype,
        "encoding": tensor.encoding.value,
        "shuffled": tensor.shuffled,
        "bytes": tensor.nbytes,
    }
    if values:
        summary["values"] = json_values(tensor)
    return summary


def summarize_message(
    message: Message, frame_bytes: int, envelope_bytes: int, *, values: bool = False
) -> dict[str, Any]:
    """A JSON-ready summary of a decoded message.

    Tensor values are left out unless ``values`` is true; then each tensor gets
    ``values`` (see :func:`json_values`): a delta set's values are the delta as sent.
    """
    body = message.body.model_dump(mode="json", exclude={"kind", "sets"})
    sets = {
        name: {
            "mode": s.mode,
            "base": s.base,
            "bytes": s.nbytes,
            "tensors": [_tensor_summary(t, values) for t in s],
        }
        for name, s in message.tensor_sets().items()
    }
    summary: dict[str, Any] = {
        "frame": "message",
        "kind": message.kind,
        "fleet": message.fleet,
        "round": message.round,
        "sender": message.sender,
        "message_id": message.message_id,
        "sent_at_ms": message.sent_at_ms,
        "frame_bytes": frame_bytes,
        "envelope_bytes": envelope_bytes,
        "body": body,
    }
    if sets:
        summary["tensor_sets"] = sets
    return summary


def _zstd_frame_end(body: bytes) -> int | None:
    """The length of the zstd frame ``body`` starts with, walked block by block (RFC
    8878, 3.1.1: header, blocks up to the one marked last, the optional checksum); None
    where it is malformed or cut short (the decoder says why)."""
    try:
        end = zstandard.frame_header_size(body)
        checksum = zstandard.get_frame_parameters(body).has_checksum
    except zstandard.ZstdError:
        return None
    while True:
        if end + 3 > len(body):
            return None
        block = int.from_bytes(body[end : end + 3], "little")
        kind = (block >> 1) & 3
        if kind == 3:  # reserved
            return None
        end += 3 + (1 if kind == 1 else block >> 3)  # an RLE block holds one byte
        if block & 1:  # the last block
            break
    end += 4 if checksum else 0
    return end if end <= len(body) else None


def _next_chunk_of(payload: bytes, transfer_id: bytes, start: int) -> int | None:
    """Where a chunk frame of the transfer ``transfer_id`` begins in ``payload`` at or
    after ``start`` (a chunk file appended to another of its transfer), or None."""
    position = payload.find(FRAME_MAGIC, start)
    while position >= 0:
        frame_type = payload[position + 3] if position + 3 < len(payload) else -1
        if frame_type in (FRAME_CHUNK, FRAME_SIGNED_CHUNK):
            offset = position + FRAME_HEADER_SIZE + auth_size(frame_type)
            if payload[offset : offset + len(transfer_id)] == transfer_id:
                return position
        position = payload.find(FRAME_MAGIC, position + 1)
    return None


def bytes_after_frame(payload: bytes) -> int | None:
    """How many bytes of ``payload`` follow its first frame: 0 for one whole frame, None
    where the excess is certain but its size cannot be told.

    A message frame ends where its zstd frame ends. A chunk frame's length is in no
    header (docs/protocol.md, section 2.2), so it is told where it can be: another
    chunk of the same transfer following it (chunk files concatenated) ends it there;
    otherwise a chunk holding more data than its whole transfer (its total size) has
    bytes after its frame, of unknown size (None). A malformed payload counts as one
    frame here: decoding it says what is wrong.
    """
    try:
        header = read_frame_header(payload)
    except DecodeError:
        return 0
    prefix = FRAME_HEADER_SIZE + auth_size(header.frame_type)
    if not header.chunk:
        end = _zstd_frame_end(payload[prefix:])
        return 0 if end is None else len(payload) - prefix - end
    try:
        chunk = read_chunk_header(payload)
    except DecodeError:
        return 0
    size = chunk_header_size(header.frame_type)
    following = _next_chunk_of(payload, chunk.transfer_id, size)
    if following is not None:
        return len(payload) - following
    return None if len(payload) - size > chunk.total_size else 0


def _one_frame_each(payloads: Sequence[bytes], names: Sequence[str] | None) -> None:
    """Refuse a payload holding more than one frame (two files concatenated)."""
    for number, payload in enumerate(payloads):
        extra = bytes_after_frame(payload)
        if extra == 0:
            continue
        name = names[number] if names is not None else f"payload {number + 1}"
        if extra is None:
            chunk = read_chunk_header(payload)
            data = len(payload) - chunk_header_size(read_frame_header(payload).frame_type)
            raise DecodeError(
                f"{name} holds more than one frame: {data} bytes of chunk data, more than "
                f"its whole transfer ({chunk.total_size} bytes); one payload per file"
            )
        raise DecodeError(f"{name} holds {extra} bytes after its frame: one payload per file")


def summarize(
    payloads: Sequence[bytes],
    limits: DecodeLimits | None = None,
    *,
    values: bool = False,
    names: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Summarize one captured payload, or the chunks of one transfer.

    One chunk on its own is summarized as a chunk (its header); the complete set of
    chunks of a transfer (any order) is reassembled and decoded. ``values`` adds every
    tensor's decoded values (see :func:`summarize_message`). Each payload must hold one
    frame (:func:`bytes_after_frame`); ``names`` (one per payload, such as the files
    they were read from) name the one that does not.

    Raises:
        DecodeError: anything malformed, a payload holding more than one frame,
            incomplete sets of chunks with more than one payload, or payloads of
            different transfers.
    """
    if not payloads:
        raise DecodeError("nothing to inspect")
    _one_frame_each(payloads, names)
    codec = Codec(limits=limits)
    first = read_frame_header(payloads[0])
    if len(payloads) == 1 and first.chunk:
        head = read_chunk_header(payloads[0])
        return {
            "frame": "signed chunk" if first.signed else "chunk",
            "transfer_id": head.transfer_id.hex(),
            "index": head.index,
            "count": head.count,
            "total_size": head.total_size,
            "sha256": head.sha256.hex(),
            "data_bytes": len(payloads[0]) - chunk_header_size(first.frame_type),
        }
    reassembler = Reassembler()
    frames = [f for p in payloads if (f := reassembler.feed("inspect", p)) is not None]
    if len(frames) != 1 or reassembler.pending_transfers:
        raise DecodeError("give one message frame, or all chunks of one transfer")
    frame = frames[0]
    raw = codec.decompress(frame)
    message = codec.decode_envelope(raw)
    return summarize_message(message, len(frame), len(raw), values=values)
