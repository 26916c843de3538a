"""Chunking of large frames and their idempotent, bounded reassembly.

A frame larger than the maximum payload (default 128 KiB, the AWS IoT Core limit; or
what an MQTT 5 broker negotiates) is split into chunk frames, each a 100-byte header
followed by a slice of the original frame. The maximum bounds whole chunk frames, header
included: each chunk but the last carries ``max_payload - 100`` data bytes::

    offset  size  field
    0       4     frame header: b"FL", version, type 0x02 (see protocol.codec)
    4       32    authentication tag of this chunk frame (protocol.auth; zeros unsealed)
    36      16    transfer id: its send time (uint64 big-endian Unix milliseconds,
                  strictly increasing per sender) then 8 random bytes
    52      4     chunk index, uint32 big-endian, 0-based
    56      4     chunk count, uint32 big-endian, >= 2
    60      8     total size of the original frame, uint64 big-endian
    68      32    SHA-256 of the original frame
    100     ...   the slice: bytes [index * n, index * n + len) of the original frame,
                  n being the length of every chunk but the last

A signed message frame (type 0x03, fleet-wide topics) splits into signed chunks (type
0x04): the same fields after a 64-byte signature instead of the tag, so every offset
above moves by 32 and the header is 132 bytes (:func:`chunk_header_size`).

Chunks travel on the topic the whole frame would have used. Every chunk carries its own
tag, so a receiver with keys refuses a forged chunk before it takes any buffer: only the
device itself can start a transfer on its topic (protocol version 5). :class:`Reassembler` takes
frames in any order, ignores duplicates and redeliveries (also after completion),
bounds the memory it holds, drops transfers that stall, and checks the SHA-256.

The send time in the transfer id (protocol version 7) orders one source's transfers, so
genuine chunks recorded earlier and replayed cannot displace a newer transfer: a
transfer sent before the newest one completed from its source is ignored, and a source
over its quota loses its transfers sent first (a replayed one, never the newer genuine
transfer in flight). A receiver may also ignore transfers older than a window by its
own clock (``ReassemblyLimits.max_transfer_age_s``; the coordinator's replay window).

Memory is bounded per source (the topic, so one device) as well as in total, so that
one source cannot starve the others: a source over its quota of transfers or bytes
loses its own transfers sent first; when the total is full the source holding the most
loses its oldest. An ``admit`` hook can refuse a source any buffer at all (a
coordinator admits only the update topics of registered devices). A refused or evicted
transfer is remembered, so its later chunks are dropped silently: one error per
transfer, never one per chunk.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol.codec import (
    FRAME_CHUNK,
    FRAME_HEADER_SIZE,
    FRAME_MAGIC,
    FRAME_SIGNED_CHUNK,
    FRAME_SIGNED_MESSAGE,
    MESSAGE_PREFIX_SIZE,
    auth_size,
    read_frame_header,
)
from protocol.errors import DecodeError, EncodeError, QuotaError
from protocol.limits import ReassemblyLimits
from protocol.messages import PROTOCOL_VERSION

__all__ = [
    "CHUNK_HEADER_SIZE",
    "DEFAULT_MAX_PAYLOAD",
    "ChunkHeader",
    "Reassembler",
    "SourceFilter",
    "chunk_header_size",
    "read_chunk_header",
    "split_frame",
    "transfer_sent_ms",
]

SourceFilter = Callable[[str], bool]
"""Whether a source (a topic) may hold incomplete transfers at all."""

log = logging.getLogger(__name__)

DEFAULT_MAX_PAYLOAD = 128 * 1024
"""Default largest MQTT payload in bytes (AWS IoT Core's message size limit)."""

_CHUNK_FIELDS = struct.Struct(">16sIIQ32s")
CHUNK_HEADER_SIZE = MESSAGE_PREFIX_SIZE + _CHUNK_FIELDS.size  # 100: header, tag, fields
"""The header of a chunk frame (type 0x02); a signed chunk's (0x04) is 32 bytes longer."""


class _TransferClock:
    """Send times of this process's transfers: Unix milliseconds, strictly increasing
    (two transfers started in one millisecond take the next one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = 0

    def next_ms(self) -> int:
        with self._lock:
            self._last = max(time.time_ns() // 1_000_000, self._last + 1)
            return self._last


_TRANSFER_CLOCK = _TransferClock()


def new_transfer_id() -> bytes:
    """A fresh transfer id: this process's next send time (u64 BE Unix ms) then 8
    random bytes."""
    return _TRANSFER_CLOCK.next_ms().to_bytes(8, "big") + os.urandom(8)


def transfer_sent_ms(transfer_id: bytes) -> int:
    """The send time (Unix milliseconds) a transfer id carries."""
    return int.from_bytes(transfer_id[:8], "big")


def chunk_header_size(frame_type: int) -> int:
    """The header size of a chunk frame of ``frame_type``: 100 (0x02) or 132 (0x04)."""
    return FRAME_HEADER_SIZE + auth_size(frame_type) + _CHUNK_FIELDS.size


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

    ``max_payload`` includes the 100-byte chunk header (:data:`CHUNK_HEADER_SIZE`): every
    chunk but the last carries ``max_payload - 100`` data bytes, the last the rest.
    Returns ``[frame]`` unchanged when it already fits (``len(frame) <= max_payload``).
    The transfer id is a fresh one (:func:`new_transfer_id`) unless ``transfer_id`` is
    given (a sender that sends the same transfer again).
    Each chunk's tag is zero bytes: a sender with a key seals every chunk
    (:func:`protocol.auth.seal`), as it sealed the message frame. A signed message frame
    (type 0x03) splits into signed chunks (0x04, 132-byte header, zero signature: the
    sender signs each, :class:`protocol.signing.SigningKey`).

    Raises:
        EncodeError: ``max_payload`` leaves no room for data after the chunk header.
    """
    if len(frame) <= max_payload:
        return [frame]
    signed = frame[3:4] == bytes((FRAME_SIGNED_MESSAGE,))  # the type byte, as it is
    chunk_type = FRAME_SIGNED_CHUNK if signed else FRAME_CHUNK
    header_size = chunk_header_size(chunk_type)
    room = max_payload - header_size
    if room < 1:
        raise EncodeError(f"max payload {max_payload} is too small to carry chunks")
    tid = transfer_id if transfer_id is not None else new_transfer_id()
    if len(tid) != 16:
        raise EncodeError("transfer id must be 16 bytes")
    count = math.ceil(len(frame) / room)
    digest = hashlib.sha256(frame).digest()
    header = FRAME_MAGIC + bytes((PROTOCOL_VERSION, chunk_type)) + bytes(auth_size(chunk_type))
    view = memoryview(frame)
    return [
        header
        + _CHUNK_FIELDS.pack(tid, i, count, len(frame), digest)
        + view[i * room : (i + 1) * room]
        for i in range(count)
    ]


def read_chunk_header(frame: bytes) -> ChunkHeader:
    """Parse a chunk frame's header (the frame header must say type 0x02 or 0x04).

    Raises:
        DecodeError: not a chunk frame, too short, or inconsistent index / count.
    """
    header = read_frame_header(frame)
    if not header.chunk:
        raise DecodeError("not a chunk frame")
    frame_type = header.frame_type
    if len(frame) < chunk_header_size(frame_type):
        raise DecodeError(f"chunk frame too short ({len(frame)} bytes)")
    offset = FRAME_HEADER_SIZE + auth_size(frame_type)
    tid, index, count, total, digest = _CHUNK_FIELDS.unpack_from(frame, offset)
    if count < 2 or index >= count:
        raise DecodeError(f"bad chunk index {index} of {count}")
    return ChunkHeader(tid, index, count, total, digest)


@dataclass
class _Transfer:
    header: ChunkHeader
    parts: dict[int, bytes] = field(default_factory=dict)
    size: int = 0
    touched: float = 0.0


Key = tuple[str, bytes]

SOURCES_REMEMBERED = 1 << 17
"""Sources whose newest completed transfer a :class:`Reassembler` remembers (131,072: a
fleet of 10,000 devices with room to spare; about 15 MB at most)."""


def _sent(key: Key) -> int:
    return transfer_sent_ms(key[1])


class Reassembler:
    """Collects chunk frames per (source, transfer id) and returns complete frames.

    ``source`` is any key naming where frames come from (the MQTT topic, which holds
    the sender's device id), so two senders cannot interfere with one transfer, and
    each source has its own quota (``max_source_transfers``, ``max_source_bytes``).

    Args:
        limits: the bounds (defaults when None).
        clock: monotonic seconds, for the stall timeout.
        wall_clock: Unix seconds, for ``limits.max_transfer_age_s``.
        admit: called with the source of each new transfer; False refuses it any
            buffer (:class:`~protocol.errors.QuotaError`). None admits every source.

    Not thread-safe: feed it from one thread (the transport's handler thread).
    """

    def __init__(
        self,
        limits: ReassemblyLimits | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        admit: SourceFilter | None = None,
    ) -> None:
        self.limits = limits or ReassemblyLimits()
        self._clock = clock
        self._wall_clock = wall_clock
        self._newest: OrderedDict[str, int] = OrderedDict()
        """Per source, the send time of the newest transfer completed from it (at most
        :data:`SOURCES_REMEMBERED` sources, the least recent forgotten first)."""
        self._admit = admit
        self._pending: OrderedDict[Key, _Transfer] = OrderedDict()
        self._dropped: OrderedDict[Key, None] = OrderedDict()
        """Transfers refused or evicted: their later chunks are ignored."""
        self._pending_bytes = 0
        self._source_bytes: dict[str, int] = {}
        self._source_transfers: dict[str, int] = {}
        self._warned: set[str] = set()
        """Sources whose evictions were logged as a warning (later ones: debug)."""

    @property
    def pending_transfers(self) -> int:
        """Incomplete transfers held now."""
        return len(self._pending)

    @property
    def pending_bytes(self) -> int:
        """Chunk data bytes held now."""
        return self._pending_bytes

    def source_transfers(self, source: str) -> int:
        """Incomplete transfers held now for ``source``."""
        return self._source_transfers.get(source, 0)

    def source_bytes(self, source: str) -> int:
        """Chunk data bytes held now for ``source``."""
        return self._source_bytes.get(source, 0)

    def feed(self, source: str, frame: bytes) -> bytes | None:
        """Take one frame; return a complete frame when one is ready, else None.

        A message frame is returned as it is, every time (duplicate whole messages are
        recognised by their message id, a level up). A chunk frame is stored; the call that
        completes its transfer returns the reassembled frame, once. Duplicates and
        redeliveries of chunks (even of a completed transfer) return None, and so do
        chunks of a transfer refused or evicted earlier.

        Freshness: the first chunk of a transfer sent (by its id's send time) no later
        than the newest transfer completed from its source, before one of its source's
        transfers in flight (a sender starts its transfers in the order it sends them),
        or longer ago than ``limits.max_transfer_age_s`` by the wall clock, is ignored
        (None), and so are its later chunks: a replay never takes a buffer from a newer
        transfer.

        Room: a new transfer over the source's ``max_source_transfers`` evicts that
        source's transfer sent first; one over ``max_pending_transfers`` evicts the
        transfer sent first of the source holding the most. A chunk over the source's
        ``max_source_bytes`` evicts that source's transfers sent before its own, one
        over ``max_pending_bytes`` those of the source holding the most bytes; where
        that is not enough, the chunk's own transfer is dropped with a QuotaError.

        Raises:
            QuotaError: the source is not admitted, or the chunk's transfer cannot fit
                (dropped; its later chunks are ignored).
            DecodeError: a malformed chunk, one inconsistent with earlier chunks of its
                transfer, one over a limit (state unchanged), or a completed transfer
                whose SHA-256 does not match (that transfer is dropped).
        """
        self.expire()
        frame_header = read_frame_header(frame)
        if not frame_header.chunk:
            return frame
        head = read_chunk_header(frame)
        data = frame[chunk_header_size(frame_header.frame_type) :]
        key = (source, head.transfer_id)
        if key in self._dropped:
            log.debug(
                "ignored chunk %d of transfer %s from %s: the transfer was dropped",
                head.index,
                head.transfer_id.hex(),
                source,
            )
            return None
        transfer = self._pending.get(key)
        if transfer is None:
            try:
                self._check_new(head)
            except DecodeError:
                self._drop(key)
                raise
            if self._admit is not None and not self._admit(source):
                self._drop(key)
                raise QuotaError(f"no transfer buffer for {source}")
            stale = self._stale(source, head.transfer_id)
            if stale is not None:
                self._drop(key)
                log.debug(
                    "ignored chunk %d of transfer %s from %s: %s",
                    head.index,
                    head.transfer_id.hex(),
                    source,
                    stale,
                )
                return None
            self._room_for_transfer(source)
            transfer = _Transfer(head)
        elif (head.count, head.total_size, head.sha256) != (
            transfer.header.count,
            transfer.header.total_size,
            transfer.header.sha256,
        ):
            raise DecodeError("chunk disagrees with earlier chunks of its transfer")
        if head.index in transfer.parts:
            log.debug(
                "ignored chunk %d of transfer %s from %s: a duplicate",
                head.index,
                head.transfer_id.hex(),
                source,
            )
            return None
        if transfer.size + len(data) > head.total_size:
            raise DecodeError("chunks carry more bytes than the transfer's total size")
        if not self._room_for_bytes(key, transfer, len(data)):
            if key in self._pending:
                self._evict(key, "it does not fit in its quota")
            else:
                self._drop(key)
            raise QuotaError(
                f"transfer of {head.total_size} bytes from {source} does not fit "
                f"(source limit {self.limits.max_source_bytes}, "
                f"total limit {self.limits.max_pending_bytes} bytes)"
            )
        if key not in self._pending:
            self._source_transfers[source] = self.source_transfers(source) + 1
        transfer.parts[head.index] = data
        transfer.size += len(data)
        transfer.touched = self._clock()
        self._pending_bytes += len(data)
        self._source_bytes[source] = self.source_bytes(source) + len(data)
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

    def _stale(self, source: str, transfer_id: bytes) -> str | None:
        """Why a new transfer from ``source`` is a replay to ignore; None if it is not."""
        sent = transfer_sent_ms(transfer_id)
        newest = self._newest.get(source)
        if newest is not None and sent <= newest:
            return (
                "it was sent no later than the newest transfer completed from its source "
                "(a redelivery or a replay)"
            )
        if self.source_transfers(source) and sent < _sent(self._last_of(source)):
            return "it was sent before a transfer in flight from its source (a replay)"
        age = self.limits.max_transfer_age_s
        if age is not None:
            ago = self._wall_clock() - sent / 1000
            if ago > age:
                if self._first_warning(source):  # an honest sender's clock may be wrong
                    log.warning(
                        "ignored a transfer from %s sent %.0f s ago by its clock, outside "
                        "the %.0f s window (a replay, or a sender whose clock is wrong)",
                        source,
                        ago,
                        age,
                    )
                return f"it was sent {ago:.0f} s ago, outside the {age:.0f} s window"
        return None

    def _room_for_transfer(self, source: str) -> None:
        """Evict so that one more transfer of ``source`` (sent after all of its pending
        ones) fits both counts."""
        limits = self.limits
        while self.source_transfers(source) >= limits.max_source_transfers:
            self._evict(self._first_of(source), "its source started too many transfers")
        while len(self._pending) >= limits.max_pending_transfers:
            hog = max(self._source_transfers, key=self._source_transfers.__getitem__)
            self._evict(self._first_of(hog), "the reassembly buffer is full")

    def _room_for_bytes(self, key: Key, transfer: _Transfer, size: int) -> bool:
        """Evict other transfers so that ``size`` more bytes of ``key`` fit; False when
        that is impossible (the transfer itself is too big for the room left)."""
        source, limits = key[0], self.limits
        while self.source_bytes(source) + size > limits.max_source_bytes:
            older = [k for k in self._pending if k[0] == source and _sent(k) < _sent(key)]
            if not older:
                return False
            self._evict(min(older, key=_sent), "its source holds too many bytes")
        while self._pending_bytes + size > limits.max_pending_bytes:
            others = [k for k in self._pending if k != key]
            if not others:
                return False
            hog = max({k[0] for k in others}, key=self.source_bytes)
            if hog == source and self.source_bytes(source) - transfer.size <= 0:
                return False
            self._evict(next(k for k in others if k[0] == hog), "the reassembly buffer is full")
        return True

    def _first_of(self, source: str) -> Key:
        """The pending transfer of ``source`` sent first."""
        return min((k for k in self._pending if k[0] == source), key=_sent)

    def _last_of(self, source: str) -> Key:
        """The pending transfer of ``source`` sent last."""
        return max((k for k in self._pending if k[0] == source), key=_sent)

    def _evict(self, key: Key, why: str) -> None:
        transfer = self._pending[key]
        level = logging.WARNING if self._first_warning(key[0]) else logging.DEBUG
        log.log(
            level,
            "dropped incomplete transfer %s from %s (%d of %d chunks): %s",
            key[1].hex(),
            key[0],
            len(transfer.parts),
            transfer.header.count,
            why,
        )
        self._forget(key, transfer)
        self._drop(key)

    def _first_warning(self, source: str) -> bool:
        """Whether ``source`` has had no warning yet (the set of those that had one is
        cleared when it reaches 1,024 sources)."""
        if source in self._warned:
            return False
        if len(self._warned) >= 1024:
            self._warned.clear()
        self._warned.add(source)
        return True

    def _drop(self, key: Key) -> None:
        """Ignore the later chunks of transfer ``key``."""
        self._dropped[key] = None
        while len(self._dropped) > max(self.limits.remember_dropped, 1):
            self._dropped.popitem(last=False)

    def _complete(self, key: tuple[str, bytes], transfer: _Transfer) -> bytes:
        self._forget(key, transfer)
        if transfer.size != transfer.header.total_size:
            raise DecodeError(
                f"transfer carried {transfer.size} bytes, announced {transfer.header.total_size}"
            )
        frame = b"".join(transfer.parts[i] for i in range(transfer.header.count))
        if hashlib.sha256(frame).digest() != transfer.header.sha256:
            raise DecodeError("reassembled frame fails its SHA-256 check")
        source = key[0]
        self._newest[source] = max(_sent(key), self._newest.pop(source, 0))
        while len(self._newest) > SOURCES_REMEMBERED:
            self._newest.popitem(last=False)
        return frame

    def _forget(self, key: tuple[str, bytes], transfer: _Transfer) -> None:
        del self._pending[key]
        self._pending_bytes -= transfer.size
        source = key[0]
        self._source_bytes[source] -= transfer.size
        self._source_transfers[source] -= 1
        if self._source_transfers[source] == 0:
            del self._source_transfers[source], self._source_bytes[source]

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
