"""The coordinator's run report: ``--json-out``, ``--report-dir`` and ``--eval-data``.

:class:`RunRecorder` observes a :class:`~coordinator.runtime.Coordinator`
(:meth:`~coordinator.runtime.Coordinator.add_observer`) and keeps one
:class:`~coordinator.report.RoundRecord` per closed round, in the lab emulator's format
(docs/report.md): the round's wall time, its on-time devices, the bytes the coordinator's
transport moved in it (:class:`~protocol.transport.TrafficStats`: received is up, sent is
down), the devices' training time, the server step and when it closed. With held-out data
(``--eval-data``, :func:`~coordinator.evaluation.read_eval_data`) it evaluates each
round's global models on it (:func:`~coordinator.evaluation.evaluate_held_out`; a real
coordinator has no per-device test splits: the held-out set is the one "device", so AMP,
WLP, best and global accuracy are all its accuracy and FM is 0) and tells the
coordinator's telemetry (:meth:`~coordinator.telemetry.FleetTelemetry.evaluated`).

The evaluation runs on a thread of its own (``coordinator-eval``), one round after
another, so the engine starts the next round as soon as it closes one; at most
:data:`EVALUATIONS_QUEUED` rounds wait for theirs (a round that closes while they do
waits for a place). An evaluation that fails is logged and its round recorded without
metrics: the run goes on.

:func:`check_outputs` checks the output paths and reads the held-out data before the run
starts; :func:`recording` wires the recorder around :meth:`Coordinator.run` and writes the
report when it returns (stopped or failed: the rounds it finished, ``final.interrupted``
true; nothing when no round finished).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import resource
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from coordinator.actions import Action, Finished, RoundClosed, RoundStarted
from coordinator.config import CoordinatorConfig
from coordinator.errors import ConfigError
from coordinator.evaluation import ModelMetrics, evaluate_held_out, read_eval_data
from coordinator.output_paths import check_distinct, check_file, check_folder
from coordinator.report import (
    ACCURACY_PLOT,
    BYTES_PLOT,
    CSV_NAME,
    RoundRecord,
    RunReport,
    write_csv,
    write_plots,
)
from models import Classifier

if TYPE_CHECKING:
    from coordinator.runtime import Coordinator
    from protocol.transport import TrafficStats

__all__ = [
    "EVALUATIONS_QUEUED",
    "HeldOut",
    "RunRecorder",
    "check_outputs",
    "peak_memory",
    "recording",
]

log = logging.getLogger(__name__)

EVALUATIONS_QUEUED = 2
"""Closed rounds whose evaluation may be under way or waiting at once."""

HeldOut = tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]
"""The held-out set: float32 images (N, C, H, W) and int64 labels (N,)."""

Totals = tuple[int, int, int, int]


def check_outputs(config: CoordinatorConfig) -> HeldOut | None:
    """Before the run starts: the report's paths can be written (``json_out`` a file,
    ``report_dir`` a folder, neither the state dir), and the held-out data is read and
    fits the models; returns it (None without ``eval_data``).

    Raises:
        ConfigError: one line naming the flag, the path and what is wrong.
    """
    check_distinct(
        [
            ("--json-out", config.json_out),
            ("--report-dir", config.report_dir),
            ("--state-dir", config.state_dir),
        ]
    )
    if config.json_out is not None:
        check_file("--json-out", config.json_out)
    if config.report_dir is not None:
        check_folder("--report-dir", config.report_dir, (CSV_NAME, ACCURACY_PLOT, BYTES_PLOT))
        if importlib.util.find_spec("matplotlib") is None:
            log.warning(
                '--report-dir: matplotlib is not installed, so %s only, no plots (pip install "'
                'edgefl[report]")',
                CSV_NAME,
            )
    if config.eval_data is None:
        return None
    if config.sharing == "head":
        raise ConfigError(
            "--eval-data needs sharing full: with head sharing every device keeps its own "
            "feature extractor, and the coordinator has no whole model to evaluate"
        )
    held_out = read_eval_data(
        config.eval_data,
        shape=config.sample_shape,
        num_classes=config.num_classes,
    )
    log.info(
        "evaluating every round's global models on %d samples of %s",
        len(held_out[1]),
        config.eval_data,
    )
    return held_out


def _totals(traffic: TrafficStats) -> Totals:
    """Bytes the coordinator's transport moved so far: received (up), sent (down), and
    the same on the wire."""
    received, sent = traffic.totals("in"), traffic.totals("out")
    return received.payload_bytes, sent.payload_bytes, received.wire_bytes, sent.wire_bytes


class RunRecorder:
    """A coordinator observer keeping the run's report (see the module docstring).

    Args:
        config: the run's settings (the report's ``config``).
        traffic: the coordinator transport's counters.
        scratch: a classifier of each architecture group to evaluate with (overwritten;
            not the coordinator's own), or None without held-out data.
        held_out: the held-out set, or None: the rounds are recorded without metrics.
        evaluated: told each round's metrics as they are measured (round, model name ->
            metric -> percent; on the evaluation thread): the coordinator's telemetry.
        final_model: the model the run delivers (``aca`` or ``oca``).
        clock: a monotonic clock, seconds.
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        traffic: TrafficStats,
        *,
        scratch: Mapping[str, Classifier] | None = None,
        held_out: HeldOut | None = None,
        evaluated: Callable[[int, dict[str, dict[str, float]]], None] | None = None,
        final_model: str = "aca",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if held_out is not None and scratch is None:
            raise ValueError("held-out data needs scratch models to evaluate with")
        self.config = config
        self._traffic = traffic
        self._scratch = scratch
        self._held_out = held_out
        self._evaluated = evaluated
        self._final_model = final_model
        self._clock = clock
        self._started = clock()
        self._round_start = self._started
        self._last: Totals = (0, 0, 0, 0)
        self._lock = threading.Lock()
        self._records: list[RoundRecord] = []
        self._evaluator = ThreadPoolExecutor(1, thread_name_prefix="coordinator-eval")
        self._queued = threading.BoundedSemaphore(EVALUATIONS_QUEUED)
        self._evaluations: list[Future[None]] = []
        self.finished = False
        """Whether the last round closed (a :class:`~coordinator.actions.Finished` came)."""

    @property
    def records(self) -> list[RoundRecord]:
        """The rounds recorded so far (evaluated where there is held-out data), in order."""
        with self._lock:
            return list(self._records)

    def __call__(self, action: Action) -> None:
        if isinstance(action, RoundStarted):
            self._round_start = self._clock()
        elif isinstance(action, Finished):
            self.finished = True
        elif isinstance(action, RoundClosed):
            self._closed(action)

    def _closed(self, action: RoundClosed) -> None:
        closed = self._clock()
        now = _totals(self._traffic)
        up, down, wire_up, wire_down = (a - b for a, b in zip(now, self._last, strict=True))
        self._last = now
        record = RoundRecord(
            round=action.round,
            wall_s=closed - self._round_start,
            active_devices=action.on_time,
            bytes_up=up,
            bytes_down=down,
            wire_bytes_up=wire_up,
            wire_bytes_down=wire_down,
            device_train_s=action.device_train_s,
            aggregate_s=action.aggregate_s,
            closed_s=closed - self._started,
            server_metrics=dict(action.server_metrics),
        )
        if self._held_out is None:
            with self._lock:
                self._records.append(record)
            return
        self._queued.acquire()  # back-pressure: a round waits for an evaluation's place
        try:
            done = self._evaluator.submit(self._evaluate, record, action.models)
        except BaseException:
            self._queued.release()
            raise
        self._evaluations.append(done)

    def _evaluate(self, record: RoundRecord, models: Mapping[str, Mapping[str, Any]]) -> None:
        """The evaluator's side of a closed round: its metrics, then its record."""
        try:
            assert self._scratch is not None and self._held_out is not None
            several = len(models) > 1
            metrics: dict[str, ModelMetrics] = {}
            try:
                for group, roles in models.items():
                    prefix = f"{group}/" if several else ""
                    scores = evaluate_held_out(roles, self._scratch[group], self._held_out)
                    metrics.update({prefix + role: m for role, m in scores.items()})
            except Exception as exc:
                log.warning("round %d: evaluation failed: %s", record.round, exc)
                metrics = {}
            record.models.update(metrics)
            with self._lock:
                self._records.append(record)
            if metrics:
                log.info(
                    "round %d: %s on the held-out data",
                    record.round,
                    ", ".join(f"{name} {m.amp:.2f}%" for name, m in metrics.items()),
                )
            if self._evaluated is not None and metrics:
                self._evaluated(
                    record.round,
                    {
                        name: {k: v for k, v in m.to_dict().items() if v is not None}
                        for name, m in metrics.items()
                    },
                )
        finally:
            self._queued.release()

    def finish(self) -> None:
        """Wait for every round's evaluation; :attr:`records` is then complete."""
        try:
            for done in self._evaluations:
                done.result()
        finally:
            self._evaluator.shutdown(wait=True, cancel_futures=True)

    def report(self, *, interrupted: bool) -> RunReport:
        """The report of the rounds recorded (call :meth:`finish` first).

        ``final`` holds the lab emulator's keys where they apply (docs/report.md): the
        byte totals are the transport's for a finished run, the sums over the recorded
        rounds for an interrupted one.
        """
        records = self.records
        totals = _totals(self._traffic)
        if interrupted:  # as the emulator's: the finished rounds' sums
            up, down, wire_up, wire_down = (
                sum(getattr(r, key) for r in records)
                for key in ("bytes_up", "bytes_down", "wire_bytes_up", "wire_bytes_down")
            )
            totals = (up, down, wire_up, wire_down)
        final: dict[str, Any] = {
            "rounds": len(records),
            "wall_s": self._clock() - self._started,
            "mean_round_wall_s": sum(r.wall_s for r in records) / max(1, len(records)),
            "bytes_up": totals[0],
            "bytes_down": totals[1],
            "wire_bytes_up": totals[2],
            "wire_bytes_down": totals[3],
            **peak_memory(),
            "models": {k: v.to_dict() for k, v in records[-1].models.items()} if records else {},
            "final_model": self._final_model,
            "num_classes": self.config.num_classes,
            "interrupted": interrupted,
        }
        config = self.config.model_dump(mode="json", exclude={"broker": {"password"}})
        return RunReport(config=config, rounds=records, final=final)

    def write(self, *, interrupted: bool) -> list[Path]:
        """Write ``json_out`` and ``report_dir`` (where set); returns the paths written.
        Stopped before any round finished: nothing (an earlier report is kept).

        Raises:
            ReportError: a file cannot be written.
        """
        report = self.report(interrupted=interrupted)
        if interrupted and not report.rounds:
            if self.config.json_out is not None or self.config.report_dir is not None:
                log.warning("no round finished: no report written")
            return []
        paths: list[Path] = []
        if self.config.json_out is not None:
            paths.append(report.write_json(self.config.json_out))
        if self.config.report_dir is not None:
            paths.append(write_csv(report, self.config.report_dir))
            if importlib.util.find_spec("matplotlib") is not None:
                paths.extend(write_plots(report, self.config.report_dir))
        if paths:
            log.info(
                "wrote the report of %d round(s): %s",
                len(report.rounds),
                ", ".join(str(p) for p in paths),
            )
        return paths


