"""`EmbeddedBroker`: an in-process MQTT 3.1.1 broker (amqtt) for users with nothing installed.

The broker runs on a background thread with its own asyncio loop, bound to a loopback
address, with anonymous access and without the $SYS publisher. amqtt speaks MQTT 3.1.1
only, grants every subscriber the QoS of its subscription (not the minimum with the
publisher's QoS) and refuses publishes to topics starting with '$'.

amqtt acknowledges a QoS 1 publish once the message is queued for delivery and drops
whatever is still queued when it shuts down (logging ``N messages not broadcasted``), so
`EmbeddedBroker.stop` first drains the queue: it sends a marker message through the broker
to itself and waits for it, which it can only receive after everything published before
it has been delivered.

amqtt 0.12 walks its subscription table with an ``await`` inside the loop when a client
connects (to send it the retained messages of an older session's subscriptions); a
subscription added meanwhile by another client raises ``RuntimeError: dictionary
changed size during iteration`` and drops the connecting client. Where the broker has
such a table (a plain dict), :func:`_snapshot_iteration` swaps in a dict whose iteration
walks a snapshot of its keys; a release that renames or reshapes it is left as it is.

A port another process holds (an installed Mosquitto listens on 1883) is found before
amqtt starts, by binding it as amqtt would, and reported as :class:`PortInUseError`, one
line; amqtt's own failure to bind, should the port be taken in between, is translated to
the same error, and amqtt's log of it (a traceback) is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import threading
import time
import uuid
from types import TracebackType
from typing import Any

from amqtt.broker import Broker
from amqtt.errors import BrokerError as AmqttBrokerError

from protocol.errors import BrokerError, TransportError
from protocol.transport.config import MqttConfig
from protocol.transport.mqtt import MqttTransport

__all__ = ["EmbeddedBroker", "PortInUseError"]

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
_NOISY_LOGGERS = ("amqtt", "transitions")
_AUTO_PORT_ATTEMPTS = 5
_DRAIN_TOPIC = "edgefl-broker/drain"  # + a random id: no client of a fleet subscribes there


class PortInUseError(BrokerError):
    """The embedded broker's port is taken by another process (another MQTT broker?).

    Attributes:
        host: the address the broker was to bind.
        port: the port that is taken.
    """

    def __init__(self, host: str, port: int) -> None:
        super().__init__(
            f"port {port} on {host} is taken (another MQTT broker, such as an installed Mosquitto?)"
        )
        self.host = host
        self.port = port


class _StartupFailureFilter(logging.Filter):
    """Drops amqtt's log of a failed start (a traceback): `EmbeddedBroker.start` raises
    the failure as a `BrokerError` instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "amqtt.broker" and record.msg == "Broker startup failed")


_STARTUP_FAILURE_FILTER = _StartupFailureFilter()


def _check_port(host: str, port: int) -> None:
    """Bind ``host:port`` as amqtt (asyncio's ``start_server``) will, and let it go.

    ``SO_REUSEADDR`` is set, as asyncio sets it, so that connections of an earlier broker
    on the port still in TIME_WAIT do not count as taken. A host that does not resolve is
    left for amqtt to report.

    Raises:
        PortInUseError: another socket holds the port.
        BrokerError: the port cannot be bound for another reason (a privileged port, an
            address not on this machine).
    """
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return
    for family, kind, proto, _name, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise PortInUseError(host, port) from exc
                reason = exc.strerror or str(exc)
                raise BrokerError(
                    f"embedded broker cannot listen on {host}:{port}: {reason}"
                ) from exc


