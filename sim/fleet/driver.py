"""The fleet driver: N emulated devices in one process, each its own device session.

:class:`Fleet` runs one :class:`~edge_client.train.session.DeviceSession` per device, the
very session a device's :class:`~edge_client.train.runtime.EdgeClient` runs, in the very
shell (:class:`~edge_client.train.shell.DeviceShell`), with a few threads whatever N is:

* the **event thread** feeds the devices' shells: inbound messages (routed by the inbox
  they came on), the coordinator's status (handed to each device of the connection it
  came on), reconnects, job results, finished uploads and expiry ticks; for their
  actions, each device's effects (:class:`_Device`) hand publishing to the connection's
  publisher and jobs to the trainer thread; persistence is done at once;
* the **trainer thread** hands the jobs to a :class:`~sim.fleet.trainer.FleetTrainer`,
  batched by a :class:`~sim.fleet.batching.CohortQueue` (decoding as it comes, training
  in cohorts), so training never blocks the handling of acks, statuses and tasks;
* the :class:`~sim.fleet.pool.Pool`'s K connections, each with its publisher thread and
  its transport's own threads.

Devices start, and send their updates, a window at a time
(:class:`~sim.fleet.window.AnswerWindow`): at most ``window`` hellos and updates wait for
the coordinator's answer, so that its one connection is not handed the fleet's messages
faster than it reads them.

Bytes are counted as N separate devices would count them (:meth:`Fleet.traffic`): what
the devices publish, and what is delivered to them, the coordinator's status once per
device it reaches although each connection receives it once.
"""

from __future__ import annotations

import heapq
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from edge_client.config import ClientConfig
from edge_client.link import total_memory_bytes
from edge_client.train.client_state import DeviceStore
from edge_client.train.data import DeviceData
from edge_client.train.exchange import (
    CoordinatorStatusReceived,
    Event,
    Failed,
    Job,
    JobDone,
    JobResult,
    Publish,
    Received,
    Reconnected,
    SendUpdate,
    SetStatus,
    Started,
    Tick,
)
from edge_client.train.hello import ModelDescription
from edge_client.train.session import DeviceSession
from edge_client.train.shell import DeviceShell
from models import Classifier
from protocol.codec import Codec
from protocol.messages import Ack, Hello
from protocol.transport import Counts, Transport
from sim.fleet.batching import DEFAULT_LINGER_S, DEFAULT_MAX_COHORT, CohortQueue
from sim.fleet.devices import build_device
from sim.fleet.pacing import DEFAULT_RATE, RateLimit
from sim.fleet.pool import ConnectionRestored, DeviceEvent, Pool, PoolEvent, StatusArrived
from sim.fleet.trainer import FleetTrainer, LoopTrainer, TrainerFactory
from sim.fleet.window import DEFAULT_WINDOW, AnswerWindow

__all__ = ["DEFAULT_CONNECTIONS", "Fleet", "FleetOptions"]

logger = logging.getLogger(__name__)

DEFAULT_CONNECTIONS = 16
"""Broker connections of a fleet of at least that many devices (docs/results.md)."""