def peak_memory() -> dict[str, int]:
    """This process's peak resident set and, where it used CUDA, the most GPU memory
    torch held at once (summed over its GPUs; 0 where it used none)."""
    gpu = 0
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        gpu = sum(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count()))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"peak_rss_bytes": rss, "peak_gpu_bytes": gpu}


@contextlib.contextmanager
def recording(coordinator: Coordinator, held_out: HeldOut | None) -> Iterator[RunRecorder | None]:
    """Record ``coordinator``'s rounds while the block runs (its :meth:`Coordinator.run`),
    then write the report its config asks for (``json_out``, ``report_dir``); with
    ``held_out`` (from :func:`check_outputs`) every round's global models are evaluated on
    it. Yields None (and does nothing) where the config asks for none of it.

    Raises:
        ReportError: the report cannot be written (after the block).
    """
    config = coordinator.config
    if held_out is None and config.json_out is None and config.report_dir is None:
        yield None
        return
    from coordinator.runtime import build_models

    recorder = RunRecorder(
        config,
        coordinator.transport.stats,
        scratch=None if held_out is None else build_models(config),
        held_out=held_out,
        evaluated=coordinator.telemetry.evaluated,
        final_model=coordinator.final_model,
    )
    coordinator.add_observer(recorder)
    failed = True
    try:
        yield recorder
        failed = False
    finally:
        recorder.finish()  # the last rounds' evaluations
        if not failed:
            recorder.write(interrupted=not recorder.finished)
        else:  # the run's own error is what the caller sees
            try:
                recorder.write(interrupted=True)
            except Exception as exc:
                log.warning("%s", exc)
