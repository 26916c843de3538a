"""The in-memory twin of an MQTT broker and transport, for tests and the simulator.

`MemoryBroker` keeps what a broker keeps (sessions, subscriptions with wildcards, retained
messages, last wills) and `MemoryTransport` implements `Transport` against it. Byte
counters use the same `publish_packet_size` formula as `MqttTransport`, so the twin's
numbers equal what a real broker connection would count. `MemoryBroker.stop` / `start`
emulate a broker restart: connected transports lose their session and, once the broker is
back, reconnect and restore their subscriptions (as `MqttTransport` does on its own).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from protocol.errors import TransportError
from protocol.transport.base import (
    Handler,
    Inbound,
    MqttVersion,
    Transport,
    Will,
    check_qos,
    validate_filter,
    validate_topic,
)
from protocol.transport.topictree import TopicTree
from protocol.transport.wire import publish_packet_size

__all__ = ["MemoryBroker", "MemoryTransport"]

logger = logging.getLogger(__name__)


@dataclass
class _Session:
    transport: MemoryTransport
    will: Will | None
    subscriptions: dict[str, int] = field(default_factory=dict)  # filter -> granted QoS


class MemoryBroker:
    """An in-process stand-in for an MQTT broker; thread-safe.

    Args:
        max_packet_size: Maximum Packet Size (bytes) announced to MQTT 5 transports and
            enforced on every publish; None for no limit.
    """

    def __init__(self, *, max_packet_size: int | None = None) -> None:
        self._max_packet_size = max_packet_size
        self._lock = threading.RLock()
        self._running = True
        self._sessions: dict[str, _Session] = {}
        self._subscribers: TopicTree[dict[str, int]] = TopicTree()  # filter -> client -> QoS
        self._retained: TopicTree[tuple[bytes, int]] = TopicTree()  # topic -> (payload, QoS)
        self._lost: list[MemoryTransport] = []  # dropped by stop(), restored by start()

    @property
    def max_packet_size(self) -> int | None:
        """The emulated Maximum Packet Size in bytes, or None."""
        return self._max_packet_size

    @property
    def is_running(self) -> bool:
        """False between `stop()` and `start()`."""
        return self._running

    @property
    def connected_clients(self) -> frozenset[str]:
        """Client ids with a live session."""
        with self._lock:
            return frozenset(self._sessions)

    def retained(self, topic: str) -> bytes | None:
        """The retained payload on `topic`, or None."""
        with self._lock:
            entry = self._retained.get(topic)
        return None if entry is None else entry[0]

    def stop(self) -> None:
        """Emulate a broker going down: sessions and retained messages are lost, no will
        is published, and every connected transport notices the lost connection."""
        with self._lock:
            self._running = False
            lost = [session.transport for session in self._sessions.values()]
            self._sessions.clear()
            self._subscribers.clear()
            self._retained.clear()
            self._lost.extend(lost)
        for transport in lost:
            transport._connection_lost()

    def start(self) -> None:
        """Bring the broker back; transports dropped by `stop()` reconnect and resubscribe."""
        with self._lock:
            self._running = True
            lost, self._lost = self._lost, []
        for transport in lost:
            transport._reconnect()

    # The methods below are the "network" between MemoryTransport and the broker.

    def _connect(self, transport: MemoryTransport, will: Will | None) -> None:
        with self._lock:
            if not self._running:
                raise TransportError("memory broker is not running (connection refused)")
            old = self._sessions.pop(transport.client_id, None)
            if old is not None:
                self._forget(old)
            self._sessions[transport.client_id] = _Session(transport, will)
        if old is not None and old.transport is not transport:
            logger.info("client id %r taken over; dropping the old session", transport.client_id)
            old.transport._connection_lost()
            if old.will is not None:
                self._route(old.will.topic, old.will.payload, old.will.qos, old.will.retain)

    def _disconnect(self, transport: MemoryTransport, *, publish_will: bool) -> None:
        with self._lock:
            session = self._session(transport)
            if session is None:
                return
            del self._sessions[transport.client_id]
            self._forget(session)
        if publish_will and session.will is not None:
            will = session.will
            self._route(will.topic, will.payload, will.qos, will.retain)

    def _subscribe(self, transport: MemoryTransport, topic_filter: str, qos: int) -> None:
        with self._lock:
            session = self._require(transport)
            session.subscriptions[topic_filter] = qos
            self._subscribers.setdefault(topic_filter, {})[transport.client_id] = qos
            retained = [
                Inbound(topic, payload, min(stored_qos, qos), True)
                for topic, (payload, stored_qos) in self._retained.matching(topic_filter)
            ]
            for message in retained:
                transport._deliver(message)

    def _unsubscribe(self, transport: MemoryTransport, topic_filter: str) -> None:
        with self._lock:
            self._require(transport).subscriptions.pop(topic_filter, None)
            self._unsubscribed(transport.client_id, topic_filter)

    def _unsubscribed(self, client_id: str, topic_filter: str) -> None:
        clients = self._subscribers.get(topic_filter)
        if clients is not None:
            clients.pop(client_id, None)
            if not clients:
                del self._subscribers[topic_filter]

    def _forget(self, session: _Session) -> None:
        """Drop a session's subscriptions from the index (the session is gone)."""
        for topic_filter in session.subscriptions:
            self._unsubscribed(session.transport.client_id, topic_filter)

    def _publish(
        self, transport: MemoryTransport, topic: str, payload: bytes, qos: int, retain: bool
    ) -> None:
        with self._lock:
            self._require(transport)
            self._route(topic, payload, qos, retain)

    def _route(self, topic: str, payload: bytes, qos: int, retain: bool) -> None:
        with self._lock:
            if retain:
                if payload:
                    self._retained[topic] = (payload, qos)
                else:
                    self._retained.pop(topic, None)
            granted: dict[str, int] = {}
            for _, clients in self._subscribers.match(topic):
                for client_id, client_qos in clients.items():
                    granted[client_id] = max(client_qos, granted.get(client_id, 0))
            for client_id, client_qos in granted.items():
                delivered = Inbound(topic, payload, min(qos, client_qos), False)
                self._sessions[client_id].transport._deliver(delivered)

    def _session(self, transport: MemoryTransport) -> _Session | None:
        session = self._sessions.get(transport.client_id)
        return session if session is not None and session.transport is transport else None

    def _require(self, transport: MemoryTransport) -> _Session:
        session = self._session(transport)
        if session is None or not self._running:
            raise TransportError(f"{transport.client_id!r} is not connected")
        return session


