"""Codec round trips and the checks on the envelope."""

from __future__ import annotations

import msgpack
import pytest
import zstandard
from pydantic import ValidationError

from protocol.codec import Codec
from protocol.errors import DecodeError, EncodeError, ProtocolError
from protocol.limits import DecodeLimits
from protocol.messages import Ack, DeviceStatus, Hello, Message
from tests.protocol.golden_cases import cases

CASES = cases()


def frame_of(envelope: dict[str, object]) -> bytes:
    raw = msgpack.packb(envelope, use_bin_type=True)
    return (
        b"FL\x07\x01"
        + bytes(32)
        + zstandard.ZstdCompressor(level=3, write_checksum=True).compress(raw)
    )


def good_envelope() -> dict[str, object]:
    return Codec().envelope(CASES["ack"])


@pytest.mark.parametrize("level", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_kind_round_trips_at_every_level(name: str, level: int) -> None:
    codec = Codec(level=level)
    assert codec.decode(codec.encode(CASES[name])) == CASES[name]


def test_level_outside_one_to_three_is_refused() -> None:
    for level in (0, 4, 19):
        with pytest.raises(ValueError, match="zstd level"):
            Codec(level=level)


def test_decode_error_is_both_protocol_error_and_value_error() -> None:
    with pytest.raises(DecodeError) as info:
        Codec().decode(b"garbage!")
    assert isinstance(info.value, ProtocolError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"v": 2}, "unsupported protocol version 2"),
        ({"kind": "launch"}, "unknown message kind"),
        ({"id": b"short"}, "16 bytes"),
        ({"sender": "dev/1"}, "sender"),
        ({"fleet": "+"}, "fleet"),
        ({"round": -7}, "round"),
        ({"body": {"accepted": True, "kind": "ack"}}, "without a 'kind'"),
        ({"body": {"accepted": "maybe"}}, "accepted"),
        ({"body": {"accepted": True, "reason": "because"}}, "reason"),
        ({"body": {"accepted": True, "surprise": 1}}, "surprise"),
    ],
)
def test_bad_envelopes_raise_decode_error(change: dict[str, object], message: str) -> None:
    env = good_envelope() | change
    with pytest.raises(DecodeError, match=message):
        Codec().decode(frame_of(env))


def test_missing_or_extra_envelope_keys() -> None:
    env = good_envelope()
    del env["ts"]
    with pytest.raises(DecodeError, match="envelope must be a map"):
        Codec().decode(frame_of(env))
    with pytest.raises(DecodeError, match="envelope must be a map"):
        Codec().decode(frame_of(good_envelope() | {"extra": 1}))
    with pytest.raises(DecodeError, match="envelope must be a map"):
        Codec().decode(frame_of([1, 2, 3]))  # type: ignore[arg-type]


def test_frame_header_checks() -> None:
    frame = Codec().encode(CASES["ack"])
    with pytest.raises(DecodeError, match="bad magic"):
        Codec().decode(b"XX" + frame[2:])
    with pytest.raises(DecodeError, match="unsupported protocol version 9"):
        Codec().decode(frame[:2] + b"\x09" + frame[3:])
    with pytest.raises(DecodeError, match="unknown frame type"):
        Codec().decode(frame[:3] + b"\x07" + frame[4:])
    with pytest.raises(DecodeError, match="reassembled"):
        Codec().decode(frame[:3] + b"\x02" + frame[4:])


def test_hello_must_come_from_its_device() -> None:
    body = CASES["hello"].body
    assert isinstance(body, Hello)
    with pytest.raises(ValidationError, match="device_id must equal"):
        Message(fleet="lab", sender="dev-999", body=body)
    env = Codec().envelope(CASES["hello"]) | {"sender": "dev-999"}
    with pytest.raises(DecodeError, match="device_id must equal"):
        Codec().decode(frame_of(env))


def test_non_finite_metrics_are_rejected() -> None:
    env = Codec().envelope(CASES["update"])
    env["body"]["metrics"] = {"loss": float("nan")}  # type: ignore[index]
    with pytest.raises(DecodeError, match="metrics"):
        Codec().decode(frame_of(env))


def test_encode_refuses_messages_over_the_limit() -> None:
    codec = Codec(limits=DecodeLimits(max_message_bytes=64))
    message = Message(fleet="lab", sender="c", body=Ack(accepted=True, detail="x" * 100))
    with pytest.raises(EncodeError, match="limit 64"):
        codec.encode(message)


def test_message_defaults_are_fresh_and_sane() -> None:
    a = Message(fleet="lab", sender="dev-1", body=DeviceStatus(state="online"))
    b = Message(fleet="lab", sender="dev-1", body=DeviceStatus(state="online"))
    assert a.message_id != b.message_id and len(a.message_id) == 32
    assert a.round == -1 and a.sent_at_ms > 1_600_000_000_000
    assert a.kind == "device_status" and a.tensor_sets() == {}
