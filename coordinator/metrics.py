"""The coordinator's Prometheus exporter: :func:`serve_metrics` (docs/metrics.md).

A :class:`FleetCollector` reads the latest :class:`~coordinator.telemetry.Snapshot` of a
:class:`~coordinator.telemetry.FleetTelemetry` when Prometheus scrapes (it never touches
the engine) and turns it into metric families on a registry of its own (the process's
global registry stays out of it); prometheus-client's threaded HTTP server serves them.

Every label takes values from a small fixed set (phases, reason codes, refusal kinds,
directions, message kinds, precisions) or from the fleet's global models (a few names per
architecture group): no device id is ever a label, so the number of series does not grow
with the fleet. Units are Prometheus's base units: seconds, bytes, and ratios in [0, 1]
for accuracies (the reports' percentages divided by 100).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import get_args

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from coordinator.state import Phase
from coordinator.telemetry import (
    DURATION_BUCKETS_S,
    REFUSAL_KINDS,
    FleetTelemetry,
    Histogram,
    Snapshot,
)
from protocol.messages import ReasonCode

__all__ = [
    "ACCURACY_METRICS",
    "PHASES",
    "FleetCollector",
    "MetricsServer",
    "serve_metrics",
    "update_outcome",
]

PHASES: tuple[str, ...] = get_args(Phase)
"""The values of ``edgefl_round_phase``'s ``phase`` label."""

ACCURACY_METRICS = ("amp", "wlp", "best", "global_acc")
"""The evaluations exported as ``edgefl_model_accuracy_ratio{metric=...}`` (percent / 100);
``fm`` (percent squared) is ``edgefl_model_accuracy_variance`` (/ 10,000). Other names an
evaluation may carry are not exported (the label set stays fixed)."""

_FAIRNESS_METRIC = "fm"


def update_outcome(reason: str) -> str:
    """The ``outcome`` label of an update acknowledged with ``reason`` (a
    :class:`~protocol.messages.ReasonCode` value): ``accepted`` (``ok``), ``late``,
    ``duplicate`` or ``rejected`` (every other code, named by the ``reason`` label)."""
    if reason == ReasonCode.OK.value:
        return "accepted"
    if reason in (ReasonCode.LATE.value, ReasonCode.DUPLICATE.value):
        return reason
    return "rejected"


class FleetCollector(Collector):
    """A Prometheus collector over ``telemetry``'s latest snapshot (read at each scrape;
    only ``edgefl_up`` = 0 before the first)."""

    def __init__(self, telemetry: FleetTelemetry) -> None:
        self._telemetry = telemetry

    def describe(self) -> list[Metric]:
        return []  # the families depend on the snapshot: nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        snapshot = self._telemetry.snapshot()
        up = GaugeMetricFamily(
            "edgefl_up", "1 once the coordinator published a snapshot of the fleet, 0 before."
        )
        up.add_metric([], 0.0 if snapshot is None else 1.0)
        yield up
        if snapshot is not None:
            yield from _families(snapshot)


def _families(s: Snapshot) -> Iterator[Metric]:
    yield _gauge(
        "edgefl_snapshot_timestamp_seconds",
        "Unix time the exported values were read on the coordinator's engine thread.",
        s.at,
    )
    info = GaugeMetricFamily(
        "edgefl_info", "The run's fleet and strategy (value 1).", labels=["fleet", "strategy"]
    )
    info.add_metric([s.fleet, s.strategy], 1.0)
    yield info
    yield _gauge("edgefl_rounds_planned", "Rounds the run is configured for.", s.rounds_planned)
    yield _gauge(
        "edgefl_round", "The current round, 1-based (the last one once finished).", s.round
    )
    phase = GaugeMetricFamily(
        "edgefl_round_phase", "1 for the run's current phase, 0 for the others.", labels=["phase"]
    )
    for name in PHASES:
        phase.add_metric([name], 1.0 if s.phase == name else 0.0)
    yield phase
    if s.deadline is not None:
        yield _gauge(
            "edgefl_round_deadline_timestamp_seconds",
            "Unix time the current round's training closes (only while training).",
            s.deadline,
        )
    yield _counter(
        "edgefl_rounds_completed",
        "Rounds closed since the coordinator started.",
        s.rounds_completed,
    )
    yield _gauge("edgefl_devices_registered", "Devices in the registry.", s.registered)
    yield _gauge("edgefl_devices_online", "Registered devices online.", s.online)
    yield _gauge(
        "edgefl_devices_selected",
        "Devices selected for the current round (0 outside training).",
        s.selected,
    )
    yield _gauge(
        "edgefl_devices_answered",
        "Selected devices done with the current round: update taken, or screened out "
        "(0 outside training).",
        s.answered,
    )
    yield _updates(s.updates)
    refusals = CounterMetricFamily(
        "edgefl_refusals",
        "Messages and frames refused, by kind (auth, foreign, replay, hello, update, "
        "bad_input, unexpected).",
        labels=["kind"],
    )
    for kind in REFUSAL_KINDS:
        refusals.add_metric([kind], float(s.refusals.get(kind, 0)))
    yield refusals
    yield _counter(
        "edgefl_enrolments",
        "Devices enrolled with the fleet token since the coordinator started.",
        s.enrolments,
    )
    yield from _traffic(s)
    yield _histogram(
        "edgefl_round_duration_seconds",
        "Wall time of each closed round, from its start to its close (aggregation included).",
        s.round_seconds,
    )
    yield _histogram(
        "edgefl_aggregation_duration_seconds",
        "Seconds each closed round's server step (aggregation, distillation ...) took.",
        s.aggregate_seconds,
    )
    yield _gauge(
        "edgefl_server_step_seconds",
        "Seconds the last closed round's server step took.",
        s.server_step_s,
    )
    yield from _models(s.models)


