"""The Prometheus exporter (coordinator/metrics.py) over a real engine's telemetry, scraped
over HTTP and parsed with prometheus_client's own parser."""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.actions import Action, Publish
from coordinator.config import MonitorSettings
from coordinator.errors import ConfigError
from coordinator.events import Tick
from coordinator.metrics import PHASES, MetricsServer, serve_metrics, update_outcome
from coordinator.monitor import monitoring
from coordinator.telemetry import DURATION_BUCKETS_S, REFUSAL_KINDS, FleetTelemetry, Snapshot
from protocol.messages import ReasonCode
from protocol.topics import DeviceLeaf, Topics
from protocol.transport.stats import TrafficStats
from tests.coordinator.helpers import FLEET, hello, received, shifted, tasks_by_device, update
from tests.coordinator.test_telemetry import Clock, feed, setup

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "edgefl-fleet.json"
TOPICS = Topics(FLEET)

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return str(response.read().decode("utf-8"))


def series(text: str) -> Series:
    """Sample name and labels -> value, every sample of the exposition."""
    out: Series = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in out, key
            out[key] = sample.value
    return out


def value(samples: Series, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture
def served() -> Iterator[tuple[Any, FleetTelemetry, TrafficStats, Clock, MetricsServer]]:
    engine, telemetry, traffic, clock = setup(min_devices=3, rounds=3, round_timeout_s=60.0)
    server = serve_metrics(telemetry, "127.0.0.1", 0)
    try:
        yield engine, telemetry, traffic, clock, server
    finally:
        server.close()


class Wire:
    """Counts what the engine takes and sends on ``traffic`` as a transport would:
    ``size`` payload bytes per message by topic leaf, wire bytes 20 more."""

    SIZES: ClassVar[dict[str, int]] = {
        "hello": 300,
        "update": 5000,
        "status": 40,
        "task": 200,
        "model": 7000,
        "ack": 60,
    }

    def __init__(self, traffic: TrafficStats) -> None:
        self.traffic = traffic

    def size(self, topic: str) -> int:
        return self.SIZES[topic.rsplit("/", 1)[1]]

    def inbound(self, topic: str) -> None:
        self.traffic.record("in", topic, self.size(topic), self.size(topic) + 20)

    def outbound(self, actions: list[Action]) -> list[Action]:
        for action in actions:
            if isinstance(action, Publish):
                size = self.size(action.topic)
                self.traffic.record("out", action.topic, size, size + 20)
        return actions


def play(engine: Any, telemetry: FleetTelemetry, traffic: TrafficStats, clock: Clock) -> None:
    """Round 1 of three devices: dev-a and dev-b on time (dev-a twice: a duplicate), dev-c
    after the deadline (late); round 2: dev-a's update holds NaN (rejected). Two refusals,
    an evaluation of round 1, and traffic on the transport's counters."""
    wire = Wire(traffic)

    def take(topic_leaf: DeviceLeaf, device_id: str, message: Any) -> list[Action]:
        wire.inbound(TOPICS.device(device_id, topic_leaf))
        return feed(telemetry, wire.outbound(engine.handle(received(message, clock.now))))

    telemetry.watch()
    feed(telemetry, wire.outbound(engine.start(clock.now)))
    actions: list[Action] = []
    for device_id in ("dev-a", "dev-b", "dev-c"):
        clock.now += 1
        actions += take("hello", device_id, hello(engine, device_id))
    tasks = tasks_by_device(actions)
    weights = engine.models()["mlp"]["aca"]
    clock.now += 1
    first = update("dev-a", 1, shifted(weights, 0.01), task=tasks["dev-a"])
    take("update", "dev-a", first)
    take("update", "dev-a", first)  # its duplicate
    take("update", "dev-b", update("dev-b", 1, shifted(weights, 0.02), task=tasks["dev-b"]))
    clock.now += 61  # past the deadline: round 1 closes with two
    closing = feed(telemetry, wire.outbound(engine.handle(Tick(clock.now))))
    clock.now += 1
    take("update", "dev-c", update("dev-c", 1, shifted(weights, 0.03), task=tasks["dev-c"]))
    nan = {k: np.full_like(v, np.nan) for k, v in weights.items()}
    tasks = tasks_by_device(closing)
    take("update", "dev-a", update("dev-a", 2, nan, task=tasks["dev-a"]))
    telemetry.refused("auth:dev-x", "a bad tag")
    telemetry.refused("replay:dev-a", "a stale frame")
    telemetry.evaluated(1, {"aca": {"amp": 81.25, "wlp": 50.0, "fm": 25.0, "best": 90.0}})
    telemetry.refresh(force=True)


def test_nothing_but_up_before_the_first_snapshot(served: Any) -> None:
    _, telemetry, _, _, server = served

    samples = series(scrape(server.url))

    assert telemetry.snapshot() is None
    assert samples == {("edgefl_up", frozenset()): 0.0}
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", server.url)
    assert server.port != 0 and f":{server.port}/" in server.url


def test_the_exposition_holds_the_snapshot_exactly(served: Any) -> None:
    engine, telemetry, traffic, clock, server = served
    play(engine, telemetry, traffic, clock)
    snapshot = telemetry.snapshot()
    assert isinstance(snapshot, Snapshot)

    samples = series(scrape(server.url))

    # Assert: what happened, as counted by hand ...
    assert value(samples, "edgefl_up") == 1
    assert value(samples, "edgefl_info", fleet=FLEET, strategy="fedavg") == 1
    assert value(samples, "edgefl_rounds_planned") == 3
    assert value(samples, "edgefl_round") == 2
    assert value(samples, "edgefl_rounds_completed_total") == 1
    assert {p: value(samples, "edgefl_round_phase", phase=p) for p in PHASES} == {
        "waiting": 0,
        "training": 1,
        "aggregating": 0,
        "finished": 0,
    }
    assert value(samples, "edgefl_round_deadline_timestamp_seconds") == snapshot.deadline
    assert value(samples, "edgefl_devices_registered") == 3
    assert value(samples, "edgefl_devices_online") == 3
    assert value(samples, "edgefl_devices_selected") == 3
    assert value(samples, "edgefl_devices_answered") == 1  # dev-a: screened out (NaN)
    updates = {
        (dict(labels)["outcome"], dict(labels)["reason"]): v
        for (name, labels), v in samples.items()
        if name == "edgefl_updates_total" and v
    }
    assert updates == {
        ("accepted", "ok"): 2,
        ("duplicate", "duplicate"): 1,
        ("late", "late"): 1,
        ("rejected", "non_finite"): 1,
    }
    refusals = {k: value(samples, "edgefl_refusals_total", kind=k) for k in REFUSAL_KINDS}
    # the engine logs the late and the NaN update as refused updates
    assert refusals == {**dict.fromkeys(REFUSAL_KINDS, 0.0), "auth": 1, "replay": 1, "update": 2}
    assert value(samples, "edgefl_enrolments_total") == 0
    assert value(samples, "edgefl_model_accuracy_ratio", model="aca", metric="amp") == 0.8125
    assert value(samples, "edgefl_model_accuracy_ratio", model="aca", metric="wlp") == 0.5
    assert value(samples, "edgefl_model_accuracy_ratio", model="aca", metric="best") == 0.9
    assert value(samples, "edgefl_model_accuracy_variance", model="aca") == 0.0025
    assert (
        "edgefl_model_accuracy_ratio",
        frozenset({("model", "aca"), ("metric", "global_acc")}),
    ) not in samples
    # bytes: 3 hellos, 4 updates (1 a duplicate, 1 late) and 1 rejected, all at fp32
    up = {"control": 3 * 300, "update": 5 * 5000}
    for kind, payload in up.items():
        precision = "fp32" if kind == "update" else "none"
        labels = {"direction": "up", "kind": kind, "precision": precision}
        assert value(samples, "edgefl_payload_bytes_total", **labels) == payload
        count = payload // Wire.SIZES["update" if kind == "update" else "hello"]
        assert value(samples, "edgefl_messages_total", **labels) == count
        assert value(samples, "edgefl_wire_bytes_total", **labels) == payload + 20 * count
    down = traffic.totals("out")
    down_samples = [
        v
        for (name, labels), v in samples.items()
        if name == "edgefl_payload_bytes_total" and ("direction", "down") in labels
    ]
    assert sum(down_samples) == down.payload_bytes > 0
    assert value(samples, "edgefl_last_round_payload_bytes", direction="up") == (
        snapshot.history[-1].bytes_up
    )
    # two rounds' models, one to each device, at fp32
    labels = {"direction": "down", "kind": "model", "precision": "fp32"}
    assert value(samples, "edgefl_payload_bytes_total", **labels) == 2 * 3 * 7000
    # the histograms hold the one closed round, in the snapshot's cumulative buckets
    for name, histogram in (
        ("edgefl_round_duration_seconds", snapshot.round_seconds),
        ("edgefl_aggregation_duration_seconds", snapshot.aggregate_seconds),
    ):
        assert value(samples, f"{name}_count") == 1
        assert value(samples, f"{name}_sum") == pytest.approx(histogram.total)
        bounds = [*(repr(float(b)) for b in DURATION_BUCKETS_S), "+Inf"]
        exported = [value(samples, f"{name}_bucket", le=b) for b in bounds]
        assert exported == list(histogram.counts)
    assert snapshot.round_seconds.total == pytest.approx(
        62.0
    )  # the last hello to the tick past the deadline
    assert value(samples, "edgefl_round_duration_seconds_bucket", le="60.0") == 0
    assert value(samples, "edgefl_round_duration_seconds_bucket", le="120.0") == 1
    assert value(samples, "edgefl_server_step_seconds") == snapshot.server_step_s

    # ... and, generally, every number the snapshot holds
    assert value(samples, "edgefl_snapshot_timestamp_seconds") == snapshot.at
    for reason, count in snapshot.updates.items():
        outcome = update_outcome(reason)
        assert value(samples, "edgefl_updates_total", outcome=outcome, reason=reason) == count
    for key, counts in snapshot.traffic.items():
        labels = {"direction": key.direction, "kind": key.kind, "precision": key.precision}
        assert value(samples, "edgefl_messages_total", **labels) == counts.messages
        assert value(samples, "edgefl_payload_bytes_total", **labels) == counts.payload_bytes
        assert value(samples, "edgefl_wire_bytes_total", **labels) == counts.wire_bytes
    traffic_series = [k for k in samples if k[0] == "edgefl_payload_bytes_total"]
    assert len(traffic_series) == len(snapshot.traffic)


def test_update_outcomes_name_every_reason_code() -> None:
    outcomes = {code.value: update_outcome(code.value) for code in ReasonCode}
    assert outcomes["ok"] == "accepted"
    assert outcomes["late"] == "late" and outcomes["duplicate"] == "duplicate"
    others = {k: v for k, v in outcomes.items() if k not in ("ok", "late", "duplicate")}
    assert set(others.values()) == {"rejected"}


def registered(devices: int) -> tuple[FleetTelemetry, str]:
    """An engine with ``devices`` registered (waiting for more), hellos and acks counted;
    its exposition."""
    engine, telemetry, traffic, clock = setup(min_devices=devices + 1)
    wire = Wire(traffic)
    telemetry.watch()
    feed(telemetry, wire.outbound(engine.start(clock.now)))
    for i in range(devices):
        device_id = f"dev-{i:04d}"
        wire.inbound(TOPICS.device(device_id, "hello"))
        feed(telemetry, wire.outbound(engine.handle(received(hello(engine, device_id), clock.now))))
    telemetry.evaluated(1, {"aca": {"amp": 50.0, "wlp": 10.0, "fm": 4.0}})
    telemetry.refresh(force=True)
    server = serve_metrics(telemetry, "127.0.0.1", 0)
    try:
        return telemetry, scrape(server.url)
    finally:
        server.close()


def test_series_do_not_grow_with_the_fleet_and_name_no_device() -> None:
    _, few = registered(3)
    many_telemetry, many = registered(1000)

    few_series, many_series = series(few), series(many)
    assert set(many_series) == set(few_series)  # the same label sets, whatever the fleet
    assert len(many_series) < 150
    assert value(many_series, "edgefl_devices_registered") == 1000
    assert value(many_series, "edgefl_devices_online") == 1000
    labels = {"direction": "up", "kind": "control", "precision": "none"}
    assert value(many_series, "edgefl_messages_total", **labels) == 1000
    snapshot = many_telemetry.snapshot()
    assert snapshot is not None and len(snapshot.devices) == 1000
    for row in snapshot.devices:  # no device id, as a label or anywhere else
        assert row.device_id not in many
    assert "dev-" not in many and "dev-" not in few


def test_close_stops_serving_and_frees_the_port(served: Any) -> None:
    _, telemetry, _, _, server = served
    scrape(server.url)
    port = server.port

    server.close()
    server.close()  # idempotent

    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), 2):
        pass
    again = serve_metrics(telemetry, "127.0.0.1", port)  # the port can be bound again
    try:
        assert again.port == port
        assert series(scrape(again.url)) == {("edgefl_up", frozenset()): 0.0}
    finally:
        again.close()


