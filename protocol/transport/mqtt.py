"""`MqttTransport`: the `Transport` on a real MQTT 3.1.1 / 5 broker, built on paho-mqtt 2.x.

paho runs its network loop on a background thread (`loop_start`) and reconnects on its
own with exponential backoff (`reconnect_delay_set`); `on_connect` restores the
subscriptions after each reconnect. Received messages are counted on the network thread
and handed to a `HandlerDispatcher`, so handlers may publish and wait for the PUBACK.
Every paho / socket / ssl exception is converted to `TransportError` here.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode

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
from protocol.transport.config import MqttConfig, TlsConfig, parse_broker_url
from protocol.transport.topictree import TopicTree
from protocol.transport.wire import publish_packet_size, varint_size

__all__ = ["MqttConfig", "MqttTransport", "TlsConfig", "parse_broker_url"]

logger = logging.getLogger(__name__)


def _properties_len(packed_len: int) -> int:
    """Length of MQTT 5 properties whose packed form (length prefix included) is given."""
    length = packed_len - 1
    while length > 0 and length + varint_size(length) > packed_len:
        length -= 1
    return length


_paho_logger = logging.getLogger(f"{__name__}.paho")


def _log_paho(client: paho.Client, userdata: Any, level: int, message: str) -> None:
    """paho reports routine events (such as the loop ending after DISCONNECT) as errors;
    its messages go to DEBUG, and this module logs what matters itself."""
    _paho_logger.debug("paho[%d]: %s", level, message)


_Send = Callable[[paho.Client], tuple[MQTTErrorCode, int | None]]


class _Pending:
    """A SUBSCRIBE / UNSUBSCRIBE waiting for its acknowledgement."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.failure: str | None = None


