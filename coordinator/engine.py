"""The round logic as a state machine: events in, actions out.

:class:`RoundEngine` never touches a broker or a clock. The runtime (or a test) feeds it
events (:mod:`coordinator.events`: a device's hello, status or update, and clock ticks),
each with the current time, and carries out the actions it returns
(:mod:`coordinator.actions`: publish a message, report a round). It persists
through a :class:`~coordinator.store.Store` before it returns an action that depends on
the write, so an Ack for an update is only sent once the update is stored.

Models are kept per architecture group (:mod:`coordinator.groups`): a device's hello
names its architecture, the engine maps it to a group (refusing architectures the fleet
does not run), and each selected device gets its group's models at its own precision.

Round rules:

* A round starts when at least ``min_devices`` registered devices are online. It selects
  ``max(1, round(C * K))`` of them at random (seeded by the run seed and round number; K =
  registered devices), capped by those online, and sends each a model and a task with a
  deadline ``round_timeout_s`` ahead.
* The round closes when every selected device's update is in, or at the deadline. Only
  on-time updates of selected devices are aggregated into the round's models; with no
  update at all the strategy says so
  (:class:`~coordinator.strategies.base.NothingToAggregate`) and the models stay as they
  were.
* Aggregation is a phase of its own: closing a round returns
  :class:`AggregateRequested` (the runtime runs the job off the engine thread, server-side
  training included) and the round is closed by the :class:`AggregateDone` event that
  answers it. Events keep coming in meanwhile: hellos, statuses, and updates for the
  round, which are late by now.
* Only authenticated messages reach the engine (the runtime's channel checks every
  frame's tag against the device's key, :mod:`coordinator.auth`), and replays are refused
  first (:class:`~coordinator.auth.ReplayGuard`; docs/protocol.md, section 7): a device
  becomes known only by its own hello, so nobody else's is ever selected.
* Late updates (after the deadline, or for an earlier round) are never averaged into a
  round. Strategies with an OCA cache still take a late update into the device's cache
  slot if it is newer than the slot (Ack ``accepted=True, reason=late``); others reject it.
* Duplicates of an accepted update are acknowledged again (``reason=duplicate``) and
  change nothing.
* Updates are screened before they touch state (:mod:`coordinator.validation`: names,
  shapes, finite values; :mod:`coordinator.screening`: the distance from the model the
  device was sent, against the round's reference). A selected device whose on-time
  update is rejected for its values (``non_finite``, ``update_norm``) counts as
  answered: the round does not wait for it (a device does not resend a rejected
  update), and an update of it that passes before the round closes is still taken.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from coordinator.actions import (
    Action,
    AggregateRequested,
    Finished,
    Publish,
    RoundClosed,
    RoundStarted,
    UpdateOutcome,
)
from coordinator.admission import hello_refusal
from coordinator.aggregation_phase import AggregationJob
from coordinator.auth import ReplayGuard
from coordinator.config import CoordinatorConfig, participants
from coordinator.errors import ConfigError, StoreError, UpdateRejectedError
from coordinator.events import (
    AggregateDone,
    Event,
    Reconnected,
    Tick,
    Undecodable,
)
from coordinator.groups import ArchitectureGroup, GroupModels
from coordinator.liveness import RoundLiveness, WaitingLog
from coordinator.outbox import Outbox, mean_metric, some, weighted_metric
from coordinator.registry import DeviceRegistry
from coordinator.screening import NormScreen, delta_norm, model_norm
from coordinator.state import Base, OcaCache, RunMeta, RunState, StoredUpdate
from coordinator.store import Store
from coordinator.strategies.base import Arrays, NothingToAggregate, Strategy
from coordinator.tasks import TaskComposer
from coordinator.transfer import Link, Transfers
from coordinator.validation import check_label_counts, check_update_weights
from protocol.messages import (
    Ack,
    DeviceStatus,
    Hello,
    Message,
    ReasonCode,
    Update,
)
from protocol.ratelog import RateLimitedLog
from protocol.sets import WEIGHTS_SET
from protocol.topics import Topics

__all__ = ["RoundEngine"]

log = logging.getLogger(__name__)

Array = npt.NDArray[Any]


_ANSWERED = frozenset({ReasonCode.NON_FINITE, ReasonCode.UPDATE_NORM})
"""Rejections of a well-formed update for its values: the device answered its task, so
the round does not wait for it to its deadline (other rejections change nothing)."""


@dataclass
class _RoundCounters:
    late: int = 0
    rejected: int = 0


class RoundEngine:
    """Runs the rounds of one federated run; see the module docstring.

    Args:
        config: the run's settings.
        strategy: the server side of the algorithm.
        store: where the run's state lives (a fresh or a resumed one).
        groups: the architecture groups the fleet runs, by name (their initial weights
            start a fresh run; the strategy says which tensors an update carries).

    Raises:
        ConfigError: no group, or ``broadcast_model`` with several (one topic serves one
            model).
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        strategy: Strategy,
        store: Store,
        groups: Mapping[str, ArchitectureGroup],
        *,
        proxy_digest: str | None = None,
    ) -> None:
        if not groups:
            raise ConfigError("a fleet runs at least one architecture")
        if config.broadcast_model and len(groups) > 1:
            raise ConfigError("broadcast_model needs a fleet of one architecture")
        self.config = config
        self.strategy = strategy
        self.topics = Topics(config.fleet)
        self._state = RunState(store)
        self._groups = dict(groups)
        self._update_tensors = {
            name: {k: g.initial[k] for k in strategy.update_shapes(g.shapes)}
            for name, g in groups.items()
        }
        """Per group, the tensors an update must carry (their shapes and dtypes)."""
        self._uplink = strategy.uplink()
        self._transfers = Transfers(
            self._state, deltas=config.downlink_deltas, teacher_budget=config.teacher_budget
        )
        self._outbox = Outbox(config, self.topics)
        """This round's model messages, by the encoded sets they carry (the objects
        :class:`Transfers` shares): devices sent the same sets get the same message, one
        id and one frame, encoded once; each copy goes to its own topic, sealed under
        its device's key."""
        self._tasks = TaskComposer(config, strategy, self._transfers, self._outbox)
        """Each device's model and task: its precisions, format and hyperparameters."""
        self.registry = DeviceRegistry()
        self._replay = ReplayGuard(config.replay_window_s)
        self._refusals = RateLimitedLog(log)
        self._proxy_digest = proxy_digest
        """Content fingerprint of the run's proxy data (None: the run has none); part of
        the run's fingerprint, so a resume cannot swap the distillation data."""
        self._caches: dict[str, OcaCache] = {}
        """Each group's OCA cache; empty where the strategy keeps none."""
        self._run: RunMeta | None = None
        self._selected: frozenset[str] = frozenset()
        """The round's selected devices (``run.selected`` as a set, for O(1) look-ups)."""
        self._answered: set[str] = set()
        """Selected devices of the round whose update is stored or was screened out."""
        self._liveness = RoundLiveness(config.silent_grace_s)
        """Whom the round still waits for (the silent are dropped after the grace)."""
        self._waiting_log = WaitingLog(config.min_devices)
        """What the log says while a round waits for devices to come online."""
        self._screened: set[str] = set()
        """Selected devices whose on-time update of the round was screened out (persisted
        one record each, :meth:`RunState.screen_out`)."""
        self._on_time: set[str] = set()
        """Devices with an on-time update of the round stored: what closing it aggregates,
        known without reading the round's update records back."""
        self._counted: dict[str, str | None] = {}
        """``run.counted`` as a map: the devices the previous round aggregated, to the
        message id of the update it took (None: not recorded, a store of an older
        version)."""
        self._aggregating: frozenset[str] = frozenset()
        """``run.aggregating`` as a set, while the round's aggregation runs."""
        self._models: GroupModels = {}
        self._counters = _RoundCounters()
        self._screen = NormScreen(config.max_update_norm_ratio, config.max_update_norm, None)
        self._heard: Callable[[str, float], None] | None = None

    # -- watching ----------------------------------------------------------------------

    def watch(
        self, heard: Callable[[str, float], None], refused: Callable[[str, str], None]
    ) -> None:
        """Call ``heard(device_id, now)`` for every fresh, authenticated frame of a
        registered device (or hello accepted) and ``refused(key, text)`` for every
        refusal the engine logs (:meth:`RateLimitedLog.listen`); on the engine thread."""
        self._heard = heard
        self._refusals.listen(refused)

    def progress(self) -> tuple[int, str, float | None, int, int]:
        """Round, phase, deadline (Unix s; None outside training), selected devices and
        those that answered (:class:`~coordinator.telemetry.EngineView`)."""
        run = self._require_run()
        training = run.phase == "training"
        selected = len(self._selected) if training else 0
        answered = len(self._answered) if training else 0
        return run.round, run.phase, run.deadline if training else None, selected, answered

    def devices(self) -> tuple[Mapping[str, Hello], frozenset[str]]:
        """The registered devices' hellos and the online ones (O(devices): copies)."""
        return self.registry.entries, frozenset(self.registry.online())

    def link_of(self, device_id: str) -> tuple[str, str]:
        """The precisions ``device_id`` transfers in: down, up."""
        link = self._link(device_id)
        return link.downlink.value, link.uplink.value

    # -- properties --------------------------------------------------------------------

    @property
    def round(self) -> int:
        """The current round (1-based); ``rounds + 1`` once finished."""
        return self._require_run().round

    @property
    def finished(self) -> bool:
        return self._run is not None and self._run.phase == "finished"

    def models(self) -> GroupModels:
        """The current global models of each group, by role (``aca``, and ``oca`` where
        kept; a group's ``oca`` is its ``aca`` until a device of the group has a slot)."""
        out: GroupModels = {}
        for group, server in self._models.items():
            models = out[group] = {"aca": dict(server["aca"])}
            cache = self._caches.get(group)
            if cache is not None:
                models["oca"] = cache.model() if cache.devices else dict(server["aca"])
        return out

    def _require_run(self) -> RunMeta:
        if self._run is None:
            raise RuntimeError("call start() first")
        return self._run

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, now: float) -> list[Action]:
        """Load or create the run's state, recover from a crash, announce the coordinator.

        Raises:
            StateMismatchError: the store belongs to another run.
            StoreError: the store cannot be read or written.
        """
        fingerprint = self.config.fingerprint_fields()
        if self._proxy_digest is not None:
            fingerprint["proxy_data"] = self._proxy_digest
        run = self._state.load_run(fingerprint)
        self._replay.restore(self._state.load_replay())
        if self.strategy.uses_oca:
            self._caches = {group: OcaCache(self._state, group) for group in self._groups}
        if run is None:
            run = RunMeta(fingerprint=fingerprint)
            initial = {name: {"aca": dict(g.initial)} for name, g in self._groups.items()}
            self._state.save_models(1, initial)
            self._state.save_run(run)
        else:
            log.info("resuming: round %d, phase %s", run.round, run.phase)
            self._state.recover(run.round, self._caches)
        self._run = run
        self._index_run(run)
        # a resumed round's devices get the grace anew (from the round's start if the
        # clock says the engine started before it)
        self._liveness.new_round(max(now, run.started_at))
        self._models = self._state.load_models(run.round, self._groups, required=("aca",))
        self._screen.new_round(run.norm_floor)
        self._on_time = set()
        for device_id in self._state.round_updates(run.round):  # a resume: same reference
            stored = self._state.read_update_meta(device_id, run.round)
            if stored.on_time:
                self._on_time.add(device_id)
                if stored.update_norm is not None:
                    self._screen.accepted(stored.update_norm)
        self.registry = DeviceRegistry(self._state.load_registry())
        actions: list[Action] = self._status("starting", force=True)
        if run.phase == "training":
            missing = [d for d in run.selected if d not in self._answered]
            if not missing:  # the crash came after the last update, before the close
                return actions + self._close_round()
            sets = self._server_sets()
            for device_id in missing:
                actions += self._task_messages(device_id, sets)
        elif run.phase == "aggregating":  # the crash came before the round closed
            actions.append(self._aggregate_requested(run))
        elif run.phase == "finished":
            actions += [*self._status("finished"), self._finished()]
        return actions

    def _index_run(self, run: RunMeta) -> None:
        """Rebuild the in-memory sets over ``run`` and the store (at start, a resume
        among them): O(devices) once, so that each event then looks up in O(1)."""
        self._selected = frozenset(run.selected)
        self._counted = run.counted_updates()
        self._aggregating = frozenset(run.aggregating)
        self._screened = {
            d for d in {*run.screened_out, *self._state.screened(run.round)} if d in self._selected
        }
        self._answered = {
            d for d in self._selected if d in self._screened or self._state.has_update(d, run.round)
        }

    def handle(self, event: Event) -> list[Action]:
        """Process one event; returns the actions to carry out, in order."""
        if self._run is None:
            raise RuntimeError("call start() first")
        if isinstance(event, Tick):
            return self._on_tick(event.now)
        if isinstance(event, Reconnected):
            return self._status(self._outbox.status_sent or "starting", force=True)
        if isinstance(event, AggregateDone):
            return self._on_aggregate_done(event)
        if isinstance(event, Undecodable):
            return self._on_undecodable(event)
        message = event.message
        if message.fleet != self.config.fleet or message.sender != event.topic_device:
            self._refusals.warning(
                f"foreign:{event.topic_device}",
                "dropped %s on device %s's topic from %s/%s (foreign sender or fleet)",
                message.kind,
                event.topic_device,
                message.fleet,
                message.sender,
            )
            return []
        replayed = self._replay.check(message, event.skew_ms)
        if replayed is not None:
            self._refusals.warning(
                f"replay:{message.sender}",
                "refused %s %s of %s: %s",
                message.kind,
                message.message_id,
                message.sender,
                replayed.detail,
            )
            if isinstance(message.body, Update) and message.sender in self.registry:
                return self._answer(message, False, replayed.reason, replayed.detail)
            return []
        if self._heard is not None and message.sender in self.registry:
            self._heard(message.sender, event.now)
        body = message.body
        if message.sender in self._selected:
            if isinstance(body, DeviceStatus) and body.state == "offline":
                self._liveness.gone(message.sender)  # its last will: do not wait for it
            else:  # it is alive: the round waits for it
                self._liveness.heard(message.sender, message.sender in self._answered)
        if isinstance(body, Hello):
            return self._on_hello(message, body, event.now)
        if isinstance(body, DeviceStatus):
            if message.sender not in self.registry:
                # devices announce themselves online before their hello: not worth a warning
                log.debug("ignored device_status of %s: say hello first", message.sender)
                return []
            self.registry.set_status(message.sender, body)
            return self._on_tick(event.now)
        if isinstance(body, Update):
            self.registry.heard(message.sender)
            return self._on_update(message, body, event.now)
        self._refusals.warning(
            f"kind:{message.sender}", "dropped unexpected %s from %s", message.kind, message.sender
        )
        return []

    # -- hello -------------------------------------------------------------------------

    def _on_hello(self, message: Message, hello: Hello, now: float) -> list[Action]:
        device_id = message.sender
        registered = self.registry.get(device_id)
        problem = hello_refusal(hello, self._groups, registered, self.config, self.strategy)
        if problem is not None:
            self._refusals.warning(
                f"hello:{device_id}:{problem[0].value}",
                "refused hello of %s: %s",
                device_id,
                problem[1],
            )
            return [self._ack(device_id, message, False, *problem)]
        if self._heard is not None:
            self._heard(device_id, now)
        if self.registry.register(hello):
            entry = self.registry.get(device_id)
            assert entry is not None
            self._state.save_device(device_id, entry)
            link = self._link(device_id)
            log.info(
                "registered %s (%d samples, %s down / %s up)",
                device_id,
                hello.num_samples,
                link.downlink.value,
                link.uplink.value,
            )
        actions: list[Action] = [self._ack(device_id, message, True, ReasonCode.OK)]
        run = self._require_run()
        if (
            run.phase == "training"
            and device_id in self._selected
            and not self._state.has_update(device_id, run.round)
        ):
            self._transfers.announced_mid_round(device_id, run.round, hello.held_base)
            actions += self._task_messages(device_id, self._server_sets())  # it may have lost it
        else:
            self._transfers.announced(device_id, hello.held_base)
        return actions + self._on_tick(now)

    def _link(self, device_id: str) -> Link:
        """The precisions ``device_id`` transfers in (:meth:`TaskComposer.link`)."""
        return self._tasks.link(self.registry.get(device_id))

    # -- update ------------------------------------------------------------------------

    def _on_update(self, message: Message, update: Update, now: float) -> list[Action]:
        device_id, run = message.sender, self._require_run()
        on_time = False
        if message.round == run.round - 1 and self._counted.get(device_id, "") in (
            message.message_id,
            None,
        ):
            # its update of the round just closed is in the model; the ack was lost
            detail = f"counted in round {message.round}"
            log.debug(
                "ignored update %s of %s for round %d: a duplicate, %s",
                message.message_id,
                device_id,
                message.round,
                detail,
            )
            return self._answer(message, True, ReasonCode.DUPLICATE, detail)
        try:
            on_time = self._classify(device_id, message.round, update, now)
            if self._state.has_update(device_id, message.round):
                log.debug(
                    "ignored update %s of %s for round %d: a duplicate, already stored",
                    message.message_id,
                    device_id,
                    message.round,
                )
                return self._answer(message, True, ReasonCode.DUPLICATE, "already stored")
            group = self._group_of(device_id)
            entry = self.registry.get(device_id)
            announced = 0 if entry is None else entry.num_samples
            base = self._uplink_base(device_id, update)
            weights = check_update_weights(update, self._update_tensors[group], announced, base)
            if self._uplink.label_counts:
                check_label_counts(update, self._groups[group].num_classes)
            sent = base.arrays if base is not None else self._models[group]["aca"]
            norm = delta_norm(weights, sent)
            reference = self._screen.check(norm, model_norm(sent, weights.keys()))
        except UpdateRejectedError as exc:
            self._counters.rejected += message.round == run.round
            self._refusals.warning(
                f"update:{device_id}:{exc.reason.value}",
                "rejected update of %s for round %d: %s",
                device_id,
                message.round,
                exc,
            )
            answer = self._answer(message, False, exc.reason, exc.detail)
            if on_time and exc.reason in _ANSWERED and device_id not in self._screened:
                # one record of its own, not the run record (O(devices) to rewrite): a
                # resumed round does not wait for it either
                self._state.screen_out(device_id, run.round)
                self._screened.add(device_id)
                self._answered_now(device_id, now)
                return [*answer, *self._close_if_answered()]
            return answer
        stored = StoredUpdate(
            device_id=device_id,
            group=group,
            round=message.round,
            num_samples=update.num_samples,
            message_id=message.message_id,
            on_time=on_time,
            received_at=now,
            metrics=dict(update.metrics),
            label_counts=None if update.label_counts is None else list(update.label_counts),
            timings=dict(update.timings),
            weight_format=self._tasks.weight_format(entry),
            update_norm=norm,
        )
        self._state.put_update(stored, weights)  # the commit point: accepted from here on
        if message.round == run.round:
            self._answered_now(device_id, now)
        if on_time:
            self._on_time.add(device_id)
            self._screen.accepted(norm)
        if base is not None:
            self._transfers.confirm(device_id, base)
        elif not self._link(device_id).lossless:
            self._transfers.updated(device_id, message.round)
        if self._caches:
            self._caches[group].absorb(device_id, message.round)
        if not on_time:
            self._counters.late += 1
            detail = "kept in the OCA cache; not averaged into the round"
            return self._answer(message, True, ReasonCode.LATE, detail)
        ratio = norm / reference if reference > 0 else math.inf
        actions = self._answer(
            message, True, ReasonCode.OK, ratio=ratio if math.isfinite(ratio) else None
        )
        log.info(
            "round %d: update of %s accepted (moves the model by %.4g, %.2f x the reference)",
            run.round,
            device_id,
            norm,
            ratio,
        )
        return actions + self._close_if_answered()

    def _close_if_answered(self) -> list[Action]:
        """Close the round once every selected device's update is in or was rejected
        (counted as they come: O(1) per update, not a walk over the selected devices)."""
        if len(self._answered) >= len(self._selected):
            return self._close_round()
        return []

    def _classify(self, device_id: str, round_number: int, update: Update, now: float) -> bool:
        """Whether the update counts in the current round; raises UpdateRejectedError if it
        cannot be taken at all."""
        run = self._require_run()
        if device_id not in self.registry:
            raise UpdateRejectedError(ReasonCode.UNKNOWN_DEVICE, "say hello first")
        if round_number > run.round or (run.phase == "finished" and round_number >= run.round):
            raise UpdateRejectedError(ReasonCode.WRONG_ROUND, f"current round is {run.round}")
        current = round_number == run.round and run.phase == "training"
        if current and device_id not in self._selected:
            raise UpdateRejectedError(ReasonCode.NOT_SELECTED, f"not selected in round {run.round}")
        if current and update.task_message not in (None, run.task_ids.get(device_id)):
            raise UpdateRejectedError(ReasonCode.WRONG_ROUND, "answers another task")
        if current and now <= run.deadline:
            return True
        if round_number == run.round and run.phase == "waiting":
            raise UpdateRejectedError(ReasonCode.WRONG_ROUND, f"round {run.round} has not started")
        if (
            run.phase == "aggregating"
            and round_number == run.round
            and device_id in self._aggregating
        ):
            return False  # a duplicate of an update being aggregated; acknowledged as such
        if not self._caches:
            raise UpdateRejectedError(ReasonCode.LATE, "after the round's deadline")
        if round_number <= self._caches[self._group_of(device_id)].slot_round(device_id):
            if self._state.has_update(device_id, round_number):
                return False  # a duplicate of the slot; acknowledged as such by the caller
            raise UpdateRejectedError(ReasonCode.LATE, "older than the device's cached update")
        return False

    def _on_undecodable(self, event: Undecodable) -> list[Action]:
        """A registered device gets a nack, so it can send its message again; anyone else
        gets nothing (logged once a minute per device)."""
        device_id, run = event.topic_device, self._require_run()
        if device_id not in self.registry:
            self._refusals.warning(
                f"bad:{device_id}",
                "dropped bad input on unknown device %s's topic: %s",
                device_id,
                event.detail,
            )
            return []
        round_number = run.round if event.round is None else event.round
        self._counters.rejected += round_number == run.round
        self._refusals.warning(
            f"bad:{device_id}:{event.reason.value}",
            "rejected input of %s (round %d, %s): %s",
            device_id,
            round_number,
            event.reason.value,
            event.detail,
        )
        body = Ack(accepted=False, reason=event.reason, ref=event.ref, detail=event.detail[:512])
        message = Message(
            fleet=self.config.fleet,
            sender=self.config.coordinator_id,
            round=round_number,
            body=body,
        )
        outcome = UpdateOutcome(device_id, round_number, event.reason)
        return [Publish(self.topics.to_device(device_id, "ack"), message), outcome]

    # -- rounds ------------------------------------------------------------------------

    def _on_tick(self, now: float) -> list[Action]:
        run = self._require_run()
        if run.phase == "training" and now > run.deadline:
            missing = [d for d in run.selected if d not in self._answered]  # once a round
            log.warning(
                "round %d deadline passed; missing %d of %d devices: %s",
                run.round,
                len(missing),
                len(run.selected),
                some(missing),
            )
            return self._close_round()
        silent = self._liveness.silent_only(now, len(self._answered), len(self._selected))
        if run.phase == "training" and silent:
            missing = [d for d in run.selected if d not in self._answered]  # once a round
            log.warning(
                "round %d: every device heard from answered; dropped %d silent of %d "
                "selected %.0f s later (--silent-grace): %s",
                run.round,
                len(missing),
                len(run.selected),
                now - self._liveness.last_answer_at,
                some(missing),
            )
            return self._close_round()
        if run.phase == "waiting":
            # counted on every event while devices join: sorting the online devices
            # each time made joining O(devices^2) (benchmarks/load.py)
            online = self.registry.online_count()
            if online >= self.config.min_devices:
                return self._start_round(now, self.registry.online())
            self._waiting_log.waiting(now, run.round, online, len(self.registry))
            return self._status("waiting")
        return []

    def _answered_now(self, device_id: str, now: float) -> None:
        """``device_id`` answered its task of the open round at ``now``."""
        self._answered.add(device_id)
        self._liveness.answered(device_id, now)

    def _start_round(self, now: float, online: list[str]) -> list[Action]:
        run = self._require_run()
        count = participants(self.config.participation, len(self.registry), len(online))
        rng = np.random.default_rng([self.config.seed, run.round])
        selected = sorted(str(d) for d in rng.choice(online, size=count, replace=False))
        run.phase, run.selected, run.started_at = "training", selected, now
        run.deadline = now + self.config.round_timeout_s
        run.task_ids = {d: uuid.uuid4().hex for d in selected}
        run.screened_out = []
        self._selected, self._answered = frozenset(selected), set()
        self._liveness.new_round(now)
        self._screened, self._on_time = set(), set()
        self._state.save_run(run)  # before the tasks go out, so a resume knows them
        self._counters = _RoundCounters()
        self._screen.new_round(run.norm_floor)
        self._transfers.new_round()
        self._outbox.new_round()
        sets = self._server_sets()
        actions: list[Action] = self._status("running")
        for device_id in selected:
            actions += self._task_messages(device_id, sets)
        log.info("round %d: selected %d of %d online", run.round, count, len(online))
        return [*actions, RoundStarted(run.round, tuple(selected))]

    def _group_of(self, device_id: str) -> str:
        """The architecture group of a registered device."""
        return self.registry[device_id].architecture

    def _server_sets(self) -> dict[str, dict[str, Arrays]]:
        """The strategy's downlink of each group for this round (arrays; each device's
        encoding differs)."""
        models = self.models()
        return {
            group: self.strategy.downlink({**server, **models[group]})
            for group, server in self._models.items()
        }

    def _uplink_base(self, device_id: str, update: Update) -> Base | None:
        weights = update.sets.get(WEIGHTS_SET)
        if weights is None or weights.mode != "delta":
            return None
        return self._transfers.uplink_base(device_id, weights.base)

    def _task_messages(
        self, device_id: str, server_sets: Mapping[str, Mapping[str, Arrays]]
    ) -> list[Action]:
        """The model (where the strategy sends one) and the task for ``device_id``."""
        group = self._group_of(device_id)
        entry = self.registry.get(device_id)
        return list(self._tasks.messages(self._require_run(), device_id, entry, group, server_sets))

    def _close_round(self) -> list[Action]:
        """Persist which updates the round aggregates, then ask for the aggregation."""
        run = self._require_run()
        run.phase = "aggregating"
        run.aggregating = sorted(d for d in self._on_time if self._state.has_update(d, run.round))
        self._aggregating = frozenset(run.aggregating)
        self._state.save_run(run)  # a resumed coordinator aggregates these same updates
        log.info("round %d: aggregating %d update(s)", run.round, len(run.aggregating))
        return [self._aggregate_requested(run)]

    def _aggregate_requested(self, run: RunMeta) -> AggregateRequested:
        job = AggregationJob(
            self.strategy, run.round, self._models, tuple(run.aggregating), self._state
        )
        return AggregateRequested(job)

    def _on_aggregate_done(self, done: AggregateDone) -> list[Action]:
        run = self._require_run()
        if run.phase != "aggregating" or done.round != run.round:
            raise RuntimeError(f"aggregation of round {done.round} done in {run.phase} {run.round}")
        closing, now = run.round, done.now
        server_metrics: dict[str, float] = {}
        if isinstance(done.result, NothingToAggregate):
            log.warning("round %d closed, model unchanged: %s", closing, done.result.reason)
            server = self._models
        else:
            server = {name: dict(arrays) for name, arrays in done.result.models.items()}
            server_metrics = dict(done.result.metrics)
        stats = [self._state.read_update_meta(d, closing) for d in run.aggregating]
        finished = closing >= self.config.rounds
        self._state.save_models(closing + 1, server)
        next_run = RunMeta(
            fingerprint=run.fingerprint,
            round=closing + 1,
            phase="finished" if finished else "waiting",
            counted=list(run.aggregating),
            counted_ids={u.device_id: u.message_id for u in stats},
            norm_floor=self._screen.next_floor(),
        )
        self._state.save_run(next_run)  # the commit point of the round
        self._state.save_replay(self._replay.snapshot())  # a restart refuses old frames
        self._run, self._models = next_run, server
        self._counted, self._aggregating = next_run.counted_updates(), frozenset()
        self._cleanup(closing)
        models = self.models()
        metrics = [(u.num_samples, {**u.timings, **u.metrics}) for u in stats]
        closed = RoundClosed(
            round=closing,
            selected=len(run.selected),
            on_time=len(stats),
            late=self._counters.late,
            rejected=self._counters.rejected,
            duration_s=max(0.0, now - run.started_at),
            models=models,
            train_loss=weighted_metric(metrics, "loss"),
            train_accuracy=weighted_metric(metrics, "accuracy"),
            device_train_s=mean_metric(metrics, "train_s"),
            aggregate_s=done.seconds,
            server_metrics=server_metrics,
        )
        actions: list[Action] = [closed]
        if self.config.broadcast_model:
            (group,) = models.values()  # the constructor made sure of it
            actions.append(self._outbox.broadcast(closing, group[self.strategy.final_model]))
        if finished:
            return [*actions, *self._status("finished"), self._finished()]
        return [*actions, *self._on_tick(now)]

    def _finished(self) -> Finished:
        return Finished(self.models(), self.strategy.final_model)

    def _cleanup(self, closed_round: int) -> None:
        try:
            self._state.recover(closed_round + 1, self._caches)
        except StoreError:
            log.exception("cleanup after round %d failed; retried on resume", closed_round)

    # -- messages ----------------------------------------------------------------------

    def _ack(
        self, device_id: str, ref: Message, accepted: bool, reason: ReasonCode, detail: str = ""
    ) -> Publish:
        return self._outbox.ack(device_id, ref, accepted, reason, detail)

    def _answer(
        self,
        update: Message,
        accepted: bool,
        reason: ReasonCode,
        detail: str = "",
        *,
        ratio: float | None = None,
    ) -> list[Action]:
        """The acknowledgement of an update from a registered device, and its outcome
        for the observers."""
        device_id = update.sender
        return [
            self._ack(device_id, update, accepted, reason, detail),
            UpdateOutcome(device_id, update.round, reason, ratio),
        ]

    def _status(self, state: str, *, force: bool = False) -> list[Action]:
        """The retained coordinator status; published only when the state changes."""
        registered, online = len(self.registry), self.registry.online_count()
        return self._outbox.status(state, self.strategy.name, registered, online, force=force)
