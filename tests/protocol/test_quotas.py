"""Per-source quotas of the chunk reassembler: one source cannot starve the others."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.chunking import Reassembler, split_frame
from protocol.codec import FRAME_MAGIC, FRAME_MESSAGE, TAG_SIZE
from protocol.errors import QuotaError
from protocol.limits import ReassemblyLimits
from protocol.messages import PROTOCOL_VERSION

HEADER = FRAME_MAGIC + bytes((PROTOCOL_VERSION, FRAME_MESSAGE)) + bytes(TAG_SIZE)
"""A message frame's header and (here unchecked) tag."""


def chunks_of(size: int, seed: int, max_payload: int = 1000) -> tuple[bytes, list[bytes]]:
    frame = HEADER + np.random.default_rng(seed).bytes(size)
    return frame, split_frame(frame, max_payload)


def test_a_flood_from_one_source_evicts_only_its_own_transfers() -> None:
    # Prepare: two honest sources each have a transfer under way
    r = Reassembler(ReassemblyLimits(max_source_transfers=3, max_pending_transfers=8))
    honest = {src: chunks_of(3000, seed=i) for i, src in enumerate(("dev-a", "dev-b"))}
    for src, (_, chunks) in honest.items():
        r.feed(src, chunks[0])
    # Execute: the flooder starts 100 transfers and finishes none
    for i in range(100):
        r.feed("evil", chunks_of(3000, seed=100 + i)[1][0])
    # Assert: the flooder holds its quota, the honest transfers complete
    assert r.source_transfers("evil") == 3
    for src, (frame, chunks) in honest.items():
        assert [r.feed(src, c) for c in chunks[1:]][-1] == frame
    assert r.source_transfers("dev-a") == r.source_transfers("dev-b") == 0


def test_a_full_buffer_evicts_from_the_source_holding_the_most() -> None:
    r = Reassembler(ReassemblyLimits(max_source_transfers=4, max_pending_transfers=5))
    for i in range(4):
        r.feed("evil", chunks_of(3000, seed=10 + i)[1][0])
    frame, chunks = chunks_of(3000, seed=1)
    r.feed("dev-a", chunks[0])
    r.feed("dev-b", chunks_of(3000, seed=2)[1][0])  # the buffer is full: evil loses one
    assert r.source_transfers("evil") == 3 and r.pending_transfers == 5
    assert [r.feed("dev-a", c) for c in chunks[1:]][-1] == frame


def test_source_bytes_quota_evicts_the_sources_older_transfers() -> None:
    r = Reassembler(ReassemblyLimits(max_source_bytes=4000))
    _, old = chunks_of(3000, seed=1)
    new_frame, new = chunks_of(3000, seed=2)
    for c in old[:-1]:
        r.feed("dev-a", c)
    outs = [r.feed("dev-a", c) for c in new]
    assert outs[-1] == new_frame
    assert r.feed("dev-a", old[-1]) is None  # evicted: its last chunk completes nothing


def test_a_transfer_larger_than_the_source_quota_is_refused_once() -> None:
    r = Reassembler(ReassemblyLimits(max_source_bytes=1500))
    _, chunks = chunks_of(5000, seed=1)
    r.feed("dev-a", chunks[0])
    with pytest.raises(QuotaError):
        r.feed("dev-a", chunks[1])
    assert [r.feed("dev-a", c) for c in chunks[2:]] == [None] * (len(chunks) - 2)
    assert r.pending_bytes == 0 and r.source_bytes("dev-a") == 0


def test_a_source_not_admitted_gets_no_buffer() -> None:
    r = Reassembler(admit=lambda source: source.startswith("dev-"))
    frame, chunks = chunks_of(3000, seed=1)
    with pytest.raises(QuotaError, match="no transfer buffer for stranger"):
        r.feed("stranger", chunks[0])
    assert [r.feed("stranger", c) for c in chunks[1:]] == [None] * (len(chunks) - 1)
    assert r.pending_transfers == 0 and r.pending_bytes == 0
    assert [r.feed("dev-a", c) for c in chunks][-1] == frame
    assert r.feed("stranger", HEADER + b"whole") == HEADER + b"whole"  # unchunked: passes


def test_stale_transfers_expire_and_free_their_quota() -> None:
    now = [0.0]
    limits = ReassemblyLimits(max_source_transfers=1, timeout_s=10)
    r = Reassembler(limits, clock=lambda: now[0])
    r.feed("dev-a", chunks_of(3000, seed=1)[1][0])
    now[0] = 11.0
    assert r.expire() == 1
    assert r.source_transfers("dev-a") == 0 and r.source_bytes("dev-a") == 0
