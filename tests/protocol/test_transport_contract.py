"""One contract suite for every `Transport`: the memory twin, amqtt, and Mosquitto (3.1.1, 5).

Each implementation subclasses `TransportContract` and provides an `env` fixture that can
make connected transports and restart its broker. Every test uses its own topic prefix,
so tests sharing a module-scoped broker do not see each other's (retained) messages.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from protocol.errors import TransportError
from protocol.transport import (
    Counts,
    Inbound,
    MemoryBroker,
    MemoryTransport,
    MqttConfig,
    MqttTransport,
    MqttVersion,
    Transport,
    Will,
    publish_packet_size,
)
from protocol.transport.broker import EmbeddedBroker
from tests.protocol.brokers import Mosquitto, free_port

OP_TIMEOUT = 5.0  # seconds for connect / publish / subscribe in tests
WAIT = 5.0  # seconds to wait for deliveries


class Inbox:
    """A handler that records messages and lets the test wait for them."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.messages: list[Inbound] = []

    def __call__(self, message: Inbound) -> None:
        with self._cond:
            self.messages.append(message)
            self._cond.notify_all()

    def arrived(self, count: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.messages) >= count, timeout)

    def wait_for(self, count: int, timeout: float = WAIT) -> list[Inbound]:
        ok = self.arrived(count, timeout)
        with self._cond:
            assert ok, f"expected {count} messages, got {len(self.messages)}: {self.messages}"
            return list(self.messages)

    @property
    def payloads(self) -> list[bytes]:
        with self._cond:
            return [m.payload for m in self.messages]


@dataclass
class Env:
    """What a contract test needs from an implementation."""

    version: MqttVersion
    new_transport: Callable[[str], Transport]
    restart_broker: Callable[[], None]
    made: list[Transport] = field(default_factory=list)

    def make(self, name: str, *, connect: bool = True, will: Will | None = None) -> Transport:
        transport = self.new_transport(f"{name}-{uuid.uuid4().hex[:8]}")
        self.made.append(transport)
        if connect:
            transport.connect(will=will, timeout=OP_TIMEOUT)
        return transport


def mqtt_env(url: str, version: MqttVersion, restart: Callable[[], None]) -> Env:
    def new(client_id: str) -> Transport:
        config = MqttConfig.from_url(
            url, client_id=client_id, version=version, reconnect_min_s=0.1, reconnect_max_s=0.5
        )
        return MqttTransport(config)

    return Env(version, new, restart)


