"""Thread-safe traffic counters: messages, payload bytes and MQTT wire bytes per topic."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

__all__ = ["Counts", "Direction", "TrafficStats"]

Direction = Literal["out", "in"]
_DIRECTIONS: tuple[Direction, ...] = ("out", "in")


@dataclass(frozen=True)
class Counts:
    """Totals for a set of messages.

    Attributes:
        messages: number of PUBLISH packets.
        payload_bytes: application payload bytes (what the codec produced).
        wire_bytes: whole MQTT PUBLISH packet bytes (header, topic, ids, properties,
            payload), as computed by `protocol.transport.wire.publish_packet_size`.
    """

    messages: int = 0
    payload_bytes: int = 0
    wire_bytes: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(
            self.messages + other.messages,
            self.payload_bytes + other.payload_bytes,
            self.wire_bytes + other.wire_bytes,
        )


class TrafficStats:
    """Counters per (direction, topic); every method may be called from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[Direction, str], Counts] = {}

    def record(self, direction: Direction, topic: str, payload_bytes: int, wire_bytes: int) -> None:
        """Add one message of `payload_bytes` / `wire_bytes` bytes on `topic`.

        Raises:
            ValueError: unknown direction or negative sizes.
        """
        if direction not in _DIRECTIONS:
            raise ValueError(f"direction must be 'out' or 'in', got {direction!r}")
        if payload_bytes < 0 or wire_bytes < payload_bytes:
            raise ValueError(f"bad sizes: payload={payload_bytes} wire={wire_bytes}")
        key = (direction, topic)
        with self._lock:
            self._counts[key] = self._counts.get(key, Counts()) + Counts(
                1, payload_bytes, wire_bytes
            )

    def snapshot(self) -> dict[Direction, dict[str, Counts]]:
        """Return a copy of the counters: ``{"out": {topic: Counts}, "in": {...}}``."""
        result: dict[Direction, dict[str, Counts]] = {"out": {}, "in": {}}
        with self._lock:
            for (direction, topic), counts in self._counts.items():
                result[direction][topic] = counts
        return result

    def totals(self, direction: Direction | None = None, topic_prefix: str | None = None) -> Counts:
        """Sum the counters of one direction (or both) over topics starting with a prefix."""
        total = Counts()
        with self._lock:
            items = list(self._counts.items())
        for (item_direction, topic), counts in items:
            if direction is not None and item_direction != direction:
                continue
            if topic_prefix is not None and not topic.startswith(topic_prefix):
                continue
            total = total + counts
        return total

    def reset(self) -> None:
        """Set every counter back to zero."""
        with self._lock:
            self._counts.clear()
