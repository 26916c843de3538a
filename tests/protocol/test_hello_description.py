"""Hello's optional model description (``input_shape``, ``num_classes``, ``layout``):
old hellos stay byte-identical, a device's real hello round-trips through both decoders,
the independent decoder reads it from docs/protocol.md alone, and a layout that does
not give the fingerprint is refused by both."""

from __future__ import annotations

import msgpack
import pytest

from edge_client.config import ClientConfig
from edge_client.train.hello import ModelDescription, device_hello
from edge_client.train.trainer import describe_model
from models import build_classifier
from protocol.codec import Codec
from protocol.errors import DecodeError
from protocol.messages import MAX_LAYOUT_TENSORS, Hello, Message
from tests.protocol import independent_decoder as spec
from tests.protocol.golden_cases import GOLDEN_DIR, cases

GOLDEN_HELLO = cases()["hello"]
KEYS = ("input_shape", "num_classes", "layout")


def device_message(model_name: str, **options: object) -> Message:
    model = build_classifier(model_name, **options)  # type: ignore[arg-type]
    config = ClientConfig(device_id="dev-1", fleet="lab", insecure_no_auth=True, model=model_name)
    hello = device_hello(
        config,
        fingerprint=model.fingerprint(),
        num_samples=5,
        held_base=None,
        memory_bytes=0,
        model=describe_model(model),
    )
    return Message(fleet="lab", sender="dev-1", body=hello)


def test_a_hello_without_the_description_is_the_golden_bytes() -> None:
    assert isinstance(GOLDEN_HELLO.body, Hello) and GOLDEN_HELLO.body.layout is None
    packed = Codec().pack(GOLDEN_HELLO)
    assert packed == (GOLDEN_DIR / "hello.msgpack").read_bytes()
    assert not set(KEYS) & set(msgpack.unpackb(packed)["body"])
    env = spec.decode_message_frame((GOLDEN_DIR / "hello.frame").read_bytes())
    assert spec.model_description(env) == (None, None, None)


@pytest.mark.parametrize(
    ("model", "options", "shape"),
    [
        ("lenet5", {"num_classes": 26}, [1, 28, 28]),
        ("tests.models.user_models:build_series", {"input_shape": (9, 6)}, [9, 6]),
    ],
)
def test_a_devices_hello_round_trips_through_both_decoders(
    model: str, options: dict[str, object], shape: list[int]
) -> None:
    message = device_message(model, **options)
    codec = Codec()
    frame = codec.encode(message)
    decoded = codec.decode(frame)
    assert decoded == message
    assert isinstance(decoded.body, Hello) and decoded.body.layout is not None
    got_shape, classes, layout = spec.model_description(spec.decode_message_frame(frame))
    assert got_shape == shape and classes == decoded.body.num_classes
    assert layout == {name: list(dims) for name, dims in decoded.body.layout.items()}
    assert spec.architecture_fingerprint(layout) == decoded.body.fingerprint


def test_a_layout_that_does_not_give_the_fingerprint_is_refused_by_both() -> None:
    codec = Codec()
    raw = msgpack.unpackb(codec.pack(device_message("lenet5")))
    raw["body"]["layout"]["head.bias"] = [11]  # a forged or damaged layout
    packed = msgpack.packb(raw)
    with pytest.raises(DecodeError, match="layout does not give the fingerprint"):
        codec.decode_envelope(packed)
    with pytest.raises(spec.RejectedError, match="layout does not give the fingerprint"):
        spec.model_description(spec.decode_envelope(packed))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("input_shape", []),
        ("input_shape", [1, 0]),
        ("input_shape", [1] * 9),
        ("num_classes", 0),
        ("layout", {}),
        ("layout", {"w": [1] * 9}),
        ("layout", {"x" * 257: [1]}),
    ],
)
def test_a_description_out_of_bounds_is_refused_by_both(key: str, value: object) -> None:
    codec = Codec()
    raw = msgpack.unpackb(codec.pack(device_message("mlp")))
    raw["body"][key] = value
    packed = msgpack.packb(raw)
    with pytest.raises(DecodeError):
        codec.decode_envelope(packed)
    with pytest.raises(spec.RejectedError):
        spec.model_description(spec.decode_envelope(packed))


def test_a_model_too_large_to_describe_leaves_its_layout_out() -> None:
    shapes = {f"t{i}": (1,) for i in range(MAX_LAYOUT_TENSORS + 1)}
    assert ModelDescription.of((3,), 2, shapes).layout is None
    assert ModelDescription.of((3,), 2, {"x" * 257: (1,)}).layout is None
    assert ModelDescription.of((3,), 2, {"w": (2, 3)}).layout == {"w": (2, 3)}
