"""What the lab emulation records of each round: :class:`RoundRecorder` observes the
coordinator (:meth:`~coordinator.runtime.Coordinator.add_observer`), evaluates every
global model after each round (AMP / FM / WLP over the devices' test splits, and the
dataset's test split) and counts the bytes the fleet moved; :func:`sim.run.run_simulation`
builds the run's report from its records.

The evaluation runs on a thread of its own (``sim-eval``), one round after another, so
the coordinator starts the next round as soon as it closes one: at 1,000 devices the
evaluation of a LeNet-5 over every device's test split and the global test set takes
seconds that would otherwise hold up every device. At most :data:`EVALUATIONS_QUEUED`
rounds wait for their evaluation; a round that closes while they do waits for a place.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import numpy as np

from coordinator.actions import Action, Publish, RoundClosed, RoundStarted
from coordinator.evaluation import MetricsError, ModelMetrics, evaluate_models, evaluate_personal
from coordinator.groups import Models
from coordinator.report import RoundRecord
from models import Classifier, load_state_arrays, state_arrays
from models.classifiers import HEAD_PREFIX
from models.weight_formats import run_weights_
from protocol.messages import Ack, CoordinatorStatus, ReasonCode, WeightFormat
from sim.errors import SimError
from sim.fleet import Fleet
from sim.partition import Federation
from sim.progress import Progress
from sim.shard import RoundSync

__all__ = ["EVALUATIONS_QUEUED", "RoundRecorder", "RunLayout", "fleet_totals"]

EVALUATIONS_QUEUED = 2
"""Closed rounds whose evaluation may be under way or waiting at once."""


class RunLayout(Protocol):
    """What the recorder reads of the run's settings (:class:`sim.run.SimConfig`)."""

    @property
    def rounds(self) -> int:
        """Rounds of the run."""

    @property
    def sharing(self) -> str:
        """``full`` or ``head`` (each device's own feature extractor is evaluated)."""

    def device_architecture(self, index: int) -> str:
        """The architecture (group) of device ``index``."""

    def device_weight_format(self, index: int) -> WeightFormat:
        """The format device ``index`` runs its weights at."""


def fleet_totals(fleet: Fleet) -> tuple[int, int, int, int]:
    """The bytes ``fleet``'s devices moved so far: up, down, wire up, wire down."""
    out, inn = fleet.traffic()
    return out.payload_bytes, inn.payload_bytes, out.wire_bytes, inn.wire_bytes


