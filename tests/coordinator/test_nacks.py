"""Issue 17: every rejected update of a known device is answered with a nack (an ack with a
reason code), over the coordinator runtime and the in-memory broker; bad input from
unknown devices is answered by nothing; the same update twice is counted once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zstandard

from coordinator.actions import Publish
from coordinator.runtime import Coordinator
from coordinator.store import MemoryStore
from protocol.channel import Channel
from protocol.codec import FRAME_MAGIC, FRAME_MESSAGE, TAG_SIZE, Codec
from protocol.messages import PROTOCOL_VERSION, Ack, Message, ReasonCode
from protocol.topics import Topics
from protocol.transport import MemoryBroker, MemoryTransport
from tests.coordinator.helpers import FLEET, config, hello, make_engine, shapes_of, update

TOPICS = Topics(FLEET)


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


class Run:
    """A coordinator of two registered devices in round 1, and an attacker's channel."""

    def __init__(self) -> None:
        self.broker, self.store = MemoryBroker(), MemoryStore()
        self.cfg = config(min_devices=2, rounds=2, round_timeout_s=60.0)
        transport = MemoryTransport(self.broker, "coordinator")
        self.coordinator = Coordinator(self.cfg, transport, self.store, tick_s=0.02)
        self.acks: list[tuple[str, Ack]] = []
        self.tasks: dict[str, Message] = {}
        self.coordinator.add_observer(self._observe)
        self.thread = threading.Thread(target=self.coordinator.run, daemon=True)
        self.thread.start()
        assert wait_for(lambda: self.store.read_meta("run") is not None)  # it listens now
        self.transport = MemoryTransport(self.broker, "attacker")
        self.transport.connect()
        self.channel = Channel(self.transport)
        engine = make_engine(self.cfg, MemoryStore())
        self.weights = {k: np.zeros(s, np.float32) for k, s in shapes_of(engine).items()}
        for device in ("dev-0", "dev-1"):
            self.channel.send(TOPICS.device(device, "hello"), hello(engine, device))
        assert wait_for(lambda: len(self.tasks) == 2)

    def _observe(self, action: object) -> None:
        if isinstance(action, Publish) and isinstance(action.message.body, Ack):
            self.acks.append((action.topic.split("/")[3], action.message.body))
        if isinstance(action, Publish) and action.topic.endswith("/task"):
            self.tasks[action.topic.split("/")[3]] = action.message

    def update(self, device: str) -> Message:
        return update(device, 1, self.weights, 50, task=self.tasks[device])

    def acks_of(self, device: str, count: int) -> list[Ack]:
        def enough() -> bool:
            return len([a for d, a in self.acks if d == device]) >= count

        assert wait_for(enough), self.acks
        return [a for d, a in self.acks if d == device]

    def close(self) -> None:
        self.coordinator.stop()
        self.thread.join(5)
        self.transport.disconnect()


@pytest.fixture
def run() -> Iterator[Run]:
    running = Run()
    yield running
    running.close()


def frame(envelope: dict[str, Any], *, checksum: bool = True) -> bytes:
    packed = msgpack.packb(envelope, use_bin_type=True)
    header = FRAME_MAGIC + bytes((PROTOCOL_VERSION, FRAME_MESSAGE)) + bytes(TAG_SIZE)
    return header + zstandard.ZstdCompressor(write_checksum=checksum).compress(packed)


def test_a_frame_without_content_checksum_is_refused_with_a_nack(run: Run) -> None:
    message = run.update("dev-0")
    run.transport.publish(
        TOPICS.device("dev-0", "update"), frame(Codec().envelope(message), checksum=False)
    )
    (_, nack) = run.acks_of("dev-0", 2)  # the hello's ack, then this one
    assert not nack.accepted and nack.reason is ReasonCode.MALFORMED
    assert "checksum" in nack.detail and nack.ref is None
    assert not run.store.keys("updates")


def shorten(tensor: Any) -> list[Any]:
    """A tensor (msgpack array: name, shape, dtype, encoding, ..., data, ...) whose data
    lacks bytes."""
    fields = list(tensor)
    fields[5] = fields[5][:-3]
    return fields


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda b: b.update(num_samples=-5), id="negative-sample-count"),
        pytest.param(lambda b: b.update(num_samples=2**40), id="huge-sample-count"),
        pytest.param(
            lambda b: b["sets"]["weights"].update(tensors=[*b["sets"]["weights"]["tensors"]] * 2),
            id="duplicate-tensor-names",
        ),
        pytest.param(
            lambda b: b["sets"]["weights"].update(
                tensors=[shorten(b["sets"]["weights"]["tensors"][0])]
            ),
            id="short-data",
        ),
    ],
)
def test_an_update_that_fails_decoding_gets_a_nack_naming_it(
    run: Run, damage: Callable[[dict[str, Any]], None]
) -> None:
    message = run.update("dev-0")
    envelope = Codec().envelope(message)
    damage(envelope["body"])
    run.transport.publish(TOPICS.device("dev-0", "update"), frame(envelope))

    (_, nack) = run.acks_of("dev-0", 2)
    assert not nack.accepted and nack.reason is ReasonCode.MALFORMED
    assert nack.ref == message.message_id
    assert not run.store.keys("updates")

    run.channel.send(TOPICS.device("dev-0", "update"), message)  # the device's resend
    (_, _, ack) = run.acks_of("dev-0", 3)
    assert ack.accepted and ack.reason is ReasonCode.OK and ack.ref == message.message_id


def test_the_same_update_twice_is_counted_once(run: Run) -> None:
    message = run.update("dev-0")
    run.channel.send(TOPICS.device("dev-0", "update"), message)
    run.channel.send(TOPICS.device("dev-0", "update"), message)

    (_, first, second) = run.acks_of("dev-0", 3)
    assert (first.reason, second.reason) == (ReasonCode.OK, ReasonCode.DUPLICATE)
    assert run.store.keys("updates") == ["updates/dev-0/r000001"]


def test_bad_input_from_an_unknown_device_gets_no_answer(run: Run) -> None:
    run.transport.publish(TOPICS.device("ghost", "update"), b"FL\x03\x01junk")
    run.transport.publish(TOPICS.device("dev-0", "update"), b"FL\x03\x01junk")
    run.acks_of("dev-0", 2)  # the known device's nack arrived, so the ghost's input was seen
    assert not any(device == "ghost" for device, _ in run.acks)


def test_a_bad_update_with_an_out_of_range_round_is_nacked_in_the_current_round(
    run: Run,
) -> None:
    message = run.update("dev-0")
    envelope = Codec().envelope(message)
    envelope["round"] = 2**40
    run.transport.publish(TOPICS.device("dev-0", "update"), frame(envelope))
    (_, nack) = run.acks_of("dev-0", 2)
    assert nack.reason is ReasonCode.MALFORMED and nack.ref == message.message_id
    assert run.thread.is_alive()
