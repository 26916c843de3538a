"""The wire format, frozen: golden envelopes and frames under tests/protocol/golden/."""

from __future__ import annotations

import msgpack
import pytest

from protocol.chunking import Reassembler, split_frame
from protocol.codec import Codec
from tests.protocol.golden_cases import GOLDEN_DIR, TRANSFER_ID, cases

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
    assert frame[:4] == b"FL\x02\x01"


def test_chunk_frames_are_frozen_and_reassemble() -> None:
    # Prepare
    frame = (GOLDEN_DIR / "model.frame").read_bytes()
    golden = sorted(GOLDEN_DIR.glob("model.chunk*"))
    # Execute
    chunks = split_frame(frame, 200, transfer_id=TRANSFER_ID)
    # Assert
    assert [p.read_bytes() for p in golden] == chunks
    assert chunks[1][:36] == b"FL\x02\x02" + TRANSFER_ID + bytes.fromhex(
        "0000000100000004" + f"{len(frame):016x}"
    )
    reassembler = Reassembler()
    outputs = [reassembler.feed("t", c) for c in reversed(chunks)]
    assert outputs[:-1] == [None] * (len(chunks) - 1) and outputs[-1] == frame


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