def _updates(updates: Mapping[str, int]) -> Metric:
    family = CounterMetricFamily(
        "edgefl_updates",
        "Updates acknowledged, by outcome (accepted, late, duplicate, rejected) and the "
        "acknowledgement's reason code.",
        labels=["outcome", "reason"],
    )
    reasons = [code.value for code in ReasonCode]
    reasons += sorted(set(updates) - set(reasons))  # (none: the codes are an enum)
    for reason in reasons:
        family.add_metric([update_outcome(reason), reason], float(updates.get(reason, 0)))
    return family


def _traffic(s: Snapshot) -> Iterator[Metric]:
    labels = ["direction", "kind", "precision"]
    messages = CounterMetricFamily(
        "edgefl_messages",
        "MQTT messages the coordinator sent (down) and received (up) on the fleet's topics.",
        labels=labels,
    )
    payload = CounterMetricFamily(
        "edgefl_payload_bytes",
        "MQTT payload bytes of those messages (encoded frames: chunk headers and "
        "authentication tags included).",
        labels=labels,
    )
    wire = CounterMetricFamily(
        "edgefl_wire_bytes", "Whole MQTT PUBLISH packet bytes of those messages.", labels=labels
    )
    for key in sorted(s.traffic, key=lambda k: (k.direction, k.kind, k.precision)):
        counts = s.traffic[key]
        values = [key.direction, key.kind, key.precision]
        messages.add_metric(values, float(counts.messages))
        payload.add_metric(values, float(counts.payload_bytes))
        wire.add_metric(values, float(counts.wire_bytes))
    yield messages
    yield payload
    yield wire
    last = GaugeMetricFamily(
        "edgefl_last_round_payload_bytes",
        "Payload bytes the coordinator sent (down) and received (up) during the last closed "
        "round (from the previous close to its close).",
        labels=["direction"],
    )
    if s.history:
        point = s.history[-1]
        last.add_metric(["up"], float(point.bytes_up))
        last.add_metric(["down"], float(point.bytes_down))
    yield last


def _models(models: Mapping[str, Mapping[str, float]]) -> Iterator[Metric]:
    accuracy = GaugeMetricFamily(
        "edgefl_model_accuracy_ratio",
        "The latest evaluated round's global models: AMP (mean device accuracy), WLP "
        "(worst device's), best device's, global test set's; ratio in [0, 1].",
        labels=["model", "metric"],
    )
    variance = GaugeMetricFamily(
        "edgefl_model_accuracy_variance",
        "FM of the latest evaluated round's global models: the variance of the devices' "
        "accuracies (ratio squared: the report's percent squared / 10,000).",
        labels=["model"],
    )
    for model in sorted(models):
        metrics = models[model]
        for metric in ACCURACY_METRICS:
            if metric in metrics:
                accuracy.add_metric([model, metric], metrics[metric] / 100.0)
        if _FAIRNESS_METRIC in metrics:
            variance.add_metric([model], metrics[_FAIRNESS_METRIC] / 10_000.0)
    yield accuracy
    yield variance


def _gauge(name: str, documentation: str, value: float) -> Metric:
    return GaugeMetricFamily(name, documentation, value=float(value))


def _counter(name: str, documentation: str, value: float) -> Metric:
    return CounterMetricFamily(name, documentation, value=float(value))


def _histogram(name: str, documentation: str, histogram: Histogram) -> Metric:
    bounds = [repr(float(b)) for b in DURATION_BUCKETS_S] + ["+Inf"]  # Go's style: 0.1, 1.0
    buckets = [(b, float(c)) for b, c in zip(bounds, histogram.counts, strict=True)]
    return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=histogram.total)


class MetricsServer:
    """The exporter's HTTP server (:class:`~coordinator.monitor.Served`): it answers
    every GET with the metrics, in Prometheus's text format (OpenMetrics where asked)."""

    def __init__(self, telemetry: FleetTelemetry, host: str, port: int) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(FleetCollector(telemetry))
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self._host = host
        self._lock = threading.Lock()
        self._closed = False

    @property
    def port(self) -> int:
        """The port it listens on (the one it got where 0 was asked)."""
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(telemetry: FleetTelemetry, host: str, port: int) -> MetricsServer:
    """Serve ``telemetry``'s metrics at ``http://host:port/metrics`` on a thread of their
    own until :meth:`MetricsServer.close`.

    Raises:
        OSError: the address cannot be bound (in use, not this machine's).
    """
    return MetricsServer(telemetry, host, port)
