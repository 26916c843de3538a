"""The embedded amqtt broker's life cycle, and broker URLs / MQTT settings."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest
from amqtt.broker import Broker
from amqtt.errors import BrokerError as AmqttBrokerError
from pydantic import SecretStr, ValidationError

from protocol.errors import BrokerError, TransportError
from protocol.transport import MqttConfig, MqttTransport, TlsConfig, parse_broker_url
from protocol.transport.broker import (
    EmbeddedBroker,
    PortInUseError,
    _port_taken,
    _snapshot_iteration,
)
from tests.protocol.brokers import accepts_connections, free_port


def connects(url: str) -> bool:
    """Whether an MQTT client completes CONNECT / CONNACK with the broker at `url`."""
    transport = MqttTransport(MqttConfig.from_url(url))
    try:
        transport.connect(timeout=3)
    except TransportError:
        return False
    transport.disconnect()
    return True


def test_start_serves_mqtt_and_stop_frees_the_port() -> None:
    broker = EmbeddedBroker()

    broker.start()
    port = broker.port
    try:
        assert broker.is_running
        assert broker.url == f"mqtt://127.0.0.1:{port}"
        assert connects(broker.url)
    finally:
        broker.stop()

    assert not broker.is_running
    assert not accepts_connections(port)
    with socket.create_server(("127.0.0.1", port)):  # bindable again: really released
        pass


def test_two_brokers_run_side_by_side() -> None:
    with EmbeddedBroker() as first, EmbeddedBroker() as second:
        assert first.port != second.port
        assert connects(first.url) and connects(second.url)


def test_restart_keeps_the_port() -> None:
    with EmbeddedBroker() as broker:
        port = broker.port
        broker.stop()

        broker.start()

        assert broker.port == port and connects(broker.url)


def test_explicit_port_is_used() -> None:
    port = free_port()

    with EmbeddedBroker(port=port) as broker:
        assert broker.port == port and connects(f"mqtt://127.0.0.1:{port}")


def test_starting_twice_is_an_error() -> None:
    with EmbeddedBroker() as broker, pytest.raises(BrokerError):
        broker.start()


@pytest.mark.parametrize("listening", [True, False], ids=["listening", "bound"])
def test_taken_port_is_one_line_and_no_traceback(
    listening: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: another process's socket on the port (a broker listens; any socket binds)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        if listening:
            squatter.listen()
        port = squatter.getsockname()[1]
        broker = EmbeddedBroker(port=port)

        # Execute
        with caplog.at_level(logging.DEBUG), pytest.raises(PortInUseError) as raised:
            broker.start()

    # Assert: a BrokerError naming the port, found before amqtt logged anything
    assert isinstance(raised.value, BrokerError)
    assert (raised.value.host, raised.value.port) == ("127.0.0.1", port)
    assert str(raised.value) == (
        f"port {port} on 127.0.0.1 is taken (another MQTT broker, such as an installed Mosquitto?)"
    )
    assert not broker.is_running
    assert not [r for r in caplog.records if r.exc_info or r.name.startswith("amqtt")]


def test_amqtts_own_failure_on_a_taken_port_is_recognised_and_not_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare: a port taken after the check (the check is skipped: amqtt binds directly),
    # and the filter EmbeddedBroker installs on amqtt's logger
    with EmbeddedBroker():  # installs the filter
        pass

    async def start_amqtt(port: int) -> None:
        config = {
            "listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{port}"}},
            "plugins": {
                "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True},
            },
        }
        await Broker(config, loop=asyncio.get_running_loop()).start()

    with socket.create_server(("127.0.0.1", 0)) as squatter:
        port = squatter.getsockname()[1]

        # Execute
        with caplog.at_level(logging.DEBUG), pytest.raises(AmqttBrokerError) as raised:
            asyncio.run(start_amqtt(port))

    # Assert: translated as a taken port; amqtt's traceback log was dropped
    assert _port_taken(raised.value)
    assert not _port_taken(AmqttBrokerError("Invalid port value in bind value: x"))
    assert not [r for r in caplog.records if r.msg == "Broker startup failed"]


def test_a_port_freed_by_a_stopped_broker_is_not_taken() -> None:
    # Connections of the stopped broker left in TIME_WAIT do not make the check refuse it
    with EmbeddedBroker() as broker:
        assert connects(broker.url)
        port = broker.port

    with EmbeddedBroker(port=port) as again:
        assert connects(again.url)


def test_stop_when_not_running_does_nothing() -> None:
    broker = EmbeddedBroker()

    broker.stop()

    assert not broker.is_running


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("mqtt://127.0.0.1", ("127.0.0.1", 1883, False)),
        ("mqtt://127.0.0.1:1884", ("127.0.0.1", 1884, False)),
        ("mqtts://broker.example", ("broker.example", 8883, True)),
        ("mqtts://broker.example:443/", ("broker.example", 443, True)),
        ("mqtt://[::1]:1883", ("::1", 1883, False)),
    ],
)
def test_parse_broker_url(url: str, expected: tuple[str, int, bool]) -> None:
    assert parse_broker_url(url) == expected


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1",
        "127.0.0.1:1883",
        "mqtt://",
        "mqtt://127.0.0.1:notaport",
        "mqtt://127.0.0.1:70000",
        "mqtt://127.0.0.1:0",
        "mqtt://127.0.0.1/topic",
        "mqtt://127.0.0.1?x=1",
    ],
)
def test_parse_broker_url_rejects(url: str) -> None:
    with pytest.raises(TransportError, match="URL"):
        parse_broker_url(url)


def test_config_from_url_with_credentials_and_overrides() -> None:
    config = MqttConfig.from_url("mqtts://dev%2F1:s%40cret@broker.example", keepalive_s=5)

    assert (config.host, config.port, config.tls) == ("broker.example", 8883, TlsConfig())
    assert config.username == "dev/1"
    assert config.password == SecretStr("s@cret")
    assert config.keepalive_s == 5
    assert "s@cret" not in repr(config)


def test_config_from_url_rejects_bad_overrides() -> None:
    with pytest.raises(TransportError):
        MqttConfig.from_url("mqtt://127.0.0.1", reconnect_min_s=5, reconnect_max_s=1)


def test_config_defaults_and_validation() -> None:
    config = MqttConfig()

    assert (config.port, config.keepalive_s, config.clean_session) == (1883, 30, True)
    assert config.client_id.startswith("edgefl-")
    assert MqttConfig().client_id != config.client_id
    with pytest.raises(ValidationError):
        MqttConfig(port=0)
    with pytest.raises(ValidationError):
        TlsConfig(cert_file="client.pem")


def test_the_subscription_table_may_change_while_a_connecting_client_walks_it() -> None:
    # Prepare: a broker-like object with a plain dict table, and one without
    class Holder:
        def __init__(self) -> None:
            self._subscriptions: dict[str, list[int]] = {"a": [], "b": []}

    holder, other = Holder(), object()

    # Execute
    done = _snapshot_iteration(holder)
    walked = []
    for topic in holder._subscriptions:  # another client subscribes meanwhile
        walked.append(topic)
        holder._subscriptions[f"new/{topic}"] = []

    # Assert: the walk saw the keys it started with, and the changes stayed
    assert done and not _snapshot_iteration(other)
    assert walked == ["a", "b"]
    assert sorted(holder._subscriptions) == ["a", "b", "new/a", "new/b"]
    with pytest.raises(RuntimeError, match="changed size"):
        plain = {"a": 1}
        for key in plain:
            plain[key + "x"] = 2