def _port_taken(error: BaseException | None) -> bool:
    """Whether ``error`` (amqtt's failure to start) is its listener finding the port taken."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno == errno.EADDRINUSE:
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


class _SnapshotDict(dict[Any, Any]):
    """A dict whose iteration walks a copy of its keys: it may change meanwhile."""

    def __iter__(self) -> Any:
        return iter(list(super().keys()))


def _snapshot_iteration(broker: object, name: str = "_subscriptions") -> bool:
    """Make iterating ``broker``'s dict ``name`` safe against changes (see the module
    docstring); whether it was done (False: no such plain dict)."""
    table = getattr(broker, name, None)
    if type(table) is not dict:
        return False
    setattr(broker, name, _SnapshotDict(table))
    return True


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


def _finish_tasks(loop: asyncio.AbstractEventLoop, timeout: float = 2.0) -> None:
    """Cancel what amqtt left running (client handlers) so their streams get closed."""
    leftovers = asyncio.all_tasks(loop)
    for task in leftovers:
        task.cancel()
    if leftovers:
        gathered = asyncio.gather(*leftovers, return_exceptions=True)
        with contextlib.suppress(Exception):
            loop.run_until_complete(asyncio.wait_for(gathered, timeout))
    with contextlib.suppress(Exception):
        loop.run_until_complete(loop.shutdown_asyncgens())


class EmbeddedBroker:
    """An amqtt broker on `host:port` (port 0: a free one, kept across restarts).

    Use ``with EmbeddedBroker() as broker:`` or `start()` / `stop()`; it may be started
    again after `stop()`, on the same port.

    Args:
        host: address to bind; keep a loopback address unless you mean to expose it.
        port: TCP port, 0 to pick a free one.
        start_timeout: seconds `start()` waits for the port to accept connections.
        quiet: set amqtt's loggers to WARNING when they have no level of their own.
    """

    def __init__(
        self,
        *,
        host: str = LOOPBACK,
        port: int = 0,
        start_timeout: float = 10.0,
        quiet: bool = True,
    ) -> None:
        self._host = host
        self._port = port
        self._auto_port = port == 0
        self._start_timeout = start_timeout
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        if quiet:
            for name in _NOISY_LOGGERS:
                noisy = logging.getLogger(name)
                if noisy.level == logging.NOTSET:
                    noisy.setLevel(logging.WARNING)

    @property
    def host(self) -> str:
        """The address the broker binds."""
        return self._host

    @property
    def port(self) -> int:
        """The TCP port (0 until the first `start()` picked one)."""
        return self._port

    @property
    def url(self) -> str:
        """``mqtt://host:port``, for `MqttConfig.from_url`."""
        return f"mqtt://{self._host}:{self._port}"

    @property
    def is_running(self) -> bool:
        """Whether the broker thread is serving."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> EmbeddedBroker:
        """Start serving; returns once the port accepts TCP connections.

        Raises:
            PortInUseError: the port (given, not picked) is taken by another process.
            BrokerError: already running, the port cannot be bound, or not ready in time.
        """
        if self.is_running:
            raise BrokerError(f"embedded broker already running on {self._host}:{self._port}")
        attempts = _AUTO_PORT_ATTEMPTS if self._auto_port and self._port == 0 else 1
        for attempt in range(attempts):
            port = self._port or _free_port(self._host)
            try:
                self._start_on(port)
            except BrokerError:
                if attempt == attempts - 1:
                    raise
                logger.debug("port %d was taken meanwhile; trying another", port)
                continue
            self._port = port
            logger.info("embedded MQTT broker listening on %s", self.url)
            return self
        raise BrokerError("unreachable")  # pragma: no cover

    def _start_on(self, port: int) -> None:
        _check_port(self._host, port)
        self._ready.clear()
        self._error = None
        thread = threading.Thread(
            target=self._serve, args=(port,), name=f"amqtt-broker-{port}", daemon=True
        )
        self._thread = thread
        thread.start()
        deadline = time.monotonic() + self._start_timeout
        if not self._ready.wait(self._start_timeout) or self._error is not None:
            self._halt(max(0.0, deadline - time.monotonic()))
            if isinstance(self._error, AmqttBrokerError) and _port_taken(self._error):
                raise PortInUseError(self._host, port) from self._error
            reason = self._error or f"not started within {self._start_timeout} s"
            raise BrokerError(f"embedded broker on {self._host}:{port}: {reason}") from self._error

    def stop(self, timeout: float = 10.0) -> None:
        """Shut the broker down (clients are disconnected) and join its thread.

        Does nothing if it is not running.

        Raises:
            BrokerError: the thread did not end within `timeout` seconds.
        """
        if self._thread is None:
            return
        self._drain(min(timeout / 2, 5.0))
        self._halt(timeout)
        logger.info("embedded MQTT broker on %s stopped", self.url)

    def _drain(self, timeout: float) -> None:
        """Wait until every message published so far has been delivered (see the module
        docstring), at most ``timeout`` seconds; a broker that cannot be reached is left
        as it is."""
        topic = f"{_DRAIN_TOPIC}/{uuid.uuid4().hex}"
        arrived = threading.Event()
        probe = MqttTransport(MqttConfig.from_url(self.url, client_id=f"drain-{uuid.uuid4().hex}"))
        try:
            probe.connect(timeout=timeout)
            probe.subscribe(topic, lambda _message: arrived.set(), qos=0, timeout=timeout)
            probe.publish(topic, b"", qos=1, timeout=timeout)
            if not arrived.wait(timeout):
                logger.warning("embedded broker: messages still queued after %.1f s", timeout)
        except TransportError as exc:
            logger.debug("embedded broker: not drained (%s)", exc)
        finally:
            probe.disconnect()

    def _halt(self, timeout: float) -> None:
        thread, loop, stop_event = self._thread, self._loop, self._stop_event
        if thread is None:
            return
        if loop is not None and stop_event is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already closed
                loop.call_soon_threadsafe(stop_event.set)
        thread.join(timeout)
        if thread.is_alive():
            raise BrokerError(f"embedded broker thread did not stop within {timeout} s")
        self._thread = None

    def _serve(self, port: int) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main(port))
        except BaseException as exc:  # reported to start() / logged; the thread must end
            if not self._ready.is_set():
                self._error = exc
            else:
                logger.exception("embedded broker crashed")
        finally:
            self._ready.set()
            self._loop = None
            self._stop_event = None
            _finish_tasks(loop)
            loop.close()

    async def _main(self, port: int) -> None:
        config: dict[str, Any] = {
            "listeners": {"default": {"type": "tcp", "bind": f"{self._host}:{port}"}},
            "plugins": {
                "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True},
            },
        }
        self._stop_event = asyncio.Event()
        logging.getLogger("amqtt.broker").addFilter(_STARTUP_FAILURE_FILTER)  # added once
        broker = Broker(config, loop=asyncio.get_running_loop())
        if not _snapshot_iteration(broker):
            logger.debug("amqtt's subscription table is not a dict: left as it is")
        await broker.start()  # raises amqtt's BrokerError, e.g. when the port is taken
        # broker.start() awaited asyncio.start_server: the socket listens, connects succeed.
        self._ready.set()
        try:
            await self._stop_event.wait()
        finally:
            await broker.shutdown()

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
