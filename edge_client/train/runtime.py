"""The edge client runtime: MQTT messages in, :func:`local_update` calls, updates out.

One :class:`EdgeClient` is one device. The wire flow (topics from
:class:`protocol.topics.Topics`):

1. ``start()`` connects (retrying with exponential backoff while the broker is not up,
   with a retained ``offline`` :class:`DeviceStatus` as last will), subscribes to its
   inbox ``fl/{fleet}/to/{id}/#`` and to the coordinator's retained status, then
   announces itself: a retained ``online`` status and a :class:`Hello`. It announces
   again after every automatic reconnect and whenever the coordinator's status becomes
   ``starting``. With ``exit_when_finished`` it stops when the status becomes
   ``finished`` after it saw the coordinator live (a retained ``finished`` of an earlier
   run does not stop it); ``stopped`` (also the coordinator's last will) never does, so
   devices outlive a coordinator crash and serve its resumed run.
2. A :class:`RoundTask` (``to/{id}/task``) names the model message
   (``to/{id}/model``) holding its sets; the two may arrive in either order. The last
   few model messages are kept by message id; a task waits for its model up to
   ``task_timeout_s``. Duplicate tasks (same message id, e.g. QoS 1 redelivery) and
   tasks for a round older than the last one done since the coordinator last said
   ``starting`` are ignored; handled task ids are persisted in ``state_dir`` so a
   restart does not train a handled task again.
3. A worker thread (never the transport's handler thread) validates the task, publishes
   status ``training``, runs :func:`edge_client.train.strategies.local_update` (holding the
   optional ``train_gate``), publishes the :class:`Update` on ``devices/{id}/update``
   (even past the deadline: the coordinator decides) and status ``idle``.
4. :class:`Ack` messages are logged.

Nothing a peer sends crashes the client: bad payloads, foreign fleets, unexpected kinds,
invalid tasks and mismatched models are logged (warning) and change nothing. A failed
training publishes status ``error`` and the client goes on.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import platform
import queue
import threading
import time
from collections import OrderedDict
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import ValidationError
from torch import nn

from edge_client.config import ClientConfig
from edge_client.errors import ConfigError, ConnectError, EdgeClientError, TaskError
from edge_client.link import DeviceState, connect_with_retry, publish_status
from edge_client.serve.follower import ModelRefresher
from edge_client.train.client_state import (
    MODEL_FILE,
    STATE_FILE,
    SavedState,
    read_model,
    read_state,
    write_model,
    write_state,
)
from edge_client.train.data import DeviceData
from edge_client.train.strategies import WEIGHTS_SET, LocalTask, local_update, validate_task
from edge_client.train.training import TrainHook
from edge_client.train.transfer import TransferState
from models import Classifier, ModelError, build_classifier, load_state_arrays, state_arrays
from protocol import __version__ as protocol_version
from protocol.channel import Channel
from protocol.codec import Codec
from protocol.deltas import UnknownBaseError
from protocol.errors import DecodeError, EncodeError, TransportError
from protocol.messages import (
    Ack,
    CoordinatorStatus,
    DeviceStatus,
    Hello,
    Message,
    ModelPayload,
    RoundTask,
    Update,
)
from protocol.tensors import Precision
from protocol.tensorset import TensorSet
from protocol.topics import Topics, parse_topic
from protocol.transport.base import Transport, Will

__all__ = ["STATE_FILE", "EdgeClient", "device_hello"]

logger = logging.getLogger(__name__)

_UPLOAD_BACKOFF_MAX_S = 10.0


@dataclass(frozen=True)
class _Job:
    """A task ready to run: its message, its body and the sets of its model message."""

    message: Message
    task: RoundTask
    sets: dict[str, TensorSet] = field(default_factory=dict)


@dataclass(frozen=True)
class _Pending:
    """A task waiting for its model message until ``expires`` (monotonic seconds)."""

    message: Message
    task: RoundTask
    expires: float


class _Wake:
    """Queue item that makes the worker recompute when the next pending task expires."""


_WAKE = _Wake()


class _CancelledError(Exception):
    """Training was stopped because the client is stopping."""


class _CancelHook(TrainHook):
    """Stops training after the current step once ``event`` is set."""

    def __init__(self, event: threading.Event) -> None:
        self._event = event

    def after_step(self, model: nn.Module) -> None:
        if self._event.is_set():
            raise _CancelledError


def _total_memory_bytes() -> int:
    """Physical memory of the machine in bytes, 0 if unknown."""
    try:
        return max(0, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (OSError, ValueError, AttributeError):
        return 0


def _software_version() -> str:
    try:
        return importlib.metadata.version("edgefl")[:64]
    except importlib.metadata.PackageNotFoundError:
        return protocol_version


def device_hello(
    config: ClientConfig,
    *,
    fingerprint: str,
    num_samples: int,
    held_base: str | None,
    memory_bytes: int | None = None,
) -> Hello:
    """The hello a device with ``config`` announces itself with (``memory_bytes``: the
    machine's physical memory when None). The sim's budget tool sends the same."""
    return Hello(
        device_id=config.device_id,
        architecture=config.model,
        fingerprint=fingerprint,
        precisions=tuple(Precision),
        memory_bytes=_total_memory_bytes() if memory_bytes is None else memory_bytes,
        threads=config.threads,
        software_version=_software_version(),
        num_samples=num_samples,
        share_label_counts=config.share_label_counts,
        platform=platform.machine()[:64],
        downlink_precision=config.downlink_precision,
        uplink_precision=config.uplink_precision,
        held_base=held_base,
    )


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
            invalid for the data, or ``state_dir`` cannot be created.
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
        channels, height, width = data.image_shape
        if height != width:
            raise ConfigError(f"images must be square for the classifiers, got {height}x{width}")
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(config.init_seed)
                self._model: Classifier = build_classifier(
                    config.model,
                    num_classes=data.num_classes,
                    in_channels=channels,
                    image_size=height,
                )
        except ModelError as exc:
            raise ConfigError(f"cannot build model {config.model!r} for the data: {exc}") from exc
        if data.device_id != config.device_id:
            logger.info("data file of %r used by device %r", data.device_id, config.device_id)
        if config.state_dir is not None:
            try:
                config.state_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"cannot create state dir {config.state_dir}: {exc}") from exc
        self.config = config
        self.transport = transport
        self.data = data
        self._gate = train_gate
        self._device = device
        self._topics = Topics(config.fleet)
        self._channel = Channel(transport, codec, max_payload=config.max_payload)
        self._lock = threading.Lock()  # guards the task bookkeeping below
        self._lifecycle = threading.Lock()  # serializes start() and stop()
        self._models: OrderedDict[str, ModelPayload] = OrderedDict()
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._handled: OrderedDict[str, None] = OrderedDict()
        self._active: set[str] = set()  # task ids queued or running
        self._rounds_done = 0
        self._last_round = -1  # latest round done in this coordinator run (not persisted)
        self._learning_state: dict[str, Any] = {}
        self._queue: queue.SimpleQueue[_Job | _Wake | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._started = False
        self._stop_requested = threading.Event()
        self._stopped = threading.Event()
        self._last_error: Exception | None = None
        self._unacked: Message | None = None  # the last update sent, until its Ack arrives
        self._seen_live_coordinator = False  # a starting / waiting / running status came
        self._memory_bytes = _total_memory_bytes()
        self._fingerprint = self._model.fingerprint()
        self._transfer = TransferState(config.state_dir, fsync=config.fsync_state)
        self._refresher: ModelRefresher | None = None
        if config.serve_onnx is not None and config.onnx_template is not None:
            self._refresher = ModelRefresher(
                config.onnx_template, config.serve_onnx, fsync=config.fsync_state
            )
        self._load_state()

    # ------------------------------------------------------------------ public API

    @property
    def device_id(self) -> str:
        """This device's id."""
        return self.config.device_id

    @property
    def model(self) -> Classifier:
        """The device's classifier (the weights of the last round trained)."""
        return self._model

    @property
    def rounds_done(self) -> int:
        """Rounds whose update was published (persisted with ``state_dir``)."""
        with self._lock:
            return self._rounds_done

    @property
    def last_error(self) -> Exception | None:
        """The last training, upload or persistence failure, or None."""
        return self._last_error

    @property
    def is_running(self) -> bool:
        """Whether ``start()`` succeeded and the client has not stopped."""
        return self._started and not self._stopped.is_set()

    @property
    def state_path(self) -> Path | None:
        """Where the persisted state lives, or None without ``state_dir``."""
        return None if self.config.state_dir is None else self.config.state_dir / STATE_FILE

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
                status = self._message(DeviceStatus(state="offline"))
                will = Will(self._status_topic, self._channel.codec.encode(status), retain=True)
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
            self._announce()
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

    # ------------------------------------------------------------------ connection

    @property
    def _status_topic(self) -> str:
        return self._topics.device(self.device_id, "status")

    def _message(self, body: Any, round_: int = -1) -> Message:
        return Message(fleet=self.config.fleet, sender=self.device_id, body=body, round=round_)

    def _hello(self) -> Hello:
        return device_hello(
            self.config,
            fingerprint=self._fingerprint,
            num_samples=self.data.num_samples,
            held_base=self._transfer.held_fingerprint,
            memory_bytes=self._memory_bytes,
        )

    def _announce(self) -> None:
        """Publish the retained ``online`` status and the hello; failures are logged."""
        self._publish_status("online")
        try:
            self._channel.send(
                self._topics.device(self.device_id, "hello"), self._message(self._hello())
            )
        except (TransportError, EncodeError) as exc:
            logger.warning("could not send the hello: %s", exc)

    def _publish_status(self, state: DeviceState, detail: str = "") -> None:
        publish_status(self._channel, self.config, state, detail)

    def _on_reconnect(self) -> None:
        logger.info("reconnected to the broker; announcing again")
        self._announce()

    # ------------------------------------------------------------------ inbound

    def _on_bad_payload(self, topic: str, error: DecodeError) -> None:
        logger.warning("dropped a bad payload on %s: %s", topic, error)

    def _on_inbox(self, topic: str, message: Message) -> None:
        try:
            info = parse_topic(topic)
        except DecodeError:
            logger.warning("ignored a %s message on unexpected topic %s", message.kind, topic)
            return
        if message.fleet != self.config.fleet:
            logger.warning("ignored a %s for fleet %r on %s", message.kind, message.fleet, topic)
            return
        if message.kind != info.leaf:
            logger.warning("ignored a %s message on %s", message.kind, topic)
            return
        try:
            body = message.body
            if isinstance(body, RoundTask):
                self._on_task(message, body)
            elif isinstance(body, ModelPayload):
                self._on_model(message, body)
            elif isinstance(body, Ack):
                self._on_ack(message, body)
        except Exception:  # a bug here must not stop the device
            logger.exception("failed to handle a %s message", message.kind)

    def _on_task(self, message: Message, task: RoundTask) -> None:
        task_id = message.message_id
        with self._lock:
            duplicate = task_id in self._handled or task_id in self._active
            duplicate = duplicate or task_id in self._pending
            unacked = self._unacked
        if duplicate:
            logger.info("ignored duplicate task %s (round %d)", task_id, message.round)
            if unacked is not None and getattr(unacked.body, "task_message", None) == task_id:
                self._resend_unacked()  # the coordinator asks again: it lost the update
            return
        with self._lock:
            if message.round < self._last_round:
                logger.warning(
                    "ignored task %s for round %d: round %d is already done",
                    task_id,
                    message.round,
                    self._last_round,
                )
                return
            model_id = task.model_message
            if model_id is None:
                self._enqueue(_Job(message, task))
            elif model_id in self._models:
                self._enqueue(_Job(message, task, dict(self._models[model_id].sets)))
            else:
                expires = time.monotonic() + self.config.task_timeout_s
                self._pending[task_id] = _Pending(message, task, expires)
                while len(self._pending) > self.config.max_pending_tasks:
                    _, dropped = self._pending.popitem(last=False)
                    logger.warning(
                        "dropped task %s: too many tasks wait", dropped.message.message_id
                    )
                self._queue.put(_WAKE)
                logger.debug("task %s waits for model message %s", task_id, model_id)

    def _on_model(self, message: Message, payload: ModelPayload) -> None:
        model_id = message.message_id
        with self._lock:
            if model_id in self._models:
                logger.debug("ignored duplicate model message %s", model_id)
                return
            self._models[model_id] = payload
            while len(self._models) > self.config.max_buffered_models:
                self._models.popitem(last=False)
            ready = [p for p in self._pending.values() if p.task.model_message == model_id]
            for pending in ready:
                del self._pending[pending.message.message_id]
                self._enqueue(_Job(pending.message, pending.task, dict(payload.sets)))
        logger.debug("model message %s (round %d) buffered", model_id, message.round)

    def _enqueue(self, job: _Job) -> None:
        """Queue ``job`` for the worker; call with ``self._lock`` held."""
        self._active.add(job.message.message_id)
        self._queue.put(job)

    def _on_ack(self, message: Message, ack: Ack) -> None:
        with self._lock:
            if self._unacked is not None and ack.ref == self._unacked.message_id:
                self._unacked = None
        if ack.accepted:
            logger.info("coordinator accepted %s (round %d) %s", ack.ref, message.round, ack.detail)
        else:
            logger.warning(
                "coordinator rejected %s (round %d): %s %s",
                ack.ref,
                message.round,
                ack.reason.value,
                ack.detail,
            )

    def _on_broadcast_model(self, topic: str, message: Message) -> None:
        """Refresh the served ONNX model (on the transport's thread: a render and a file
        write, milliseconds for the small models devices serve)."""
        assert self._refresher is not None
        if message.fleet != self.config.fleet:
            logger.warning("ignored a model of fleet %r on %s", message.fleet, topic)
            return
        try:
            self._refresher.apply(message)
        except (EdgeClientError, DecodeError, OSError) as exc:
            logger.error("round %d: the served model was not refreshed: %s", message.round, exc)

    def _on_coordinator_status(self, topic: str, message: Message) -> None:
        status = message.body
        if message.fleet != self.config.fleet or not isinstance(status, CoordinatorStatus):
            logger.warning("ignored a %s (fleet %r) on %s", message.kind, message.fleet, topic)
            return
        logger.info("coordinator status: %s %s", status.state, status.detail)
        if status.state in ("starting", "waiting", "running"):
            self._seen_live_coordinator = True
        if status.state == "starting":  # perhaps a new run, numbering rounds from 0 again
            with self._lock:
                self._last_round = -1
            self._announce()
            self._resend_unacked()
        elif status.state == "stopped":
            logger.info("the coordinator stopped (or crashed); waiting for it to come back")
        elif status.state == "finished" and self.config.exit_when_finished:
            if not self._seen_live_coordinator:
                logger.info("a run finished before this device started; waiting for a new one")
                return
            logger.info("the coordinator finished its run; the device stops")
            # not on the handler thread: stop() disconnects the transport that runs it
            threading.Thread(target=self.stop, name="edge-client-stop", daemon=True).start()

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
            if isinstance(item, _Job):
                announce = False
                try:
                    announce = self._run(item)
                except Exception as exc:  # never let the worker die
                    logger.exception("task %s failed unexpectedly", item.message.message_id)
                    self._last_error = exc
                finally:
                    with self._lock:
                        self._active.discard(item.message.message_id)
                if announce:  # after the task left _active, so its resend is taken
                    self._announce()

    def _expire_pending(self) -> float | None:
        """Drop tasks whose model did not come in time; seconds until the next expiry."""
        now = time.monotonic()
        with self._lock:
            expired = [p for p in self._pending.values() if p.expires <= now]
            for pending in expired:
                del self._pending[pending.message.message_id]
            upcoming = min((p.expires for p in self._pending.values()), default=None)
        for pending in expired:
            logger.warning(
                "dropped task %s (round %d): model message %s did not arrive within %.0f s",
                pending.message.message_id,
                pending.message.round,
                pending.task.model_message,
                self.config.task_timeout_s,
            )
        return None if upcoming is None else max(0.0, upcoming - now)

    def _local_task(self, job: _Job) -> tuple[LocalTask, float]:
        """Decode the job's sets into a :class:`LocalTask`; also the decode seconds.

        Raises:
            UnknownBaseError: a set is a delta against a model this device does not hold.
            TaskError: a named payload is missing or does not decode, or the upload asked
                for is not supported.
        """
        start = time.perf_counter()
        arrays: dict[str, dict[str, np.ndarray]] = {}
        if job.task.model_message is not None:
            names = job.task.payloads or tuple(job.sets)
            try:
                lossy = job.task.downlink_precision is not Precision.FP32
                lossy = lossy or job.task.uplink.mode == "delta"
                arrays = self._transfer.decode(job.sets, names, hold=lossy)
            except UnknownBaseError:
                raise
            except DecodeError as exc:
                raise TaskError(f"cannot decode the model message: {exc}") from exc
        uplink = job.task.uplink
        if uplink.mode not in ("full", "delta") or uplink.subset not in ("all", "head"):
            raise TaskError(
                f"upload mode {uplink.mode!r} / subset {uplink.subset!r} is not supported "
                "by this client (full or delta uploads of all tensors or of the head)"
            )
        upload: Literal["all", "head"] = "head" if uplink.subset == "head" else "all"
        task = LocalTask(job.task.strategy, dict(job.task.hyperparameters), arrays, upload)
        return task, time.perf_counter() - start

    def _run(self, job: _Job) -> bool:
        """Train one task and publish its update; True when the device should announce
        itself again (it lacks the base of a delta, and the coordinator must resend)."""
        message, task = job.message, job.task
        round_ = message.round
        with self._lock:
            stale = round_ < self._last_round
        if stale:
            logger.warning(
                "skipped task %s for round %d: a later round is done", message.message_id, round_
            )
            return False
        try:
            local_task, decode_s = self._local_task(job)
            validate_task(self._model, local_task)
        except UnknownBaseError as exc:
            logger.warning("round %d: %s; asking for the full model", round_, exc)
            return True
        except TaskError as exc:
            logger.warning("rejected task %s (round %d): %s", message.message_id, round_, exc)
            self._remember(message.message_id)
            return False
        self._publish_status("training")
        logger.info("round %d: training (%s)", round_, task.strategy)
        try:
            with self._gate if self._gate is not None else contextlib.nullcontext():
                result = local_update(
                    self._model,
                    self.data,
                    local_task,
                    self._learning_state,
                    hooks=(_CancelHook(self._stop_requested),),
                    device=self._device,
                )
            self._save_model()
            start = time.perf_counter()
            weights = self._transfer.encode_upload(
                result.sets[WEIGHTS_SET], task.uplink, local_task.sets, commit=False
            )
            timings = {"decode_s": decode_s, **result.timings}
            timings["encode_s"] = time.perf_counter() - start
            update = self._update_body(job, result.num_samples, weights, result.metrics, timings)
        except _CancelledError:
            logger.info("round %d: training cancelled, the device stops", round_)
            return False
        except Exception as exc:
            logger.exception("round %d: training failed", round_)
            self._last_error = exc
            self._remember(message.message_id)
            self._publish_status("error", f"round {round_}: {type(exc).__name__}: {exc}")
            return False
        update_message = self._message(update, round_)
        with self._lock:
            self._unacked = update_message
        if not self._publish_update(update_message):
            if self._stop_requested.is_set():
                # Abandoned, not failed: the task stays unhandled and the error feedback
                # unchanged, so a restarted device trains it again if the round is open.
                logger.info("round %d: upload abandoned, the device stops", round_)
                return False
            self._remember(message.message_id)
            self._publish_status("error", f"round {round_}: the update could not be published")
            return False
        self._transfer.commit_upload()
        self._remember(message.message_id, round_=round_)
        self._publish_status("idle")
        logger.info(
            "round %d: update sent (%d samples, loss %.4f, accuracy %.3f)",
            round_,
            update.num_samples,
            update.metrics.get("loss", float("nan")),
            update.metrics.get("accuracy", float("nan")),
        )
        return False

    def _update_body(
        self,
        job: _Job,
        num_samples: int,
        weights: TensorSet,
        metrics: dict[str, float],
        timings: dict[str, float],
    ) -> Update:
        finite = {k: v for k, v in metrics.items() if np.isfinite(v)}
        if len(finite) != len(metrics):
            logger.warning(
                "non-finite training metrics left out: %s", sorted(set(metrics) - set(finite))
            )
        label_counts = None
        if job.task.uplink.label_counts:
            if self.config.share_label_counts:
                label_counts = tuple(int(c) for c in self.data.label_counts())
                logger.info("sharing label counts (the device consented)")
            else:
                logger.warning("the task asks for label counts; not sent (no consent)")
        try:
            return Update(
                task_message=job.message.message_id,
                num_samples=num_samples,
                sets={WEIGHTS_SET: weights},
                label_counts=label_counts,
                metrics=finite,
                timings={k: max(0.0, v) for k, v in timings.items()},
            )
        except ValidationError as exc:
            raise EncodeError(f"invalid update: {exc}") from exc

    def _resend_unacked(self) -> None:
        """Publish the last update again if the coordinator never acknowledged it (it may
        have been down when the update was sent); the coordinator ignores duplicates."""
        message = self._unacked
        if message is None:
            return
        logger.info("round %d: sending the unacknowledged update again", message.round)
        try:
            self._channel.send(self._topics.device(self.device_id, "update"), message)
        except (TransportError, EncodeError) as exc:
            logger.warning("could not resend the update: %s", exc)

    def _publish_update(self, message: Message) -> bool:
        """Publish ``message``, retrying while the broker is unreachable; False if that
        did not succeed within ``upload_retry_s`` or a stop was requested."""
        topic = self._topics.device(self.device_id, "update")
        deadline = time.monotonic() + self.config.upload_retry_s
        delay = 0.5
        while True:
            try:
                self._channel.send(topic, message)
                return True
            except (TransportError, EncodeError) as exc:
                give_up = (
                    isinstance(exc, EncodeError)
                    or self._stop_requested.is_set()
                    or time.monotonic() + delay > deadline
                )
                if give_up:
                    logger.error("round %d: publishing the update failed: %s", message.round, exc)
                    self._last_error = exc
                    return False
                logger.warning("publishing the update failed (%s); retry in %.1f s", exc, delay)
                self._stop_requested.wait(delay)
                delay = min(delay * 2, _UPLOAD_BACKOFF_MAX_S)

    # ------------------------------------------------------------------ persistence

    def _remember(self, task_id: str, *, round_: int | None = None) -> None:
        """Record a handled task (and a round done when ``round_`` is given); persist."""
        with self._lock:
            self._handled[task_id] = None
            while len(self._handled) > self.config.remember_tasks:
                self._handled.popitem(last=False)
            if round_ is not None:
                self._rounds_done += 1
                self._last_round = max(self._last_round, round_)
            saved = SavedState(
                fleet=self.config.fleet,
                device_id=self.device_id,
                rounds_done=self._rounds_done,
                handled_tasks=list(self._handled),
            )
        self._save_state(saved)

    def _save_state(self, saved: SavedState) -> None:
        """Persist ``saved``; failures are logged, never raised."""
        path = self.state_path
        if path is None:
            return
        try:
            write_state(path, saved, fsync=self.config.fsync_state)
        except OSError as exc:
            logger.warning("could not save the client state to %s: %s", path, exc)
            self._last_error = exc

    def _save_model(self) -> None:
        """Persist the trained model (before the update goes out); failures are logged."""
        if self.config.state_dir is None:
            return
        path = self.config.state_dir / MODEL_FILE
        try:
            write_model(path, state_arrays(self._model), fsync=self.config.fsync_state)
        except OSError as exc:
            logger.warning("could not save the model to %s: %s", path, exc)
            self._last_error = exc

    def _load_model(self) -> None:
        """Start from the model saved by the last run of this device, if it fits."""
        assert self.config.state_dir is not None
        path = self.config.state_dir / MODEL_FILE
        if not path.exists():
            return
        try:
            load_state_arrays(self._model, read_model(path))
        except (OSError, ValueError, ModelError) as exc:
            logger.warning("ignored the saved model %s: %s", path, exc)
            return
        logger.info("resumed the local model from %s", path)

    def _load_state(self) -> None:
        path = self.state_path
        if path is None or not path.exists():
            return
        try:
            saved = read_state(path)
        except (OSError, ValueError) as exc:  # ValidationError and JSONDecodeError too
            logger.warning("ignored the unreadable client state %s: %s", path, exc)
            return
        if (saved.fleet, saved.device_id) != (self.config.fleet, self.device_id):
            logger.warning(
                "ignored the client state %s: it belongs to %s/%s",
                path,
                saved.fleet,
                saved.device_id,
            )
            return
        self._handled = OrderedDict.fromkeys(saved.handled_tasks[-self.config.remember_tasks :])
        self._rounds_done = saved.rounds_done
        logger.info("resumed: %d rounds done", saved.rounds_done)
        self._load_model()
