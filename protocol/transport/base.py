"""The transport interface the runtimes use, and the MQTT topic rules it relies on.

`Transport` is the one seam between the runtimes and a broker: `MqttTransport` talks to a
real broker through paho-mqtt, `MemoryTransport` to an in-process `MemoryBroker`. Both
deliver received messages to handlers on a dispatcher thread of their own
(`HandlerDispatcher`), so a handler may publish (and wait for the acknowledgement) without
blocking the network loop.
"""

from __future__ import annotations

import abc
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from protocol.errors import TransportError
from protocol.transport.stats import TrafficStats
from protocol.transport.wire import MqttVersion, publish_packet_size

__all__ = [
    "Handler",
    "HandlerDispatcher",
    "Inbound",
    "MqttVersion",
    "Transport",
    "Will",
    "check_qos",
    "topic_matches",
    "validate_filter",
    "validate_topic",
]

logger = logging.getLogger(__name__)

MAX_TOPIC_BYTES = 65_535  # a topic is a UTF-8 string with a 16-bit length prefix
VALID_QOS = (0, 1, 2)


@dataclass(frozen=True)
class Will:
    """A last-will message the broker publishes if the connection drops without DISCONNECT."""

    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = True


@dataclass(frozen=True)
class Inbound:
    """A message received from the broker, as handed to a `Handler`."""

    topic: str
    payload: bytes
    qos: int
    retain: bool


Handler = Callable[[Inbound], None]


def _check_common(text: str, what: str) -> None:
    if not isinstance(text, str) or not text:
        raise TransportError(f"{what} must be a non-empty string, got {text!r}")
    if "\x00" in text:
        raise TransportError(f"{what} contains a NUL character: {text!r}")
    if len(text.encode("utf-8", errors="surrogatepass")) > MAX_TOPIC_BYTES:
        raise TransportError(f"{what} is longer than {MAX_TOPIC_BYTES} UTF-8 bytes")


def validate_topic(topic: str) -> None:
    """Check that `topic` is a valid MQTT topic name to publish to.

    Raises:
        TransportError: empty, not a string, contains a wildcard ('+' or '#') or NUL,
            or longer than 65535 UTF-8 bytes.
    """
    _check_common(topic, "topic")
    if "+" in topic or "#" in topic:
        raise TransportError(f"wildcards are not allowed in a topic name: {topic!r}")


def validate_filter(topic_filter: str) -> None:
    """Check that `topic_filter` is a valid MQTT topic filter to subscribe to.

    Raises:
        TransportError: empty, not a string, contains NUL, longer than 65535 UTF-8 bytes,
            '#' anywhere but as the whole last level, or '+' not as a whole level.
    """
    _check_common(topic_filter, "topic filter")
    levels = topic_filter.split("/")
    for index, level in enumerate(levels):
        if "#" in level and (level != "#" or index != len(levels) - 1):
            raise TransportError(f"'#' must be the whole last level: {topic_filter!r}")
        if "+" in level and level != "+":
            raise TransportError(f"'+' must be a whole level: {topic_filter!r}")


def topic_matches(topic_filter: str, topic: str) -> bool:
    """Return whether `topic` matches `topic_filter` under the MQTT wildcard rules.

    '+' matches exactly one level, '#' (last) matches the parent level and any number of
    levels below it, and a topic starting with '$' is not matched by a filter whose first
    level is a wildcard. Both arguments are assumed valid (see `validate_topic` and
    `validate_filter`); nothing is raised.
    """
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    filter_levels = topic_filter.split("/")
    topic_levels = topic.split("/")
    for index, level in enumerate(filter_levels):
        if level == "#":
            return True
        if index >= len(topic_levels):
            return False
        if level != "+" and level != topic_levels[index]:
            return False
    return len(topic_levels) == len(filter_levels)


def check_qos(qos: int) -> None:
    """Raise `TransportError` unless `qos` is 0, 1 or 2."""
    if qos not in VALID_QOS:
        raise TransportError(f"QoS must be 0, 1 or 2, got {qos!r}")


class HandlerDispatcher:
    """Runs handlers for received messages on one thread, in arrival order.

    `submit` never blocks and never runs a handler; the dispatcher thread looks up the
    handlers with `resolve(topic)` at delivery time (so a filter unsubscribed in the
    meantime receives nothing more) and calls them outside any lock of the caller. A
    handler that raises is logged and the next message is still delivered.
    """

    def __init__(self, name: str, resolve: Callable[[str], list[Handler]]) -> None:
        self._name = name
        self._resolve = resolve
        self._queue: queue.SimpleQueue[Inbound | Callable[[], None] | None] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the dispatcher thread if it is not running."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def submit(self, message: Inbound | Callable[[], None]) -> None:
        """Queue `message` for delivery to its handlers (or a callable to run in order)."""
        with self._idle:
            self._pending += 1
        self._queue.put(message)

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds until every submitted message was handled.

        Returns False on timeout, or at once when called from a handler (it would wait
        for itself).
        """
        if threading.current_thread() is self._thread:
            return self._pending <= 1
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Deliver what is queued, then end the thread (joined unless called from it)."""
        thread = self._thread
        if thread is None:
            return
        self._queue.put(None)
        if thread is not threading.current_thread():
            thread.join(timeout)
        self._thread = None

    def _run(self) -> None:
        while True:
            message = self._queue.get()
            if message is None:
                return
            try:
                if not isinstance(message, Inbound):
                    self._call(message)
                    continue
                for handler in self._resolve(message.topic):
                    try:
                        handler(message)
                    except Exception:
                        logger.exception("handler for %r raised; delivery goes on", message.topic)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    @staticmethod
    def _call(callback: Callable[[], None]) -> None:
        try:
            callback()
        except Exception:
            logger.exception("reconnect callback raised")


