"""Fuzzing: random and mutated input may only ever raise the documented DecodeError."""

from __future__ import annotations

import msgpack
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.chunking import Reassembler, split_frame
from protocol.codec import Codec
from protocol.errors import DecodeError
from protocol.messages import Message
from tests.protocol.golden_cases import cases

CODEC = Codec()
FRAMES = [CODEC.encode(m) for m in cases().values()]
ENVELOPES = [CODEC.pack(m) for m in cases().values()]
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))


def mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    buf = bytearray(data)
    for op, pos, value in edits:
        if not buf:
            break
        i = pos % len(buf)
        if op == 0:
            buf[i] ^= 1 << (value % 8)  # bit flip
        elif op == 1:
            buf[i] = value  # byte overwrite
        elif op == 2:
            del buf[i]
        elif op == 3:
            buf.insert(i, value)
        else:
            del buf[i:]
    return bytes(buf)


edits = st.lists(
    st.tuples(st.integers(0, 4), st.integers(0, 1 << 20), st.integers(0, 255)),
    min_size=1,
    max_size=6,
)


def decode_or_decode_error(frame: bytes) -> Message | None:
    try:
        return CODEC.decode(frame)
    except DecodeError:
        return None


@FUZZ
@given(st.binary(max_size=2048))
def test_random_bytes(data: bytes) -> None:
    decode_or_decode_error(data)
    decode_or_decode_error(b"FL\x07\x01" + bytes(32) + data)


@FUZZ
@given(index=st.integers(0, len(FRAMES) - 1), edits=edits)
def test_mutated_frames(index: int, edits: list[tuple[int, int, int]]) -> None:
    decode_or_decode_error(mutate(FRAMES[index], edits))


@FUZZ
@given(index=st.integers(0, len(ENVELOPES) - 1), edits=edits)
def test_mutated_envelopes_behind_a_valid_zstd_frame(
    index: int, edits: list[tuple[int, int, int]]
) -> None:
    raw = mutate(ENVELOPES[index], edits)
    decode_or_decode_error(
        b"FL\x07\x01" + bytes(32) + zstandard.ZstdCompressor(write_checksum=True).compress(raw)
    )


@FUZZ
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats()
        | st.text(max_size=8)
        | st.binary(max_size=16),
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(st.text(max_size=6), children, max_size=4)
        ),
        max_leaves=30,
    )
)
def test_arbitrary_msgpack_values_as_bodies(body: object) -> None:
    for name in ("update", "model", "hello", "task"):
        env = CODEC.unpack(ENVELOPES[list(cases()).index(name)])
        env["body"] = body if not isinstance(body, dict) else {**env["body"], **body}
        env["body"] = (
            env["body"]
            if not isinstance(env["body"], dict)
            else {k: v for k, v in env["body"].items() if k != "kind"}
        )
        frame = (
            b"FL\x07\x01"
            + bytes(32)
            + zstandard.ZstdCompressor(write_checksum=True).compress(msgpack.packb(env))
        )
        decode_or_decode_error(frame)


@FUZZ
@given(order=st.permutations(range(5)), edits=edits, victim=st.integers(0, 4))
def test_mutated_chunks_never_escape_decode_error(
    order: list[int], edits: list[tuple[int, int, int]], victim: int
) -> None:
    chunks = split_frame(FRAMES[2], 120)[:5]
    chunks[victim] = mutate(chunks[victim], edits)
    r = Reassembler()
    for i in order:
        try:
            out = r.feed("t", chunks[i])
        except DecodeError:
            continue
        if out is not None:
            decode_or_decode_error(out)