class MemoryTransport(Transport):
    """`Transport` on a `MemoryBroker`: same contract as `MqttTransport`, no sockets.

    `timeout` arguments are accepted for interface compatibility; nothing here waits
    except `flush`.
    """

    def __init__(
        self, broker: MemoryBroker, client_id: str, *, version: MqttVersion = MqttVersion.V311
    ) -> None:
        super().__init__(f"memory-transport-{client_id}", version, self._handlers_for)
        self._broker = broker
        self._client_id = client_id
        self._lock = threading.Lock()
        self._subscriptions: TopicTree[tuple[Handler, int]] = TopicTree()
        self._will: Will | None = None
        self._active = False  # between connect() and disconnect()/abort()

    @property
    def client_id(self) -> str:
        """The client id this transport connects with."""
        return self._client_id

    def connect(self, *, will: Will | None = None, timeout: float = 10.0) -> None:
        if self._active:
            raise TransportError(f"{self._client_id!r} is already connected")
        if will is not None:
            validate_topic(will.topic)
            check_qos(will.qos)
        self._broker._connect(self, will)
        self._will = will
        self._max_packet_size = (
            self._broker.max_packet_size if self._version is MqttVersion.V5 else None
        )
        self._dispatcher.start()
        self._active = self._connected = True

    def disconnect(self) -> None:
        self._close(publish_will=False)

    def abort(self) -> None:
        self._close(publish_will=True)

    def _close(self, *, publish_will: bool) -> None:
        if not self._active:
            return
        self._active = self._connected = False
        self._broker._disconnect(self, publish_will=publish_will)
        with self._lock:
            self._subscriptions.clear()
        self._dispatcher.stop()

    def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        timeout: float = 30.0,
    ) -> None:
        payload, wire = self._checked_publish(topic, payload, qos, self._broker.max_packet_size)
        if not self._connected:
            raise TransportError(f"{self._client_id!r} is not connected")
        self._broker._publish(self, topic, payload, qos, retain)
        self._stats.record("out", topic, len(payload), wire)

    def subscribe(
        self, topic_filter: str, handler: Handler, *, qos: int = 1, timeout: float = 10.0
    ) -> None:
        validate_filter(topic_filter)
        check_qos(qos)
        if not self._connected:
            raise TransportError(f"{self._client_id!r} is not connected")
        with self._lock:
            self._subscriptions[topic_filter] = (handler, qos)
        try:
            self._broker._subscribe(self, topic_filter, qos)
        except TransportError:
            with self._lock:
                self._subscriptions.pop(topic_filter, None)
            raise

    def unsubscribe(self, topic_filter: str, *, timeout: float = 10.0) -> None:
        validate_filter(topic_filter)
        if not self._connected:
            raise TransportError(f"{self._client_id!r} is not connected")
        with self._lock:
            self._subscriptions.pop(topic_filter, None)
        self._broker._unsubscribe(self, topic_filter)

    # Called by MemoryBroker.

    def _deliver(self, message: Inbound) -> None:
        wire = publish_packet_size(message.topic, len(message.payload), message.qos, self._version)
        self._stats.record("in", message.topic, len(message.payload), wire)
        self._dispatcher.submit(message)

    def _connection_lost(self) -> None:
        self._connected = False

    def _reconnect(self) -> None:
        if not self._active:
            return
        self._broker._connect(self, self._will)
        with self._lock:
            restore = [(f, qos) for f, (_, qos) in self._subscriptions.items()]
        for topic_filter, qos in restore:
            self._broker._subscribe(self, topic_filter, qos)
        self._connected = True
        logger.info("%r reconnected; %d subscriptions restored", self._client_id, len(restore))
        self._reconnected()

    def _handlers_for(self, topic: str) -> list[Handler]:
        with self._lock:
            return [h for _, (h, _) in self._subscriptions.match(topic)]
