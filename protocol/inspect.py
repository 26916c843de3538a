"""Summaries of captured payloads, for ``python -m protocol inspect``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from protocol.chunking import Reassembler, chunk_header_size, read_chunk_header
from protocol.codec import Codec, read_frame_header
from protocol.errors import DecodeError
from protocol.limits import DecodeLimits
from protocol.messages import Message
from protocol.tensors import EncodedTensor

__all__ = ["json_values", "summarize", "summarize_message"]


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


def summarize(
    payloads: Sequence[bytes], limits: DecodeLimits | None = None, *, values: bool = False
) -> dict[str, Any]:
    """Summarize one captured payload, or the chunks of one transfer.

    One chunk on its own is summarized as a chunk (its header); the complete set of
    chunks of a transfer (any order) is reassembled and decoded. ``values`` adds every
    tensor's decoded values (see :func:`summarize_message`).

    Raises:
        DecodeError: anything malformed, incomplete sets of chunks with more than one
            payload, or payloads of different transfers.
    """
    if not payloads:
        raise DecodeError("nothing to inspect")
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
