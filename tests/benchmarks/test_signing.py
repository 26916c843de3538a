"""benchmarks/signing.py: every frame it times is signed and verified for real."""

from __future__ import annotations

from benchmarks.signing import BROADCAST, markdown, measure, signed_parts
from protocol.codec import Codec
from protocol.messages import Message, ModelPayload
from protocol.samples import sample_weights
from protocol.signing import SigningKey
from protocol.tensorset import encode_tensors


def test_a_chunked_broadcast_is_signed_per_chunk_and_as_a_whole() -> None:
    key = SigningKey.generate()
    sets = {"global": encode_tensors(sample_weights("resnet8"), "fp32")}
    frame = Codec().encode(Message(fleet="lab", sender="c", body=ModelPayload(sets=sets)))
    signed, parts = signed_parts(key, BROADCAST, frame)
    assert len(parts) > 1 and signed[:4] == b"FL\x07\x03"
    for part in parts:
        assert part[:4] == b"FL\x07\x04"
        key.verify(BROADCAST, part)
    key.verify(BROADCAST, signed)


def test_the_table_has_a_row_per_frame() -> None:
    rows = measure(repeat=1)
    assert [r["frame"] for r in rows] == [
        "status", "lenet5 fp32", "lenet5 int8", "resnet8 fp32", "resnet8 int8"
    ]  # fmt: skip
    assert all(r["sign_us"] > 0 and r["verify_us"] > 0 and r["decode_us"] > 0 for r in rows)
    assert markdown(rows).count("\n") == len(rows) + 1
