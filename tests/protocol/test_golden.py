"""The wire format, frozen: golden envelopes and frames under tests/protocol/golden/."""

from __future__ import annotations

import hashlib

import msgpack
import numpy as np
import pytest

from protocol.arrays import content_fingerprint, fingerprint_bytes
from protocol.auth import AuthError, frame_tag, topic_device, verify
from protocol.chunking import Reassembler
from protocol.codec import Codec
from protocol.errors import DecodeError
from protocol.signing import SigningKey, VerifyKey
from tests.protocol.golden_cases import (
    BROADCAST_TOPIC,
    GOLDEN_DIR,
    GOLDEN_KEY,
    GOLDEN_SIGNING_SEED,
    GOLDEN_TOPICS,
    STUDENT_FINGERPRINT,
    TRANSFER_ID,
    cases,
    golden_chunks,
    golden_signed_chunks,
)

CASES = cases()


@pytest.mark.parametrize("name", sorted(CASES))
def test_envelope_bytes_are_frozen(name: str) -> None:
    # Prepare
    expected = (GOLDEN_DIR / f"{name}.msgpack").read_bytes()
    # Execute
    packed = Codec().pack(CASES[name])
    # Assert
    assert packed == expected, f"wire format of {name!r} changed: bump PROTOCOL_VERSION"


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_frames_still_decode(name: str) -> None:
    # Prepare
    frame = (GOLDEN_DIR / f"{name}.frame").read_bytes()
    codec = Codec()
    # Execute
    message = codec.decode(frame)
    # Assert
    assert message == CASES[name]
    assert codec.decompress(frame) == (GOLDEN_DIR / f"{name}.msgpack").read_bytes()
    signed = topic_device(GOLDEN_TOPICS[name]) is None  # fleet-wide: type 0x03
    assert frame[:4] == (b"FL\x07\x03" if signed else b"FL\x07\x01")
    body = 68 if signed else 36  # after the 64-byte signature or the 32-byte tag
    # the zstd frame: magic, then a descriptor with Frame_Content_Size present (bits 6-7
    # or Single_Segment), Content_Checksum_flag (bit 2) set and no Dictionary_ID (bits 0-1)
    assert frame[body : body + 4] == bytes.fromhex("28b52ffd")
    descriptor = frame[body + 4]
    assert descriptor & 0b100 and descriptor & 0b11 == 0 and descriptor & 0b1110_0000


def test_version_3_frames_are_refused() -> None:
    # Prepare: a version 3 frame had no tag; its zstd frame followed the header
    frame = (GOLDEN_DIR / "ack.frame").read_bytes()
    # Execute, Assert
    with pytest.raises(DecodeError, match="unsupported protocol version 3"):
        Codec().decode(b"FL\x03\x01" + frame[36:])


def test_version_5_frames_are_refused() -> None:
    # Prepare: version 5 had the same layouts but no signed types (fleet-wide frames
    # carried a zero tag and nothing else)
    frame = (GOLDEN_DIR / "ack.frame").read_bytes()
    # Execute, Assert
    with pytest.raises(DecodeError, match="unsupported protocol version 5"):
        Codec().decode(b"FL\x05\x01" + frame[4:])


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_frames_carry_their_tag(name: str) -> None:
    # Prepare
    frame = (GOLDEN_DIR / f"{name}.frame").read_bytes()
    topic = GOLDEN_TOPICS[name]
    # Execute, Assert: device topics are sealed with the device's key, fleet-wide ones
    # signed with the coordinator's (Ed25519 is deterministic: the bytes are frozen)
    if topic_device(topic) is None:
        key = SigningKey(GOLDEN_SIGNING_SEED)
        key.verify(topic, frame)
        assert frame[4:68] != bytes(64)
        with pytest.raises(AuthError, match="bad coordinator signature"):
            key.verify("fl/lab/broadcast/model", frame)  # the topic is signed
    else:
        verify(GOLDEN_KEY, topic, frame)
        assert frame[4:36] == frame_tag(GOLDEN_KEY, topic, frame)


