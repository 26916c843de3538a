"""Issue 17: nobody without a device's key joins, impersonates it, or replays its messages.

A real coordinator runtime with a keyring, real HMAC-SHA256, honest devices driven by
hand over a broker (Mosquitto where installed, and the in-memory one), and an attacker
who may publish anything on any topic.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.__main__ import main as coordinator_main
from coordinator.errors import ConfigError
from coordinator.runtime import Coordinator
from coordinator.state import RunState
from coordinator.store import MemoryStore
from protocol.auth import Keyring, new_key, seal
from protocol.channel import Channel
from protocol.messages import Ack, Message, ReasonCode, RoundTask
from protocol.topics import Topics
from protocol.transport import MemoryBroker, MemoryTransport, MqttConfig, MqttTransport, Transport
from tests.coordinator.helpers import (
    FLEET,
    GROUP,
    config,
    hello,
    make_engine,
    shapes_of,
    status,
    update,
)
from tests.protocol.brokers import Mosquitto

DEVICES = ("dev-0", "dev-1")
TOPICS = Topics(FLEET)


class Inbox:
    """What one device's channel received, by kind."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.cond = threading.Condition()

    def __call__(self, topic: str, message: Message) -> None:
        with self.cond:
            self.messages.append(message)
            self.cond.notify_all()

    def wait_for(self, predicate: Callable[[Message], bool], timeout: float = 15.0) -> Message:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                found = [m for m in self.messages if predicate(m)]
                if found:
                    return found[-1]
                remaining = deadline - time.monotonic()
                assert remaining > 0, [m.kind for m in self.messages]
                self.cond.wait(remaining)

    def acks_for(self, message_id: str) -> list[Ack]:
        with self.cond:
            return [
                m.body
                for m in self.messages
                if isinstance(m.body, Ack) and m.body.ref == message_id
            ]


class Fleet:
    """A coordinator with a keyring, two honest devices (channels with their own keys)
    and an attacker's raw transport and channel."""

    def __init__(self, make_transport: Callable[[str], Transport], **overrides: Any) -> None:
        self.keys = {d: new_key() for d in DEVICES}
        self.cfg = config(
            min_devices=2, rounds=2, insecure_no_auth=False, round_timeout_s=60.0, **overrides
        )
        self.store = MemoryStore()
        self.coordinator = Coordinator(
            self.cfg,
            make_transport("coordinator"),
            self.store,
            tick_s=0.02,
            keyring=Keyring(self.keys),
        )
        self.engine = make_engine(self.cfg, MemoryStore())
        self.thread = threading.Thread(target=self.coordinator.run, daemon=True)
        self.devices: dict[str, Channel] = {}
        self.inbox = {d: Inbox() for d in DEVICES}
        for device_id in DEVICES:
            transport = make_transport(device_id)
            transport.connect()
            channel = Channel(transport, auth=Keyring({device_id: self.keys[device_id]}))
            channel.subscribe(TOPICS.device_inbox(device_id), self.inbox[device_id])
            self.devices[device_id] = channel
        self.attacker_transport = make_transport("attacker")
        self.attacker_transport.connect()
        wrong = Keyring({d: new_key() for d in (*DEVICES, "intruder")})
        self.attacker = Channel(self.attacker_transport, auth=wrong)

    def weights(self, value: float) -> dict[str, np.ndarray]:
        return {k: np.full(s, value, np.float32) for k, s in shapes_of(self.engine).items()}

    def join(self) -> dict[str, Message]:
        """Start the coordinator, announce both devices, return each one's round-1 task."""
        self.thread.start()
        deadline = time.monotonic() + 15
        while self.store.read_meta("run") is None:  # subscribed: hellos now reach it
            assert time.monotonic() < deadline, "the coordinator did not start"
            time.sleep(0.02)
        for device_id, channel in self.devices.items():
            channel.send(TOPICS.device(device_id, "status"), status(device_id, "idle"))
            channel.send(TOPICS.device(device_id, "hello"), hello(self.engine, device_id))
        return {
            d: self.inbox[d].wait_for(lambda m: isinstance(m.body, RoundTask) and m.round == 1)
            for d in DEVICES
        }

    def close(self) -> None:
        self.coordinator.stop()
        self.thread.join(10)
        for channel in self.devices.values():
            channel.transport.disconnect()
        self.attacker_transport.disconnect()


def _mqtt(url: str) -> Callable[[str], Transport]:
    def make(client_id: str) -> Transport:
        return MqttTransport(MqttConfig.from_url(url, client_id=f"auth-{client_id}"))

    return make


