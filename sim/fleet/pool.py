"""The fleet driver's connection pool: K broker connections carrying N emulated devices.

Each device keeps its own identity and topics: its connection subscribes to the device's
inbox ``fl/{fleet}/to/{id}/#`` (one subscription per device) and publishes the device's
messages on ``fl/{fleet}/devices/{id}/...`` with the device as sender; only the MQTT
connection is shared. Each connection also subscribes once to the coordinator's retained
status, which the driver hands to each of its devices.

Per connection, one publisher thread publishes for its devices in the order asked (so
each device's messages keep their order): a message, the retained status, and an update
as the device shell's :class:`~edge_client.train.shell.Upload` says (retried while the
broker is unreachable, as the device's
:class:`~edge_client.train.retry.RetrySchedule` says; a retry waits on the thread's heap
without holding up the connection's other devices). The same thread first subscribes its
devices' inboxes and the status, then announces its devices.

The connections share one codec (:class:`SharedDecodes`): a frame many devices receive
(a round's model, one message sealed under each device's key) is checked under each
device's key and decoded once, into one message the devices share.

A pool connection has no last will: the broker cannot publish N devices' ``offline``
statuses for one dropped connection. The driver publishes ``offline`` for every device
when it stops; an emulator that crashes leaves its devices' last statuses as they were.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field

from edge_client.config import ClientConfig
from edge_client.errors import ConfigError, ConnectError
from edge_client.link import DeviceState, new_session, publish_status
from edge_client.train.exchange import Event, Publish, Received, SendUpdate, Started
from edge_client.train.retry import RetrySchedule
from edge_client.train.shell import Retry, Upload, publish_once
from protocol.auth import Keyring
from protocol.channel import Channel
from protocol.codec import FRAME_HEADER_SIZE, MESSAGE_PREFIX_SIZE, Codec
from protocol.errors import DecodeError, TransportError
from protocol.messages import Message
from protocol.topics import Topics
from protocol.transport import Counts, Inbound, TrafficStats, Transport, publish_packet_size
from sim.fleet.pacing import RateLimit

__all__ = [
    "ConnectionRestored",
    "DeviceEvent",
    "Pool",
    "PoolEvent",
    "SharedDecodes",
    "StatusArrived",
]

logger = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class DeviceEvent:
    """An event of one device's session."""

    device_id: str
    event: Event


@dataclass(frozen=True)
class StatusArrived:
    """The coordinator's status arrived on ``connection``: it is for each of its devices.
    ``payload_bytes`` / ``wire_bytes``: its size, as the transport counted it once."""

    connection: int
    topic: str
    message: Message
    payload_bytes: int
    wire_bytes: int


@dataclass(frozen=True)
class ConnectionRestored:
    """``connection`` reconnected to the broker (its subscriptions are restored)."""

    connection: int


PoolEvent = DeviceEvent | StatusArrived | ConnectionRestored


@dataclass(order=True)
class _Retry:
    """An update to publish again at ``due`` (monotonic seconds)."""

    due: float
    order: int
    device_id: str = field(compare=False)
    upload: Upload = field(compare=False)


class _Setup:
    """Queue item: subscribe the connection's devices and announce them."""


_SETUP = _Setup()


def _keyring(configs: Sequence[ClientConfig]) -> Keyring | None:
    """The keys of the devices one connection carries; None when all run insecure.

    Raises:
        ConfigError: a device without a key, or keys and insecure devices mixed.
    """
    rings = [c.keyring() for c in configs]
    if all(r is None for r in rings):
        return None
    if any(r is None for r in rings):
        raise ConfigError("devices with keys and insecure ones cannot share a connection")
    return Keyring({d: k for r in rings if r is not None for d, k in r.items()})


SHARED_FRAME_BYTES = 4096
"""Frames from this size on are decoded once for all the fleet's devices that receive
them (a round's model); smaller ones (tasks, acks, statuses) each time."""
SHARED_FRAMES_KEPT = 8
"""Decoded large frames the fleet keeps (the models of a round's groups and
precisions)."""