class RoundRecorder:
    """A coordinator observer: after each round it evaluates every global model and
    counts the bytes the fleet moved (a :class:`~coordinator.report.RoundRecord` each), and tells
    ``progress`` which devices trained.

    The evaluations run on the recorder's own thread; :meth:`finish` waits for them (and
    raises what one raised) before :attr:`records` is complete.
    """

    def __init__(
        self,
        config: RunLayout,
        federation: Federation,
        scratch: dict[str, Classifier],
        fleet: Fleet,
        progress: Progress | None,
    ) -> None:
        self.records: list[RoundRecord] = []
        self._scratch = scratch
        self._fleet = fleet
        self._device_ids = [d.device_id for d in federation.devices]
        self._groups = [config.device_architecture(i) for i in range(len(self._device_ids))]
        formats = [config.device_weight_format(i) for i in range(len(self._device_ids))]
        self._formats = {
            group: sorted({f for g, f in zip(self._groups, formats, strict=True) if g == group})
            for group in set(self._groups)
        }
        """The formats each group's devices run their models at."""
        self._personal = config.sharing == "head"
        self._progress = progress
        self._total_rounds = config.rounds
        self._round = 0
        self._trained: set[str] = set()
        self._device_tests = [(d.test.x, d.test.y) for d in federation.devices]
        test = federation.test
        self._global_test = None if test is None else (test.x, test.y)
        self._last = (0, 0, 0, 0)
        self._round_start = time.perf_counter()
        self.coordinator_up = threading.Event()
        """Set once the coordinator announced a state past ``starting``."""
        self.sync: RoundSync | None = None
        """A sharded run's link to the other ranks (their devices' bytes count too)."""
        self.rejected = 0
        """Updates of the rounds rejected by the coordinator (screening among them)."""
        self._started = time.perf_counter()
        self._evaluator = ThreadPoolExecutor(1, thread_name_prefix="sim-eval")
        self._queued = threading.BoundedSemaphore(EVALUATIONS_QUEUED)
        self._evaluations: list[Future[None]] = []
        self.evaluated: Callable[[int, dict[str, dict[str, float]]], None] | None = None
        """Told each round's metrics as they are measured (round, model name -> metric
        -> percent; on the evaluation thread): the coordinator's telemetry."""

    def totals(self) -> tuple[int, int, int, int]:
        """Bytes so far: up, down, wire up, wire down (in a sharded run, every rank's)."""
        if self.sync is not None:
            answers = self.sync.ask("traffic")
            up, down, wire_up, wire_down = (sum(a[i] for a in answers) for i in range(4))
            return up, down, wire_up, wire_down
        return fleet_totals(self._fleet)

    def __call__(self, action: Action) -> None:
        if isinstance(action, RoundStarted):
            self._round_start = time.perf_counter()
            self._round, self._trained = action.round, set()
            if self._progress is not None:
                text = f"round {action.round}/{self._total_rounds}: devices trained"
                self._progress.step(text, total=len(action.selected))
            return
        if isinstance(action, Publish):
            status = action.message.body
            if isinstance(status, CoordinatorStatus) and status.state != "starting":
                self.coordinator_up.set()
            self._count_accepted_update(action)
            return
        if not isinstance(action, RoundClosed):
            return
        closed = time.perf_counter()
        self.rejected += action.rejected
        now = self.totals()
        delta = [a - b for a, b in zip(now, self._last, strict=True)]
        self._last = now
        record = RoundRecord(
            round=action.round,
            wall_s=closed - self._round_start,
            active_devices=action.on_time,
            bytes_up=delta[0],
            bytes_down=delta[1],
            wire_bytes_up=delta[2],
            wire_bytes_down=delta[3],
            device_train_s=action.device_train_s,
            aggregate_s=action.aggregate_s,
            closed_s=closed - self._started,
            server_metrics=dict(action.server_metrics),
        )
        # what the evaluation reads of the devices is read now: they train on
        evaluations = [
            (group, self._evaluation(group, models)) for group, models in action.models.items()
        ]
        self._queued.acquire()  # back-pressure: a round waits for an evaluation's place
        try:
            done = self._evaluator.submit(self._record, record, evaluations)
        except BaseException:
            self._queued.release()
            raise
        self._evaluations.append(done)

    def finish(self) -> None:
        """Wait for every round's evaluation; the records are then complete.

        Raises:
            the first error an evaluation raised (the later ones are not run); a
            :class:`~coordinator.evaluation.MetricsError` as a :class:`SimError`.
        """
        try:
            for done in self._evaluations:
                done.result()
        except MetricsError as exc:
            raise SimError(str(exc)) from exc
        finally:
            self._evaluator.shutdown(wait=True, cancel_futures=True)

    def _record(
        self,
        record: RoundRecord,
        evaluations: list[tuple[str, Callable[[], dict[str, ModelMetrics]]]],
    ) -> None:
        """The evaluator's side of a closed round: its metrics, its record, its line."""
        try:
            several = len(evaluations) > 1
            for group, evaluate in evaluations:
                prefix = f"{group}/" if several else ""
                record.models.update({prefix + role: m for role, m in evaluate().items()})
            self.records.append(record)
            if self.evaluated is not None:
                self.evaluated(
                    record.round,
                    {
                        name: {k: v for k, v in m.to_dict().items() if v is not None}
                        for name, m in record.models.items()
                    },
                )
            if self._progress is not None:
                self._progress.round_closed(record)
        finally:
            self._queued.release()

    def _evaluation(self, group: str, models: Models) -> Callable[[], dict[str, ModelMetrics]]:
        """What evaluates one group's global models by role: each on every device's test
        split; with head sharing the ``aca`` head on each of the group's devices' own
        feature extractor (read now, as the round closed)."""
        scratch = self._scratch[group]
        if not self._personal:
            return lambda: evaluate_models(
                self._as_run(group, models), scratch, self._device_tests, self._global_test
            )
        head = {k: v for k, v in models["aca"].items() if k.startswith(HEAD_PREFIX)}
        members = [i for i, g in enumerate(self._groups) if g == group]
        states = [
            {**state_arrays(self._fleet.model(self._device_ids[i]), "features"), **head}
            for i in members
        ]
        tests = [self._device_tests[i] for i in members]
        return lambda: {"aca": evaluate_personal(states, scratch, tests)}

    def _as_run(self, group: str, models: Models) -> dict[str, Mapping[str, np.ndarray]]:
        """``models`` by role, and where some of the group's devices run int8 or binarized
        weights, each role also as those devices run it, named ``ROLE@FORMAT``
        (``aca@binary``): the model a binary device gets is not the float one."""
        out: dict[str, Mapping[str, np.ndarray]] = dict(models)
        scratch = self._scratch[group]
        for weight_format in self._formats[group]:
            if weight_format == "float":
                continue
            for role, arrays in models.items():
                load_state_arrays(scratch, arrays)
                out[f"{role}@{weight_format}"] = state_arrays(run_weights_(scratch, weight_format))
        return out

    @property
    def round_started(self) -> bool:
        """Whether a round has started (its progress replaced the setup steps)."""
        return self._round > 0

    def _count_accepted_update(self, action: Publish) -> None:
        """An accepted update of this round (its ack) is one more device trained."""
        body, message = action.message.body, action.message
        if not isinstance(body, Ack) or body.reason is not ReasonCode.OK:
            return  # (late and duplicate updates are acknowledged with other reasons)
        if message.round != self._round:
            return
        if action.topic not in self._trained and self._progress is not None:
            self._progress.advance()
        self._trained.add(action.topic)
