"""The coordinator's I/O shell: MQTT messages in, :class:`RoundEngine` actions out.

:class:`Coordinator` connects a transport (with a retained ``stopped`` status as its last
will), subscribes to every device topic of the fleet, and feeds the engine from one thread:
messages decoded by the :class:`~protocol.channel.Channel` are queued by the transport's
handler thread and processed in order with clock ticks. Actions are carried out in the
order the engine returns them; round results go to observers (the lab emulator evaluates
models there) and to the log. A round's aggregation runs on a thread of its own, on the
``server_device``, and comes back through the same queue as an ``AggregateDone`` event
(while it runs the engine goes on answering devices); if it fails, :meth:`Coordinator.run`
raises :class:`~coordinator.errors.AggregationError` and the run can be resumed. At the
end the final models are saved as ``.pt`` and ``.onnx`` under ``state_dir/final`` (in a
folder per architecture group where the fleet runs several); if that fails (a full disk),
:meth:`Coordinator.run` raises :class:`~coordinator.errors.StoreError` and resuming the
finished run saves them again.

:class:`RunStatus`, an observer, keeps ``state_dir/status.json`` (the run's phase, every
round's start and close, the process's peak RSS at exit) for scripts and benchmarks to
read instead of the log.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt
import torch

from coordinator.actions import (
    Action,
    AggregateRequested,
    Finished,
    Publish,
    RoundClosed,
    RoundStarted,
    UpdateOutcome,
)
from coordinator.aggregation_phase import AggregationJob
from coordinator.auth import load_keys, load_signing_key
from coordinator.config import CoordinatorConfig
from coordinator.context import ServerContext, resolve_server_device
from coordinator.engine import RoundEngine
from coordinator.enrolment import FleetKeys
from coordinator.errors import AggregationError, ConfigError, CoordinatorError, StoreError
from coordinator.events import AggregateDone, Event, Received, Reconnected, Tick, Undecodable
from coordinator.groups import ArchitectureGroup, GroupModels, Models
from coordinator.proxy import proxy_digest, server_proxy
from coordinator.store import MemoryStore, Store
from coordinator.strategies.registry import build_strategy
from coordinator.telemetry import FleetTelemetry
from models import Classifier, build_classifier, load_state_arrays, seeded
from models.errors import ModelError
from protocol.auth import AuthError, KeySource, topic_device
from protocol.channel import Channel
from protocol.codec import Codec
from protocol.errors import DecodeError, EncodeError, QuotaError, TransportError
from protocol.limits import ReassemblyLimits
from protocol.messages import CoordinatorStatus, Message, ReasonCode
from protocol.ratelog import RateLimitedLog
from protocol.signing import SigningKey
from protocol.topics import parse_topic
from protocol.transport import Transport, Will
from protocol.transport.retry import connect_retrying

__all__ = [
    "STATUS_FILE",
    "Coordinator",
    "Observer",
    "RunStatus",
    "build_models",
    "save_final_models",
    "save_group_models",
]

log = logging.getLogger(__name__)

_FAN_OUT_MIN = 8
"""Devices a batch of actions must message before the sender threads share it out."""

Array = npt.NDArray[Any]
Observer = Callable[[Action], None]
"""Called with every RoundStarted, RoundClosed and Finished action, on the engine thread."""


STATUS_FILE = "status.json"
"""The status file's name in the state dir (:class:`RunStatus`)."""


@dataclass(frozen=True)
class _AggregationFailed:
    """Queued in place of an AggregateDone when the aggregation raised."""

    round: int
    error: Exception


def build_models(config: CoordinatorConfig) -> dict[str, Classifier]:
    """A classifier of each of the run's architectures, by architecture (its group's
    name), each initialised from ``config.seed`` (same weights every time, as a device
    built with that seed has them).

    Raises:
        ConfigError: invalid model options.
    """
    templates = {}
    for name in config.architectures:
        try:
            with seeded(config.seed):
                templates[name] = build_classifier(
                    name, num_classes=config.num_classes, input_shape=config.sample_shape
                )
        except ModelError as exc:
            raise ConfigError(str(exc)) from exc
    return templates