class SharedDecodes(Codec):
    """The fleet's codec: a frame that many devices receive (the coordinator sends one
    model to each, sealed under each device's key) decodes to one shared
    :class:`Message`, not one copy per device.

    The channel checks each frame's tag under its device's key before it decodes it; two
    frames whose bytes after the tag are the same hold the same message, so the later
    gets the first's (frozen) decoding, waiting for it where it is under way on another
    connection's thread. Thread-safe.

    Args:
        codec: the codec whose limits and level it keeps.
    """

    def __init__(self, codec: Codec) -> None:
        super().__init__(level=codec.level, limits=codec.limits)
        self._decoded: OrderedDict[tuple[bytes, memoryview], Future[Message]] = OrderedDict()
        self._lock = threading.Lock()
        self.shared = 0
        """Frames that reused a decoding."""

    def decode(self, frame: bytes) -> Message:
        if len(frame) < SHARED_FRAME_BYTES:
            return super().decode(frame)
        # the header, then the message after the tag (the tag differs per device)
        key = (frame[:FRAME_HEADER_SIZE], memoryview(frame)[MESSAGE_PREFIX_SIZE:])
        hash(key)  # the view keeps its hash: hashed here, not while holding the lock
        with self._lock:
            decoding = self._decoded.get(key)
            if decoding is None:
                mine = self._decoded[key] = Future()
                while len(self._decoded) > SHARED_FRAMES_KEPT:
                    self._decoded.popitem(last=False)
            else:
                self._decoded.move_to_end(key)
        if decoding is None:
            try:
                message = super().decode(frame)
            except BaseException:
                with self._lock:
                    if self._decoded.get(key) is mine:
                        del self._decoded[key]
                mine.cancel()  # waiters decode it themselves, and fail as it did
                raise
            mine.set_result(message)
            return message
        try:
            message = decoding.result()
        except CancelledError:
            return super().decode(frame)
        with self._lock:
            self.shared += 1
        return message


class Pool:
    """The connections of a fleet and their publisher threads.

    Args:
        transports: K not yet connected transports.
        members: for each transport, the configurations of the devices it carries.
        post: where inbound messages, statuses, reconnects and finished uploads go (the
            driver's event queue); called from the transports' and publishers' threads.
        codec: encoder / decoder with its limits; a default :class:`Codec` if None.
        rate: how fast the devices publish, all connections together; None: no limit.
    """

    def __init__(
        self,
        transports: Sequence[Transport],
        members: Sequence[Sequence[ClientConfig]],
        post: Callable[[PoolEvent], None],
        *,
        codec: Codec | None = None,
        rate: RateLimit | None = None,
    ) -> None:
        if len(transports) != len(members) or not all(members):
            raise ValueError("one non-empty list of devices per transport")
        configs = [c for group in members for c in group]
        self.codec = SharedDecodes(codec or Codec())
        self._topics = Topics(configs[0].fleet)
        self._post = post
        self._rate = rate
        self._configs = {c.device_id: c for c in configs}
        self.session = new_session()
        """The session id of this pool's run, in every status its devices publish."""
        self._connection_of: dict[str, int] = {}
        self._connections: list[_Connection] = []
        for index, (transport, group) in enumerate(zip(transports, members, strict=True)):
            max_payload = min(c.max_payload for c in group)
            channel = Channel(
                transport,
                self.codec,
                max_payload=max_payload,
                auth=_keyring(group),
                fleet_key=group[0].fleet_key(),
            )
            ids = tuple(c.device_id for c in group)
            self._connections.append(_Connection(self, index, channel, ids))
            self._connection_of.update(dict.fromkeys(ids, index))
        self._fanout = TrafficStats()  # further deliveries of a message received once
        self._undelivered = Counts()  # received by a transport, delivered to no device
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    @property
    def size(self) -> int:
        """The number of connections."""
        return len(self._connections)

    def devices_of(self, connection: int) -> tuple[str, ...]:
        """The ids of the devices ``connection`` carries."""
        return self._connections[connection].devices

    def connect(self, retry_s: float, stop: threading.Event) -> bool:
        """Connect every transport, retrying each with exponential backoff (0.5 s doubling
        up to 10 s) for up to ``retry_s`` seconds; False if ``stop`` was set meanwhile.

        Raises:
            ConnectError: a connection failed for ``retry_s`` seconds.
        """
        return all(c.connect(retry_s, stop) for c in self._connections)

    def start(self, ready: Callable[[str | Exception | int], None]) -> None:
        """Start the publisher threads. Each subscribes its devices' inboxes (calling
        ``ready(device_id)`` after each), then the coordinator's status, then announces
        its devices and calls ``ready(connection_index)``; a failure calls
        ``ready(ConnectError)`` and ends that thread."""
        for connection in self._connections:
            connection.start(ready)

    def publish(self, device_id: str, action: Publish) -> None:
        """Publish ``action.message`` once for ``device_id`` (a failure is logged)."""
        connection = self._connection_of_device(device_id)
        connection.put(lambda: connection.publish(action))

    def set_status(self, device_id: str, state: DeviceState, detail: str = "") -> None:
        """Publish the retained status of ``device_id``."""
        connection = self._connection_of_device(device_id)
        connection.put(lambda: connection.set_status(device_id, state, detail))

    def upload(self, device_id: str, action: SendUpdate) -> None:
        """Publish the update of ``device_id`` (retried as its schedule says); its
        :class:`~edge_client.train.session.UpdateSent` comes back through ``post``,
        unless the fleet stops meanwhile."""
        connection = self._connection_of_device(device_id)
        schedule = RetrySchedule.of(self._configs[device_id])
        connection.put(lambda: connection.upload(device_id, Upload(action, schedule)))

    def _connection_of_device(self, device_id: str) -> _Connection:
        return self._connections[self._connection_of[device_id]]

    def count_deliveries(
        self, topic: str, payload_bytes: int, wire_bytes: int, devices: int
    ) -> None:
        """A message that a transport received (and counted) once on ``topic`` reached
        ``devices`` of its devices: count it once per device (none: not at all, as a
        stopped device, disconnected, would not have received it)."""
        if devices == 0:
            self._uncount(Counts(1, payload_bytes, wire_bytes))
        for _ in range(devices - 1):
            self._fanout.record("in", topic, payload_bytes, wire_bytes)

    def traffic(self) -> tuple[Counts, Counts]:
        """What the devices published and what was delivered to them: (out, in)."""
        stats = [c.channel.transport.stats for c in self._connections] + [self._fanout]
        out = sum((s.totals("out") for s in stats), Counts())
        inn = sum((s.totals("in") for s in stats), Counts())
        with self._lock:
            gone = self._undelivered
        inn = Counts(
            inn.messages - gone.messages,
            inn.payload_bytes - gone.payload_bytes,
            inn.wire_bytes - gone.wire_bytes,
        )
        return out, inn

    def close(self, idle_timeout: float = 10.0) -> None:
        """Publish what is queued, then stop the publishers and disconnect. A publisher
        that makes no progress for ``idle_timeout`` seconds is left behind (logged).
        Retries of updates not yet sent are dropped."""
        self._stopping.set()
        for connection in self._connections:
            connection.put(None)
        for connection in self._connections:
            connection.join(idle_timeout)
        for connection in self._connections:
            connection.channel.transport.disconnect()

    def _uncount(self, counts: Counts) -> None:
        """``counts`` were received (and counted by a transport) but reached no device."""
        with self._lock:
            self._undelivered = self._undelivered + counts

    def _pace(self) -> None:
        """Wait for the rate limit before a publish (not once the fleet stops)."""
        if self._rate is not None and not self._stopping.is_set():
            self._rate.acquire()

    def _config(self, device_id: str) -> ClientConfig:
        return self._configs[device_id]