@pytest.fixture(scope="module")
def mosquitto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    with Mosquitto(tmp_path_factory.mktemp("mosquitto")) as broker:
        yield broker


@pytest.fixture
def memory_fleet() -> Iterator[Fleet]:
    broker = MemoryBroker()
    fleet = Fleet(lambda client_id: MemoryTransport(broker, client_id))
    yield fleet
    fleet.close()


def test_a_forged_update_on_an_honest_device_topic_is_refused_over_mosquitto(
    mosquitto: Mosquitto,
) -> None:
    # Prepare: the attack of issue 17, on a real broker
    fleet = Fleet(_mqtt(mosquitto.url))
    try:
        tasks = fleet.join()
        started = time.monotonic()
        forged = update("dev-0", 1, fleet.weights(3.0), 100, task=tasks["dev-0"])
        # Execute: the forged update, with the right task id, under a wrong key
        fleet.attacker.send(TOPICS.device("dev-0", "update"), forged)
        time.sleep(0.5)
        assert not fleet.store.exists(RunState.update_key("dev-0", 1))
        honest = {d: update(d, 1, fleet.weights(0.5), 100, task=tasks[d]) for d in DEVICES}
        for device_id, message in honest.items():
            fleet.devices[device_id].send(TOPICS.device(device_id, "update"), message)
        acks = {
            d: fleet.inbox[d].wait_for(
                lambda m, d=d: isinstance(m.body, Ack) and m.body.ref == honest[d].message_id
            )
            for d in DEVICES
        }
        fleet.inbox["dev-0"].wait_for(lambda m: isinstance(m.body, RoundTask) and m.round == 2)
        # Assert: the honest updates were taken, the round closed without waiting for its
        # deadline, no ack was sent for the forgery, and the model holds no 3.0
        assert all(
            isinstance(a.body, Ack) and a.body.reason == ReasonCode.OK for a in acks.values()
        )
        assert time.monotonic() - started < 30
        assert fleet.inbox["dev-0"].acks_for(forged.message_id) == []
        model = fleet.coordinator.engine.models()[GROUP]["aca"]
        assert all(np.allclose(v, 0.5) for v in model.values())
    finally:
        fleet.close()


def test_forged_hellos_never_register_and_are_never_selected(memory_fleet: Fleet) -> None:
    # Prepare: 50 hellos with the fleet's fingerprint, from devices nobody registered, and
    # their online statuses; then one under an honest device's id with a wrong key
    fleet = memory_fleet
    fleet.thread.start()
    for i in range(50):
        intruder = f"intruder-{i}"
        fleet.attacker.transport.publish(
            TOPICS.device(intruder, "status"),
            fleet.attacker.codec.encode(status(intruder, "idle")),
        )
        fleet.attacker.transport.publish(
            TOPICS.device(intruder, "hello"),
            fleet.attacker.codec.encode(hello(fleet.engine, intruder)),
        )
    fleet.attacker.send(TOPICS.device("dev-0", "hello"), hello(fleet.engine, "dev-0"))
    # Execute: the honest devices join
    for device_id, channel in fleet.devices.items():
        channel.send(TOPICS.device(device_id, "status"), status(device_id, "idle"))
        channel.send(TOPICS.device(device_id, "hello"), hello(fleet.engine, device_id))
    tasks = {d: fleet.inbox[d].wait_for(lambda m: isinstance(m.body, RoundTask)) for d in DEVICES}
    # Assert: only the two honest devices are registered, online and selected
    engine = fleet.coordinator.engine
    assert set(engine.registry.entries) == set(DEVICES)
    assert engine.registry.online() == sorted(DEVICES)
    assert set(tasks) == set(DEVICES)
    assert not [k for k in fleet.store.keys() if "intruder" in k]  # noqa: SIM118


