"""FleetTelemetry over a real engine: what the metrics and the dashboard read."""

from __future__ import annotations

from typing import Any

from coordinator.actions import Action
from coordinator.store import MemoryStore
from coordinator.telemetry import (
    RECENT_REFUSALS,
    REFUSAL_KINDS,
    REFUSAL_TEXT_MAX,
    FleetTelemetry,
    TrafficKey,
)
from protocol.messages import Message
from protocol.topics import Topics
from protocol.transport.stats import Counts, TrafficStats
from tests.coordinator.helpers import (
    FLEET,
    config,
    hello,
    make_engine,
    received,
    shifted,
    tasks_by_device,
    update,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def setup(**overrides: Any) -> tuple[Any, FleetTelemetry, TrafficStats, Clock]:
    cfg = config(**overrides)
    engine = make_engine(cfg, MemoryStore())
    traffic = TrafficStats()
    clock = Clock()
    telemetry = FleetTelemetry(
        fleet=cfg.fleet,
        strategy=cfg.strategy,
        rounds=cfg.rounds,
        engine=engine,
        traffic=traffic,
        clock=clock,
    )
    engine.watch(telemetry.heard, telemetry.refused)
    return engine, telemetry, traffic, clock


def feed(telemetry: FleetTelemetry, actions: list[Action]) -> list[Action]:
    for action in actions:
        telemetry(action)
    return actions


def test_no_snapshot_is_built_unless_someone_watches() -> None:
    engine, telemetry, _, clock = setup()
    feed(telemetry, engine.start(clock.now))
    telemetry.refresh(force=True)
    assert telemetry.snapshot() is None
    telemetry.watch()
    telemetry.refresh()
    snapshot = telemetry.snapshot()
    assert snapshot is not None and snapshot.phase == "waiting" and snapshot.registered == 0


def test_a_round_is_counted_as_it_happened() -> None:
    engine, telemetry, traffic, clock = setup(min_devices=3)
    telemetry.watch()
    ids = ["dev-a", "dev-b", "dev-c"]
    feed(telemetry, engine.start(clock.now))
    actions: list[Action] = []
    for device_id in ids:
        clock.now += 1
        actions += feed(telemetry, engine.handle(received(hello(engine, device_id), clock.now)))
    tasks = tasks_by_device(actions)
    assert sorted(tasks) == ids
    weights = engine.models()["mlp"]["aca"]
    clock.now += 1
    first = update("dev-a", 1, shifted(weights, 0.01), task=tasks["dev-a"])
    feed(telemetry, engine.handle(received(first, clock.now)))
    feed(telemetry, engine.handle(received(first, clock.now)))  # its duplicate
    telemetry.refresh(force=True)
    mid = telemetry.snapshot()
    assert mid is not None
    assert (mid.phase, mid.round, mid.selected, mid.answered) == ("training", 1, 3, 1)
    assert mid.deadline == engine._run.deadline
    assert mid.updates == {"ok": 1, "duplicate": 1}
    for device_id in ids[1:]:
        clock.now += 1
        message = update(device_id, 1, shifted(weights, 0.01), task=tasks[device_id])
        feed(telemetry, engine.handle(received(message, clock.now)))
    snapshot = telemetry.snapshot()
    assert snapshot is not None
    assert snapshot.rounds_completed == 1 and snapshot.round == 2
    assert snapshot.updates["ok"] == 3
    assert snapshot.round_seconds.count == 1 and snapshot.aggregate_seconds.count == 1
    assert [p.round for p in snapshot.history] == [1]
    assert snapshot.history[0].on_time == 3 and snapshot.history[0].selected == 3
    rows = {r.device_id: r for r in snapshot.devices}
    assert list(rows) == ids
    assert all(r.online and r.rounds_answered == 1 for r in rows.values())
    outcomes = [r.last_outcome for r in rows.values()]
    assert outcomes == ["duplicate", "ok", "ok"]  # dev-a's last was its duplicate
    assert rows["dev-c"].last_seen == clock.now
    assert all(r.screening_ratio is not None for r in rows.values())

    # bytes: per label set and per device, from the transport's per-topic counters
    topics = Topics(FLEET)
    traffic.record("in", topics.device("dev-a", "update"), 1000, 1040)
    traffic.record("in", topics.device("dev-a", "hello"), 100, 130)
    traffic.record("out", topics.to_device("dev-b", "model"), 2000, 2050)
    traffic.record("out", topics.coordinator_status, 50, 70)
    traffic.record("in", "stray/topic", 7, 9)  # outside the layout: counted nowhere
    telemetry.refresh(force=True)
    snapshot = telemetry.snapshot()
    assert snapshot is not None
    assert snapshot.traffic == {
        TrafficKey("up", "update", "fp32"): Counts(1, 1000, 1040),
        TrafficKey("up", "control", "none"): Counts(1, 100, 130),
        TrafficKey("down", "model", "fp32"): Counts(1, 2000, 2050),
        TrafficKey("down", "control", "none"): Counts(1, 50, 70),
    }
    rows = {r.device_id: r for r in snapshot.devices}
    assert (rows["dev-a"].bytes_up, rows["dev-a"].bytes_down) == (1100, 0)
    assert (rows["dev-b"].bytes_up, rows["dev-b"].bytes_down) == (0, 2000)

    # an evaluation arriving later is drawn on its round
    telemetry.evaluated(1, {"aca": {"amp": 55.5, "wlp": 20.0}})
    telemetry.refresh()
    snapshot = telemetry.snapshot()
    assert snapshot is not None
    assert snapshot.models == {"aca": {"amp": 55.5, "wlp": 20.0}}
    assert snapshot.history[0].models == {"aca": {"amp": 55.5, "wlp": 20.0}}


def test_refusals_are_counted_by_kind_and_kept_bounded() -> None:
    engine, telemetry, _, clock = setup()
    telemetry.watch()
    feed(telemetry, engine.start(clock.now))
    feed(telemetry, engine.handle(received(hello(engine, "dev-a"), clock.now)))
    forged = hello(engine, "dev-b")
    for _ in range(3 * RECENT_REFUSALS):  # a flood on dev-a's topic naming another sender
        feed(telemetry, engine.handle(received(forged, clock.now, topic_device="dev-a")))
    telemetry.refused("made-up-key:x", "y" * 10_000)
    telemetry.refresh(force=True)
    snapshot = telemetry.snapshot()
    assert snapshot is not None
    assert set(snapshot.refusals) == set(REFUSAL_KINDS)
    assert snapshot.refusals["foreign"] == 3 * RECENT_REFUSALS
    assert snapshot.refusals["unexpected"] == 1
    assert len(snapshot.recent_refusals) == RECENT_REFUSALS
    assert len(snapshot.recent_refusals[-1].text) == REFUSAL_TEXT_MAX
    assert "dev-b" in snapshot.recent_refusals[0].text
    # the forged sender never becomes a row
    assert [r.device_id for r in snapshot.devices] == ["dev-a"]


def test_a_replayed_frame_changes_no_row() -> None:
    engine, telemetry, _, clock = setup()
    telemetry.watch()
    feed(telemetry, engine.start(clock.now))
    first = hello(engine, "dev-a")
    feed(telemetry, engine.handle(received(first, clock.now)))
    seen = clock.now
    clock.now += 30
    feed(telemetry, engine.handle(received(first, clock.now)))  # the same frame again
    telemetry.refresh(force=True)
    snapshot = telemetry.snapshot()
    assert snapshot is not None
    assert snapshot.devices[0].last_seen == seen
    assert snapshot.refusals["replay"] == 1


def test_wait_changed_returns_when_a_snapshot_is_published() -> None:
    engine, telemetry, _, clock = setup()
    telemetry.watch()
    feed(telemetry, engine.start(clock.now))
    telemetry.refresh()
    version, snapshot = telemetry.wait_changed(0, timeout=0.01)
    assert version >= 1 and snapshot is not None
    same, _ = telemetry.wait_changed(version, timeout=0.01)  # nothing new: times out
    assert same == version
    message: Message = hello(engine, "dev-a")
    feed(telemetry, engine.handle(received(message, clock.now)))
    clock.now += 2
    telemetry.refresh()
    newer, snapshot = telemetry.wait_changed(version, timeout=0.01)
    assert newer > version and snapshot is not None and snapshot.registered == 1