class TransportContract:
    """The behaviour every Transport implementation must show."""

    @pytest.fixture
    def env(self) -> Env:
        raise NotImplementedError

    @pytest.fixture
    def live(self, env: Env) -> Iterator[Env]:
        yield env
        for transport in env.made:
            transport.disconnect()

    @pytest.fixture
    def prefix(self) -> str:
        return f"test/{uuid.uuid4().hex[:12]}"

    @pytest.mark.parametrize("qos", [0, 1])
    def test_binary_payloads_round_trip(self, live: Env, prefix: str, qos: int) -> None:
        receiver, sender = live.make("rx"), live.make("tx")
        inbox = Inbox()
        receiver.subscribe(f"{prefix}/data", inbox, qos=qos, timeout=OP_TIMEOUT)
        payloads = [b"", bytes(range(256)) * 3, os.urandom(1 << 20)]

        for payload in payloads:
            sender.publish(f"{prefix}/data", payload, qos=qos, timeout=OP_TIMEOUT)

        received = inbox.wait_for(len(payloads))
        assert [m.payload for m in received] == payloads
        assert {(m.topic, m.qos, m.retain) for m in received} == {(f"{prefix}/data", qos, False)}

    def test_wildcard_subscriptions(self, live: Env, prefix: str) -> None:
        plus_rx, hash_rx, sender = live.make("plus"), live.make("hash"), live.make("tx")
        plus, hash_ = Inbox(), Inbox()
        plus_rx.subscribe(f"{prefix}/+/temp", plus, timeout=OP_TIMEOUT)
        hash_rx.subscribe(f"{prefix}/fleet/#", hash_, timeout=OP_TIMEOUT)

        for suffix in ("a/temp", "a/hum", "a/b/temp", "fleet/x/y", "fleet", "fleet/temp"):
            sender.publish(f"{prefix}/{suffix}", suffix.encode(), timeout=OP_TIMEOUT)

        # "fleet/temp" matches both filters and comes last: it marks the end for each.
        assert [m.payload for m in plus.wait_for(2)] == [b"a/temp", b"fleet/temp"]
        assert [m.payload for m in hash_.wait_for(3)] == [b"fleet/x/y", b"fleet", b"fleet/temp"]

    def test_retained_message_reaches_later_subscriber(self, live: Env, prefix: str) -> None:
        sender = live.make("tx")
        sender.publish(f"{prefix}/state", b"latest", qos=1, retain=True, timeout=OP_TIMEOUT)
        sender.publish(f"{prefix}/event", b"transient", qos=1, timeout=OP_TIMEOUT)
        late, inbox = live.make("late"), Inbox()

        late.subscribe(f"{prefix}/#", inbox, qos=1, timeout=OP_TIMEOUT)

        (message,) = inbox.wait_for(1)
        assert (message.topic, message.payload, message.retain) == (
            f"{prefix}/state",
            b"latest",
            True,
        )
        sender.publish(f"{prefix}/state", b"", retain=True, timeout=OP_TIMEOUT)  # clear it

    def test_last_will_published_on_abort(self, live: Env, prefix: str) -> None:
        observer, inbox = live.make("observer"), Inbox()
        observer.subscribe(f"{prefix}/will/#", inbox, timeout=OP_TIMEOUT)
        will = Will(f"{prefix}/will/victim", b"gone", qos=1, retain=False)
        victim = live.make("victim", will=will)

        victim.abort()

        (message,) = inbox.wait_for(1)
        assert (message.topic, message.payload) == (will.topic, b"gone")
        assert not victim.is_connected

    def test_no_last_will_on_clean_disconnect(self, live: Env, prefix: str) -> None:
        observer, inbox = live.make("observer"), Inbox()
        observer.subscribe(f"{prefix}/will/#", inbox, timeout=OP_TIMEOUT)
        victim = live.make("victim", will=Will(f"{prefix}/will/victim", b"gone", retain=False))

        victim.disconnect()
        live.make("marker").publish(f"{prefix}/will/marker", b"marker", timeout=OP_TIMEOUT)

        inbox.wait_for(1)
        time.sleep(0.1)  # a will, had one been sent, would have been routed by now
        assert inbox.payloads == [b"marker"]
        assert not victim.is_connected

    def test_unsubscribe_stops_delivery(self, live: Env, prefix: str) -> None:
        receiver, sender, inbox = live.make("rx"), live.make("tx"), Inbox()
        receiver.subscribe(f"{prefix}/a", inbox, timeout=OP_TIMEOUT)
        receiver.subscribe(f"{prefix}/b", inbox, timeout=OP_TIMEOUT)
        sender.publish(f"{prefix}/a", b"a1", timeout=OP_TIMEOUT)
        inbox.wait_for(1)

        receiver.unsubscribe(f"{prefix}/a", timeout=OP_TIMEOUT)
        sender.publish(f"{prefix}/a", b"a2", timeout=OP_TIMEOUT)
        sender.publish(f"{prefix}/b", b"b1", timeout=OP_TIMEOUT)

        inbox.wait_for(2)
        receiver.flush(WAIT)
        assert inbox.payloads == [b"a1", b"b1"]

    def test_qos1_messages_from_one_publisher_arrive_in_order(self, live: Env, prefix: str) -> None:
        receiver, sender, inbox = live.make("rx"), live.make("tx"), Inbox()
        receiver.subscribe(f"{prefix}/seq", inbox, qos=1, timeout=OP_TIMEOUT)
        expected = [i.to_bytes(4, "big") for i in range(100)]

        for payload in expected:
            sender.publish(f"{prefix}/seq", payload, qos=1, timeout=OP_TIMEOUT)

        assert [m.payload for m in inbox.wait_for(100)] == expected

    def test_byte_counters_follow_the_packet_size_formula(self, live: Env, prefix: str) -> None:
        receiver, sender, inbox = live.make("rx"), live.make("tx"), Inbox()
        sizes = [0, 1, 100, 20_000, 70_000]
        expected: dict[str, Counts] = {}
        for qos in (0, 1):
            topic = f"{prefix}/q{qos}"
            receiver.subscribe(topic, inbox, qos=qos, timeout=OP_TIMEOUT)
            wire = sum(publish_packet_size(topic, n, qos, live.version) for n in sizes)
            expected[topic] = Counts(len(sizes), sum(sizes), wire)

        for qos in (0, 1):
            for size in sizes:
                sender.publish(f"{prefix}/q{qos}", b"x" * size, qos=qos, timeout=OP_TIMEOUT)
        inbox.wait_for(2 * len(sizes))

        sent, received = sender.stats.snapshot()["out"], receiver.stats.snapshot()["in"]
        assert {t: sent[t] for t in expected} == expected
        assert {t: received[t] for t in expected} == expected
        total = sum(expected.values(), Counts())
        assert sender.stats.totals("out", topic_prefix=prefix) == total
        assert receiver.stats.totals("in", topic_prefix=prefix) == total
        assert sender.stats.totals("in", topic_prefix=prefix) == Counts()

    def test_operations_need_a_connection(self, live: Env, prefix: str) -> None:
        never = live.make("never", connect=False)
        closed = live.make("closed")
        closed.disconnect()

        for transport in (never, closed):
            assert not transport.is_connected
            with pytest.raises(TransportError):
                transport.publish(f"{prefix}/x", b"p", timeout=OP_TIMEOUT)
            with pytest.raises(TransportError):
                transport.subscribe(f"{prefix}/x", Inbox(), timeout=OP_TIMEOUT)

    def test_connect_twice_is_an_error(self, live: Env) -> None:
        transport = live.make("twice")

        with pytest.raises(TransportError):
            transport.connect(timeout=OP_TIMEOUT)
        assert transport.is_connected

    @pytest.mark.parametrize("topic", ["", "a/+", "a/#", "nul\x00byte", "x" * 65_536])
    def test_invalid_publish_topic(self, live: Env, topic: str) -> None:
        transport = live.make("bad")

        with pytest.raises(TransportError):
            transport.publish(topic, b"p", timeout=OP_TIMEOUT)
        assert transport.is_connected

    @pytest.mark.parametrize("topic_filter", ["", "a/#/b", "a#", "a/b+", "nul\x00"])
    def test_invalid_subscribe_filter(self, live: Env, topic_filter: str) -> None:
        transport = live.make("bad")

        with pytest.raises(TransportError):
            transport.subscribe(topic_filter, Inbox(), timeout=OP_TIMEOUT)

    def test_raising_handler_does_not_stop_delivery(self, live: Env, prefix: str) -> None:
        receiver, sender, inbox = live.make("rx"), live.make("tx"), Inbox()

        def flaky(message: Inbound) -> None:
            inbox(message)
            raise RuntimeError("handler bug")

        receiver.subscribe(f"{prefix}/t", flaky, timeout=OP_TIMEOUT)
        for i in range(3):
            sender.publish(f"{prefix}/t", bytes([i]), timeout=OP_TIMEOUT)

        assert [m.payload for m in inbox.wait_for(3)] == [b"\x00", b"\x01", b"\x02"]
        assert receiver.is_connected

    def test_handler_may_publish(self, live: Env, prefix: str) -> None:
        echo, client, inbox = live.make("echo"), live.make("client"), Inbox()
        echo.subscribe(
            f"{prefix}/ping",
            lambda m: echo.publish(f"{prefix}/pong", m.payload, timeout=OP_TIMEOUT),
            timeout=OP_TIMEOUT,
        )
        client.subscribe(f"{prefix}/pong", inbox, timeout=OP_TIMEOUT)

        client.publish(f"{prefix}/ping", b"hello", timeout=OP_TIMEOUT)

        assert inbox.wait_for(1)[0].payload == b"hello"

    def test_context_manager_disconnects(self, live: Env) -> None:
        transport = live.make("ctx")

        with transport as same:
            assert same is transport

        assert not transport.is_connected

    def test_reconnects_and_restores_subscriptions(self, live: Env, prefix: str) -> None:
        receiver, sender, inbox = live.make("rx"), live.make("tx"), Inbox()
        receiver.subscribe(f"{prefix}/r", inbox, qos=1, timeout=OP_TIMEOUT)

        live.restart_broker()

        deadline = time.monotonic() + 15
        while not inbox.messages and time.monotonic() < deadline:
            with contextlib.suppress(TransportError):  # the sender may still be reconnecting
                sender.publish(f"{prefix}/r", b"again", qos=1, timeout=1)
            inbox.arrived(1, timeout=0.2)
        assert inbox.payloads[:1] == [b"again"]
        assert receiver.is_connected and sender.is_connected

    def test_reconnect_callback_runs_after_each_reconnect_only(self, live: Env) -> None:
        transport, calls = live.make("cb"), threading.Event()
        transport.on_reconnect(calls.set)
        assert transport.flush(OP_TIMEOUT)
        assert not calls.is_set()  # the first connect is not a reconnect

        live.restart_broker()

        assert calls.wait(15)
        assert transport.is_connected