def test_monitoring_serves_the_metrics_and_refuses_a_busy_port() -> None:
    engine, telemetry, _, clock = setup()
    feed(telemetry, engine.start(clock.now))
    with monitoring(telemetry, MonitorSettings(metrics_port="127.0.0.1:0")) as servers:
        (server,) = servers
        telemetry.refresh()  # watched now: the engine thread's next tick builds one
        samples = series(scrape(server.url))
        assert value(samples, "edgefl_up") == 1
        assert value(samples, "edgefl_round_phase", phase="waiting") == 1
        busy = server.url.split(":")[2].split("/")[0]
        with (
            pytest.raises(ConfigError, match="cannot serve the metrics"),
            monitoring(telemetry, MonitorSettings(metrics_port=f"127.0.0.1:{busy}")),
        ):
            pass


def expressions(node: Any) -> Iterator[str]:
    """Every PromQL ``expr`` (and templating ``query``) in a Grafana dashboard."""
    if isinstance(node, dict):
        for key, item in node.items():
            if key == "expr" and isinstance(item, str):
                yield item
            elif key == "query" and isinstance(item, str | dict):
                text = item if isinstance(item, str) else item.get("query", "")
                if isinstance(text, str):
                    yield text
            else:
                yield from expressions(item)
    elif isinstance(node, list):
        for item in node:
            yield from expressions(item)


