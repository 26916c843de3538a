"""Forged fleet-wide frames over a real Mosquitto with no ACL (anyone may publish): the
coordinator's status is signed, so a forged ``starting`` while the devices train, or a
forged retained ``finished``, changes nothing (docs/protocol.md, section 2.5).

The hole this closes: one untagged ``starting`` made every device say hello again; the
coordinator re-sent the task with a newly encoded model, which overwrote the device's
delta base, so its int8 delta upload was refused ``unknown_base`` (12 of 12 honest updates
lost over 4 rounds, each round at its deadline). A forged retained ``finished`` stopped
every device, and the run never ended.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from coordinator.actions import Publish, RoundClosed
from coordinator.config import CoordinatorConfig, TrainingSettings
from coordinator.runtime import Coordinator
from edge_client.config import ClientConfig
from edge_client.train.data import DeviceData
from edge_client.train.runtime import EdgeClient
from protocol.auth import Keyring, new_key
from protocol.channel import Channel
from protocol.messages import Ack, CoordinatorStatus, Message
from protocol.signing import SigningKey
from protocol.tensors import Precision
from protocol.topics import Topics
from protocol.transport import MqttConfig, MqttTransport
from sim.datasets import load_dataset
from sim.partition import partition_dataset
from tests.protocol.brokers import Mosquitto

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow]

FLEET = "forged"
ROUNDS, DEVICES, DEADLINE_S = 3, 2, 60.0


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    with Mosquitto(tmp_path_factory.mktemp("forged")) as running:
        yield running


class Attacker:
    """Anyone on the broker: publishes unsigned statuses, and statuses signed by a key of
    its own, each time the coordinator sends a task."""

    def __init__(self, url: str) -> None:
        self.transport = MqttTransport(MqttConfig.from_url(url, client_id="attacker"))
        self.transport.connect()
        self.unsigned = Channel(self.transport)
        self.impostor = Channel(self.transport, auth=Keyring(), fleet_key=SigningKey.generate())
        self.topic = Topics(FLEET).coordinator_status
        self.sent = 0

    def status(self, state: str) -> Message:
        body = CoordinatorStatus(state=state)  # type: ignore[arg-type]
        return Message(fleet=FLEET, sender="coordinator", body=body)

    def strike(self) -> None:
        for channel in (self.unsigned, self.impostor):
            channel.send(self.topic, self.status("starting"))
            channel.send(self.topic, self.status("finished"), retain=True)
            self.sent += 2


def test_forged_statuses_lose_no_update_and_stop_no_device(broker: Mosquitto) -> None:
    # Prepare: a coordinator with int8 transfers (deltas both ways), two edge clients with
    # its public key, and an attacker who has already retained a forged "finished"
    signing = SigningKey.generate()
    synthetic = load_dataset("synthetic", seed=0, train_samples=400)
    splits = partition_dataset(synthetic, DEVICES, float("inf"), seed=0).devices
    keys = {split.device_id: new_key() for split in splits}
    config = CoordinatorConfig(
        fleet=FLEET,
        strategy="fedavg",
        model="mlp",
        rounds=ROUNDS,
        participation=1.0,
        min_devices=DEVICES,
        round_timeout_s=DEADLINE_S,
        downlink_precision=Precision.INT8,
        uplink_precision=Precision.INT8,
        training=TrainingSettings(local_steps=2, batch_size=16),
    )
    coordinator = Coordinator(
        config,
        MqttTransport(MqttConfig.from_url(broker.url, client_id="forged-coordinator")),
        keyring=Keyring(keys),
        signing_key=signing,
    )
    attacker = Attacker(broker.url)
    attacker.strike()  # before anything starts: a retained forged "finished"
    closed: list[RoundClosed] = []
    acks: list[Ack] = []

    def observe(action: object) -> None:
        if isinstance(action, RoundClosed):
            closed.append(action)
        elif isinstance(action, Publish) and action.topic.endswith("/task"):
            attacker.strike()  # while the devices train
        elif isinstance(action, Publish) and isinstance(action.message.body, Ack):
            acks.append(action.message.body)

    coordinator.add_observer(observe)
    clients = [
        EdgeClient(
            ClientConfig.from_broker_url(
                broker.url,
                device_id=split.device_id,
                fleet=FLEET,
                model="mlp",
                auth_key=keys[split.device_id].hex(),
                coordinator_key=signing.verify_key.public.hex(),
                exit_when_finished=True,
            ),
            MqttTransport(MqttConfig.from_url(broker.url, client_id=split.device_id)),
            DeviceData(
                split.device_id, split.train.x, split.train.y, split.test.x, split.test.y, 10
            ),
        )
        for split in splits
    ]
    outcome: dict[str, object] = {}
    thread = threading.Thread(
        target=lambda: outcome.setdefault("models", coordinator.run()), daemon=True
    )
    # Execute
    started = time.monotonic()
    thread.start()
    for client in clients:
        client.start()
    thread.join(ROUNDS * DEADLINE_S)
    finished = [client.wait(30) for client in clients]
    elapsed = time.monotonic() - started
    attacker.transport.disconnect()
    # Assert: every round closed with every update, long before its deadline, and the
    # devices stopped at the real "finished" only
    assert not thread.is_alive() and "models" in outcome
    assert [(c.round, c.on_time, c.selected) for c in closed] == [
        (r, DEVICES, DEVICES) for r in range(1, ROUNDS + 1)
    ]
    assert all(c.duration_s < DEADLINE_S / 2 for c in closed), [c.duration_s for c in closed]
    refused = [a for a in acks if not a.accepted]
    assert not refused, [(a.reason, a.detail) for a in refused]
    assert all(finished) and elapsed < ROUNDS * DEADLINE_S
    assert attacker.sent >= 4 * (ROUNDS + 1)