def test_a_replayed_update_a_moved_one_and_a_tampered_one_change_nothing(
    memory_fleet: Fleet,
) -> None:
    # Prepare
    fleet = memory_fleet
    tasks = fleet.join()
    dev0, dev1 = fleet.devices["dev-0"], fleet.devices["dev-1"]
    first = update("dev-0", 1, fleet.weights(0.5), 100, task=tasks["dev-0"])
    dev0.send(TOPICS.device("dev-0", "update"), first)
    fleet.inbox["dev-0"].wait_for(
        lambda m: isinstance(m.body, Ack) and m.body.ref == first.message_id
    )
    stored = fleet.store.snapshot()
    # Execute: the sealed frame of dev-0's update, replayed as is; moved to dev-1's topic;
    # with one byte changed
    frame = dev0.encode(TOPICS.device("dev-0", "update"), first)
    raw = fleet.attacker_transport
    raw.publish(TOPICS.device("dev-0", "update"), frame)
    raw.publish(TOPICS.device("dev-1", "update"), frame)
    tampered = bytearray(frame)
    tampered[-10] ^= 0x01
    raw.publish(TOPICS.device("dev-0", "update"), bytes(tampered))
    # a message of dev-0 sealed with dev-0's key for dev-1's topic is refused too
    moved = Message(fleet=FLEET, sender="dev-1", round=1, body=first.body)
    raw.publish(
        TOPICS.device("dev-1", "update"),
        seal(fleet.keys["dev-0"], TOPICS.device("dev-0", "update"), dev1.codec.encode(moved)),
    )
    time.sleep(0.5)
    assert fleet.coordinator.transport.flush(5)
    # Assert: nothing stored changed; the replay was answered as the duplicate it is and
    # dev-1 got no ack for anything it did not send
    assert fleet.store.keys() == stored.keys()
    assert not fleet.store.exists(RunState.update_key("dev-1", 1))
    replies = fleet.inbox["dev-0"].acks_for(first.message_id)
    assert replies[0].reason == ReasonCode.OK
    assert all(a.reason == ReasonCode.DUPLICATE for a in replies[1:])
    assert fleet.inbox["dev-1"].acks_for(first.message_id) == []
    assert fleet.inbox["dev-1"].acks_for(moved.message_id) == []


def test_an_update_outside_the_replay_window_is_refused_with_a_reason(
    memory_fleet: Fleet,
) -> None:
    # Prepare: dev-0's update as it was sent an hour ago (a replay, or a wrong clock)
    fleet = memory_fleet
    tasks = fleet.join()
    old = update("dev-0", 1, fleet.weights(0.5), 100, task=tasks["dev-0"]).model_copy(
        update={"sent_at_ms": int((time.time() - 3600) * 1000)}
    )
    # Execute
    fleet.devices["dev-0"].send(TOPICS.device("dev-0", "update"), old)
    ack = fleet.inbox["dev-0"].wait_for(
        lambda m: isinstance(m.body, Ack) and m.body.ref == old.message_id
    )
    # Assert
    assert isinstance(ack.body, Ack)
    assert not ack.body.accepted and ack.body.reason == ReasonCode.REPLAYED
    assert not fleet.store.exists(RunState.update_key("dev-0", 1))


def test_a_replayed_online_status_does_not_bring_a_device_back(memory_fleet: Fleet) -> None:
    # Prepare: dev-1's sealed "idle" status, captured, then dev-1 goes offline
    fleet = memory_fleet
    fleet.join()
    dev1 = fleet.devices["dev-1"]
    topic = TOPICS.device("dev-1", "status")
    captured = dev1.encode(topic, status("dev-1", "idle"))
    dev1.transport.publish(topic, captured)
    dev1.send(topic, status("dev-1", "offline"))
    engine = fleet.coordinator.engine
    deadline = time.monotonic() + 5
    while "dev-1" in engine.registry.online() and time.monotonic() < deadline:
        time.sleep(0.02)
    # Execute: the attacker replays the captured frame
    fleet.attacker_transport.publish(topic, captured)
    time.sleep(0.3)
    assert fleet.coordinator.transport.flush(5)
    # Assert
    assert engine.registry.online() == ["dev-0"]


def test_a_coordinator_without_keys_refuses_to_start(tmp_path: Path) -> None:
    # Prepare
    transport = MemoryTransport(MemoryBroker(), "coordinator")
    keyring = tmp_path / "keys.json"
    Keyring({"dev-0": new_key()}).save(keyring)
    # Execute, Assert
    with pytest.raises(ConfigError, match="no device keys"):
        Coordinator(config(insecure_no_auth=False), transport)
    with pytest.raises(ConfigError, match="not both"):
        Coordinator(config(insecure_no_auth=True, device_keys=keyring), transport)
    loaded = Coordinator(config(insecure_no_auth=False, device_keys=keyring), transport)
    assert loaded.keyring is not None and list(loaded.keyring) == ["dev-0"]
    assert keyring.stat().st_mode & 0o777 == 0o600
    code = coordinator_main(["--broker", "mqtt://127.0.0.1:9", "--model", "mlp"])
    assert code == 2