def test_chunk_frames_are_frozen_and_reassemble() -> None:
    # Prepare
    frame = (GOLDEN_DIR / "model.frame").read_bytes()
    golden = sorted(
        GOLDEN_DIR.glob("model.chunk*"), key=lambda p: int(p.name[len("model.chunk") :])
    )
    topic = GOLDEN_TOPICS["model"]
    # Execute
    chunks = golden_chunks(frame)
    # Assert: the bytes, the documented layout, every chunk's own tag
    assert [p.read_bytes() for p in golden] == chunks
    count = len(chunks)
    assert count == -(-len(frame) // (200 - 100))
    assert chunks[1][:4] == b"FL\x07\x02"
    assert (
        chunks[1][36:100]
        == TRANSFER_ID
        + bytes.fromhex(f"00000001{count:08x}{len(frame):016x}")
        + hashlib.sha256(frame).digest()
    )
    for chunk in chunks:
        verify(GOLDEN_KEY, topic, chunk)
        assert chunk[4:36] == frame_tag(GOLDEN_KEY, topic, chunk)
    reassembler = Reassembler()
    outputs = [reassembler.feed("t", c) for c in reversed(chunks)]
    assert outputs[:-1] == [None] * (len(chunks) - 1) and outputs[-1] == frame


def test_signed_chunk_frames_are_frozen_and_reassemble() -> None:
    # Prepare: the golden model published on the broadcast topic, in 200-byte chunks
    golden = sorted(
        GOLDEN_DIR.glob("broadcast.chunk*"), key=lambda p: int(p.name[len("broadcast.chunk") :])
    )
    frame = Codec().encode(CASES["model"])
    key = SigningKey(GOLDEN_SIGNING_SEED)
    public = VerifyKey(key.verify_key.public)
    # Execute
    chunks = golden_signed_chunks(frame)
    # Assert: the bytes, the layout (132-byte header), every chunk's own signature
    assert [p.read_bytes() for p in golden] == chunks
    signed_length = len(frame) + 32  # a 64-byte signature in place of the 32-byte tag
    assert len(chunks) == -(-signed_length // (200 - 132))
    assert chunks[1][:4] == b"FL\x07\x04"
    assert chunks[1][68:84] == TRANSFER_ID
    assert chunks[1][84:100] == bytes.fromhex(f"00000001{len(chunks):08x}{signed_length:016x}")
    for chunk in chunks:
        public.verify(BROADCAST_TOPIC, chunk)
    reassembler = Reassembler()
    outputs = [reassembler.feed("t", c) for c in chunks]
    whole = outputs[-1]
    assert outputs[:-1] == [None] * (len(chunks) - 1) and whole is not None
    assert whole[:4] == b"FL\x07\x03" and hashlib.sha256(whole).digest() == chunks[0][100:132]
    public.verify(BROADCAST_TOPIC, whole)
    assert Codec().decode(whole) == CASES["model"]


def test_tensor_layouts_match_the_documented_bytes() -> None:
    """Independent of our decoder: read the golden envelope with plain msgpack."""
    env = msgpack.unpackb((GOLDEN_DIR / "model.msgpack").read_bytes(), raw=False)
    tensors = {t[0]: t for t in env["body"]["sets"]["student"]["tensors"]}
    # fp32 little-endian: -1.0 = 0xBF800000
    assert tensors["fp32"][5][:4] == bytes.fromhex("000080bf")
    # byte shuffle: first the low bytes of all 12 values, ..., last the high bytes
    assert tensors["fp32s"][4] == 1
    assert tensors["fp32s"][5][-12:] == bytes(
        [0xBF, 0xBF, 0x00, 0x3E, 0x3F, 0x3F, 0x3F] + [0x40] * 5
    )
    # fp16 -1.0 = 0xBC00, bf16 -1.0 = 0xBF80 (both little-endian)
    assert tensors["fp16"][5][:2] == bytes.fromhex("00bc")
    assert tensors["bf16"][5][:2] == bytes.fromhex("80bf")
    # int8_ch row 0 [-1, -0.5, 0, 0.25]: offset -1, scale 1.25/255 -> codes 0, 102, 204, 255
    assert tensors["int8_ch"][5][:4] == bytes([0, 102, 204, 255])
    assert tensors["int8_ch"][6][1][:4] == bytes.fromhex("000080bf")
    # int4_ch rows [0, 7, 15], [0, 7, 15], [0, 0, 0]: low nibble first, zero padding
    assert tensors["int4_ch"][5] == bytes.fromhex("700ff70000")
    assert tensors["steps"][2:6] == ["int64", "raw", 0, (7).to_bytes(8, "little")]


def test_canonical_bools_and_int4_padding_in_the_golden_bytes() -> None:
    env = msgpack.unpackb((GOLDEN_DIR / "model.msgpack").read_bytes(), raw=False)
    tensors = {t[0]: t for t in env["body"]["sets"]["student"]["tensors"]}
    assert tensors["mask"][2:6] == ["bool", "raw", 0, b"\x01\x00"]
    assert tensors["int4_ch"][5][-1] >> 4 == 0  # 9 codes: the last high nibble is padding


def test_content_fingerprint_bytes_are_frozen() -> None:
    """Section 6, byte by byte: u32 LE name length, name, u8 dtype token length, token,
    u8 ndim, u64 LE dims, little-endian values in C order."""
    # Prepare
    arrays = {
        "w": np.array([[1, -2]], np.int16),
        "é": np.array(True),
        "z": np.zeros((0, 3), np.float32),
    }
    expected = (
        bytes.fromhex("01000000") + b"w" + b"\x05int16" + b"\x02"
        + bytes.fromhex("0100000000000000" "0200000000000000")
        + bytes.fromhex("0100feff")
        + bytes.fromhex("02000000") + "é".encode() + b"\x04bool" + b"\x00" + b"\x01"
        + bytes.fromhex("01000000") + b"z" + b"\x07float32" + b"\x02"
        + bytes.fromhex("0000000000000000" "0300000000000000")
    )  # fmt: skip
    # Execute
    canonical = fingerprint_bytes(arrays)
    # Assert
    assert canonical == expected
    assert content_fingerprint(arrays) == hashlib.sha256(expected).hexdigest()[:16]
    big_endian = {k: v.astype(v.dtype.newbyteorder(">")) for k, v in arrays.items()}
    assert content_fingerprint(big_endian) == content_fingerprint(arrays)


def test_golden_update_is_a_delta_against_the_golden_student_as_decoded() -> None:
    # Prepare
    model = Codec().decode((GOLDEN_DIR / "model.frame").read_bytes())
    update = Codec().decode((GOLDEN_DIR / "update.frame").read_bytes())
    # Execute
    student = model.tensor_sets()["student"].to_arrays()
    weights = update.tensor_sets()["weights"]
    # Assert
    assert content_fingerprint(student) == STUDENT_FINGERPRINT
    assert weights.mode == "delta" and weights.base == STUDENT_FINGERPRINT
    assert list(update.tensor_sets()) == ["weights"]
