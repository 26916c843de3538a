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

from collections.abc import Iterator

import pytest

from coordinator.actions import Publish
from protocol.auth import Keyring, new_key
from protocol.channel import Channel
from protocol.messages import CoordinatorStatus, Message
from protocol.signing import SigningKey
from protocol.tensors import Precision
from protocol.topics import Topics
from protocol.transport import MqttConfig, MqttTransport
from tests.coordinator.mqtt_fleet import DEADLINE_S, device_ids, run_fleet
from tests.protocol.brokers import Mosquitto

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow]

FLEET = "forged"
ROUNDS, DEVICES = 3, 2


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
    keys = {device: new_key() for device in device_ids(DEVICES)}
    attacker = Attacker(broker.url)
    attacker.strike()  # before anything starts: a retained forged "finished"

    def strike_at_each_task(action: object) -> None:
        if isinstance(action, Publish) and action.topic.endswith("/task"):
            attacker.strike()  # while the devices train

    # Execute
    run = run_fleet(
        broker.url,
        FLEET,
        ROUNDS,
        keys,
        signing,
        observer=strike_at_each_task,
        downlink_precision=Precision.INT8,
        uplink_precision=Precision.INT8,
    )
    attacker.transport.disconnect()
    # Assert: every round closed with every update, long before its deadline, and the
    # devices stopped at the real "finished" only
    assert run.finished
    assert [(c.round, c.on_time, c.selected) for c in run.closed] == [
        (r, DEVICES, DEVICES) for r in range(1, ROUNDS + 1)
    ]
    assert all(c.duration_s < DEADLINE_S / 2 for c in run.closed), [
        c.duration_s for c in run.closed
    ]
    refused = [a for a in run.acks if not a.accepted]
    assert not refused, [(a.reason, a.detail) for a in refused]
    assert run.elapsed_s < ROUNDS * DEADLINE_S
    assert attacker.sent >= 4 * (ROUNDS + 1)
