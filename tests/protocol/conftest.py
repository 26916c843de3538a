"""Broker fixtures shared by the protocol tests: one broker per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from protocol.transport.broker import EmbeddedBroker
from tests.protocol.brokers import Mosquitto


@pytest.fixture(scope="module")
def embedded_broker() -> Iterator[EmbeddedBroker]:
    """An amqtt broker on a free loopback port (MQTT 3.1.1)."""
    with EmbeddedBroker() as broker:
        yield broker


@pytest.fixture(scope="module")
def mosquitto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    """A mosquitto on a free loopback port; skips where mosquitto is not installed."""
    with Mosquitto(tmp_path_factory.mktemp("mosquitto")) as broker:
        yield broker


@pytest.fixture(scope="module")
def mosquitto_limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    """A mosquitto announcing a Maximum Packet Size of 65536 bytes to MQTT 5 clients."""
    workdir = tmp_path_factory.mktemp("mosquitto-limited")
    with Mosquitto(workdir, extra_config="max_packet_size 65536") as broker:
        yield broker
