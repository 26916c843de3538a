"""Issue 17 over a real Mosquitto: a flood of unfinished chunked transfers from one device
id (and from an unregistered one) does not block the honest devices' uploads, and an
upload damaged on the way is nacked and sent again by the device in time.

The coordinator and two real edge clients (threaded runtimes, real sessions) run in this
process; the attacker is a plain MQTT client on the devices' topics.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from coordinator.actions import Publish, RoundClosed
from coordinator.runtime import Coordinator
from coordinator.store import MemoryStore
from edge_client.config import ClientConfig
from edge_client.train.data import DeviceData
from edge_client.train.runtime import EdgeClient
from protocol.channel import Channel
from protocol.chunking import split_frame
from protocol.codec import Codec
from protocol.messages import Ack, DeviceStatus, Message, ReasonCode
from protocol.topics import Topics
from protocol.transport import MqttTransport, Transport
from protocol.transport.config import MqttConfig
from sim.datasets import load_dataset
from sim.partition import partition_dataset
from tests.coordinator.helpers import FLEET, config, hello, make_engine
from tests.protocol.brokers import Mosquitto

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow]

TOPICS = Topics(FLEET)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    with Mosquitto(tmp_path_factory.mktemp("mosquitto")) as mosquitto:
        yield mosquitto


def mqtt(broker: Mosquitto, client_id: str) -> MqttTransport:
    return MqttTransport(MqttConfig.from_url(broker.url, client_id=client_id))


class CorruptFirstUpdate(MqttTransport):
    """Flips one byte of the first update this device publishes (a fault on the way)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.corrupted = False

    def publish(self, topic: str, payload: bytes, **kwargs: Any) -> None:  # type: ignore[override]
        if topic.endswith("/update") and not self.corrupted and len(payload) > 200:
            self.corrupted = True
            payload = payload[:-10] + bytes([payload[-10] ^ 0xFF]) + payload[-9:]
        super().publish(topic, payload, **kwargs)


def wait_for(predicate: Any, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def clients(broker: Mosquitto, transports: list[Transport]) -> list[EdgeClient]:
    federation = partition_dataset(
        load_dataset("synthetic", seed=0, train_samples=400), 2, float("inf"), seed=0
    )
    out = []
    for split, transport in zip(federation.devices, transports, strict=True):
        data = DeviceData(
            split.device_id, split.train.x, split.train.y, split.test.x, split.test.y, 10
        )
        client_config = ClientConfig(
            device_id=split.device_id,
            fleet=FLEET,
            model="mlp",
            max_payload=4096,  # the update travels in chunks
            ack_timeout_s=20.0,
            exit_when_finished=True,
            # unauthenticated, as the coordinator of tests.coordinator.helpers.config: the
            # damaged upload must reach the decoder to be nacked (with keys, its tag fails
            # and the device resends after ack_timeout_s instead)
            insecure_no_auth=True,
        )
        out.append(EdgeClient(client_config, transport, data))
    return out


def junk_transfer(seed: int) -> bytes:
    """The first chunk of a transfer that never completes."""
    frame = b"FL\x03\x01" + np.random.default_rng(seed).bytes(20_000)
    return split_frame(frame, 4096)[0]


def test_a_flood_does_not_block_honest_uploads_and_a_damaged_upload_is_resent(
    broker: Mosquitto,
) -> None:
    # Prepare: a coordinator that waits for two devices; the attacker registers dev-evil
    # (then says it is offline, so it is not selected) and floods from it and a stranger
    cfg = config(min_devices=2, rounds=1, participation=1.0, round_timeout_s=120.0)
    cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"local_steps": 2})})
    store = MemoryStore()
    coordinator = Coordinator(cfg, mqtt(broker, "coordinator"), store, tick_s=0.05)
    acks: list[tuple[str, Ack]] = []
    closed: list[RoundClosed] = []

    def observe(action: object) -> None:
        if isinstance(action, Publish) and isinstance(action.message.body, Ack):
            acks.append((action.topic, action.message.body))
        if isinstance(action, RoundClosed):
            closed.append(action)

    coordinator.add_observer(observe)
    thread = threading.Thread(target=coordinator.run, daemon=True)
    thread.start()
    assert wait_for(lambda: store.read_meta("run") is not None, 10)  # it listens now
    attacker = mqtt(broker, "attacker")
    attacker.connect()
    channel = Channel(attacker, Codec())
    evil_hello = hello(make_engine(cfg, MemoryStore()), "dev-evil")
    channel.send(TOPICS.device("dev-evil", "hello"), evil_hello)
    assert wait_for(lambda: "dev-evil" in coordinator.engine.registry, 10)
    offline = Message(fleet=FLEET, sender="dev-evil", body=DeviceStatus(state="offline"))
    channel.send(TOPICS.device("dev-evil", "status"), offline)
    for i in range(100):  # fills the fleet-wide limit of 64 several times over
        attacker.publish(TOPICS.device("dev-evil", "update"), junk_transfer(i), qos=1)
        attacker.publish(TOPICS.device("ghost", "update"), junk_transfer(1000 + i), qos=1)
    assert attacker.flush(10)

    # Execute: two honest devices join; dev-b's first upload is damaged on the way
    transports: list[Transport] = [
        mqtt(broker, "device-0"),
        CorruptFirstUpdate(MqttConfig.from_url(broker.url, client_id="device-1")),
    ]
    devices = clients(broker, transports)
    for device in devices:
        device.start()
    stop_flood = threading.Event()

    def keep_flooding() -> None:
        i = 200
        while not stop_flood.is_set():
            attacker.publish(TOPICS.device("dev-evil", "update"), junk_transfer(i), qos=1)
            attacker.publish(TOPICS.device("ghost", "update"), junk_transfer(i + 1), qos=1)
            i += 2
            time.sleep(0.01)

    flood = threading.Thread(target=keep_flooding, daemon=True)
    flood.start()
    thread.join(120)
    stop_flood.set()
    flood.join(5)

    # Assert: the round closed with both honest updates, the damaged one after its nack
    assert not thread.is_alive()
    assert [c.round for c in closed] == [1] and closed[0].on_time == 2
    damaged = transports[1]
    assert isinstance(damaged, CorruptFirstUpdate) and damaged.corrupted
    device_1 = devices[1].device_id
    reasons = [a.reason for topic, a in acks if topic == TOPICS.to_device(device_1, "ack")]
    assert reasons == [ReasonCode.OK, ReasonCode.MALFORMED, ReasonCode.OK]  # hello, nack, update
    reassembler = coordinator.channel._reassembler
    limits = reassembler.limits
    assert reassembler.source_transfers(TOPICS.device("dev-evil", "update")) <= (
        limits.max_source_transfers
    )
    assert reassembler.source_transfers(TOPICS.device("ghost", "update")) == 0
    assert not any(t == TOPICS.to_device("ghost", "ack") for t, _ in acks)  # no nack to strangers
    for device in devices:
        device.stop()
    attacker.disconnect()
