"""The one shell of the device session: every action it returns, carried out in one place.

A :class:`DeviceShell` holds one :class:`~edge_client.train.session.DeviceSession`. Its
driver feeds it events (:meth:`DeviceShell.handle`); the shell carries out each action the
session returns (:meth:`DeviceShell.carry_out`, a ``match`` over the action union that the
type checker proves exhaustive): persistence itself, in the device's
:class:`~edge_client.train.client_state.DeviceStore`, and the rest through the driver's
:class:`DeviceEffects`, the few things that differ between the three drivers:

================  =====================  ===================  =========================
effect            EdgeClient (threads)   sim.fleet (events)   sim.budget (synchronous)
================  =====================  ===================  =========================
publish, status   the device's channel   the connection's     counted, handed to the
                                         publisher thread     coordinator's engine
send an update    :class:`Upload`,       :class:`Upload`,     counted, sent at once
                  waiting between tries  retries on a heap
run a job         the worker thread      the cohort queue     at once / with the cohort
stop              a thread calls stop()  the device's offline status
================  =====================  ===================  =========================

An update is published by an :class:`Upload`: its attempts follow the device's
:class:`~edge_client.train.retry.RetrySchedule`, and it says when the session is to hear
of it (:class:`~edge_client.train.session.UpdateSent`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

from edge_client.train.client_state import DeviceStore
from edge_client.train.exchange import (
    Action,
    CommitUpload,
    Event,
    Job,
    Publish,
    RunJob,
    SaveModel,
    SaveState,
    SaveUnacked,
    SendUpdate,
    SetStatus,
    Stop,
    UpdateSent,
)
from edge_client.train.retry import RetrySchedule
from edge_client.train.session import DeviceSession
from edge_client.train.strategies import learning_state_entries
from models import Classifier, state_arrays
from protocol.channel import Channel
from protocol.errors import EncodeError, TransportError
from protocol.messages import Message

__all__ = ["DeviceEffects", "DeviceShell", "Retry", "Upload", "publish_once"]

logger = logging.getLogger(__name__)

_LOCAL = (SaveState, SaveUnacked, SaveModel, CommitUpload)
"""Actions that only touch the device's own state: carried out before
:meth:`DeviceShell.handle` lets go of its lock, so whoever reads the session (rounds
done, handled tasks) finds the kept model and the committed residual on disk too."""


class DeviceEffects(Protocol):
    """What a driver does for its device's shell (see the module docstring's table)."""

    def publish(self, action: Publish) -> None:
        """Publish ``action.message`` once; a failure is logged and changes nothing."""
        ...

    def set_status(self, action: SetStatus) -> None:
        """Publish the device's retained status."""
        ...

    def send_update(self, action: SendUpdate) -> None:
        """Publish the update (an :class:`Upload`) and, unless the device stops meanwhile,
        feed the session the :class:`~edge_client.train.session.UpdateSent` it answers."""
        ...

    def run_job(self, job: Job) -> None:
        """Run ``job`` on the trainer and feed the session its
        :class:`~edge_client.train.exchange.JobDone`."""
        ...

    def commit_upload(self) -> None:
        """Keep the uplink residual of the update just sent (error feedback)."""
        ...

    def trained_model(self) -> Classifier:
        """The device's model, as its last training left it."""
        ...

    def learning_state(self) -> Mapping[str, Any]:
        """The device's learning state across rounds, as its last training left it
        (persisted with the model)."""
        ...

    def stop(self) -> None:
        """Stop the device (the coordinator finished its run, or refused the device)."""
        ...


