"""Chunking: splits within the size, idempotent reassembly in any order."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.chunking import CHUNK_HEADER_SIZE, Reassembler, read_chunk_header, split_frame
from protocol.errors import DecodeError, EncodeError

HEADER = b"FL\x07\x01"


def frame_of(size: int, seed: int = 0) -> bytes:
    return HEADER + np.random.default_rng(seed).bytes(size)


def test_small_frames_pass_through_unchanged() -> None:
    frame = frame_of(100)
    assert split_frame(frame, 1000) == [frame]
    assert Reassembler().feed("t", frame) == frame


def test_chunks_respect_the_maximum_and_carry_the_header_fields() -> None:
    frame = frame_of(300_000)
    chunks = split_frame(frame)
    assert all(len(c) <= 128 * 1024 for c in chunks) and len(chunks) == 3
    heads = [read_chunk_header(c) for c in chunks]
    assert [h.index for h in heads] == [0, 1, 2]
    assert {(h.count, h.total_size, h.sha256, h.transfer_id) for h in heads} == {
        (3, len(frame), hashlib.sha256(frame).digest(), heads[0].transfer_id)
    }
    assert b"".join(c[CHUNK_HEADER_SIZE:] for c in chunks) == frame


def test_the_maximum_includes_the_chunk_header() -> None:
    # Prepare
    fits, over = frame_of(1000 - len(HEADER)), frame_of(1001 - len(HEADER))
    frame = frame_of(2 * 900 + 10 - len(HEADER))
    # Execute
    chunks = split_frame(frame, 1000)
    # Assert: 1000 - 100 = 900 data bytes per chunk but the last
    assert CHUNK_HEADER_SIZE == 100
    assert split_frame(fits, 1000) == [fits]
    assert [len(c) for c in split_frame(over, 1000)] == [1000, 100 + 1001 - 900]
    assert [len(c) for c in chunks] == [1000, 1000, 100 + 10]
    assert [read_chunk_header(c).count for c in chunks] == [3, 3, 3]


def test_too_small_a_maximum_is_refused() -> None:
    with pytest.raises(EncodeError, match="too small"):
        split_frame(frame_of(500), CHUNK_HEADER_SIZE)


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(2001, 6000),
    max_payload=st.integers(CHUNK_HEADER_SIZE + 200, 2000),
    data=st.data(),
)
def test_any_order_with_duplicates_reassembles_exactly_once(
    size: int, max_payload: int, data: st.DataObject
) -> None:
    # Prepare
    frame = frame_of(size)
    chunks = split_frame(frame, max_payload)
    deliveries = data.draw(st.permutations(chunks + data.draw(st.lists(st.sampled_from(chunks)))))
    # Execute
    r = Reassembler()
    outs = [r.feed("t", c) for c in deliveries]
    outs += [r.feed("t", c) for c in chunks]  # QoS 1 redelivery after completion
    # Assert
    assert [o for o in outs if o is not None] == [frame]
    assert r.pending_transfers == 0 and r.pending_bytes == 0


def test_interleaved_transfers_from_two_sources_do_not_mix() -> None:
    a, b = frame_of(5000, 1), frame_of(7000, 2)
    tid = bytes(16)  # same transfer id from two senders
    ca, cb = split_frame(a, 1000, transfer_id=tid), split_frame(b, 1000, transfer_id=tid)
    r = Reassembler()
    done = {}
    for i in range(max(len(ca), len(cb))):
        for source, chunks in (("dev-a", ca), ("dev-b", cb)):
            if i < len(chunks) and (out := r.feed(source, chunks[i])) is not None:
                done[source] = out
    assert done == {"dev-a": a, "dev-b": b}


def test_a_corrupted_chunk_fails_the_checksum_and_is_dropped() -> None:
    frame = frame_of(3000)
    chunks = split_frame(frame, 1000)
    bad = bytearray(chunks[1])
    bad[-1] ^= 0xFF
    r = Reassembler()
    r.feed("t", chunks[0])
    r.feed("t", bytes(bad))
    r.feed("t", chunks[2])
    with pytest.raises(DecodeError, match="SHA-256"):
        r.feed("t", chunks[3])
    assert r.pending_transfers == 0
    assert [r.feed("t", c) for c in chunks][-1] == frame  # a clean resend succeeds


def test_inconsistent_chunks_are_refused_without_changing_state() -> None:
    chunks = split_frame(frame_of(3000), 1000)
    other = split_frame(
        frame_of(3500, seed=9), 1000, transfer_id=read_chunk_header(chunks[0]).transfer_id
    )
    r = Reassembler()
    r.feed("t", chunks[0])
    before = (r.pending_transfers, r.pending_bytes)
    with pytest.raises(DecodeError, match="disagrees"):
        r.feed("t", other[1])
    assert (r.pending_transfers, r.pending_bytes) == before


@pytest.mark.parametrize(
    "mutate",
    [
        lambda c: c[:62],  # truncated header
        lambda c: (
            c[:52] + (5).to_bytes(4, "big") + (3).to_bytes(4, "big") + c[60:]
        ),  # index >= count
        lambda c: c[:56] + (1).to_bytes(4, "big") + c[60:],  # count 1
        lambda c: c[:60] + (2).to_bytes(8, "big") + c[68:],  # total smaller than count
    ],
)
def test_malformed_chunk_headers(mutate: object) -> None:
    chunk = split_frame(frame_of(3000), 1000)[0]
    with pytest.raises(DecodeError):
        Reassembler().feed("t", mutate(chunk))  # type: ignore[operator]