class FleetOptions(BaseModel):
    """How the driver carries its devices: connections, cohorts, timeouts."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    connections: int | None = Field(default=None, ge=1)
    """Broker connections (at most one per device); None: min(devices, 16)."""
    max_cohort: int = Field(default=DEFAULT_MAX_COHORT, ge=1)
    """Training jobs handed to the trainer at once, at most."""
    linger_s: float = Field(default=DEFAULT_LINGER_S, ge=0, allow_inf_nan=False)
    """Quiet seconds after which the training jobs waiting go to the trainer."""
    window: int = Field(default=DEFAULT_WINDOW, ge=1)
    """Hellos and updates waiting for the coordinator's answer at once, at most: a device
    starts, or sends its update, when fewer wait."""
    max_rate: float | None = Field(default=DEFAULT_RATE, gt=0, allow_inf_nan=False)
    """Messages per second the devices publish at most, all connections together, over
    bursts of 200 (sim.fleet.pacing); None: no limit."""
    connect_retry_s: float = Field(default=60.0, ge=0, allow_inf_nan=False)
    """How long each connection keeps retrying to reach the broker, seconds."""
    client_id_prefix: str = "fleet"
    """MQTT client ids are PREFIX-NNN."""

    def pool_size(self, devices: int) -> int:
        """The connections for ``devices`` devices.

        Raises:
            ValueError: more connections than devices.
        """
        if self.connections is None:
            return min(devices, DEFAULT_CONNECTIONS)
        if self.connections > devices:
            raise ValueError(f"{self.connections} connections for {devices} devices")
        return self.connections


class Fleet:
    """N emulated devices over a pool of broker connections (see the module docstring).

    Args:
        devices: each device's configuration and data.
        make_transport: a not yet connected transport for an MQTT client id.
        trainer: builds the trainer of the fleet's jobs (default: :class:`LoopTrainer`).
        options: connections, cohorts and timeouts.
        codec: encoder / decoder with its limits; a default :class:`Codec` if None.

    Raises:
        ConfigError: a device's model cannot be built for its data, or its state dir
            cannot be created.
        ValueError: no devices, more connections than devices, or two devices with one id.
    """

    def __init__(
        self,
        devices: Sequence[tuple[ClientConfig, DeviceData]],
        make_transport: Callable[[str], Transport],
        *,
        trainer: TrainerFactory = LoopTrainer,
        options: FleetOptions | None = None,
        codec: Codec | None = None,
    ) -> None:
        options = options or FleetOptions()
        if not devices:
            raise ValueError("a fleet needs devices")
        size = options.pool_size(len(devices))
        self._devices: dict[str, _Device] = {}
        specs = []
        memory = total_memory_bytes()
        fingerprints: dict[tuple[Any, ...], tuple[str, ModelDescription]] = {}
        for config, data in devices:
            if config.device_id in self._devices:
                raise ValueError(f"two devices named {config.device_id!r}")
            spec, session, store = build_device(config, data, memory, fingerprints)
            specs.append(spec)
            self._devices[config.device_id] = _Device(
                self, config.device_id, session, store, spec.learning_state
            )
        self._trainer: FleetTrainer = trainer(specs)
        self._events: queue.SimpleQueue[PoolEvent | _Tick | None] = queue.SimpleQueue()
        self._cohorts = CohortQueue(options.max_cohort, options.linger_s)
        # what waits to send a message the coordinator answers: a device's start (its
        # hello; no action) or its update
        self._window: AnswerWindow[tuple[str, SendUpdate | None]] = AnswerWindow(options.window)
        configs = [config for config, _ in devices]
        members = [configs[i::size] for i in range(size)]
        transports = [make_transport(f"{options.client_id_prefix}-{i:03d}") for i in range(size)]
        rate = None if options.max_rate is None else RateLimit(options.max_rate)
        self._pool = Pool(transports, members, self._post, codec=codec, rate=rate)
        self._options = options
        self._expiries: list[tuple[float, str]] = []
        self._running = len(self._devices)
        self._all_stopped = threading.Event()
        self._stop = threading.Event()
        self._closed = False
        self._received: Counts | None = None  # what was received until the fleet closed
        self._threads = [
            threading.Thread(target=self._event_loop, name="fleet-events", daemon=True),
            threading.Thread(target=self._train_loop, name="fleet-trainer", daemon=True),
        ]

    # -- public API ------------------------------------------------------------------------

    @property
    def device_ids(self) -> tuple[str, ...]:
        """The devices, in the order given."""
        return tuple(self._devices)

    @property
    def connections(self) -> int:
        """The number of broker connections carrying the devices."""
        return self._pool.size

    def model(self, device_id: str) -> Classifier:
        """The device's classifier (the weights of its last training)."""
        return self._trainer.model(device_id)

    def traffic(self) -> tuple[Counts, Counts]:
        """Messages, payload and wire bytes the devices published and received so far,
        counted as N separate devices would: (out, in). Nothing is received once the
        fleet is closing (a device that stops disconnects)."""
        out, inn = self._pool.traffic()
        return out, self._received if self._received is not None else inn

    def start(self, on_subscribed: Callable[[str], None] | None = None) -> None:
        """Connect, subscribe and announce every device; returns once all are announced.

        Args:
            on_subscribed: called with each device id once its inbox is subscribed, on
                the calling thread.

        Raises:
            ConnectError: a connection cannot be made within ``connect_retry_s``, or
                subscribing failed (the fleet is closed).
            RuntimeError: started before.
        """
        if self._threads[0].ident is not None or self._closed:
            raise RuntimeError("a Fleet can be started once")
        for thread in self._threads:
            thread.start()
        ready: queue.SimpleQueue[str | Exception | int] = queue.SimpleQueue()
        try:
            if not self._pool.connect(self._options.connect_retry_s, self._stop):
                return
            self._pool.start(ready.put)
            pending = self._pool.size
            while pending:
                item = ready.get()
                if isinstance(item, Exception):
                    raise item
                if isinstance(item, int):
                    pending -= 1
                elif on_subscribed is not None:
                    on_subscribed(item)
        except BaseException:
            self.close()
            raise
        logger.info(
            "fleet: %d devices announced over %d connections", len(self._devices), self.connections
        )

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every device stopped; False if ``timeout`` (seconds) passed first."""
        return self._all_stopped.wait(timeout)

    def rounds_done(self, device_id: str) -> int:
        """Rounds whose update the device published."""
        return self._devices[device_id].session.rounds_done

    def close(self, timeout: float = 10.0) -> None:
        """Stop: training ends after its current step, every device still running
        publishes its retained ``offline`` status, the connections close cleanly.
        Idempotent.

        Args:
            timeout: seconds to wait for each thread, or for a publisher that makes no
                progress.
        """
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._cohorts.close()
        close = getattr(self._trainer, "close", None)
        if close is not None:
            close()
        self._events.put(None)
        for thread in self._threads:
            if thread.ident is not None:
                thread.join(timeout)
                if thread.is_alive():
                    logger.warning("fleet: %s still busy after %.1f s", thread.name, timeout)
        self._drop_undelivered()
        self._received = self._pool.traffic()[1]
        for device_id, device in self._devices.items():
            if not device.stopped:
                device.stopped = True
                self._pool.set_status(device_id, "offline")
        self._pool.close(timeout)
        stopped = sum(d.session.rounds_done for d in self._devices.values())
        logger.info("fleet stopped: %d devices, %d rounds done in all", len(self._devices), stopped)

    def _drop_undelivered(self) -> None:
        """Statuses that arrived as the fleet closed reached no device: uncount them."""
        while True:
            try:
                item = self._events.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, StatusArrived):
                self._pool.count_deliveries(item.topic, item.payload_bytes, item.wire_bytes, 0)

    # -- the event thread --------------------------------------------------------------------

    def _post(self, item: PoolEvent) -> None:
        """Queue an event from the pool for the event thread (from any thread): the
        fleet is not quiet."""
        self._cohorts.touch()
        self._events.put(item)

    def _event_loop(self) -> None:
        while True:
            due = [t for t in (self._window.next_expiry(),) if t is not None]
            if self._expiries:
                due.append(self._expiries[0][0])
            wait = max(0.0, min(due) - time.monotonic()) if due else None
            item: PoolEvent | _Tick | None
            try:
                item = self._events.get(timeout=wait)
            except queue.Empty:
                item = _TICK  # an expiry is due
            if item is None:
                return
            try:
                self._dispatch(item)
                self._tick()
            except Exception:  # a bug here must not stop the fleet
                logger.exception("fleet: failed to handle %r", type(item).__name__)

    def _dispatch(self, item: PoolEvent | _Tick) -> None:
        if isinstance(item, DeviceEvent) and isinstance(item.event, Started):
            self._window.queue((item.device_id, None))  # it starts when the window lets it
        elif isinstance(item, DeviceEvent):
            self._handle(item.device_id, item.event)
        elif isinstance(item, StatusArrived):
            delivered = 0
            event = CoordinatorStatusReceived(item.topic, item.message)
            for device_id in self._pool.devices_of(item.connection):
                if not self._devices[device_id].stopped:
                    delivered += 1
                    self._handle(device_id, event)
            self._pool.count_deliveries(item.topic, item.payload_bytes, item.wire_bytes, delivered)
        elif isinstance(item, ConnectionRestored):
            for device_id in self._pool.devices_of(item.connection):
                self._handle(device_id, Reconnected())

    def _tick(self) -> None:
        """Start the devices and send the updates the window admits; tell the sessions
        whose waiting tasks are due to expire that time passed."""
        for device_id, update in self._window.admit():
            if update is None:
                self._handle(device_id, Started())
            elif not self._devices[device_id].stopped:
                self._window.sent(update.message.message_id)
                self._pool.upload(device_id, update)
        now = time.monotonic()
        due = set()
        while self._expiries and self._expiries[0][0] <= now:
            due.add(heapq.heappop(self._expiries)[1])
        for device_id in due:
            self._handle(device_id, Tick(now))

    def _handle(self, device_id: str, event: Event) -> None:
        device = self._devices[device_id]
        if device.stopped:
            return
        if isinstance(event, Received) and isinstance(event.message.body, Ack):
            self._window.answered(event.message.body.ref)
        device.shell.handle(event)
        expiry = device.session.next_expiry
        if expiry is not None:
            heapq.heappush(self._expiries, (expiry, device_id))

    def _stopped(self, device: _Device) -> None:
        """``device`` stopped (the coordinator finished its run)."""
        device.stopped = True
        self._pool.set_status(device.device_id, "offline")
        self._running -= 1
        if self._running == 0:
            self._all_stopped.set()

    # -- the trainer thread ------------------------------------------------------------------

    def _train_loop(self) -> None:
        while (batch := self._cohorts.next_batch()) is not None:
            results = self._run(batch)
            for (device_id, _), result in zip(batch, results, strict=True):
                self._events.put(DeviceEvent(device_id, JobDone(result)))

    def _run(self, batch: list[tuple[str, Job]]) -> list[JobResult]:
        try:
            results = self._trainer.run_many(batch)
            if len(results) != len(batch):
                raise RuntimeError(f"{len(results)} results for {len(batch)} jobs")
        except Exception as exc:  # a bug of the trainer: these jobs fail, the fleet goes on
            logger.exception("fleet: the trainer failed on %d jobs", len(batch))
            return [Failed(job.message.message_id, exc) for _, job in batch]
        return results


class _Device:
    """One emulated device: its shell, and what the fleet does for it (the shell's
    :class:`~edge_client.train.shell.DeviceEffects`), on the event thread."""

    def __init__(
        self,
        fleet: Fleet,
        device_id: str,
        session: DeviceSession,
        store: DeviceStore | None,
        learning_state: Mapping[str, Any],
    ) -> None:
        self.device_id = device_id
        self.shell = DeviceShell(session, self, store=store)
        self.stopped = False
        self._fleet = fleet
        self._learning_state = learning_state  # its trainer's (FleetDevice.learning_state)

    @property
    def session(self) -> DeviceSession:
        return self.shell.session

    def publish(self, action: Publish) -> None:
        if isinstance(action.message.body, Hello):
            self._fleet._window.sent(action.message.message_id)
        self._fleet._pool.publish(self.device_id, action)

    def set_status(self, action: SetStatus) -> None:
        self._fleet._pool.set_status(self.device_id, action.state, action.detail)

    def send_update(self, action: SendUpdate) -> None:
        self._fleet._window.queue((self.device_id, action))  # it goes when the window lets it

    def run_job(self, job: Job) -> None:
        self._fleet._cohorts.submit(self.device_id, job)

    def commit_upload(self) -> None:
        self._fleet._trainer.commit_upload(self.device_id)

    def trained_model(self) -> Classifier:
        return self._fleet._trainer.model(self.device_id)

    def learning_state(self) -> Mapping[str, Any]:
        return self._learning_state

    def stop(self) -> None:
        self._fleet._stopped(self)


class _Tick:
    """Event-thread item: time passed (expiries may be due)."""


_TICK = _Tick()