class TestMemoryTransport(TransportContract):
    @pytest.fixture
    def env(self) -> Env:
        broker = MemoryBroker()

        def restart() -> None:
            broker.stop()
            broker.start()

        return Env(MqttVersion.V311, lambda cid: MemoryTransport(broker, cid), restart)

    def test_broker_restart_drops_connections_until_started(self) -> None:
        broker = MemoryBroker()
        transport = MemoryTransport(broker, "dev")
        transport.connect()

        broker.stop()

        assert not transport.is_connected and not broker.connected_clients
        with pytest.raises(TransportError):
            transport.publish("a", b"p")
        broker.start()
        assert transport.is_connected and broker.connected_clients == {"dev"}
        transport.disconnect()

    @pytest.mark.parametrize(
        ("version", "expected"), [(MqttVersion.V5, 1024), (MqttVersion.V311, None)]
    )
    def test_max_packet_size_emulation(self, version: MqttVersion, expected: int | None) -> None:
        broker = MemoryBroker(max_packet_size=1024)
        transport = MemoryTransport(broker, "dev", version=version)
        transport.connect()

        assert transport.max_packet_size == expected
        transport.publish("a", b"x" * 1000)
        with pytest.raises(TransportError):
            transport.publish("a", b"x" * 1024)
        transport.disconnect()


