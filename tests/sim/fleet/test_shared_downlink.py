"""A downlink the same for many devices is encoded once: the coordinator's channel
compresses one model message once and seals a copy per device, each copy verifies only
under its own device's key on its own topic, and the fleet decodes the copies once; in a
run, a round's devices at one precision get one model message (one id), byte counts as
before."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest

from coordinator.actions import Action, Publish, RoundClosed
from coordinator.config import TrainingSettings
from coordinator.runtime import Coordinator
from protocol.auth import AuthError, Keyring, verify
from protocol.channel import Channel
from protocol.codec import MESSAGE_PREFIX_SIZE, Codec
from protocol.messages import CoordinatorStatus, Message, ModelPayload
from protocol.tensorset import encode_tensors
from protocol.transport import Inbound, MemoryBroker, MemoryTransport, Transport
from sim.fleet import Fleet
from sim.fleet.pool import SharedDecodes
from sim.run import SimConfig, build_federation, device_data, fleet_keyring

DEVICES = ("dev-000", "dev-001", "dev-002")
KEYS = {d: bytes([i + 1]) * 32 for i, d in enumerate(DEVICES)}


class CountingCodec(Codec):
    """A codec that counts the model messages it encodes, by round."""

    def __init__(self) -> None:
        super().__init__()
        self.models: Counter[int] = Counter()
        self._lock = threading.Lock()

    def encode(self, message: Message) -> bytes:
        if isinstance(message.body, ModelPayload):
            with self._lock:
                self.models[message.round] += 1
        return super().encode(message)


def _model_message() -> Message:
    rng = np.random.default_rng(0)
    weights = {"w": rng.standard_normal((64, 32)).astype(np.float32)}
    body = ModelPayload(sets={"global": encode_tensors(weights)})
    return Message(fleet="sim", sender="coordinator", round=1, body=body)


def _raw_frames(broker: MemoryBroker) -> tuple[Transport, dict[str, bytes]]:
    """A listener keeping the raw payload of each device's model topic."""
    frames: dict[str, bytes] = {}
    listener = MemoryTransport(broker, "listener")
    listener.connect()

    def keep(inbound: Inbound) -> None:
        frames[inbound.topic] = inbound.payload

    listener.subscribe("fl/sim/to/+/model", keep)
    return listener, frames


def test_one_model_to_many_devices_is_encoded_once_and_sealed_per_device() -> None:
    broker = MemoryBroker()
    listener, frames = _raw_frames(broker)
    sender = MemoryTransport(broker, "coordinator")
    sender.connect()
    codec = CountingCodec()
    channel = Channel(sender, codec, auth=Keyring(KEYS))
    model = _model_message()

    for device_id in DEVICES:
        channel.send(f"fl/sim/to/{device_id}/model", model)
    assert listener.flush(5.0)

    assert codec.models == {1: 1}  # compressed once for the three devices
    assert len(frames) == len(DEVICES)
    bodies = {frame[MESSAGE_PREFIX_SIZE:] for frame in frames.values()}
    assert len(bodies) == 1  # the same message bytes ...
    assert len({frame[:MESSAGE_PREFIX_SIZE] for frame in frames.values()}) == len(DEVICES)
    for device_id in DEVICES:  # ... each copy with its own device's tag
        topic = f"fl/sim/to/{device_id}/model"
        verify(KEYS[device_id], topic, frames[topic])
        for other in DEVICES:
            if other != device_id:
                with pytest.raises(AuthError):
                    verify(KEYS[other], topic, frames[topic])
                with pytest.raises(AuthError):  # nor on another device's topic
                    verify(KEYS[device_id], f"fl/sim/to/{other}/model", frames[topic])


def test_the_fleet_decodes_the_copies_once_each_checked_under_its_key() -> None:
    broker = MemoryBroker()
    sender = MemoryTransport(broker, "coordinator")
    sender.connect()
    receiver = MemoryTransport(broker, "fleet-000")
    receiver.connect()
    shared = SharedDecodes(Codec())
    inbox = Channel(receiver, shared, auth=Keyring(KEYS))
    got: dict[str, Message] = {}
    refused: list[str] = []
    for device_id in DEVICES:
        inbox.subscribe(
            f"fl/sim/to/{device_id}/#",
            lambda topic, message: got.__setitem__(topic.split("/")[3], message),
            on_error=lambda topic, error: refused.append(topic.split("/")[3]),
        )
    model = _model_message()
    outbox = Channel(sender, Codec(), auth=Keyring(KEYS))
    for device_id in DEVICES:
        outbox.send(f"fl/sim/to/{device_id}/model", model)
    # a copy sealed under another device's key: the same message bytes, refused
    forged = Channel(sender, Codec(), auth=Keyring({DEVICES[0]: KEYS[DEVICES[1]]}))
    forged.send(f"fl/sim/to/{DEVICES[0]}/model", model)
    assert receiver.flush(5.0)

    assert set(got) == set(DEVICES) and refused == [DEVICES[0]]
    first = got[DEVICES[0]]
    assert all(message is first for message in got.values())  # one decoding, shared
    assert first == model
    assert shared.shared == len(DEVICES) - 1


QUICK = TrainingSettings(local_epochs=1, local_steps=1, batch_size=16)


@contextlib.contextmanager
def _run(config: SimConfig, codec: Codec) -> Iterator[tuple[Fleet, list[int]]]:
    """A coordinator (its channel on ``codec``) and its fleet over one in-memory broker."""
    broker = MemoryBroker()
    federation, shape = build_federation(config)
    keyring = fleet_keyring([d.device_id for d in federation.devices])
    coordinator = Coordinator(
        config.coordinator_config(federation.num_classes, shape),
        MemoryTransport(broker, "coordinator"),
        codec=codec,
        keyring=keyring,
    )
    devices = [
        (config.device_config(i, s.device_id, keyring[s.device_id]), device_data(federation, i))
        for i, s in enumerate(federation.devices)
    ]
    fleet = Fleet(devices, lambda client: MemoryTransport(broker, client))
    closed: list[int] = []
    up = threading.Event()

    def observe(action: Action) -> None:
        if isinstance(action, RoundClosed):
            closed.append(action.on_time)
        elif isinstance(action, Publish):
            body = action.message.body
            if isinstance(body, CoordinatorStatus) and body.state != "starting":
                up.set()

    coordinator.add_observer(observe)
    thread = threading.Thread(target=coordinator.run, daemon=True)
    thread.start()
    try:
        # devices join a coordinator that is up (as the sim's do): one that joins while
        # it starts announces itself twice and gets its task twice
        assert up.wait(30)
        fleet.start()
        thread.join(120)
        assert not thread.is_alive(), "the run did not finish"
        yield fleet, closed
    finally:
        coordinator.stop()
        thread.join(10)
        fleet.close()


def test_a_run_sends_each_round_one_model_message_per_precision() -> None:
    config = SimConfig(
        devices=6,
        connections=2,
        rounds=2,
        participation=1.0,
        training=QUICK,
        model="mlp",
        transport="inproc",
        device_precisions=("fp32", "int8"),
    )
    codec = CountingCodec()
    with _run(config, codec) as (fleet, closed):
        assert closed == [6, 6]
        # fp32 and int8 devices, each precision's model compressed once a round (round
        # 2's int8 one a delta against the model the int8 devices all hold)
        assert codec.models == {1: 2, 2: 2}
        # the fleet decoded each round's two models once each, for its six devices
        assert fleet._pool.codec.shared == 2 * (6 - 2)
        out, inn = fleet.traffic()
        assert out.messages > 0 and inn.payload_bytes > 0
