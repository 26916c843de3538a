"""Exact sizes of MQTT PUBLISH packets on the wire (MQTT 3.1.1 section 3.3, MQTT 5 3.3).

A PUBLISH packet is::

    fixed header        1 byte (type, DUP, QoS, RETAIN)
    remaining length    variable byte integer, 1-4 bytes
    topic name          2-byte length + UTF-8 bytes
    packet identifier   2 bytes, only when QoS > 0
    properties          MQTT 5 only: variable byte integer length + the properties
    payload             the rest
"""

from __future__ import annotations

import enum

from protocol.errors import EncodeError


class MqttVersion(enum.Enum):
    """The MQTT protocol version a transport speaks."""

    V311 = "3.1.1"
    V5 = "5"


__all__ = ["MAX_REMAINING_LENGTH", "publish_packet_size", "varint_size"]

MAX_REMAINING_LENGTH = 268_435_455  # largest value a 4-byte variable byte integer holds


def varint_size(n: int) -> int:
    """Return how many bytes the MQTT variable byte integer encoding of `n` takes (1-4).

    Raises:
        EncodeError: `n` is negative or above 268,435,455.
    """
    if n < 0 or n > MAX_REMAINING_LENGTH:
        raise EncodeError(f"{n} cannot be encoded as an MQTT variable byte integer")
    if n < 128:
        return 1
    if n < 16_384:
        return 2
    if n < 2_097_152:
        return 3
    return 4


def publish_packet_size(
    topic: str,
    payload_len: int,
    qos: int,
    version: MqttVersion,
    properties_len: int = 0,
) -> int:
    """Return the size in bytes of the PUBLISH packet carrying `payload_len` payload bytes.

    `properties_len` is the length of the MQTT 5 properties themselves (not counting
    their own length prefix); it must be 0 for MQTT 3.1.1.

    Raises:
        EncodeError: negative lengths, properties on MQTT 3.1.1, an invalid QoS, or a
            packet larger than MQTT allows.
    """
    if payload_len < 0 or properties_len < 0:
        raise EncodeError("lengths must not be negative")
    if qos not in (0, 1, 2):
        raise EncodeError(f"QoS must be 0, 1 or 2, got {qos!r}")
    remaining = 2 + len(topic.encode("utf-8")) + payload_len
    if qos > 0:
        remaining += 2
    if version is MqttVersion.V5:
        remaining += varint_size(properties_len) + properties_len
    elif properties_len:
        raise EncodeError("MQTT 3.1.1 PUBLISH packets have no properties")
    return 1 + varint_size(remaining) + remaining