class Transport(abc.ABC):
    """A connection to an MQTT broker (or its in-memory twin) used by the runtimes.

    Handlers run on the transport's own dispatcher thread, never inside `publish` and
    never while the transport holds an internal lock. Messages from one publisher on one
    topic arrive in order. A handler that raises is logged and does not stop delivery.
    Subscriptions are restored automatically after an automatic reconnect; `disconnect`
    and `abort` forget them. Use as a context manager to disconnect on exit (connecting
    stays explicit).
    """

    @abc.abstractmethod
    def connect(self, *, will: Will | None = None, timeout: float = 10.0) -> None:
        """Connect and block until the broker accepted the session (`timeout` in seconds).

        Raises:
            TransportError: refused, unreachable, timed out, or already connected.
        """

    @abc.abstractmethod
    def disconnect(self) -> None:
        """Close cleanly (DISCONNECT is sent, so no last will). Does nothing if closed."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Drop the connection without DISCONNECT, so the broker publishes the last will."""

    @abc.abstractmethod
    def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        timeout: float = 30.0,
    ) -> None:
        """Publish `payload` on `topic`.

        Returns when the broker acknowledged it (QoS 1 and 2) or when the packet was
        handed to the socket (QoS 0); `timeout` is in seconds.

        Raises:
            TransportError: invalid topic or QoS, not connected, packet larger than the
                broker's Maximum Packet Size, or no acknowledgement within `timeout`.
        """

    @abc.abstractmethod
    def subscribe(
        self, topic_filter: str, handler: Handler, *, qos: int = 1, timeout: float = 10.0
    ) -> None:
        """Subscribe `handler` to `topic_filter`; returns after the broker's SUBACK.

        Subscribing again to the same filter replaces its handler.

        Raises:
            TransportError: invalid filter or QoS, not connected, refused, or timed out.
        """

    @abc.abstractmethod
    def unsubscribe(self, topic_filter: str, *, timeout: float = 10.0) -> None:
        """Stop delivery for `topic_filter`; returns after the broker's UNSUBACK.

        Raises:
            TransportError: invalid filter, not connected, or timed out.
        """

    def __init__(
        self, name: str, version: MqttVersion, resolve: Callable[[str], list[Handler]]
    ) -> None:
        """Set up the state every transport shares.

        Args:
            name: name of the handler thread.
            version: the MQTT version spoken.
            resolve: maps a topic to the handlers subscribed to it.
        """
        self._version = version
        self._connected = False
        self._max_packet_size: int | None = None
        self._stats = TrafficStats()
        self._dispatcher = HandlerDispatcher(name, resolve)
        self._reconnect_callbacks: list[Callable[[], None]] = []

    def on_reconnect(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after every automatic reconnect, once subscriptions are restored.

        It runs on the handler thread, in order with message handlers, so it may publish
        (a device re-announces itself, a coordinator republishes its retained status).
        Not called for the first `connect`.
        """
        self._reconnect_callbacks.append(callback)

    def _reconnected(self) -> None:
        for callback in self._reconnect_callbacks:
            self._dispatcher.submit(callback)

    def _checked_publish(
        self, topic: str, payload: bytes, qos: int, limit: int | None
    ) -> tuple[bytes, int]:
        """Validate a publish; return the payload as bytes and its PUBLISH packet size.

        Raises:
            TransportError: invalid topic or QoS, or a packet larger than ``limit``.
        """
        validate_topic(topic)
        check_qos(qos)
        data = bytes(payload)
        wire = publish_packet_size(topic, len(data), qos, self._version)
        if limit is not None and wire > limit:
            raise TransportError(f"PUBLISH of {wire} bytes exceeds the broker's limit {limit}")
        return data, wire

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every message received so far went through its handlers.

        Returns False if that did not happen within `timeout` seconds.
        """
        return self._dispatcher.flush(timeout)

    @property
    def is_connected(self) -> bool:
        """Whether the transport currently has a session with the broker."""
        return self._connected

    @property
    def max_packet_size(self) -> int | None:
        """Maximum Packet Size (bytes) from the broker's MQTT 5 CONNACK; None if absent."""
        return self._max_packet_size

    @property
    def protocol_version(self) -> MqttVersion:
        """The MQTT version this transport speaks."""
        return self._version

    @property
    def stats(self) -> TrafficStats:
        """Per-topic payload and wire byte counters of this transport."""
        return self._stats

    def __enter__(self) -> Transport:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.disconnect()
