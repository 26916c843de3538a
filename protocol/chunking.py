"""Chunking of large frames and their idempotent, bounded reassembly.

A frame larger than the maximum payload (default 128 KiB, the AWS IoT Core limit; or
what an MQTT 5 broker negotiates) is split into chunk frames, each a 68-byte header
followed by a slice of the original frame. The maximum bounds whole chunk frames, header
included: each chunk but the last carries ``max_payload - 68`` data bytes::

    offset  size  field
    0       4     frame header: b"FL", version, type 0x02 (see protocol.codec)
    4       16    transfer id (random)
    20      4     chunk index, uint32 big-endian, 0-based
    24      4     chunk count, uint32 big-endian, >= 2
    28      8     total size of the original frame, uint64 big-endian
    36      32    SHA-256 of the original frame
    68      ...   the slice: bytes [index * n, index * n + len) of the original frame,
                  n being the length of every chunk but the last

Chunks travel on the topic the whole frame would have used. :class:`Reassembler` takes
frames in any order, ignores duplicates and redeliveries (also after completion),
bounds the memory it holds, drops transfers that stall, and checks the SHA-256.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol.codec import FRAME_CHUNK, FRAME_HEADER_SIZE, FRAME_MAGIC, read_frame_header
from protocol.errors import DecodeError, EncodeError
from protocol.limits import ReassemblyLimits
from protocol.messages import PROTOCOL_VERSION

__all__ = [
    "CHUNK_HEADER_SIZE",
    "DEFAULT_MAX_PAYLOAD",
    "ChunkHeader",
    "Reassembler",
    "read_chunk_header",
    "split_frame",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_PAYLOAD = 128 * 1024
"""Default largest MQTT payload in bytes (AWS IoT Core's message size limit)."""

_CHUNK_FIELDS = struct.Struct(">16sIIQ32s")
CHUNK_HEADER_SIZE = FRAME_HEADER_SIZE + _CHUNK_FIELDS.size  # 68


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """The fixed fields of one chunk frame."""

    transfer_id: bytes
    index: int
    count: int
    total_size: int
    sha256: bytes


def split_frame(
    frame: bytes, max_payload: int = DEFAULT_MAX_PAYLOAD, *, transfer_id: bytes | None = None
) -> list[bytes]:
    """Split a frame into chunk frames of at most ``max_payload`` bytes each.

    ``max_payload`` includes the 68-byte chunk header (:data:`CHUNK_HEADER_SIZE`): every
    chunk but the last carries ``max_payload - 68`` data bytes, the last the rest.
    Returns ``[frame]`` unchanged when it already fits (``len(frame) <= max_payload``).

    Raises:
        EncodeError: ``max_payload`` leaves no room for data after the chunk header.
    """
    if len(frame) <= max_payload:
        return [frame]
    room = max_payload - CHUNK_HEADER_SIZE
    if room < 1:
        raise EncodeError(f"max payload {max_payload} is too small to carry chunks")
    tid = transfer_id if transfer_id is not None else os.urandom(16)
    if len(tid) != 16:
        raise EncodeError("transfer id must be 16 bytes")
    count = math.ceil(len(frame) / room)
    digest = hashlib.sha256(frame).digest()
    header = FRAME_MAGIC + bytes((PROTOCOL_VERSION, FRAME_CHUNK))
    view = memoryview(frame)
    return [
        header
        + _CHUNK_FIELDS.pack(tid, i, count, len(frame), digest)
        + view[i * room : (i + 1) * room]
        for i in range(count)
    ]


def read_chunk_header(frame: bytes) -> ChunkHeader:
    """Parse a chunk frame's header (the frame header must say type 0x02).

    Raises:
        DecodeError: not a chunk frame, too short, or inconsistent index / count.
    """
    if read_frame_header(frame).frame_type != FRAME_CHUNK:
        raise DecodeError("not a chunk frame")
    if len(frame) < CHUNK_HEADER_SIZE:
        raise DecodeError(f"chunk frame too short ({len(frame)} bytes)")
    tid, index, count, total, digest = _CHUNK_FIELDS.unpack_from(frame, FRAME_HEADER_SIZE)
    if count < 2 or index >= count:
        raise DecodeError(f"bad chunk index {index} of {count}")
    return ChunkHeader(tid, index, count, total, digest)


@dataclass
class _Transfer:
    header: ChunkHeader
    parts: dict[int, bytes] = field(default_factory=dict)
    size: int = 0
    touched: float = 0.0


class Reassembler:
    """Collects chunk frames per (source, transfer id) and returns complete frames.

    ``source`` is any key naming where frames come from (the MQTT topic, which holds
    the sender's device id), so two senders cannot interfere with one transfer.

    Not thread-safe: feed it from one thread (the transport's handler thread).
    """

    def __init__(
        self,
        limits: ReassemblyLimits | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits or ReassemblyLimits()
        self._clock = clock
        self._pending: OrderedDict[tuple[str, bytes], _Transfer] = OrderedDict()
        self._done: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self._pending_bytes = 0

    @property
    def pending_transfers(self) -> int:
        """Incomplete transfers held now."""
        return len(self._pending)

    @property
    def pending_bytes(self) -> int:
        """Chunk data bytes held now."""
        return self._pending_bytes

    def feed(self, source: str, frame: bytes) -> bytes | None:
        """Take one frame; return a complete frame when one is ready, else None.

        A message frame is returned as it is, every time (duplicate whole messages are
        recognised by their message id, a level up). A chunk frame is stored; the call that
        completes its transfer returns the reassembled frame, once. Duplicates and
        redeliveries of chunks (even of a completed transfer) return None.

        Raises:
            DecodeError: a malformed chunk, one inconsistent with earlier chunks of its
                transfer, one over a limit (state unchanged), or a completed transfer
                whose SHA-256 does not match (that transfer is dropped).
        """
        self.expire()
        if read_frame_header(frame).frame_type != FRAME_CHUNK:
            return frame
        head = read_chunk_header(frame)
        data = frame[CHUNK_HEADER_SIZE:]
        key = (source, head.transfer_id)
        if key in self._done:
            return None
        transfer = self._pending.get(key)
        if transfer is None:
            self._check_new(head)
            transfer = _Transfer(head)
        elif (head.count, head.total_size, head.sha256) != (
            transfer.header.count,
            transfer.header.total_size,
            transfer.header.sha256,
        ):
            raise DecodeError("chunk disagrees with earlier chunks of its transfer")
        if head.index in transfer.parts:
            return None
        if transfer.size + len(data) > head.total_size:
            raise DecodeError("chunks carry more bytes than the transfer's total size")
        if self._pending_bytes + len(data) > self.limits.max_pending_bytes:
            raise DecodeError(
                f"reassembly buffer full ({self._pending_bytes} bytes pending, "
                f"limit {self.limits.max_pending_bytes})"
            )
        transfer.parts[head.index] = data
        transfer.size += len(data)
        transfer.touched = self._clock()
        self._pending_bytes += len(data)
        self._pending[key] = transfer
        self._pending.move_to_end(key)
        if len(transfer.parts) < head.count:
            return None
        return self._complete(key, transfer)

    def _check_new(self, head: ChunkHeader) -> None:
        limits = self.limits
        if head.count > limits.max_chunks:
            raise DecodeError(f"transfer of {head.count} chunks, limit {limits.max_chunks}")
        if head.total_size > limits.max_transfer_bytes:
            raise DecodeError(
                f"transfer of {head.total_size} bytes, limit {limits.max_transfer_bytes}"
            )
        if head.total_size < head.count:
            raise DecodeError("transfer total size is smaller than its chunk count")
        if len(self._pending) >= limits.max_pending_transfers:
            raise DecodeError(
                f"{len(self._pending)} transfers pending, limit {limits.max_pending_transfers}"
            )

    def _complete(self, key: tuple[str, bytes], transfer: _Transfer) -> bytes:
        self._forget(key, transfer)
        if transfer.size != transfer.header.total_size:
            raise DecodeError(
                f"transfer carried {transfer.size} bytes, announced {transfer.header.total_size}"
            )
        frame = b"".join(transfer.parts[i] for i in range(transfer.header.count))
        if hashlib.sha256(frame).digest() != transfer.header.sha256:
            raise DecodeError("reassembled frame fails its SHA-256 check")
        self._remember(key)
        return frame

    def _forget(self, key: tuple[str, bytes], transfer: _Transfer) -> None:
        del self._pending[key]
        self._pending_bytes -= transfer.size

    def _remember(self, key: tuple[str, bytes]) -> None:
        if self.limits.remember_completed == 0:
            return
        self._done[key] = None
        while len(self._done) > self.limits.remember_completed:
            self._done.popitem(last=False)

    def expire(self) -> int:
        """Drop incomplete transfers idle for longer than the timeout; return how many."""
        deadline = self._clock() - self.limits.timeout_s
        stale = [k for k, t in self._pending.items() if t.touched < deadline]
        for key in stale:
            transfer = self._pending[key]
            log.warning(
                "dropping incomplete transfer %s from %s (%d of %d chunks)",
                key[1].hex(),
                key[0],
                len(transfer.parts),
                transfer.header.count,
            )
            self._forget(key, transfer)
        return len(stale)