class MqttTransport(Transport):
    """`Transport` over paho-mqtt; see the module docstring. One paho client per `connect`."""

    def __init__(self, config: MqttConfig) -> None:
        super().__init__(f"mqtt-handlers-{config.client_id}", config.version, self._handlers_for)
        self._config = config
        self._lock = threading.Lock()
        self._client: paho.Client | None = None
        self._subscriptions: TopicTree[tuple[Handler, int]] = TopicTree()
        self._pending: dict[int, _Pending] = {}
        self._connack = threading.Event()
        self._refusal: str | None = None

    @property
    def config(self) -> MqttConfig:
        """The configuration this transport was built with."""
        return self._config

    def connect(self, *, will: Will | None = None, timeout: float = 10.0) -> None:
        cfg = self._config
        if self._client is not None:
            raise TransportError(f"{cfg.client_id!r} is already connected")
        client = self._new_client(will)
        with self._lock:
            if self._client is not None:
                raise TransportError(f"{cfg.client_id!r} is already connected")
            self._client = client
            self._connack.clear()
            self._refusal = None
        self._dispatcher.start()
        try:
            # paho fixes the TCP/TLS connect timeout for this and every automatic reconnect
            client.connect_timeout = min(timeout, cfg.connect_timeout_s)
            if self._version is MqttVersion.V5:
                client.connect(cfg.host, cfg.port, cfg.keepalive_s, clean_start=cfg.clean_session)
            else:
                client.connect(cfg.host, cfg.port, cfg.keepalive_s)
            client.loop_start()
        except (OSError, ValueError) as exc:
            self._drop(client)
            self._dispatcher.stop()
            raise TransportError(f"cannot connect to {cfg.host}:{cfg.port}: {exc}") from exc
        if not self._connack.wait(timeout) or self._refusal is not None:
            reason = self._refusal or f"no CONNACK within {timeout} s"
            self._drop(client)
            self._dispatcher.stop()
            raise TransportError(f"connect to {cfg.host}:{cfg.port} failed: {reason}")

    def _new_client(self, will: Will | None) -> paho.Client:
        cfg = self._config
        v5 = self._version is MqttVersion.V5
        try:
            client = paho.Client(
                callback_api_version=CallbackAPIVersion.VERSION2,
                client_id=cfg.client_id,
                protocol=paho.MQTTv5 if v5 else paho.MQTTv311,
                clean_session=None if v5 else cfg.clean_session,
            )
            client.on_log = _log_paho
            client.reconnect_delay_set(cfg.reconnect_min_s, cfg.reconnect_max_s)  # type: ignore[arg-type]
            client.max_inflight_messages_set(cfg.max_inflight)
            if will is not None:
                validate_topic(will.topic)
                check_qos(will.qos)
                client.will_set(will.topic, will.payload, will.qos, will.retain)
            if cfg.username is not None:
                password = cfg.password.get_secret_value() if cfg.password else None
                client.username_pw_set(cfg.username, password)
            if cfg.tls is not None:
                client.tls_set(
                    ca_certs=str(cfg.tls.ca_file) if cfg.tls.ca_file else None,
                    certfile=str(cfg.tls.cert_file) if cfg.tls.cert_file else None,
                    keyfile=str(cfg.tls.key_file) if cfg.tls.key_file else None,
                )
                client.tls_insecure_set(cfg.tls.insecure)
        except (ValueError, OSError, ssl.SSLError) as exc:
            raise TransportError(f"invalid MQTT client settings: {exc}") from exc
        client.on_pre_connect = self._on_pre_connect
        client.on_socket_open = self._on_socket_open
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_subscribe = self._on_ack
        client.on_unsubscribe = self._on_ack
        return client

    def disconnect(self) -> None:
        client = self._detach()
        if client is None:
            return
        client.disconnect()
        client.loop_stop()
        self._dispatcher.stop()

    def abort(self) -> None:
        client = self._detach()
        if client is not None:
            self._drop(client)
            self._dispatcher.stop()

    def _detach(self) -> paho.Client | None:
        with self._lock:
            client, self._client = self._client, None
            self._connected = False
            self._subscriptions.clear()
            for pending in self._pending.values():
                pending.failure = "connection closed"
                pending.done.set()
            self._pending.clear()
        return client

    def _drop(self, client: paho.Client) -> None:
        """Close the socket without DISCONNECT and stop the loop (which may not reconnect:
        `_on_pre_connect` refuses once `client` is no longer the current one)."""
        with self._lock:
            if self._client is client:
                self._client = None
                self._connected = False
        sock = client.socket()
        if isinstance(sock, socket.socket):
            with contextlib.suppress(OSError):  # already closed by the peer or by paho
                sock.shutdown(socket.SHUT_RDWR)
        client.loop_stop()
        if sock is not None:
            sock.close()

    def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        timeout: float = 30.0,
    ) -> None:
        # paho sends an empty property block (one 0x00 byte) on MQTT 5: properties_len 0.
        payload, wire = self._checked_publish(topic, payload, qos, self._max_packet_size)
        client = self._require_connected()
        try:
            info = client.publish(topic, payload, qos=qos, retain=retain)
            info.wait_for_publish(timeout)
        except (ValueError, RuntimeError, OSError) as exc:
            raise TransportError(f"publish to {topic!r} failed: {exc}") from exc
        if not info.is_published():
            raise TransportError(f"publish to {topic!r} not acknowledged within {timeout} s")
        self._stats.record("out", topic, len(payload), wire)

    def subscribe(
        self, topic_filter: str, handler: Handler, *, qos: int = 1, timeout: float = 10.0
    ) -> None:
        validate_filter(topic_filter)
        check_qos(qos)
        with self._lock:
            previous = self._subscriptions.get(topic_filter)
            self._subscriptions[topic_filter] = (handler, qos)
        try:
            self._request(lambda c: c.subscribe(topic_filter, qos), topic_filter, timeout)
        except TransportError:
            with self._lock:
                if previous is None:
                    self._subscriptions.pop(topic_filter, None)
                else:
                    self._subscriptions[topic_filter] = previous
            raise

    def unsubscribe(self, topic_filter: str, *, timeout: float = 10.0) -> None:
        validate_filter(topic_filter)
        with self._lock:
            self._subscriptions.pop(topic_filter, None)
        self._request(lambda c: c.unsubscribe(topic_filter), topic_filter, timeout)

    def _request(self, send: _Send, topic_filter: str, timeout: float) -> None:
        """Send a (UN)SUBSCRIBE via `send(client)` and wait for its acknowledgement."""
        pending = _Pending()
        client = self._require_connected()
        with self._lock:  # held so that the ack cannot be handled before we registered
            try:
                rc, mid = send(client)
            except (ValueError, OSError) as exc:
                raise TransportError(f"request for {topic_filter!r} failed: {exc}") from exc
            if rc != MQTTErrorCode.MQTT_ERR_SUCCESS or mid is None:
                raise TransportError(f"request for {topic_filter!r}: {paho.error_string(rc)}")
            self._pending[mid] = pending
        if not pending.done.wait(timeout):
            with self._lock:
                self._pending.pop(mid, None)
            raise TransportError(f"no acknowledgement for {topic_filter!r} within {timeout} s")
        if pending.failure is not None:
            raise TransportError(f"broker refused {topic_filter!r}: {pending.failure}")

    def _require_connected(self) -> paho.Client:
        with self._lock:
            client = self._client
            if client is None or not self._connected:
                raise TransportError(f"{self._config.client_id!r} is not connected")
            return client

    # paho callbacks: they run on paho's network thread and must never raise.

    def _on_pre_connect(self, client: paho.Client, userdata: Any) -> None:
        if client is not self._client:
            raise ConnectionAbortedError("transport closed; not reconnecting")

    def _on_socket_open(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        if self._config.tcp_nodelay and isinstance(sock, socket.socket):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _on_connect(
        self, client: paho.Client, userdata: Any, flags: Any, reason: Any, properties: Any
    ) -> None:
        if client is not self._client:
            return
        if reason.is_failure:
            logger.warning("broker refused the connection: %s", reason)
            self._refusal = str(reason)
            self._connack.set()
            return
        size = getattr(properties, "MaximumPacketSize", None)
        reconnect = self._connack.is_set()  # set by the first CONNACK of this client
        with self._lock:
            self._max_packet_size = size if self._version is MqttVersion.V5 else None
            self._connected = True
            restore = [(f, qos) for f, (_, qos) in self._subscriptions.items()]
        if restore:
            try:
                client.subscribe(restore)
            except (ValueError, OSError):
                logger.exception("could not restore %d subscriptions", len(restore))
            logger.info("reconnected; restoring %d subscriptions", len(restore))
        self._connack.set()
        if reconnect:
            self._reconnected()

    def _on_disconnect(
        self, client: paho.Client, userdata: Any, flags: Any, reason: Any, properties: Any
    ) -> None:
        if client is self._client:
            self._connected = False
            logger.warning("connection to the broker lost (%s); reconnecting", reason)

    def _on_message(self, client: paho.Client, userdata: Any, message: paho.MQTTMessage) -> None:
        try:
            payload = bytes(message.payload)
            properties_len = 0
            if self._version is MqttVersion.V5 and message.properties is not None:
                packed = message.properties.pack()  # type: ignore[no-untyped-call]
                properties_len = _properties_len(len(packed))
            topic = message.topic
            wire = publish_packet_size(
                topic, len(payload), message.qos, self._version, properties_len
            )
            self._stats.record("in", topic, len(payload), wire)
            self._dispatcher.submit(Inbound(topic, payload, message.qos, bool(message.retain)))
        except Exception:
            logger.exception("dropped an undecodable incoming message")

    def _on_ack(
        self, client: paho.Client, userdata: Any, mid: int, reasons: Any, properties: Any
    ) -> None:
        with self._lock:
            pending = self._pending.pop(mid, None)
        if pending is None:
            return
        failed = [str(r) for r in (reasons or []) if r.is_failure]
        pending.failure = ", ".join(failed) if failed else None
        pending.done.set()

    def _handlers_for(self, topic: str) -> list[Handler]:
        with self._lock:
            return [h for _, (h, _) in self._subscriptions.match(topic)]
