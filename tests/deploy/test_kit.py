"""The kit against a real Mosquitto started from the configuration ``python -m deploy`` wrote.

One broker per module runs the kit of fleet ``lab`` with both listeners (client
certificates, passwords). What the ACL forbids is shown two ways: over MQTT 3.1.1 a denied
publish is dropped silently, so a forged message is sent before a control message on the
same connection and must not have arrived when the control one does (the broker keeps
one connection's order); over MQTT 5 the broker's PUBACK says 0x87, not authorized.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from protocol.errors import TransportError
from protocol.topics import Topics
from protocol.transport.base import Inbound, MqttVersion
from protocol.transport.config import MqttConfig, TlsConfig
from protocol.transport.mqtt import MqttTransport
from tests.deploy.kit_broker import KitBroker, deploy, kit_broker
from tests.protocol.brokers import LOOPBACK

pytestmark = pytest.mark.mosquitto

FLEET = "lab"
LAB = Topics(FLEET)
OTHER = Topics("other")
NOT_AUTHORIZED = 0x87
REFUSAL_S = 1.5
"""How long a refused client waits for a CONNACK that never comes (the broker ends the
TLS session; paho reports no refusal of its own)."""


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KitBroker]:
    kit = tmp_path_factory.mktemp("deploy") / "lab"
    with kit_broker(kit, FLEET, certificates=["dev-1", "dev-2"], passwords=["dev-3"]) as running:
        yield running


class Inbox:
    """A connected client and what arrived on its subscriptions."""

    def __init__(self, config: MqttConfig, *filters: str) -> None:
        self.transport = MqttTransport(config)
        self.messages: queue.Queue[Inbound] = queue.Queue()
        self.transport.connect(timeout=5)
        for topic_filter in filters:
            self.transport.subscribe(topic_filter, self.messages.put)

    def next(self) -> tuple[str, bytes]:
        message = self.messages.get(timeout=5)
        return message.topic, message.payload

    def assert_empty(self) -> None:
        assert self.messages.empty(), self.messages.get_nowait()

    def close(self) -> None:
        self.transport.disconnect()


@pytest.fixture
def coordinator(broker: KitBroker) -> Iterator[Inbox]:
    """The coordinator, subscribed as the real one is: to every device topic of the fleet."""
    inbox = Inbox(broker.client("coordinator"), LAB.from_devices())
    yield inbox
    inbox.close()


def publish(config: MqttConfig, *messages: tuple[str, bytes]) -> None:
    with MqttTransport(config) as transport:
        transport.connect(timeout=5)
        for topic, payload in messages:
            transport.publish(topic, payload)


def puback_reasons(config: MqttConfig, *topics: str) -> list[str]:
    """Publish to each topic over MQTT 5 (paho directly: the transport does not surface
    PUBACK reason codes) and return, in order, what the broker's PUBACK said: "ok" (0x00,
    or 0x10 when nobody is subscribed), "refused" (0x87, not authorized) or the code."""
    assert config.tls is not None
    client = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
    tls = config.tls
    client.tls_set(
        ca_certs=str(tls.ca_file),
        certfile=str(tls.cert_file) if tls.cert_file else None,
        keyfile=str(tls.key_file) if tls.key_file else None,
    )
    if config.username is not None:
        secret = config.password.get_secret_value() if config.password else None
        client.username_pw_set(config.username, secret)
    connected, acked = threading.Event(), threading.Event()
    reasons: dict[int, int] = {}

    def on_publish(
        client: paho.Client, userdata: object, mid: int, reason: object, props: object
    ) -> None:
        reasons[mid] = reason.value  # type: ignore[attr-defined]
        if len(reasons) == len(topics):
            acked.set()

    client.on_connect = lambda *args: connected.set()
    client.on_publish = on_publish
    client.connect(config.host, config.port)
    client.loop_start()
    try:
        assert connected.wait(5)
        mids = [client.publish(topic, b"probe", qos=1).mid for topic in topics]
        assert acked.wait(5)
        return [_verdict(reasons[mid]) for mid in mids]
    finally:
        client.disconnect()
        client.loop_stop()


def _verdict(code: int) -> str:
    if code in (0x00, 0x10):
        return "ok"
    return "refused" if code == NOT_AUTHORIZED else hex(code)


# (a) a device's own topics ----------------------------------------------------------


@pytest.mark.parametrize("version", [MqttVersion.V311, MqttVersion.V5])
def test_a_device_publishes_under_its_own_id_and_the_coordinator_receives_it(
    broker: KitBroker, coordinator: Inbox, version: MqttVersion
) -> None:
    update = LAB.device("dev-1", "update")

    publish(broker.client("devices/dev-1", version=version), (update, b"weights"))

    assert coordinator.next() == (update, b"weights")


# (b) another device's topic ---------------------------------------------------------


def test_a_publish_on_another_devices_topic_never_reaches_the_coordinator(
    broker: KitBroker, coordinator: Inbox
) -> None:
    forged, own = LAB.device("dev-2", "update"), LAB.device("dev-1", "update")

    publish(broker.client("devices/dev-1"), (forged, b"forged"), (own, b"control"))

    assert coordinator.next() == (own, b"control")  # the forged one was sent first
    coordinator.assert_empty()


def test_mqtt5_names_the_refusal_in_the_puback(broker: KitBroker) -> None:
    reasons = puback_reasons(
        broker.client("devices/dev-1"),
        LAB.device("dev-2", "update"),
        LAB.device("dev-1", "update"),
        LAB.to_device("dev-1", "task"),  # a device never writes downlink topics
        LAB.broadcast_model,
        LAB.coordinator_status,
    )

    assert reasons == ["refused", "ok", "refused", "refused", "refused"]


def test_the_certificate_not_the_connect_user_name_is_the_identity(broker: KitBroker) -> None:
    # dev-1's certificate with the coordinator's user name in CONNECT is still dev-1
    config = broker.client("devices/dev-1", username="coordinator", password="anything")

    reasons = puback_reasons(config, LAB.to_device("dev-2", "task"), LAB.device("dev-1", "hello"))

    assert reasons == ["refused", "ok"]


# (c) another device's downlink ------------------------------------------------------


def test_a_device_cannot_read_another_devices_downlink(broker: KitBroker) -> None:
    spy = Inbox(
        broker.client("devices/dev-1"), LAB.device_inbox("dev-2"), LAB.device_inbox("dev-1")
    )
    owner = Inbox(broker.client("devices/dev-2"), LAB.device_inbox("dev-2"))
    try:
        publish(
            broker.client("coordinator"),
            (LAB.to_device("dev-2", "task"), b"for dev-2"),
            (LAB.to_device("dev-1", "task"), b"for dev-1"),
        )

        assert owner.next() == (LAB.to_device("dev-2", "task"), b"for dev-2")
        assert spy.next() == (LAB.to_device("dev-1", "task"), b"for dev-1")
        spy.assert_empty()
    finally:
        spy.close()
        owner.close()


# (d) clients without a certificate of the fleet's CA ----------------------------------


def test_a_client_without_a_certificate_is_refused(broker: KitBroker) -> None:
    config = MqttConfig(
        host=LOOPBACK,
        port=broker.certificate_port,
        tls=TlsConfig(ca_file=broker.kit / "ca" / "ca.pem"),
        connect_timeout_s=REFUSAL_S,
    )

    with pytest.raises(TransportError):
        MqttTransport(config).connect(timeout=REFUSAL_S)


def test_a_certificate_of_another_ca_is_refused(broker: KitBroker, tmp_path: Path) -> None:
    rogue = tmp_path / "rogue"
    deploy("init", "--fleet", FLEET, "--out", rogue)  # same fleet name, another CA
    deploy("device", "dev-1", "--out", rogue)
    who = rogue / "devices" / "dev-1"
    config = MqttConfig(
        host=LOOPBACK,
        port=broker.certificate_port,
        tls=TlsConfig(ca_file=broker.kit / "ca" / "ca.pem", cert_file=who / "cert.pem",
                      key_file=who / "key.pem"),
        connect_timeout_s=REFUSAL_S,
    )  # fmt: skip

    with pytest.raises(TransportError):
        MqttTransport(config).connect(timeout=REFUSAL_S)


# (e) another fleet ------------------------------------------------------------------


def test_a_device_of_another_fleet_cannot_connect(broker: KitBroker, tmp_path: Path) -> None:
    other = tmp_path / "other"
    deploy("init", "--fleet", "other", "--out", other)
    deploy("device", "dev-9", "--out", other)
    who = other / "devices" / "dev-9"
    config = MqttConfig(
        host=LOOPBACK,
        port=broker.certificate_port,
        tls=TlsConfig(ca_file=broker.kit / "ca" / "ca.pem", cert_file=who / "cert.pem",
                      key_file=who / "key.pem"),
        connect_timeout_s=REFUSAL_S,
    )  # fmt: skip

    with pytest.raises(TransportError):
        MqttTransport(config).connect(timeout=REFUSAL_S)


def test_the_acl_grants_nothing_outside_the_fleet(broker: KitBroker) -> None:
    device = puback_reasons(
        broker.client("devices/dev-1"),
        OTHER.device("dev-1", "update"),
        LAB.device("dev-1", "update"),
    )
    coordinator = puback_reasons(
        broker.client("coordinator"),
        OTHER.to_device("dev-1", "task"),
        LAB.to_device("dev-1", "task"),
    )

    assert device == ["refused", "ok"]
    assert coordinator == ["refused", "ok"]


def test_a_device_subscribed_to_everything_receives_only_what_is_for_it(
    broker: KitBroker,
) -> None:
    spy = Inbox(broker.client("devices/dev-1"), "fl/#")
    try:
        publish(broker.client("devices/dev-2"), (LAB.device("dev-2", "update"), b"uploads"))
        publish(
            broker.client("coordinator"),
            (LAB.to_device("dev-2", "task"), b"for dev-2"),
            (LAB.broadcast_model, b"for all"),
            (LAB.to_device("dev-1", "task"), b"for dev-1"),
        )

        assert spy.next() == (LAB.broadcast_model, b"for all")
        assert spy.next() == (LAB.to_device("dev-1", "task"), b"for dev-1")
        spy.assert_empty()
    finally:
        spy.close()


# (f) the password listener ----------------------------------------------------------


def test_the_right_password_connects_and_the_acl_holds(
    broker: KitBroker, coordinator: Inbox
) -> None:
    config = broker.password_client("devices/dev-3", "dev-3")
    forged, own = LAB.device("dev-1", "update"), LAB.device("dev-3", "update")

    publish(config, (forged, b"forged"), (own, b"control"))

    assert coordinator.next() == (own, b"control")
    coordinator.assert_empty()
    assert puback_reasons(config, forged, own) == ["refused", "ok"]


def test_the_coordinator_may_log_in_with_its_password(broker: KitBroker) -> None:
    config = broker.password_client("coordinator", "coordinator")

    assert puback_reasons(
        config, LAB.to_device("dev-3", "task"), LAB.device("dev-3", "update")
    ) == [
        "ok",
        "refused",
    ]


@pytest.mark.parametrize(
    ("username", "password"),
    [("dev-3", "wrong"), ("dev-1", "anything"), ("coordinator", "")],
    ids=["wrong-password", "certificate-device", "empty-password"],
)
def test_a_wrong_password_is_refused(broker: KitBroker, username: str, password: str) -> None:
    transport = MqttTransport(broker.password_client("devices/dev-3", username, password))

    with pytest.raises(TransportError):
        transport.connect(timeout=REFUSAL_S)
    assert not transport.is_connected


def test_a_device_issued_later_connects_at_once_or_after_a_reload(
    broker: KitBroker, coordinator: Inbox
) -> None:
    deploy("device", "dev-5", "--out", broker.kit)
    deploy("passwords", "dev-6", "--out", broker.kit)
    late = broker.password_client("devices/dev-6", "dev-6")
    with pytest.raises(TransportError):  # the broker has not read the new password file yet
        MqttTransport(late).connect(timeout=REFUSAL_S)

    broker.reload()
    publish(broker.client("devices/dev-5"), (LAB.device("dev-5", "hello"), b"certificate"))
    deadline = time.monotonic() + 5  # the broker acts on SIGHUP in its next loop
    while True:
        try:
            publish(late, (LAB.device("dev-6", "hello"), b"password"))
            break
        except TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)

    assert coordinator.next() == (LAB.device("dev-5", "hello"), b"certificate")
    assert coordinator.next() == (LAB.device("dev-6", "hello"), b"password")


def test_an_anonymous_client_is_refused(broker: KitBroker) -> None:
    config = MqttConfig(
        host=LOOPBACK,
        port=broker.password_port,
        tls=TlsConfig(ca_file=broker.kit / "ca" / "ca.pem"),
        connect_timeout_s=REFUSAL_S,
    )

    with pytest.raises(TransportError):
        MqttTransport(config).connect(timeout=REFUSAL_S)
