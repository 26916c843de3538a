"""Hello's optional ``weight_format``: old hellos stay valid and byte-identical, new ones
round-trip, and the independent decoder reads it from docs/protocol.md alone."""

from __future__ import annotations

import msgpack
import pytest

from protocol.codec import Codec
from protocol.errors import DecodeError
from protocol.messages import Hello, Message
from tests.protocol import independent_decoder as spec
from tests.protocol.golden_cases import GOLDEN_DIR, cases

GOLDEN_HELLO = cases()["hello"]


def with_format(weight_format: str) -> Message:
    assert isinstance(GOLDEN_HELLO.body, Hello)
    body = GOLDEN_HELLO.body.model_copy(update={"weight_format": weight_format})
    return GOLDEN_HELLO.model_copy(update={"body": body})


def test_a_hello_without_the_key_decodes_as_a_float_device() -> None:
    # Prepare: the golden hello predates the key
    frame = (GOLDEN_DIR / "hello.frame").read_bytes()
    assert "weight_format" not in msgpack.unpackb(Codec().decompress(frame))["body"]
    # Execute
    message = Codec().decode(frame)
    # Assert
    assert isinstance(message.body, Hello) and message.body.weight_format == "float"
    assert spec.weight_format(spec.decode_message_frame(frame)) == "float"


def test_a_float_hello_is_encoded_without_the_key_byte_for_byte() -> None:
    # Execute
    packed = Codec().pack(with_format("float"))
    # Assert
    assert packed == (GOLDEN_DIR / "hello.msgpack").read_bytes()


@pytest.mark.parametrize("weight_format", ["int8", "binary"])
def test_a_hello_with_the_key_round_trips_through_both_decoders(weight_format: str) -> None:
    # Prepare
    message = with_format(weight_format)
    codec = Codec()
    # Execute
    frame = codec.encode(message)
    # Assert
    assert codec.decode(frame) == message
    env = spec.decode_message_frame(frame)
    assert env["body"]["weight_format"] == weight_format
    assert spec.weight_format(env) == weight_format


def test_an_unknown_weight_format_is_refused_by_both_decoders() -> None:
    # Prepare: a binary hello with its value swapped for one of the same length
    codec = Codec()
    raw = codec.pack(with_format("binary")).replace(b"\xa6binary", b"\xa6ternar")
    # Execute, Assert
    with pytest.raises(DecodeError):
        codec.decode_envelope(raw)
    with pytest.raises(spec.RejectedError, match="weight_format"):
        spec.weight_format(spec.decode_envelope(raw))
