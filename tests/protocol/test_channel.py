"""Channel: whole messages over a transport, chunked and reassembled on the way."""

from __future__ import annotations

import queue

import numpy as np
import pytest

from protocol.channel import Channel
from protocol.errors import DecodeError, EncodeError
from protocol.messages import DeviceStatus, Message, ModelPayload
from protocol.samples import sample_weights
from protocol.tensorset import encode_tensors
from protocol.transport.base import MqttVersion
from protocol.transport.memory import MemoryBroker, MemoryTransport

TOPIC = "fl/lab/to/dev-1/model"


def model_message(precision: str = "fp32") -> Message:
    sets = {"global": encode_tensors(sample_weights("resnet8_small"), precision)}
    return Message(fleet="lab", sender="coordinator", body=ModelPayload(sets=sets))


def pair(
    broker: MemoryBroker, version: MqttVersion = MqttVersion.V311
) -> tuple[MemoryTransport, MemoryTransport]:
    a = MemoryTransport(broker, "coordinator", version=version)
    b = MemoryTransport(broker, "dev-1", version=version)
    a.connect()
    b.connect()
    return a, b


def test_a_large_message_arrives_whole_through_chunks() -> None:
    # Prepare
    sender_t, receiver_t = pair(MemoryBroker())
    inbox: queue.Queue[Message] = queue.Queue()
    Channel(receiver_t).subscribe("fl/lab/to/dev-1/#", lambda _t, m: inbox.put(m))
    message = model_message()
    # Execute
    sent = Channel(sender_t, max_payload=64 * 1024).send(TOPIC, message)
    got = inbox.get(timeout=5)
    # Assert
    assert sent.frames == -(-sent.message_bytes // (64 * 1024 - 68)) and sent.frames > 1
    assert got == message
    assert sender_t.stats.totals("out").messages == sent.frames
    assert sender_t.stats.totals("out").payload_bytes == sent.payload_bytes


def test_chunks_honour_the_mqtt5_maximum_packet_size() -> None:
    broker = MemoryBroker(max_packet_size=20_000)
    sender_t, receiver_t = pair(broker, MqttVersion.V5)
    inbox: queue.Queue[Message] = queue.Queue()
    Channel(receiver_t).subscribe("fl/lab/to/dev-1/#", lambda _t, m: inbox.put(m))
    channel = Channel(sender_t)
    assert channel.max_payload_for(TOPIC) < 20_000
    channel.send(TOPIC, model_message("int8"))
    assert inbox.get(timeout=5).tensor_sets()["global"].numel == 78_042
    snapshot = sender_t.stats.snapshot()
    assert snapshot  # every publish counted, each under the limit:
    assert sender_t.stats.totals("out").wire_bytes <= 20_000 * sender_t.stats.totals("out").messages


def test_bad_payloads_go_to_on_error_and_never_to_the_handler() -> None:
    sender_t, receiver_t = pair(MemoryBroker())
    good: queue.Queue[Message] = queue.Queue()
    bad: queue.Queue[tuple[str, DecodeError]] = queue.Queue()
    Channel(receiver_t).subscribe(
        "fl/lab/to/dev-1/#", lambda _t, m: good.put(m), on_error=lambda t, e: bad.put((t, e))
    )
    sender_t.publish(TOPIC, b"FL\x07\x01" + bytes(32) + b"not zstd")
    sender_t.publish(TOPIC, b"")
    status = Message(fleet="lab", sender="coordinator", body=DeviceStatus(state="online"))
    Channel(sender_t).send(TOPIC, status)
    assert good.get(timeout=5) == status
    errors = [bad.get(timeout=5) for _ in range(2)]
    assert all(topic == TOPIC and isinstance(e, DecodeError) for topic, e in errors)
    assert good.empty()


def test_retained_messages_must_fit_one_frame() -> None:
    sender_t, _ = pair(MemoryBroker())
    with pytest.raises(EncodeError, match="retained"):
        Channel(sender_t, max_payload=4096).send(TOPIC, model_message(), retain=True)


def test_latest_is_retained_when_it_fits_one_frame_and_else_sent_in_chunks() -> None:
    broker = MemoryBroker()
    sender_t, receiver_t = pair(broker)
    inbox: queue.Queue[Message] = queue.Queue()
    Channel(receiver_t).subscribe("fl/lab/to/dev-1/#", lambda _t, m: inbox.put(m))
    small = Message(fleet="lab", sender="coordinator", body=DeviceStatus(state="idle"))
    sent = Channel(sender_t).send(TOPIC, small, latest=True)
    retained = broker.retained(TOPIC)
    assert sent.frames == 1 and retained is not None
    big = Channel(sender_t, max_payload=4096).send(TOPIC, model_message(), latest=True)
    assert big.frames > 1
    assert broker.retained(TOPIC) == retained  # chunks are not retained
    assert inbox.get(timeout=5).kind == "device_status"
    assert inbox.get(timeout=5).kind == "model"


def test_decoded_weights_match_what_was_sent() -> None:
    sender_t, receiver_t = pair(MemoryBroker())
    inbox: queue.Queue[Message] = queue.Queue()
    Channel(receiver_t).subscribe("fl/lab/to/dev-1/#", lambda _t, m: inbox.put(m))
    weights = sample_weights("lenet5")
    sets = {"global": encode_tensors(weights, "fp32", shuffle=True)}
    Channel(sender_t, max_payload=10_000).send(
        TOPIC, Message(fleet="lab", sender="coordinator", body=ModelPayload(sets=sets))
    )
    arrays = inbox.get(timeout=5).tensor_sets()["global"].to_arrays()
    assert all(np.array_equal(arrays[k], v) for k, v in weights.items())
