"""The training device's threaded MQTT shell around its session.

One :class:`EdgeClient` is one device. Its logic (which task to train, when to announce,
what to persist, when to resend) is the pure :class:`~edge_client.train.session.DeviceSession`,
whose actions its :class:`~edge_client.train.shell.DeviceShell` carries out; the client
is that shell's threaded driver: it turns transport callbacks into the session's events,
publishes on its channel, runs the training jobs on its worker thread with a
:class:`~edge_client.train.trainer.LocalTrainer`, and persists in ``state_dir``. The wire
flow (topics from :class:`protocol.topics.Topics`):

1. ``start()`` connects (retrying with exponential backoff while the broker is not up,
   with a retained ``offline`` :class:`DeviceStatus` as last will), subscribes to its
   inbox ``fl/{fleet}/to/{id}/#`` and to the coordinator's retained status, then
   announces itself: a retained ``online`` status and a :class:`Hello`. It announces
   again after every automatic reconnect and whenever the coordinator's status becomes
   ``starting``. With ``exit_when_finished`` it stops when the status becomes
   ``finished`` after it saw the coordinator live (a retained ``finished`` of an earlier
   run does not stop it); ``stopped`` (also the coordinator's last will) never does, so
   devices outlive a coordinator crash and serve its resumed run.
2. A :class:`RoundTask` (``to/{id}/task``) and its model message (``to/{id}/model``)
   may arrive in either order (the session's rules); handled task ids are persisted in
   ``state_dir`` so a restart does not train a handled task again.
3. A worker thread (never the transport's handler thread) runs the session's jobs: it
   decodes and validates the task, publishes status ``training``, trains (holding the
   optional ``train_gate``), publishes the :class:`Update` on ``devices/{id}/update``
   (even past the deadline: the coordinator decides; retried while the broker is
   unreachable, up to ``upload_retry_s``) and status ``idle``.
4. :class:`Ack` messages are logged; the last update is sent again until one comes.
   The ack of a hello tells whether the device is in: a refusal is logged at ERROR with
   what to do, and a hello left unanswered for ``hello_timeout_s`` with why it may be
   (the session's hello rules). With ``exit_when_refused`` the client then stops, and
   :attr:`EdgeClient.refusal` says why (the command line exits 3 or 4).

Nothing a peer sends crashes the client: bad payloads, foreign fleets, unexpected kinds,
invalid tasks and mismatched models are logged (warning) and change nothing. A failed
training publishes status ``error`` and the client goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Collection, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from edge_client.config import ClientConfig
from edge_client.errors import ConfigError, ConnectError, EdgeClientError
from edge_client.link import (
    DeviceState,
    connect_with_retry,
    new_session,
    publish_status,
    total_memory_bytes,
)
from edge_client.serve.follower import ModelRefresher
from edge_client.train.client_state import STATE_FILE, DeviceStore
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
from edge_client.train.refusal import Refusal
from edge_client.train.retry import RetrySchedule
from edge_client.train.session import DeviceSession
from edge_client.train.shell import DeviceShell, Retry, Upload, publish_once
from edge_client.train.trainer import (
    CancelHook,
    LocalTrainer,
    build_device_model,
    describe_model,
    resumed_learning_state,
)
from edge_client.train.transfer import TransferState
from models import Classifier, ModelError, load_state_arrays
from protocol.channel import Channel
from protocol.codec import Codec
from protocol.errors import DecodeError, TransportError
from protocol.messages import DeviceStatus, Message
from protocol.ratelog import RateLimitedLog
from protocol.topics import Topics
from protocol.transport.base import Transport, Will

__all__ = ["STATE_FILE", "EdgeClient"]

logger = logging.getLogger(__name__)


class _Wake:
    """Queue item that makes the worker recompute when the next waiting task expires."""


_WAKE = _Wake()


class EdgeClient:
    """One edge device: trains the coordinator's tasks on its local data.

    Args:
        config: the device's configuration.
        transport: a not yet connected transport (``MqttTransport`` or
            ``MemoryTransport``); the client connects, uses and disconnects it.
        data: the device's local data; the classifier ``config.model`` is built for its
            class count, channels and (square) image size.
        train_gate: a context manager held while training (e.g. a shared
            ``threading.Semaphore``, so that many clients in one process do not all
            train at once); None: no gate.
        codec: encoder / decoder with its limits; a default :class:`Codec` if None.
        device: where to train.

    Raises:
        ConfigError: the images are not square, the model name or its options are
            invalid for the data, ``state_dir`` cannot be created, or ``serve_onnx`` or
            ``exit_when_finished`` without the coordinator's public key (with keys).
    """

    def __init__(
        self,
        config: ClientConfig,
        transport: Transport,
        data: DeviceData,
        *,
        train_gate: AbstractContextManager[object] | None = None,
        codec: Codec | None = None,
        device: torch.device = torch.device("cpu"),  # noqa: B008
    ) -> None:
        model = build_device_model(config, data)
        if data.device_id != config.device_id:
            logger.info("data file of %r used by device %r", data.device_id, config.device_id)
        store = DeviceStore.of(config, on_error=self._failed)  # before any thread starts
        self.config = config
        self.transport = transport
        self.data = data
        self._topics = Topics(config.fleet)
        auth, fleet_key = config.keyring(), config.fleet_key()
        self._fleet_topics = auth is None or fleet_key is not None
        """Whether the coordinator's fleet-wide frames can be read (they are signed: a
        device without the coordinator's public key cannot check them)."""
        if not self._fleet_topics:
            for flag, given in (
                ("--serve-onnx", config.serve_onnx is not None),
                ("--exit-when-finished", config.exit_when_finished),
            ):
                if given:
                    raise ConfigError(
                        f"{flag} needs the coordinator's public key to check its signed "
                        "status and models: give --coordinator-key-file FILE (the .pub of "
                        "its signing key)"
                    )
            logger.warning(
                "no coordinator public key (--coordinator-key-file): the coordinator's "
                "status is not read (its frames are signed); the device still trains, its "
                "tasks and acks come on its own authenticated topics"
            )
        self._channel = Channel(
            transport, codec, max_payload=config.max_payload, auth=auth, fleet_key=fleet_key
        )
        self._session_id = new_session()
        """This run's session id: in every status and in the last will."""
        self._refusals = RateLimitedLog(logger)
        """Bad or foreign frames anyone on the broker may send: one WARNING per topic a
        minute, the rest at DEBUG (a flood must not fill the device's disk)."""
        self._lock = threading.Lock()  # guards the session
        self._lifecycle = threading.Lock()  # serializes start() and stop()
        self._queue: queue.SimpleQueue[Job | _Wake | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._started = False
        self._stop_requested = threading.Event()
        self._stopped = threading.Event()
        self._last_error: Exception | None = None
        transfer = TransferState(config.state_dir, fsync=config.fsync_state)
        unacked = None if store is None else store.load_unacked(config.fleet, config.device_id)
        transfer.recover(unacked)
        self._trainer = LocalTrainer(
            model,
            data,
            transfer,
            hooks=(CancelHook(self._stop_requested.is_set),),
            gate=train_gate,
            device=device,
        )
        self._refresher: ModelRefresher | None = None
        if config.serve_onnx is not None and config.onnx_template is not None:
            self._refresher = ModelRefresher(
                config.onnx_template, config.serve_onnx, fsync=config.fsync_state
            )
        self._schedule = RetrySchedule.of(config)
        self._session = DeviceSession(
            config,
            fingerprint=model.fingerprint(),
            num_samples=data.num_samples,
            label_counts=tuple(int(c) for c in data.label_counts()),
            memory_bytes=total_memory_bytes(),
            held_base=transfer.held_fingerprint,
            saved=None if store is None else store.load_state(),
            unacked=unacked,
            model=describe_model(model),
        )
        self._shell = DeviceShell(self._session, _Effects(self), store=store, lock=self._lock)
        if self._session.restored and store is not None:
            self._load_model(store, device)

    # ------------------------------------------------------------------ public API

    @property
    def device_id(self) -> str:
        """This device's id."""
        return self.config.device_id

    @property
    def model(self) -> Classifier:
        """The device's classifier (the weights of the last round trained)."""
        return self._trainer.model

    @property
    def rounds_done(self) -> int:
        """Rounds whose update was published (persisted with ``state_dir``)."""
        with self._lock:
            return self._session.rounds_done

    @property
    def last_error(self) -> Exception | None:
        """The last training, upload or persistence failure, or None."""
        return self._last_error

    @property
    def refusal(self) -> Refusal | None:
        """Why the client stopped trying to join its fleet (``exit_when_refused``): the
        coordinator refused its hello, or none answered it; None: it did not."""
        with self._lock:
            return self._session.refusal

    @property
    def is_running(self) -> bool:
        """Whether ``start()`` succeeded and the client has not stopped."""
        return self._started and not self._stopped.is_set()

    @property
    def state_path(self) -> Path | None:
        """Where the persisted state lives, or None without ``state_dir``."""
        return None if self.config.state_dir is None else self.config.state_dir / STATE_FILE

    @property
    def _handled(self) -> Collection[str]:
        """Ids of the handled tasks."""
        with self._lock:
            return self._session.handled

    def start(self) -> None:
        """Connect, subscribe and announce the device; returns once it is announced.

        Connection attempts are retried with exponential backoff (from
        ``connect_backoff_s`` doubling up to ``connect_backoff_max_s``) for up to
        ``connect_retry_s`` seconds. If :meth:`stop` is called meanwhile, returns with the
        client stopped.

        Raises:
            ConnectError: no session within ``connect_retry_s``, or subscribing failed.
            RuntimeError: the client was started before.
        """
        with self._lifecycle:
            if self._started or self._stopped.is_set():
                raise RuntimeError("an EdgeClient can be started once")
            self._started = True
            try:
                status = Message(
                    fleet=self.config.fleet,
                    sender=self.device_id,
                    body=DeviceStatus(state="offline", session=self._session_id),
                )
                will = Will(
                    self._status_topic,
                    self._channel.encode(self._status_topic, status),
                    retain=True,
                )
                connected = connect_with_retry(
                    self.transport, self.config, will, self._stop_requested
                )
            except ConnectError:
                self._stopped.set()
                raise
            if not connected:
                self._stopped.set()
                return
            try:
                inbox = self._topics.device_inbox(self.device_id)
                self._channel.subscribe(inbox, self._on_inbox, on_error=self._on_bad_payload)
                if self._fleet_topics:
                    self._channel.subscribe(
                        self._topics.coordinator_status,
                        self._on_coordinator_status,
                        on_error=self._on_bad_payload,
                    )
                if self._refresher is not None:
                    self._channel.subscribe(
                        self._topics.broadcast_model,
                        self._on_broadcast_model,
                        on_error=self._on_bad_payload,
                    )
            except TransportError as exc:
                self.transport.disconnect()
                self._stopped.set()
                raise ConnectError(f"subscribing failed: {exc}") from exc
            self.transport.on_reconnect(self._on_reconnect)
            self._worker = threading.Thread(
                target=self._work, name=f"edge-client-{self.device_id}", daemon=True
            )
            self._worker.start()
            self._handle_and_wake(Started())
            logger.info(
                "device %s online in fleet %s (%s, %d samples)",
                self.device_id,
                self.config.fleet,
                self.config.model,
                self.data.num_samples,
            )

    def stop(self, timeout: float = 10.0) -> None:
        """Stop: end training after its current step, publish the retained ``offline``
        status and disconnect cleanly (so no last will). Idempotent; safe from any thread.

        Args:
            timeout: seconds to wait for the worker thread to finish.
        """
        self._stop_requested.set()
        with self._lifecycle:
            if self._stopped.is_set():
                return
            self._queue.put(None)
            worker = self._worker
            if worker is not None and worker is not threading.current_thread():
                worker.join(timeout)
                if worker.is_alive():
                    logger.warning("worker still busy after %.1f s; disconnecting anyway", timeout)
            if self._started:
                if self.transport.is_connected:
                    self._publish_status("offline")
                self.transport.disconnect()
            self._stopped.set()
            logger.info("device %s stopped after %d rounds", self.device_id, self.rounds_done)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the client stopped; False if ``timeout`` (seconds) passed first."""
        return self._stopped.wait(timeout)

    # ------------------------------------------------------------------ the session

    def _handle(self, event: Event) -> None:
        """Feed ``event`` to the session and carry out its actions."""
        self._shell.handle(event)

    def _handle_and_wake(self, event: Event) -> None:
        """:meth:`_handle` an event from outside the worker thread, then wake the worker
        if the session now waits for something (a hello's answer), so that it ticks."""
        self._handle(event)
        with self._lock:
            waiting = self._session.next_expiry is not None
        if waiting:
            self._queue.put(_WAKE)

    def _failed(self, error: Exception) -> None:
        """Remember a persistence or upload failure (``last_error``)."""
        self._last_error = error

    @property
    def _status_topic(self) -> str:
        return self._topics.device(self.device_id, "status")

    def _publish_status(self, state: DeviceState, detail: str = "") -> None:
        publish_status(self._channel, self.config, state, detail, self._session_id)

    # ------------------------------------------------------------------ inbound

    def _on_reconnect(self) -> None:
        self._handle_and_wake(Reconnected())

    def _on_bad_payload(self, topic: str, error: DecodeError) -> None:
        self._refusals.warning(f"bad:{topic}", "dropped a bad payload on %s: %s", topic, error)

    def _on_inbox(self, topic: str, message: Message) -> None:
        try:
            self._handle(Received(topic, message, time.monotonic()))
            with self._lock:
                waiting = self._session.next_expiry is not None
            if waiting:
                self._queue.put(_WAKE)  # the worker recomputes when to expire it
        except Exception:  # a bug here must not stop the device
            logger.exception("failed to handle a %s message", message.kind)

    def _on_coordinator_status(self, topic: str, message: Message) -> None:
        self._handle_and_wake(CoordinatorStatusReceived(topic, message))

    def _on_broadcast_model(self, topic: str, message: Message) -> None:
        """Refresh the served ONNX model (on the transport's thread: a render and a file
        write, milliseconds for the small models devices serve)."""
        assert self._refresher is not None
        if message.fleet != self.config.fleet:
            self._refusals.warning(
                f"fleet:{topic}", "ignored a model of fleet %r on %s", message.fleet, topic
            )
            return
        try:
            self._refresher.apply(message)
        except (EdgeClientError, DecodeError, OSError) as exc:
            logger.error("round %d: the served model was not refreshed: %s", message.round, exc)

    # ------------------------------------------------------------------ worker

    def _work(self) -> None:
        while not self._stop_requested.is_set():
            timeout = self._expire_pending()
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                continue
            if item is None:
                return
            if isinstance(item, _Wake):
                continue
            task_id = item.message.message_id
            try:
                result: JobResult = self._trainer.run(item)
            except Exception as exc:  # a bug: the task fails, the device goes on
                logger.exception("task %s failed unexpectedly", task_id)
                result = Failed(task_id, exc)
            if isinstance(result, Failed):
                self._last_error = result.error
            try:
                self._handle(JobDone(result))
            except Exception:  # never let the worker die
                logger.exception("task %s: its result was not handled", task_id)

    def _expire_pending(self) -> float | None:
        """Drop tasks whose model did not come in time; seconds until the next expiry."""
        now = time.monotonic()
        self._handle(Tick(now))
        with self._lock:
            upcoming = self._session.next_expiry
        return None if upcoming is None else max(0.0, upcoming - now)

    # ------------------------------------------------------------------ persistence

    def _load_model(self, store: DeviceStore, device: torch.device) -> None:
        """Start from the model saved by the last run of this device, if it fits, and
        from the learning state saved with it, if that fits too."""
        arrays = store.load_model()
        if arrays is None:
            return
        try:
            load_state_arrays(self._trainer.model, arrays)
        except (ValueError, ModelError) as exc:
            logger.warning("ignored the saved model %s: %s", store.model_path, exc)
            return
        logger.info("resumed the local model from %s", store.model_path)
        saved = store.load_learning_state(arrays)
        if saved is not None:
            trainer = self._trainer
            restored = resumed_learning_state(saved, trainer.model, device)
            trainer.learning_state.update(restored)
            if restored:
                logger.info("resumed the learning state %s", sorted(restored))


class _Effects:
    """What the client does for its shell (:class:`~edge_client.train.shell.DeviceEffects`)."""

    def __init__(self, client: EdgeClient) -> None:
        self._client = client

    def publish(self, action: Publish) -> None:
        publish_once(self._client._channel, action)

    def set_status(self, action: SetStatus) -> None:
        self._client._publish_status(action.state, action.detail)

    def send_update(self, action: SendUpdate) -> None:
        """Publish the update, waiting between attempts (on the worker thread, which
        trained it), and tell the session; nothing when a stop was requested meanwhile
        (the task stays unhandled and the error feedback unchanged, so a restarted device
        trains it again)."""
        client = self._client
        stop_requested = client._stop_requested
        upload = Upload(action, client._schedule)
        while isinstance(
            step := upload.attempt(client._channel.send, stop_requested.is_set), Retry
        ):
            stop_requested.wait(step.delay_s)
        if (step is None or not step.ok) and upload.error is not None:
            client._failed(upload.error)
        if step is not None:
            client._handle(step)

    def run_job(self, job: Job) -> None:
        self._client._queue.put(job)  # the worker thread runs it

    def commit_upload(self) -> None:
        self._client._trainer.commit_upload()

    def trained_model(self) -> Classifier:
        return self._client._trainer.model

    def learning_state(self) -> Mapping[str, Any]:
        return self._client._trainer.learning_state

    def stop(self) -> None:
        # not on the handler thread: stop() disconnects the transport that runs it
        threading.Thread(target=self._client.stop, name="edge-client-stop", daemon=True).start()
