"""MQTT transports: the `Transport` interface, paho-based and in-memory implementations,
traffic counters, PUBLISH packet sizes and an embedded (amqtt) broker.

The embedded broker is imported lazily (``from protocol.transport.broker import
EmbeddedBroker`` or ``protocol.transport.EmbeddedBroker``) so that devices, which never
run a broker, do not import amqtt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from protocol.transport.base import (
    Handler,
    Inbound,
    MqttVersion,
    Transport,
    Will,
    topic_matches,
    validate_filter,
    validate_topic,
)
from protocol.transport.config import (
    PASSWORD_ENV,
    MqttConfig,
    TlsConfig,
    parse_broker_url,
    read_password,
)
from protocol.transport.memory import MemoryBroker, MemoryTransport
from protocol.transport.mqtt import MqttTransport
from protocol.transport.stats import Counts, TrafficStats
from protocol.transport.wire import publish_packet_size, varint_size

if TYPE_CHECKING:
    from protocol.transport.broker import EmbeddedBroker

__all__ = [
    "Counts",
    "EmbeddedBroker",
    "Handler",
    "Inbound",
    "MemoryBroker",
    "MemoryTransport",
    "MqttConfig",
    "MqttTransport",
    "MqttVersion",
    "TlsConfig",
    "TrafficStats",
    "Transport",
    "Will",
    "parse_broker_url",
    "read_password",
    "PASSWORD_ENV",
    "publish_packet_size",
    "topic_matches",
    "validate_filter",
    "validate_topic",
    "varint_size",
]


def __getattr__(name: str) -> Any:
    if name == "EmbeddedBroker":
        from protocol.transport.broker import EmbeddedBroker

        return EmbeddedBroker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