class DeviceShell:
    """One device's session and the carrying out of its actions.

    Args:
        session: the device's session.
        effects: what the driver does for it.
        store: the device's state folder; None: nothing is persisted.
        lock: held while the session handles an event and while the actions that touch
            only the device's own state are carried out (a driver with several threads
            passes its lock, and holds it to read the session); None: no lock.
    """

    def __init__(
        self,
        session: DeviceSession,
        effects: DeviceEffects,
        *,
        store: DeviceStore | None = None,
        lock: AbstractContextManager[object] | None = None,
    ) -> None:
        self.session = session
        self._effects = effects
        self._store = store
        self._lock = lock if lock is not None else contextlib.nullcontext()

    def handle(self, event: Event) -> None:
        """Feed ``event`` to the session and carry out its actions, in order; the ones
        that touch only the device's own state (which the session lists first) before
        the lock is let go, the rest, which may block or feed the session again, after."""
        with self._lock:
            actions = self.session.handle(event)
            later = []
            for action in actions:
                if isinstance(action, _LOCAL):
                    self.carry_out(action)
                else:
                    later.append(action)
        for action in later:
            self.carry_out(action)

    def carry_out(self, action: Action) -> None:
        """Carry out one of the session's actions."""
        match action:
            case Publish():
                self._effects.publish(action)
            case SetStatus():
                self._effects.set_status(action)
            case SendUpdate():
                self._effects.send_update(action)
            case RunJob(job=job):
                self._effects.run_job(job)
            case SaveState(saved=saved):
                if self._store is not None:
                    self._store.save_state(saved)
            case SaveUnacked(message=message):
                if self._store is not None:
                    self._store.save_unacked(message)
            case SaveModel():
                if self._store is not None:
                    self._store.save_model(
                        state_arrays(self._effects.trained_model()),
                        learning_state_entries(self._effects.learning_state()),
                    )
            case CommitUpload():
                self._effects.commit_upload()
            case Stop():
                self._effects.stop()
            case _:  # mypy: every action type has a case above
                unhandled: NoReturn = action
                raise AssertionError(f"unhandled action {unhandled!r}")


@dataclass(frozen=True)
class Retry:
    """Publish the update again in ``delay_s`` seconds."""

    delay_s: float


class Upload:
    """The publishing attempts of one update, as its device's schedule says.

    Args:
        action: the update to publish.
        schedule: the device's retry schedule.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        action: SendUpdate,
        schedule: RetrySchedule,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.action = action
        self._schedule = schedule
        self._clock = clock
        self._deadline = clock() + schedule.upload_deadline_s
        self._delay = schedule.first_delay_s
        self.error: TransportError | EncodeError | None = None
        """The last attempt's failure, if it failed."""

    def attempt(
        self, send: Callable[[str, Message], object], stopping: Callable[[], bool]
    ) -> UpdateSent | Retry | None:
        """Publish the update once with ``send(topic, message)``.

        Returns:
            :class:`UpdateSent` to feed the session (``ok``: it went out; not ``ok``: an
            encoding error, or no attempt left before the deadline); :class:`Retry`: try
            again after its delay; None: the device stops (``stopping()``), the session
            is not told (its task stays unhandled, so a restarted device trains it again).
        """
        message = self.action.message
        try:
            send(self.action.topic, message)
        except (TransportError, EncodeError) as exc:
            self.error = exc
            stops = stopping()
            delay = self._delay
            if not (
                isinstance(exc, EncodeError) or stops or self._clock() + delay > self._deadline
            ):
                logger.warning(
                    "%s: publishing the update failed (%s); retry in %.1f s",
                    message.sender,
                    exc,
                    delay,
                )
                self._delay = self._schedule.next_delay(delay)
                return Retry(delay)
            logger.error(
                "%s: round %d: publishing the update failed: %s", message.sender, message.round, exc
            )
            if stops:
                logger.info(
                    "%s: round %d: upload abandoned, the device stops",
                    message.sender,
                    message.round,
                )
                return None
            return UpdateSent(self.action.task_id, ok=False)
        self.error = None
        return UpdateSent(self.action.task_id, ok=True)


def publish_once(channel: Channel, action: Publish) -> None:
    """Carry out ``action`` on ``channel``: one attempt, a failure logged (the session
    does not hear of it)."""
    message = action.message
    try:
        channel.send(action.topic, message, retain=action.retain, latest=action.latest)
    except (TransportError, EncodeError) as exc:
        logger.warning("%s: could not send the %s: %s", message.sender, message.kind, exc)