def test_the_grafana_dashboard_queries_only_exported_metrics(served: Any) -> None:
    engine, telemetry, traffic, clock, server = served
    play(engine, telemetry, traffic, clock)
    exported = {name for name, _ in series(scrape(server.url))}
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))

    exprs = list(expressions(dashboard))
    used = {m for e in exprs for m in re.findall(r"\bedgefl_[A-Za-z0-9_]+", e)}

    assert len(exprs) >= 8
    assert used, "the dashboard queries no edgefl_ metric"
    assert used <= exported, sorted(used - exported)
    assert {"edgefl_round_phase", "edgefl_updates_total", "edgefl_payload_bytes_total"} <= used
    assert "edgefl_round_duration_seconds_bucket" in used
    assert "edgefl_model_accuracy_ratio" in used and "edgefl_refusals_total" in used
    # it imports anywhere: its datasource is an input, not this machine's
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    assert dashboard["__inputs"][0]["pluginId"] == "prometheus"
    text = DASHBOARD.read_text(encoding="utf-8")
    uids = set(re.findall(r'"uid":\s*"([^"]*)"', text)) - {dashboard["uid"]}
    assert uids <= {"${DS_PROMETHEUS}", "-- Grafana --"}, uids  # (the built-in annotations)
    assert dashboard["schemaVersion"] >= 36
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