def save_group_models(
    models: GroupModels,
    templates: Mapping[str, Classifier],
    out_dir: Path,
    *,
    onnx: bool = True,
    final: str | None = None,
) -> list[Path]:
    """:func:`save_final_models` of every architecture group: into ``out_dir`` for a
    fleet of one architecture, into ``out_dir/GROUP`` for each group of several.

    Raises:
        StoreError: a file cannot be written.
        ModelError: a model cannot be exported.
    """
    written = []
    for group, models_of_group in models.items():
        out = out_dir if len(models) == 1 else out_dir / group
        written += save_final_models(models_of_group, templates[group], out, onnx=onnx, final=final)
    return written


def save_final_models(
    models: Models,
    template: Classifier,
    out_dir: Path,
    *,
    onnx: bool = True,
    final: str | None = None,
) -> list[Path]:
    """Save each model as ``NAME.pt`` (a state_dict of tensors; load it with
    ``torch.load(path, weights_only=True)``) and, with ``onnx``, ``NAME.onnx``; the model
    named ``final`` (the one the run delivers) also as ``model.pt`` / ``model.onnx``.

    Files are written to a temporary name, then renamed. Returns the paths written.

    Raises:
        StoreError: a file cannot be written (a full disk, a read-only directory). Its
            temporary file is removed.
        ModelError: a model cannot be exported.
    """
    from models.onnx_export import export_onnx

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"cannot create {out_dir}: {exc}") from exc
    written = []
    named = dict(models)
    if final is not None:
        named["model"] = models[final]
    for name, arrays in named.items():
        load_state_arrays(template, arrays)
        buffer = io.BytesIO()
        torch.save(template.state_dict(), buffer)  # in memory: I/O errors come as OSError
        outputs = {f"{name}.pt": buffer.getvalue()}
        if onnx:
            outputs[f"{name}.onnx"] = export_onnx(template, template.input_shape)
        for filename, data in outputs.items():
            path = out_dir / filename
            tmp = out_dir / f".tmp-{filename}"
            try:
                tmp.write_bytes(data)
                tmp.replace(path)
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                raise StoreError(f"cannot write {path}: {exc}") from exc
            written.append(path)
    return written