class TestEmbeddedBroker(TransportContract):
    @pytest.fixture
    def env(self, embedded_broker: EmbeddedBroker) -> Env:
        def restart() -> None:
            embedded_broker.stop()
            embedded_broker.start()

        return mqtt_env(embedded_broker.url, MqttVersion.V311, restart)


@pytest.mark.mosquitto
class TestMosquittoV311(TransportContract):
    @pytest.fixture
    def env(self, mosquitto: Mosquitto) -> Env:
        return mqtt_env(mosquitto.url, MqttVersion.V311, mosquitto.restart)


@pytest.mark.mosquitto
class TestMosquittoV5(TransportContract):
    @pytest.fixture
    def env(self, mosquitto: Mosquitto) -> Env:
        return mqtt_env(mosquitto.url, MqttVersion.V5, mosquitto.restart)


@pytest.mark.mosquitto
@pytest.mark.parametrize(
    ("version", "expected"), [(MqttVersion.V5, 65_536), (MqttVersion.V311, None)]
)
def test_mosquitto_announces_max_packet_size(
    mosquitto_limited: Mosquitto, version: MqttVersion, expected: int | None
) -> None:
    config = MqttConfig.from_url(mosquitto_limited.url, version=version)
    with MqttTransport(config) as transport:
        transport.connect(timeout=OP_TIMEOUT)

        assert transport.max_packet_size == expected
        transport.publish("limits/ok", b"x" * 60_000, timeout=OP_TIMEOUT)
        if expected is not None:
            with pytest.raises(TransportError):
                transport.publish("limits/big", b"x" * 65_536, timeout=OP_TIMEOUT)
            assert transport.is_connected


def test_connect_to_a_closed_port_fails_fast() -> None:
    transport = MqttTransport(MqttConfig(port=free_port(), connect_timeout_s=2))

    started = time.monotonic()
    with pytest.raises(TransportError):
        transport.connect(timeout=2)
    assert time.monotonic() - started < 2
    assert not transport.is_connected
