"""Bounds every decoder in the package enforces on untrusted bytes.

Set these when you decode input from a source you do not trust (every device, as far
as the coordinator is concerned). Each bound is proven by ``tests/protocol/test_limits.py``.
A violated bound raises :class:`protocol.errors.DecodeError` before any memory in
proportion to the claimed size is allocated.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ALL_DTYPES", "DecodeLimits", "ReassemblyLimits"]

MiB = 1024 * 1024

ALL_DTYPES: frozenset[str] = frozenset(
    {"float32", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"}
)
"""Element types a tensor may decode to (``dtype`` field on the wire)."""


class DecodeLimits(BaseModel):
    """Limits of :class:`protocol.codec.Codec` when it decodes one message frame."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_frame_bytes: int = Field(64 * MiB, ge=16)
    """Largest compressed frame accepted (after chunk reassembly), in bytes."""
    max_message_bytes: int = Field(64 * MiB, ge=16)
    """Largest decompressed envelope (zstd bomb guard), in bytes."""
    max_tensors: int = Field(4096, ge=0)
    """Most tensors in one message, over all its tensor sets."""
    max_tensor_sets: int = Field(16, ge=0)
    """Most named tensor sets in one message."""
    max_dims: int = Field(8, ge=0)
    """Most dimensions of one tensor."""
    max_elements: int = Field(1 << 27, ge=0)
    """Most elements in one tensor (134 M)."""
    max_total_elements: int = Field(1 << 28, ge=0)
    """Most elements in one message, all tensors together."""
    max_name_bytes: int = Field(256, ge=1)
    """Longest tensor name, in UTF-8 bytes."""
    max_array_len: int = Field(65536, ge=8)
    """Longest msgpack array (shapes, label counts, tensor lists)."""
    max_map_len: int = Field(1024, ge=8)
    """Largest msgpack map (hyperparameters, metrics)."""
    allowed_dtypes: frozenset[str] = ALL_DTYPES
    """Element types a tensor may decode to; anything else is rejected."""


class ReassemblyLimits(BaseModel):
    """Limits of :class:`protocol.chunking.Reassembler`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_transfer_bytes: int = Field(64 * MiB, ge=1)
    """Largest total size a chunked transfer may announce, in bytes."""
    max_chunks: int = Field(65536, ge=1)
    """Most chunks one transfer may announce."""
    max_pending_transfers: int = Field(64, ge=1)
    """Most incomplete transfers buffered at once (all sources together)."""
    max_pending_bytes: int = Field(256 * MiB, ge=1)
    """Most chunk bytes buffered at once, all incomplete transfers together."""
    max_source_transfers: int = Field(4, ge=1)
    """Most incomplete transfers buffered for one source (one topic, so one device): a
    new transfer beyond it evicts that source's oldest, never another source's."""
    max_source_bytes: int = Field(64 * MiB, ge=1)
    """Most chunk bytes buffered for one source: a chunk beyond it evicts that source's
    older transfers, or is refused (its transfer dropped) when its own is too big."""
    timeout_s: float = Field(120.0, gt=0)
    """An incomplete transfer with no new chunk for this long is dropped (seconds)."""
    max_transfer_age_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    """A new transfer whose id says it was sent longer ago than this, by the receiver's
    clock, is ignored (a replay); None: no such window (a device, whose clock may not be
    the coordinator's). The coordinator sets its replay window."""
    remember_dropped: int = Field(1024, ge=1)
    """How many dropped transfers (refused, evicted, replayed) are remembered, so their
    later chunks are ignored, one error per transfer. (Chunks of a completed transfer
    need no such memory: its send time is at most the newest completed from its
    source.)"""