class Coordinator:
    """Runs a federated job over a transport until the last round closes.

    Args:
        config: the run's settings.
        transport: a not yet connected transport; the coordinator connects it.
        store: the state store (in memory when None, so nothing survives a crash).
        codec: codec with its decode limits (defaults when None).
        tick_s: seconds between clock ticks (deadline checks, round starts).
        clock: returns Unix time in seconds.
        keyring: the fleet's device keys; None: those ``config`` names (its device keys,
            enrolled devices and fleet token), or none with ``config.insecure_no_auth``
            (:func:`~coordinator.auth.load_keys`).
        signing_key: signs the fleet-wide frames; None: the one ``config`` names
            (:func:`~coordinator.auth.load_signing_key`). Unused without a keyring.
        proxy_data: unlabeled samples for server-side distillation, ``(N,
            *sample_shape)`` (one-channel images also ``(N, H, W)``), uint8 or floats
            (:func:`~coordinator.proxy.proxy_tensor`); every aggregation finds them in
            its context.
        held_out: a labelled held-out set ``(x, y)``, float32 ``(N, *sample_shape)``
            and int64 ``(N,)`` (the ``--eval-data`` :func:`~coordinator.evaluation.
            read_eval_data` reads); every aggregation finds it in its context, for what
            its server step reports (never trained on).

    Raises:
        ConfigError: no device keys without ``insecure_no_auth``, an unreadable keyring
            or fleet token, unknown strategy or model, ``server_device`` cuda without a
            GPU, proxy data that does not fit the models, or none for a strategy that
            distils on it.
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        transport: Transport,
        store: Store | None = None,
        *,
        codec: Codec | None = None,
        tick_s: float = 0.1,
        clock: Callable[[], float] = time.time,
        proxy_data: npt.NDArray[Any] | None = None,
        held_out: tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]] | None = None,
        keyring: KeySource | None = None,
        signing_key: SigningKey | None = None,
    ) -> None:
        self.config = config
        self.transport = transport
        self.keyring = keyring if keyring is not None else load_keys(config)
        if self.keyring is not None and signing_key is None:
            signing_key = load_signing_key(config)
        self.signing_key = None if self.keyring is None else signing_key
        """The key of the fleet-wide frames (None: insecure, nothing is signed)."""
        self.channel = Channel(
            transport,
            codec,
            reassembly=ReassemblyLimits(max_transfer_age_s=config.replay_window_s),
            admit=self._admit,
            auth=self.keyring,
            fleet_key=self.signing_key,
        )
        self._refusals = RateLimitedLog(log)
        self._clock = clock
        self._tick_s = tick_s
        self._server_device = resolve_server_device(config.server_device)
        self._templates = build_models(config)
        """A classifier of each architecture group, by group."""
        strategy = build_strategy(config, self._templates)
        self._proxy = server_proxy(proxy_data, strategy, config)
        self._held_out = held_out
        self.engine = RoundEngine(
            config,
            strategy,
            store if store is not None else MemoryStore(),
            {name: ArchitectureGroup.of(t) for name, t in self._templates.items()},
            proxy_digest=None if self._proxy is None else proxy_digest(self._proxy),
        )
        keys = self.keyring
        self.telemetry = FleetTelemetry(
            fleet=config.fleet,
            strategy=config.strategy,
            rounds=config.rounds,
            engine=self.engine,
            traffic=transport.stats,
            enrolments=(lambda: keys.enrolments) if isinstance(keys, FleetKeys) else None,
        )
        """What the metrics exporter and the dashboard show (fed on the engine thread)."""
        self.engine.watch(self.telemetry.heard, self.telemetry.refused)
        self._refusals.listen(self.telemetry.refused)
        self._events: queue.Queue[Event | _AggregationFailed] = queue.Queue()
        self._stop = threading.Event()
        self._senders: concurrent.futures.ThreadPoolExecutor | None = None
        """Threads that publish a round's device messages (:meth:`_send_run`), one
        per core, while :meth:`run` runs; None on a single core."""
        self._observers: list[Observer] = []
        self.final_models: GroupModels | None = None
        self.final_model = self.engine.strategy.final_model
        """Name of the model the run delivers (``aca`` or ``oca``)."""

    def add_observer(self, observer: Observer) -> None:
        """Call ``observer(action)`` for each action the engine takes, after it was
        carried out: each Publish (acknowledgements included), RoundStarted, RoundClosed
        and Finished. Observers run on the engine thread and must be quick."""
        self._observers.append(observer)

    def stop(self) -> None:
        """Ask :meth:`run` to return after the event it is processing (thread-safe)."""
        self._stop.set()

    def run(self) -> GroupModels | None:
        """Connect, run rounds until the last one closes (or :meth:`stop`), disconnect.

        Returns:
            The final global models of each group, or None when stopped before the end.

        Raises:
            TransportError: the broker cannot be reached at start (within
                ``config.connect_retry_s``).
            StoreError: the state store failed (fatal: the run cannot go on safely), or
                the final models could not be saved (resume to save them).
            CoordinatorError: the final models could not be exported.
            AggregationError: a round's aggregation failed (resume to run it again).
        """
        fleet, me = self.config.fleet, self.config.coordinator_id
        topics = self.engine.topics
        will = Message(fleet=fleet, sender=me, body=CoordinatorStatus(state="stopped"))
        if not self._connect(
            Will(topics.coordinator_status, self.channel.encode(topics.coordinator_status, will))
        ):
            return None
        cores = min(len(os.sched_getaffinity(0)), 32)
        if cores > 1:
            self._senders = concurrent.futures.ThreadPoolExecutor(cores, "coordinator-send")
        try:
            self.channel.subscribe(topics.from_devices(), self._receive, on_error=self._bad_input)
            self.transport.on_reconnect(self._on_reconnect)
            self._execute(self.engine.start(self._clock()))
            next_tick = self._clock() + self._tick_s
            while not self._stop.is_set() and self.final_models is None:
                try:
                    event = self._events.get(timeout=max(0.0, next_tick - self._clock()))
                except queue.Empty:
                    event = Tick(self._clock())
                    next_tick = self._clock() + self._tick_s
                    self.telemetry.refresh()
                if isinstance(event, _AggregationFailed):
                    raise AggregationError(
                        f"the aggregation of round {event.round} failed: {event.error}"
                    ) from event.error
                self._execute(self.engine.handle(event))
        finally:
            if self.final_models is None:
                self._publish_final_status("stopped")
            if self._senders is not None:
                self._senders.shutdown()
                self._senders = None
            self.transport.disconnect()
        return self.final_models

    # -- inbound (transport handler thread) -------------------------------------------

    def _receive(self, topic: str, message: Message) -> None:
        try:
            info = parse_topic(topic)
        except DecodeError:
            self._refusals.warning("topic:", "ignored message on unexpected topic %s", topic)
            return
        if info.role != "device" or info.device_id is None:
            return
        now = self._clock()
        skew_ms = message.sent_at_ms - int(now * 1000)
        self._events.put(Received(info.device_id, message, now, skew_ms))

    def _admit(self, topic: str) -> bool:
        """Whether chunks on ``topic`` may be buffered: only the updates of registered
        devices are large enough to need chunks (a dict lookup, safe off the engine
        thread)."""
        try:
            info = parse_topic(topic)
        except DecodeError:
            return False
        return (
            info.role == "device"
            and info.leaf == "update"
            and info.device_id is not None
            and info.device_id in self.engine.registry
        )

    def _bad_input(self, topic: str, error: DecodeError) -> None:
        """A bad update of a registered device goes to the engine, which nacks it (and
        logs it); with keys only one whose tag verified gets there (the channel refuses
        anything failing before that as unauthenticated). Unauthenticated payloads and
        other bad input are logged here, at WARNING once per device (topics outside the
        layout: once for all of them) and minute, the others at DEBUG, and answered with
        nothing."""
        if isinstance(error, AuthError):
            source = error.device_id or "topic outside the layout"
            self._refusals.warning(
                f"auth:{source}", "refused unauthenticated payload on %s: %s", topic, error
            )
            return
        try:
            info = parse_topic(topic)
        except DecodeError:
            self._refusals.warning(
                "topic:", "dropped bad input on unexpected topic %s: %s", topic, error
            )
            return
        if info.role != "device" or info.device_id is None or info.leaf != "update":
            self._refusals.warning(
                f"undecodable:{topic}", "dropped undecodable payload on %s: %s", topic, error
            )
            return
        reason = ReasonCode.OVERSIZE if isinstance(error, QuotaError) else ReasonCode.MALFORMED
        self._events.put(
            Undecodable(
                info.device_id,
                reason,
                str(error),
                self._clock(),
                ref=error.message_id,
                round=error.round,
            )
        )

    def _connect(self, will: Will) -> bool:
        """Connect, retrying with a doubling backoff (1 s up to 10 s) for
        ``config.connect_retry_s``; False when :meth:`stop` came first.

        Raises:
            TransportError: no session within ``connect_retry_s``.
        """

        def waiting(attempt: int, exc: TransportError, wait: float, remaining: float) -> None:
            log.warning(
                "waiting for the MQTT broker: attempt %d failed (%s); next in %.0f s, "
                "giving up %.0f s from now (--connect-retry)",
                attempt,
                exc,
                wait,
                remaining,
            )

        attempts = connect_retrying(
            self.transport,
            will,
            self._stop,
            retry_s=self.config.connect_retry_s,
            first_delay_s=1.0,
            max_delay_s=10.0,
            timeout_s=10.0,
            on_wait=waiting,
        )
        if attempts is not None and attempts > 1:
            log.info("connected to the MQTT broker at attempt %d", attempts)
        return attempts is not None

    def _on_reconnect(self) -> None:
        self._events.put(Reconnected(self._clock()))

    # -- actions (engine thread) ------------------------------------------------------

    def _execute(self, actions: list[Action]) -> None:
        """Carry out ``actions`` in order, each followed by its telemetry and observers;
        a run of device messages among them (a round's fan-out) is published on the
        sender threads (:meth:`_send_run`) before its actions' observers are called."""
        run: list[Publish] = []
        for action in actions:
            if isinstance(action, Publish) and topic_device(action.topic) is not None:
                run.append(action)
                continue
            self._send_run(run)
            run = []
            match action:  # exhaustive: an action the engine adds fails the type check here
                case Publish():
                    self._publish(action)
                case RoundStarted():
                    log.info(
                        "round %d/%d started: %d devices",
                        action.round,
                        self.config.rounds,
                        len(action.selected),
                    )
                case AggregateRequested():
                    self._aggregate(action.job)
                case RoundClosed():
                    self._log_round(action)
                case Finished():
                    self._finish(action)
                case UpdateOutcome():
                    pass  # for the observers
                case _:  # mypy: every action type has a case above
                    unhandled: NoReturn = action
                    raise AssertionError(f"unhandled action {unhandled!r}")
            self._observe(action)
        self._send_run(run)

    def _observe(self, action: Action) -> None:
        self.telemetry(action)
        for observer in self._observers:
            observer(action)

    def _send_run(self, run: list[Publish]) -> None:
        """Publish ``run`` (consecutive messages to devices), then observe each.

        With :attr:`_senders` and at least :data:`_FAN_OUT_MIN` devices, each device's
        messages are published in order on a sender thread, the devices side by side:
        a copy of a round's model costs its device's seal and chunking (the frame is
        compressed once), and over MQTT the wait for each PUBACK; the hashing lets go
        of the GIL, the Python work around it does not (on an in-process broker the
        threads mostly wait for each other: docs/results.md, "On a GPU")."""
        per_device: dict[str | None, list[Publish]] = {}
        for action in run:
            per_device.setdefault(topic_device(action.topic), []).append(action)
        if self._senders is None or len(per_device) < _FAN_OUT_MIN:
            for action in run:
                self._publish(action)
        else:
            sending = [self._senders.submit(self._publish_all, p) for p in per_device.values()]
            for future in sending:
                future.result()  # what _publish does not log is raised here, as inline
        for action in run:
            self._observe(action)

    def _publish_all(self, actions: list[Publish]) -> None:
        for action in actions:
            self._publish(action)

    def _aggregate(self, job: AggregationJob) -> None:
        """Run ``job`` on a thread of its own; its outcome comes back as an event."""
        context = ServerContext.for_round(
            self._server_device,
            self.config.seed,
            job.round,
            proxy_data=self._proxy,
            held_out=self._held_out,
        )

        def work() -> None:
            start = time.perf_counter()
            try:
                result = job.run(context)
            except Exception as exc:  # surfaces on the engine thread
                log.exception("round %d: the aggregation failed", job.round)
                self._events.put(_AggregationFailed(job.round, exc))
                return
            seconds = time.perf_counter() - start
            self._events.put(AggregateDone(job.round, result, self._clock(), seconds))

        name = f"aggregate-round-{job.round}"
        threading.Thread(target=work, name=name, daemon=True).start()

    def _publish(self, action: Publish) -> None:
        try:
            self.channel.send(
                action.topic, action.message, retain=action.retain, latest=action.latest
            )
        except (TransportError, EncodeError) as exc:
            log.error("could not publish %s to %s: %s", action.message.kind, action.topic, exc)

    def _log_round(self, closed: RoundClosed) -> None:
        loss = "-" if closed.train_loss is None else f"{closed.train_loss:.4f}"
        acc = "-" if closed.train_accuracy is None else f"{100 * closed.train_accuracy:.1f}%"
        log.info(
            "round %d/%d closed in %.3f s: %d/%d updates on time, %d late, %d rejected; "
            "device train loss %s, accuracy %s; server step %.3f s",
            closed.round,
            self.config.rounds,
            closed.duration_s,
            closed.on_time,
            closed.selected,
            closed.late,
            closed.rejected,
            loss,
            acc,
            closed.aggregate_s,
        )
        if closed.server_metrics:
            log.info(
                "round %d: server step measured %s",
                closed.round,
                ", ".join(f"{name} {value:.4g}" for name, value in closed.server_metrics.items()),
            )

    def _finish(self, finished: Finished) -> None:
        """Save the final models (under ``state_dir/final``), then mark the run done.

        Raises:
            StoreError: a model could not be written (the run is finished in the state
                store: resuming it saves the models again).
            CoordinatorError: a model could not be exported.
        """
        if self.config.state_dir is not None:
            try:
                paths = save_group_models(
                    finished.models,
                    self._templates,
                    self.config.state_dir / "final",
                    onnx=self.config.export_onnx,
                    final=finished.final,
                )
            except StoreError as exc:
                raise StoreError(
                    f"could not save the final models ({exc}); free space and resume "
                    "with --resume to save them"
                ) from exc
            except ModelError as exc:
                raise CoordinatorError(f"could not export the final models: {exc}") from exc
            log.info("final models saved: %s", ", ".join(str(p) for p in paths))
        self.final_models = finished.models

    def _publish_final_status(self, state: str) -> None:
        body = CoordinatorStatus(state=state, strategy=self.config.strategy)
        message = Message(fleet=self.config.fleet, sender=self.config.coordinator_id, body=body)
        try:
            self.channel.send(self.engine.topics.coordinator_status, message, retain=True)
        except (TransportError, EncodeError) as exc:
            log.debug("could not publish the final status: %s", exc)


class RunStatus:
    """An observer that keeps the run's status as one JSON object in ``path``
    (``state_dir/status.json`` under ``python -m coordinator``), rewritten at every round
    transition: to a temporary file, then renamed over the old one, so a reader (or a
    process killed mid-write) sees the old object or the new one, never a mix (not
    fsynced: after a power cut it may be stale). The fields (docs/architecture.md,
    "The status file"):

    ``format`` (1), ``fleet``, ``rounds`` (planned), ``pid`` (the coordinator process),
    ``phase`` (``starting``, ``training``, ``aggregating``, ``closed``, ``finished``;
    ``stopped`` when the process exited before the end), ``round`` (the latest round
    started), ``started`` (round -> ``selected`` devices and Unix time ``at``; none for
    a round whose process was killed before writing it: a resumed round is not started
    again), ``closed`` (round -> ``duration_s``, ``on_time``, ``selected``, ``late``,
    ``rejected``, ``server_step_s``; a round closed again after a crash replaces its
    entry) and ``peak_rss_mb`` (the process's peak RSS, MB = 2**20 bytes, written at its
    exit; null before). With ``resume`` the rounds of the file's earlier processes are
    kept. A write that fails is logged and the run goes on.
    """

    def __init__(self, path: Path, config: CoordinatorConfig, *, resume: bool) -> None:
        self._path = path
        self._rounds: dict[str, dict[str, Any]] = {"started": {}, "closed": {}}
        if resume:
            try:
                old = json.loads(path.read_text())
                self._rounds = {key: dict(old[key]) for key in self._rounds}
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.debug("no earlier status in %s: %s", path, exc)
        self._status: dict[str, Any] = {
            "format": 1,
            "fleet": config.fleet,
            "rounds": config.rounds,
            "pid": os.getpid(),
            "phase": "starting",
            "round": max((int(r) for r in self._rounds["started"]), default=0),
            "peak_rss_mb": None,
        }
        self._write()

    def __call__(self, action: Action) -> None:
        if isinstance(action, RoundStarted):
            entry = {"selected": len(action.selected), "at": time.time()}
            self._rounds["started"][str(action.round)] = entry
            self._status |= {"phase": "training", "round": action.round}
        elif isinstance(action, AggregateRequested):
            self._status["phase"] = "aggregating"
        elif isinstance(action, RoundClosed):
            self._rounds["closed"][str(action.round)] = {
                "duration_s": action.duration_s,
                "on_time": action.on_time,
                "selected": action.selected,
                "late": action.late,
                "rejected": action.rejected,
                "server_step_s": action.aggregate_s,
            }
            self._status["phase"] = "closed"
        elif isinstance(action, Finished):
            self._status["phase"] = "finished"
        else:
            return
        self._write()

    def exited(self, peak_rss_mb: float) -> None:
        """Record the process's peak RSS (MB, kept to 0.1 MB as the log has it) as it
        exits (``stopped`` if unfinished)."""
        self._status["peak_rss_mb"] = round(peak_rss_mb, 1)
        if self._status["phase"] != "finished":
            self._status["phase"] = "stopped"
        self._write()

    def _write(self) -> None:
        tmp = self._path.with_name(f".tmp-{self._path.name}")
        try:
            tmp.write_text(json.dumps(self._status | self._rounds))
            tmp.replace(self._path)
        except OSError as exc:
            log.warning("could not write the status file %s: %s", self._path, exc)
