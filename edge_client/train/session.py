"""The training device's logic as a session: events in, actions out.

:class:`DeviceSession` is the one device. It never touches a broker, a thread, a file or
a clock: its shell (:class:`~edge_client.train.shell.DeviceShell`) feeds it events
(started, a decoded inbox message, the coordinator's status, reconnected, a job's result,
an update sent, time passing) and carries out the actions it returns (publish, set the
retained status, send an update with retries, run a job on the trainer, persist, stop).
Three drivers run that shell: :class:`~edge_client.train.runtime.EdgeClient` (threads, on
a device), :class:`sim.fleet.Fleet` (many devices, an event thread) and :mod:`sim.budget`
(synchronously).

Training goes through the trainer seam (:mod:`edge_client.train.trainer`): a job
(:class:`DecodeJob`, then :class:`TrainJob`) goes out in a :class:`RunJob` action, its
result comes back in a :class:`JobDone` event. One job runs at a time; tasks wait in the
session's queue and a task for a round older than the last one done is skipped when its
turn comes.

Task rules:

* A :class:`RoundTask` names the model message holding its sets; the two may arrive in
  either order. The ``max_buffered_models`` model messages sent last (by their envelope
  ``ts``: a replayed older one never evicts a newer one) are kept; a task waits
  for its model up to ``task_timeout_s`` (at most ``max_pending_tasks`` wait).
* Duplicate tasks (handled, queued, running or waiting) are ignored; a duplicate of the
  task whose update is unacknowledged sends that update again. Tasks for a round older
  than the last one done since the coordinator last said ``starting`` are ignored, and
  so are tasks sent (envelope ``ts``) before the newest task taken, which is persisted
  (a replay, of this run or an earlier one), and tasks whose deadline passed more than
  ``stale_task_s`` ago.
* Resend rule: an update sent waits ``ack_timeout_s`` for the coordinator's ack. An ack
  accepting it (``ok``, ``late``, ``duplicate``) or rejecting it for good ends the wait;
  a nack with a retryable reason (``malformed``, ``oversize``, ``internal``: the update
  may have been damaged or dropped on the way; a nack with no ``ref`` names the device's
  unacknowledged update) or no ack in time sends the very same message again, at most
  ``max_resends`` times (the coordinator counts one update once, however often it comes).
* A task that is rejected, fails or whose update is sent (or cannot be) is handled: its
  id is remembered (the last ``remember_tasks``) and persisted (:class:`SaveState`).
* The device announces itself (retained ``online`` status and a :class:`Hello`) when
  started, reconnected, when the coordinator says ``starting`` and when it lacks the
  base of a delta (so the coordinator resends the full model).
* With ``exit_when_finished`` a ``finished`` coordinator stops the device once it saw
  the coordinator live; ``stopped`` never does.

Hello rules (why a device is not let in, told at the device):

* An ack whose ``ref`` is one of the device's last hellos answers it. Accepted: the
  device is registered. Refused (``fingerprint_mismatch``, ``unsupported_precision``,
  ``consent_required``, ``malformed``): the device logs the reason, the coordinator's
  detail, its own model (architecture, classes, input shape) and what to do, at ERROR
  (once a minute per reason at most); with ``exit_when_refused`` it stops, and
  :attr:`DeviceSession.refusal` says why. Otherwise it stays up and says hello again as
  before (reconnect, ``starting``).
* With ``hello_timeout_s``, a hello left unanswered (no ack, no task) that long makes
  the device say why it may be (:meth:`DeviceSession.no_answer_hint`: the coordinator of
  the fleet is up but silent, so it cannot authenticate the device's key; or no
  coordinator status was ever seen on the fleet, so the fleet name or the broker is
  wrong). With ``exit_when_refused`` it then stops; otherwise it says hello again and
  repeats the hint, waiting twice as long each time (10 minutes at most). A device the
  coordinator let in before (in this run of the device) never stops for want of an
  answer: its hello may have been lost (a broker restart), it says hello again. A
  coordinator whose status is ``stopped`` or ``finished`` answers no hello: the device
  waits for its ``starting`` (which makes it say hello again) without stopping.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection
from dataclasses import dataclass

from pydantic import ValidationError

from edge_client.config import ClientConfig
from edge_client.train.client_state import SavedState
from edge_client.train.exchange import (
    Action,
    Cancelled,
    CommitUpload,
    CoordinatorStatusReceived,
    Decoded,
    DecodeJob,
    Event,
    Failed,
    Job,
    JobDone,
    JobResult,
    NeedsBase,
    Publish,
    Received,
    Reconnected,
    Rejected,
    RunJob,
    SaveModel,
    SaveState,
    SaveUnacked,
    SendUpdate,
    SetStatus,
    Started,
    Stop,
    Tick,
    Trained,
    TrainJob,
    UpdateSent,
)
from edge_client.train.hello import ModelDescription, device_hello
from edge_client.train.refusal import (
    HELLOS_REMEMBERED,
    MAX_HELLO_WAIT_S,
    REFUSAL_LOG_INTERVAL_S,
    Refusal,
    no_answer_hint,
    refused_text,
)
from edge_client.train.retry import RetrySchedule
from protocol.errors import DecodeError
from protocol.messages import (
    Ack,
    CoordinatorStatus,
    Message,
    ModelPayload,
    ReasonCode,
    RoundTask,
    Update,
)
from protocol.ratelog import RateLimitedLog
from protocol.sets import WEIGHTS_SET
from protocol.topics import Topics, parse_topic

__all__ = ["DeviceSession"]

logger = logging.getLogger(__name__)

RETRYABLE = frozenset({ReasonCode.MALFORMED, ReasonCode.OVERSIZE, ReasonCode.INTERNAL})
"""Reasons of a nack after which the device sends its update again (the update may have
been damaged or dropped on the way, or the coordinator failed to take it)."""


@dataclass(frozen=True)
class _Pending:
    """A task waiting for its model message until ``expires`` (monotonic seconds)."""

    message: Message
    task: RoundTask
    expires: float


class DeviceSession:
    """One training device's state machine (see the module docstring for its rules).

    Args:
        config: the device's configuration.
        fingerprint: the model's architecture fingerprint (for the hello).
        num_samples: local training samples (for the hello).
        label_counts: samples per class, sent when a task asks and the device consents.
        memory_bytes: the machine's physical memory (for the hello), 0 if unknown.
        held_base: content fingerprint of the model the device holds, None: none.
        model: what the hello says of the model beside its fingerprint (input shape,
            classes, tensors), also logged beside a refusal of the hello; None: nothing
            (its architecture's name is logged).
        saved: the state persisted by an earlier run of this device; ignored (with a
            warning) when it belongs to another fleet or device.
        unacked: the update an earlier run of this device sent and never saw
            acknowledged (its state dir's): sent again, the very same message, when the
            device starts, and kept until an ack refers to it.
        wall_clock: Unix time in seconds, against which a task's deadline is judged.
    """

    def __init__(
        self,
        config: ClientConfig,
        *,
        fingerprint: str,
        num_samples: int,
        label_counts: tuple[int, ...],
        memory_bytes: int,
        held_base: str | None = None,
        saved: SavedState | None = None,
        unacked: Message | None = None,
        wall_clock: Callable[[], float] = time.time,
        model: ModelDescription | None = None,
    ) -> None:
        self.config = config
        self._wall = wall_clock
        self._schedule = RetrySchedule.of(config)
        self._topics = Topics(config.fleet)
        self._fingerprint = fingerprint
        self._num_samples = num_samples
        self._label_counts = label_counts
        self._memory_bytes = memory_bytes
        self._held_base = held_base
        self._models: dict[str, tuple[int, ModelPayload]] = {}
        """The model messages buffered: id -> (send time, payload)."""
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._handled: OrderedDict[str, None] = OrderedDict()
        self._queue: deque[DecodeJob] = deque()  # tasks waiting for the trainer
        self._running: Job | None = None  # the job out on the trainer, or its upload
        self._upload: Update | None = None  # the update of the running job, being sent
        self._rounds_done = 0
        self._last_round = -1  # latest round done in this coordinator run (not persisted)
        self._newest_task_ms = 0
        """Send time of the newest task taken (persisted): an older one is a replay."""
        self._unacked: Message | None = None  # the last update sent, until its Ack arrives
        self._awaiting_ack = False  # _unacked was published: its ack is awaited
        self._ack_due: float | None = None  # when it is sent again (set at the next tick)
        self._resends = 0  # times _unacked was sent again for want of an ack
        self._seen_live_coordinator = False  # a starting / waiting / running status came
        self._newest_status_ms = -1  # send time of the newest coordinator status taken
        self._newest_will_ms = -1  # send time of the newest coordinator's will (stopped)
        self._model = model
        self._model_summary = config.model if model is None else model.summary(config.model)
        self._hellos: deque[str] = deque(maxlen=HELLOS_REMEMBERED)  # ids of the last hellos
        self._hello_watch = False  # a hello awaits its answer (with hello_timeout_s)
        self._hello_since: float | None = None  # when the wait began (set at the next tick)
        self._hello_due: float | None = None  # when the next hint is due
        self._hello_wait = 0.0  # the current wait, seconds (doubles after each hint)
        self._coordinator_state: str | None = None  # of the newest coordinator status taken
        self._admitted = False  # a hello was accepted (or a task came) in this run
        self._refusals = RateLimitedLog(logger)
        """Refusals of what anyone on the broker may send (replays, strays): one WARNING
        per kind a minute, the rest at DEBUG."""
        self._refusals_logged: dict[ReasonCode, float] = {}  # reason -> when logged at ERROR
        self.refusal: Refusal | None = None
        """Why the device stopped trying to join (``exit_when_refused``), or None."""
        self.restored = False
        """Whether ``saved`` was taken (the shell then resumes the saved model too)."""
        if saved is not None:
            self._restore(saved)
        if unacked is not None:
            self._unacked = unacked
            logger.info("round %d: an update of an earlier run awaits its ack", unacked.round)

    @property
    def rounds_done(self) -> int:
        """Rounds whose update was published."""
        return self._rounds_done

    @property
    def handled(self) -> Collection[str]:
        """Ids of the tasks handled (the last ``remember_tasks``)."""
        return tuple(self._handled)

    @property
    def next_expiry(self) -> float | None:
        """When the next tick is due (monotonic seconds): a waiting task expires, an
        update's ack or a hello's answer is overdue; None: nothing waits. ``0.0``: tick
        now."""
        timers = [p.expires for p in self._pending.values()]
        if self._awaiting_ack:
            timers.append(0.0 if self._ack_due is None else self._ack_due)
        if self._hello_watch:
            timers.append(0.0 if self._hello_due is None else self._hello_due)
        return min(timers, default=None)

    def handle(self, event: Event) -> list[Action]:
        """The actions ``event`` leads to, in the order to carry them out."""
        if isinstance(event, Started):
            return self._announce() + self._resend_unacked()  # one an earlier run sent
        if isinstance(event, Reconnected):
            logger.info("reconnected to the broker; announcing again")
            return self._announce()
        if isinstance(event, Received):
            return self._on_inbox(event)
        if isinstance(event, CoordinatorStatusReceived):
            return self._on_coordinator_status(event.topic, event.message)
        if isinstance(event, Tick):
            self._expire(event.now)
            return self._check_ack(event.now) + self._check_hello(event.now)
        if isinstance(event, JobDone):
            return self._on_result(event.result)
        return self._on_update_sent(event)

    # -- announcing ------------------------------------------------------------------------

    def _message(self, body: object, round_: int = -1) -> Message:
        return Message(
            fleet=self.config.fleet, sender=self.config.device_id, body=body, round=round_
        )

    def _announce(self) -> list[Action]:
        if self.config.hello_timeout_s is not None:  # (re)start the wait for its answer
            self._hello_watch, self._hello_since, self._hello_due = True, None, None
            self._hello_wait = self.config.hello_timeout_s
        return [SetStatus("online"), self._hello()]

    def _hello(self) -> Publish:
        """Publish a new hello (its id remembered, to know its ack)."""
        hello = device_hello(
            self.config,
            fingerprint=self._fingerprint,
            num_samples=self._num_samples,
            held_base=self._held_base,
            memory_bytes=self._memory_bytes,
            model=self._model,
        )
        message = self._message(hello)
        self._hellos.append(message.message_id)
        return Publish(self._topics.device(self.config.device_id, "hello"), message)

    def _answered(self, *, admitted: bool = False) -> None:
        """The coordinator answered a hello (an ack or a task): the wait is over."""
        self._hello_watch, self._hello_since, self._hello_due = False, None, None
        self._admitted = self._admitted or admitted

    def _check_hello(self, now: float) -> list[Action]:
        """Arm the wait of a hello just sent; when it is over, say why no answer came and
        stop (``exit_when_refused``) or say hello again."""
        timeout = self.config.hello_timeout_s
        if not self._hello_watch or timeout is None or self.refusal is not None:
            return []
        if self._hello_since is None or self._hello_due is None:
            self._hello_since, self._hello_due = now, now + self._hello_wait
            return []
        if now < self._hello_due:
            return []
        hint, hopeless = self.no_answer_hint(now - self._hello_since)
        if not hopeless:  # the coordinator is down: its "starting" brings a new hello
            logger.warning("%s", hint)
            self._answered()
            return []
        if self._admitted:  # its key and fleet are right: the hello may have been lost
            hint = (
                f"no answer from the coordinator of fleet {self.config.fleet} in "
                f"{now - self._hello_since:.0f} s, which let this device in before (a hello "
                "lost in a broker restart?)"
            )
        elif self.config.exit_when_refused:
            self.refusal = Refusal("unanswered", hint)
            logger.error("%s; the device stops", hint)
            self._answered()
            return [Stop()]
        self._hello_wait = min(2 * self._hello_wait, max(MAX_HELLO_WAIT_S, timeout))
        self._hello_due = now + self._hello_wait
        level = logging.WARNING if self._admitted else logging.ERROR
        logger.log(level, "%s; saying hello again (next hint in %.0f s)", hint, self._hello_wait)
        return [self._hello()]

    def no_answer_hint(self, waited: float) -> tuple[str, bool]:
        """Why no coordinator answered the device's hello in ``waited`` seconds, and
        whether waiting on is hopeless (:func:`~edge_client.train.refusal.no_answer_hint`)."""
        config = self.config
        return no_answer_hint(
            fleet=config.fleet,
            device_id=config.device_id,
            broker=f"{config.broker.host}:{config.broker.port}",
            state=self._coordinator_state,
            reads_status=config.insecure_no_auth or config.coordinator_key is not None,
            waited=waited,
        )

    def _resend_unacked(self) -> list[Action]:
        """The last update again if the coordinator never acknowledged it (it may have
        been down when the update was sent); the coordinator ignores duplicates."""
        message = self._unacked
        if message is None:
            return []
        logger.info("round %d: sending the unacknowledged update again", message.round)
        self._awaiting_ack, self._ack_due = True, None
        return [Publish(self._topics.device(self.config.device_id, "update"), message)]

    # -- inbound ---------------------------------------------------------------------------

    def _on_inbox(self, event: Received) -> list[Action]:
        topic, message = event.topic, event.message
        try:
            info = parse_topic(topic)
        except DecodeError:
            self._refusals.warning(
                "topic", "ignored a %s message on unexpected topic %s", message.kind, topic
            )
            return []
        if message.fleet != self.config.fleet:
            self._refusals.warning(
                "fleet", "ignored a %s for fleet %r on %s", message.kind, message.fleet, topic
            )
            return []
        if message.kind != info.leaf:
            self._refusals.warning("kind", "ignored a %s message on %s", message.kind, topic)
            return []
        body = message.body
        if isinstance(body, RoundTask):
            return self._on_task(message, body, event.now)
        if isinstance(body, ModelPayload):
            return self._on_model(message, body)
        if isinstance(body, Ack):
            return self._on_ack(message, body, event.now)
        return []

    def _on_task(self, message: Message, task: RoundTask, now: float) -> list[Action]:
        self._answered(admitted=True)  # only a registered device gets tasks
        task_id = message.message_id
        if task_id in self._handled or task_id in self._active() or task_id in self._pending:
            logger.info("ignored duplicate task %s (round %d)", task_id, message.round)
            unacked = self._unacked
            if unacked is not None and getattr(unacked.body, "task_message", None) == task_id:
                return self._resend_unacked()  # the coordinator asks again: it lost the update
            return []
        overdue = self._wall() - task.deadline
        if overdue > self.config.stale_task_s:
            self._refusals.warning(
                "task:stale",
                "ignored task %s for round %d: its deadline passed %.0f s ago (a replay, or "
                "a task of an earlier run)",
                task_id,
                message.round,
                overdue,
            )
            return []
        if message.sent_at_ms < self._newest_task_ms:
            self._refusals.warning(
                "task:replay",
                "ignored task %s for round %d: it was sent before the newest task taken (a replay)",
                task_id,
                message.round,
            )
            return []
        if message.round < self._last_round:
            self._refusals.warning(
                "task:done",
                "ignored task %s for round %d: round %d is already done",
                task_id,
                message.round,
                self._last_round,
            )
            return []
        self._newest_task_ms = message.sent_at_ms
        model_id = task.model_message
        if model_id is None:
            return self._enqueue(DecodeJob(message, task))
        if model_id in self._models:
            return self._enqueue(DecodeJob(message, task, dict(self._models[model_id][1].sets)))
        self._pending[task_id] = _Pending(message, task, now + self.config.task_timeout_s)
        while len(self._pending) > self.config.max_pending_tasks:
            _, dropped = self._pending.popitem(last=False)
            logger.warning("dropped task %s: too many tasks wait", dropped.message.message_id)
        logger.debug("task %s waits for model message %s", task_id, model_id)
        return []

    def _on_model(self, message: Message, payload: ModelPayload) -> list[Action]:
        model_id = message.message_id
        if model_id in self._models:
            logger.debug("ignored duplicate model message %s", model_id)
            return []
        sent = message.sent_at_ms
        ready = [p for p in self._pending.values() if p.task.model_message == model_id]
        full = len(self._models) >= self.config.max_buffered_models
        if not ready and full and sent < min(t for t, _ in self._models.values()):
            logger.debug("ignored model message %s: older than every one buffered", model_id)
            return []
        self._models[model_id] = (sent, payload)
        while len(self._models) > self.config.max_buffered_models:
            del self._models[min(self._models, key=lambda k: self._models[k][0])]
        actions: list[Action] = []
        for pending in ready:
            del self._pending[pending.message.message_id]
            actions += self._enqueue(DecodeJob(pending.message, pending.task, dict(payload.sets)))
        logger.debug("model message %s (round %d) buffered", model_id, message.round)
        return actions

    def _on_ack(self, message: Message, ack: Ack, now: float) -> list[Action]:
        if ack.ref is not None and ack.ref in self._hellos:
            return self._on_hello_ack(message, ack, now)
        unacked = self._unacked
        if ack.accepted:
            logger.info("coordinator accepted %s (round %d) %s", ack.ref, message.round, ack.detail)
        else:
            self._refusals.warning(
                f"ack:{ack.reason.value}",
                "coordinator rejected %s (round %d): %s %s",
                ack.ref,
                message.round,
                ack.reason.value,
                ack.detail,
            )
        if unacked is None:
            return []
        ours = ack.ref == unacked.message_id
        if not ack.accepted and ack.reason in RETRYABLE and (ours or ack.ref is None):
            return self._retry(now, f"the coordinator could not take it ({ack.reason.value})")
        if ours:
            self._unacked, self._awaiting_ack, self._ack_due = None, False, None
            return [SaveUnacked(None)]
        return []

    def _on_hello_ack(self, message: Message, ack: Ack, now: float) -> list[Action]:
        """The coordinator's answer to one of the device's hellos."""
        self._answered(admitted=ack.accepted)
        fleet = self.config.fleet
        if ack.accepted:
            logger.info(
                "coordinator accepted %s (round %d): device %s registered in fleet %s",
                ack.ref,
                message.round,
                self.config.device_id,
                fleet,
            )
            return []
        if self.refusal is not None:  # stopping already
            return []
        reason = ack.reason
        text = refused_text(fleet, ack, f"{self._model_summary} (fingerprint {self._fingerprint})")
        if self.config.exit_when_refused:
            self.refusal = Refusal("refused", text)
            logger.error("%s; the device stops", text)
            return [Stop()]
        last = self._refusals_logged.get(reason)
        if last is None or now - last >= REFUSAL_LOG_INTERVAL_S:
            self._refusals_logged[reason] = now
            logger.error(
                "%s; the device stays up and says hello again when the coordinator "
                "restarts (--exit-when-finished: it exits instead)",
                text,
            )
        else:
            logger.debug("%s", text)
        return []

    def _check_ack(self, now: float) -> list[Action]:
        """Arm the ack timer of an update just sent; send it again when it is overdue."""
        if not self._awaiting_ack:
            return []
        if self._ack_due is None:
            self._ack_due = now + self._schedule.ack_timeout_s
            return []
        if now < self._ack_due:
            return []
        return self._retry(now, f"no ack within {self._schedule.ack_timeout_s:.0f} s")

    def _retry(self, now: float, why: str) -> list[Action]:
        """Send the unacknowledged update again, unless it was resent often enough."""
        message = self._unacked
        if message is None:
            return []
        if self._resends >= self._schedule.max_resends:
            if self._awaiting_ack:
                logger.warning(
                    "round %d: %s; gave up after %d resends", message.round, why, self._resends
                )
            self._awaiting_ack, self._ack_due = False, None
            return []
        self._resends += 1
        self._awaiting_ack, self._ack_due = True, now + self._schedule.ack_timeout_s
        logger.warning(
            "round %d: %s; sending the update again (%d of %d)",
            message.round,
            why,
            self._resends,
            self._schedule.max_resends,
        )
        return [Publish(self._topics.device(self.config.device_id, "update"), message)]

    def _on_coordinator_status(self, topic: str, message: Message) -> list[Action]:
        status = message.body
        if message.fleet != self.config.fleet or not isinstance(status, CoordinatorStatus):
            self._refusals.warning(
                "status:fleet", "ignored a %s (fleet %r) on %s", message.kind, message.fleet, topic
            )
            return []
        if status.state == "stopped":
            # the coordinator's last will, signed when it connected: older than the
            # statuses that followed, so it is ordered only among the wills
            if message.sent_at_ms <= self._newest_will_ms:
                logger.debug("ignored a coordinator's last will seen before (a replay)")
                return []
            self._newest_will_ms = message.sent_at_ms
            self._coordinator_state = "stopped"  # what the broker holds now
            logger.info("the coordinator stopped (or crashed); waiting for it to come back")
            return []
        if message.sent_at_ms < self._newest_status_ms:
            self._refusals.warning(
                "status:replay",
                "ignored a coordinator status %s sent before the newest one (a replay)",
                status.state,
            )
            return []
        self._newest_status_ms = message.sent_at_ms
        self._coordinator_state = status.state
        logger.info("coordinator status: %s %s", status.state, status.detail)
        if status.state in ("starting", "waiting", "running"):
            self._seen_live_coordinator = True
        if status.state == "starting":  # perhaps a new run, numbering rounds from 0 again
            self._last_round = -1
            return self._announce() + self._resend_unacked()
        if status.state == "finished" and self.config.exit_when_finished:
            if not self._seen_live_coordinator:
                logger.info("a run finished before this device started; waiting for a new one")
                return []
            logger.info("the coordinator finished its run; the device stops")
            return [Stop()]
        return []

    def _expire(self, now: float) -> None:
        """Drop the tasks whose model did not come in time."""
        for pending in [p for p in self._pending.values() if p.expires <= now]:
            del self._pending[pending.message.message_id]
            logger.warning(
                "dropped task %s (round %d): model message %s did not arrive within %.0f s",
                pending.message.message_id,
                pending.message.round,
                pending.task.model_message,
                self.config.task_timeout_s,
            )

    # -- jobs ------------------------------------------------------------------------------

    def _active(self) -> set[str]:
        """Ids of the tasks queued or running."""
        active = {job.message.message_id for job in self._queue}
        if self._running is not None:
            active.add(self._running.message.message_id)
        return active

    def _enqueue(self, job: DecodeJob) -> list[Action]:
        self._queue.append(job)
        return self._next_job()

    def _next_job(self) -> list[Action]:
        """Start the next queued task if the trainer is free (stale ones are skipped)."""
        while self._running is None and self._queue:
            job = self._queue.popleft()
            if job.message.round < self._last_round:
                logger.warning(
                    "skipped task %s for round %d: a later round is done",
                    job.message.message_id,
                    job.message.round,
                )
                continue
            self._running = job
            return [RunJob(job)]
        return []

    def _on_result(self, result: JobResult) -> list[Action]:
        job = self._running
        if job is None or job.message.message_id != result.task_id:
            logger.warning("ignored the result of task %s: it is not running", result.task_id)
            return []
        message, round_ = job.message, job.message.round
        if isinstance(result, Decoded):
            self._held_base = result.held_base
            logger.info("round %d: training (%s)", round_, job.task.strategy)
            train = TrainJob(message, job.task, result.local, result.decode_s)
            self._running = train
            return [SetStatus("training"), RunJob(train)]
        if isinstance(result, Trained):
            return self._on_trained(job, result)
        self._running = None
        if isinstance(result, NeedsBase):
            self._held_base = result.held_base
            logger.warning("round %d: %s; asking for the full model", round_, result.reason)
            return self._announce() + self._next_job()
        if isinstance(result, Rejected):
            logger.warning(
                "rejected task %s (round %d): %s", message.message_id, round_, result.reason
            )
            return [self._remember(message.message_id), *self._next_job()]
        if isinstance(result, Cancelled):
            logger.info("round %d: training cancelled, the device stops", round_)
            return []
        error = result.error
        logger.error("round %d: training failed", round_, exc_info=error)
        detail = f"round {round_}: {type(error).__name__}: {error}"
        return [self._remember(message.message_id), SetStatus("error", detail), *self._next_job()]

    def _on_trained(self, job: Job, result: Trained) -> list[Action]:
        try:
            update = self._update_body(job, result)
        except ValidationError as exc:
            return self._on_result(Failed(result.task_id, exc))
        message = self._message(update, job.message.round)
        self._unacked, self._awaiting_ack, self._ack_due, self._resends = message, False, None, 0
        self._upload = update
        topic = self._topics.device(self.config.device_id, "update")
        return [
            SaveModel(),
            SaveUnacked(message),
            SendUpdate(topic, message, job.message.message_id),
        ]

    def _update_body(self, job: Job, result: Trained) -> Update:
        metrics = result.metrics
        finite = {k: v for k, v in metrics.items() if math.isfinite(v)}
        if len(finite) != len(metrics):
            logger.warning(
                "non-finite training metrics left out: %s", sorted(set(metrics) - set(finite))
            )
        label_counts = None
        if job.task.uplink.label_counts:
            if self.config.share_label_counts:
                label_counts = self._label_counts
                logger.info("sharing label counts (the device consented)")
            else:
                logger.warning("the task asks for label counts; not sent (no consent)")
        return Update(
            task_message=job.message.message_id,
            num_samples=result.num_samples,
            sets={WEIGHTS_SET: result.weights},
            label_counts=label_counts,
            metrics=finite,
            timings={k: max(0.0, v) for k, v in result.timings.items()},
        )

    def _on_update_sent(self, event: UpdateSent) -> list[Action]:
        job = self._running
        if job is None or job.message.message_id != event.task_id:
            logger.warning("ignored the upload of task %s: it is not running", event.task_id)
            return []
        self._running, update = None, self._upload
        self._upload = None
        round_ = job.message.round
        if not event.ok:
            detail = f"round {round_}: the update could not be published"
            return [self._remember(event.task_id), SetStatus("error", detail), *self._next_job()]
        if self._unacked is not None:
            self._awaiting_ack = True  # the ack timer starts at the next tick
        actions: list[Action] = [CommitUpload(), self._remember(event.task_id, round_=round_)]
        if update is not None:
            logger.info(
                "round %d: update sent (%d samples, loss %.4f, accuracy %.3f)",
                round_,
                update.num_samples,
                update.metrics.get("loss", float("nan")),
                update.metrics.get("accuracy", float("nan")),
            )
        return [*actions, SetStatus("idle"), *self._next_job()]

    # -- persistence -----------------------------------------------------------------------

    def _remember(self, task_id: str, *, round_: int | None = None) -> SaveState:
        """Record a handled task (and a round done when ``round_`` is given)."""
        self._handled[task_id] = None
        while len(self._handled) > self.config.remember_tasks:
            self._handled.popitem(last=False)
        if round_ is not None:
            self._rounds_done += 1
            self._last_round = max(self._last_round, round_)
        return SaveState(
            SavedState(
                fleet=self.config.fleet,
                device_id=self.config.device_id,
                rounds_done=self._rounds_done,
                handled_tasks=list(self._handled),
                newest_task_ms=self._newest_task_ms,
            )
        )

    def _restore(self, saved: SavedState) -> None:
        if (saved.fleet, saved.device_id) != (self.config.fleet, self.config.device_id):
            logger.warning(
                "ignored the saved client state: it belongs to %s/%s",
                saved.fleet,
                saved.device_id,
            )
            return
        self._handled = OrderedDict.fromkeys(saved.handled_tasks[-self.config.remember_tasks :])
        self._rounds_done = saved.rounds_done
        self._newest_task_ms = saved.newest_task_ms
        self.restored = True
        logger.info("resumed: %d rounds done", saved.rounds_done)