class _Connection:
    """One transport, the devices it carries and its publisher thread."""

    def __init__(self, pool: Pool, index: int, channel: Channel, devices: tuple[str, ...]) -> None:
        self.pool = pool
        self.index = index
        self.channel = channel
        self.devices = devices
        # what the publisher thread does next, in order
        self._queue: queue.SimpleQueue[Callable[[], None] | _Setup | None] = queue.SimpleQueue()
        self._retries: list[_Retry] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._ready: Callable[[str | Exception | int], None] = lambda _: None
        self.progress = 0  # items carried out, to tell a slow publisher from a stuck one

    def connect(self, retry_s: float, stop: threading.Event) -> bool:
        transport = self.channel.transport
        deadline = time.monotonic() + retry_s
        delay, attempt = 0.5, 0
        while not stop.is_set():
            attempt += 1
            try:
                transport.connect(timeout=_CONNECT_TIMEOUT_S)
                # A round trip the broker answers once it has set the session up: amqtt
                # walks its subscriptions then, and fails if another client subscribes
                # meanwhile, so the next connection waits for it. (Unsubscribing a
                # filter this client never subscribed changes nothing.)
                transport.unsubscribe(self.pool._topics.coordinator_status)
                # What came before that answer matched none of this client's (still
                # absent) subscriptions: amqtt sends a new client the retained messages
                # of every filter any client subscribed. It reached no device.
                self.pool._uncount(transport.stats.totals("in"))
            except TransportError as exc:
                transport.disconnect()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ConnectError(
                        f"connection {self.index} of the fleet: no connection to the broker "
                        f"after {attempt} attempts in {retry_s:.0f} s: {exc}"
                    ) from exc
                logger.warning("connection %d: attempt %d failed (%s)", self.index, attempt, exc)
                stop.wait(min(delay, remaining))
                delay = min(delay * 2, 10.0)
                continue
            transport.on_reconnect(self._on_reconnect)
            return True
        return False

    def start(self, ready: Callable[[str | Exception | int], None]) -> None:
        self._ready = ready
        self._queue.put(_SETUP)
        self._thread = threading.Thread(
            target=self._run, name=f"fleet-publisher-{self.index}", daemon=True
        )
        self._thread.start()

    def put(self, work: Callable[[], None] | None) -> None:
        """Have the publisher thread do ``work``; None: end the thread."""
        self._queue.put(work)

    def join(self, idle_timeout: float) -> None:
        thread = self._thread
        if thread is None:
            return
        seen, since = self.progress, time.monotonic()
        while thread.is_alive():
            thread.join(1.0)
            if self.progress != seen:
                seen, since = self.progress, time.monotonic()
            elif time.monotonic() - since > idle_timeout:
                logger.warning("connection %d: publisher stuck; disconnecting anyway", self.index)
                return

    # -- the publisher thread -----------------------------------------------------------

    def _run(self) -> None:
        while True:
            wait = None
            if self._retries:
                wait = max(0.0, self._retries[0].due - time.monotonic())
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                self._retry_due()
                continue
            if item is None:
                return
            if isinstance(item, _Setup):
                try:
                    self._setup()
                except ConnectError as exc:
                    self._ready(exc)
                    return
                except Exception as exc:  # start() must hear of it, whatever it is
                    logger.exception("connection %d: setting up failed", self.index)
                    self._ready(exc)
                    return
            else:
                try:
                    item()
                except Exception:  # never let the publisher die
                    logger.exception("connection %d: a publish failed", self.index)
            self.progress += 1
            self._retry_due()

    def _setup(self) -> None:
        topics = self.pool._topics
        try:
            for device_id in self.devices:
                self.channel.subscribe(
                    topics.device_inbox(device_id),
                    self._inbox_handler(device_id),
                    on_error=_bad_payload,
                )
                self._ready(device_id)
            if self.channel.auth is None or self.channel.fleet_key is not None:
                # (without the coordinator's public key its signed status is unreadable)
                self.channel.transport.subscribe(topics.coordinator_status, self._on_status)
        except TransportError as exc:
            raise ConnectError(f"connection {self.index}: subscribing failed: {exc}") from exc
        for device_id in self.devices:
            self.pool._post(DeviceEvent(device_id, Started()))
        self._ready(self.index)

    def publish(self, action: Publish) -> None:
        self.pool._pace()
        publish_once(self.channel, action)

    def set_status(self, device_id: str, state: DeviceState, detail: str) -> None:
        self.pool._pace()
        config = self.pool._config(device_id)
        publish_status(self.channel, config, state, detail, self.pool.session)

    def upload(self, device_id: str, upload: Upload) -> None:
        """Publish the update once; retry later or tell the device's session."""
        step = upload.attempt(self._paced_send, self.pool._stopping.is_set)
        if isinstance(step, Retry):
            later = _Retry(time.monotonic() + step.delay_s, next(self._order), device_id, upload)
            heapq.heappush(self._retries, later)
        elif step is not None:
            self.pool._post(DeviceEvent(device_id, step))

    def _paced_send(self, topic: str, message: Message) -> None:
        self.pool._pace()
        self.channel.send(topic, message)

    def _retry_due(self) -> None:
        now = time.monotonic()
        while self._retries and self._retries[0].due <= now:
            retry = heapq.heappop(self._retries)
            if self.pool._stopping.is_set():
                continue  # the fleet stops: the update is abandoned
            self.upload(retry.device_id, retry.upload)

    # -- inbound (the transport's handler thread) ----------------------------------------

    def _inbox_handler(self, device_id: str) -> Callable[[str, Message], None]:
        post = self.pool._post

        def received(topic: str, message: Message) -> None:
            post(DeviceEvent(device_id, Received(topic, message, time.monotonic())))

        return received

    def _on_status(self, inbound: Inbound) -> None:
        try:
            self.channel.authenticate(inbound.topic, inbound.payload)  # signed by the coordinator
            message = self.channel.codec.decode(inbound.payload)
        except DecodeError as exc:
            _bad_payload(inbound.topic, exc)
            return
        transport = self.channel.transport
        size = len(inbound.payload)
        wire = publish_packet_size(inbound.topic, size, inbound.qos, transport.protocol_version)
        self.pool._post(StatusArrived(self.index, inbound.topic, message, size, wire))

    def _on_reconnect(self) -> None:
        self.pool._post(ConnectionRestored(self.index))


def _bad_payload(topic: str, error: DecodeError) -> None:
    logger.warning("dropped a bad payload on %s: %s", topic, error)
