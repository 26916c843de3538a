"""The replay rules (coordinator.auth.ReplayGuard, docs/protocol.md section 7) in the
engine: pure, with the engine's events."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from coordinator.auth import ReplayGuard
from coordinator.events import Received
from coordinator.store import MemoryStore
from protocol.messages import Ack, ReasonCode
from protocol.ratelog import RateLimitedLog
from tests.coordinator.helpers import (
    config,
    hello,
    make_engine,
    published,
    shapes_of,
    status,
    tasks_by_device,
    update,
)


def test_a_replayed_hello_or_status_is_dropped_and_an_older_one_too() -> None:
    # Prepare
    guard = ReplayGuard(600)
    engine = make_engine(config(), MemoryStore())
    first, idle = hello(engine, "dev-0"), status("dev-0", "idle")
    older = idle.model_copy(update={"sent_at_ms": idle.sent_at_ms - 1, "message_id": "1" * 32})
    # Execute, Assert
    assert guard.check(first, 0) is None
    assert guard.check(idle, 0) is None
    replays = [guard.check(first, 0), guard.check(idle, 0), guard.check(older, 0)]
    assert all(r is not None and r.reason == ReasonCode.REPLAYED for r in replays)
    # a last will (offline), made at connect time, is older and still taken
    will = status("dev-0", "offline").model_copy(update={"sent_at_ms": 0})
    assert guard.check(will, 0) is None


def test_a_replayed_offline_status_is_refused() -> None:
    # Prepare: a device's offline status (its last will, or its clean goodbye) taken once
    guard = ReplayGuard(600)
    engine = make_engine(config(), MemoryStore())
    assert guard.check(hello(engine, "dev-0"), 0) is None
    will = status("dev-0", "offline").model_copy(update={"sent_at_ms": 5})
    assert guard.check(will, 0) is None
    older = will.model_copy(update={"sent_at_ms": 4, "message_id": "2" * 32})
    # Execute, Assert: the same one again, or an older one, is a replay
    for replay in (will, older):
        refused = guard.check(replay, 0)
        assert refused is not None and refused.reason == ReasonCode.REPLAYED
    # a newer one (the next session's will) is taken
    assert guard.check(will.model_copy(update={"sent_at_ms": 6, "message_id": "3" * 32}), 0) is None
    # after a restart (the ids seen are forgotten) the last one taken is still a replay
    restarted = ReplayGuard(600)
    restarted.restore(guard.snapshot())
    again = will.model_copy(update={"sent_at_ms": 6, "message_id": "3" * 32})
    refused = restarted.check(again, 0)
    assert refused is not None and refused.reason == ReasonCode.REPLAYED


def test_the_offline_of_an_earlier_session_replayed_later_is_refused() -> None:
    # Prepare: run 1 of the device (session "a..."), then run 2 (session "b...")
    guard = ReplayGuard(600)
    engine = make_engine(config(), MemoryStore())

    def at(state: str, ms: int, session: str, tag: str):
        message = status("dev-0", state)
        body = message.body.model_copy(update={"session": session * 16})
        return message.model_copy(update={"sent_at_ms": ms, "message_id": tag * 32, "body": body})

    old_will = at("offline", 100, "a", "1")
    for message in (
        at("online", 101, "a", "2"),
        hello(engine, "dev-0").model_copy(update={"sent_at_ms": 102}),
        at("idle", 150, "a", "3"),
        at("online", 201, "b", "4"),
        at("idle", 202, "b", "5"),
    ):
        assert guard.check(message, 0) is None
    # Execute: run 1's will, captured by an attacker and replayed now
    refused = guard.check(old_will, 0)
    # Assert: refused (it would take the idle device offline, and with --min-devices at
    # the fleet no round would start again); run 2's own will, older than its statuses,
    # is still taken
    assert refused is not None and "not the device's current session" in refused.detail
    assert guard.check(at("offline", 200, "b", "6"), 0) is None


def test_hellos_and_updates_outside_the_window_are_refused_statuses_are_not() -> None:
    guard = ReplayGuard(600)
    engine = make_engine(config(), MemoryStore())
    assert guard.check(hello(engine, "dev-0"), 601_000) is not None
    assert guard.check(update("dev-0", 1, {}, 1), -601_000) is not None
    assert guard.check(status("dev-0", "idle"), 3_600_000) is None  # retained: any age
    assert guard.check(hello(engine, "dev-0"), 599_000) is None


def test_the_engine_answers_a_stale_update_replayed_and_changes_nothing() -> None:
    # Prepare: a round running with dev-0 and dev-1
    store = MemoryStore()
    engine = make_engine(config(min_devices=2), store)
    engine.start(0.0)
    actions = []
    for device_id in ("dev-0", "dev-1"):
        actions += engine.handle(Received(device_id, hello(engine, device_id), 1.0))
    tasks = tasks_by_device(actions)
    weights = {k: np.ones(s, np.float32) for k, s in shapes_of(engine).items()}
    stale = update("dev-0", 1, weights, 100, task=tasks["dev-0"])
    before = store.snapshot()
    # Execute: it arrives stamped 20 minutes away from the coordinator's clock
    acks = published(engine.handle(Received("dev-0", stale, 2.0, skew_ms=-1_200_000)), "ack")
    # Assert
    (ack,) = acks
    assert isinstance(ack.message.body, Ack)
    assert ack.message.body.reason == ReasonCode.REPLAYED and not ack.message.body.accepted
    assert store.keys() == before.keys()
    # a replayed hello is dropped without an answer
    assert engine.handle(Received("dev-1", hello(engine, "dev-1"), 3.0, skew_ms=900_000)) == []


def test_refusals_are_logged_once_per_source_and_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    limited = RateLimitedLog(
        logging.getLogger("test.refusals"), interval_s=60, clock=lambda: now[0]
    )
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        for _ in range(100):
            limited.warning("dev-x", "refused %s", "dev-x")
        limited.warning("dev-y", "refused %s", "dev-y")
        now[0] = 61.0
        limited.warning("dev-x", "refused %s", "dev-x")
    assert caplog.text.count("refused dev-x") == 2 and caplog.text.count("refused dev-y") == 1
    assert limited.suppressed == 99
    # each of the others leaves a DEBUG line (-v shows every refusal)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="test.refusals"):
        limited.warning("dev-x", "refused %s", "dev-x")
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]


def test_the_guard_survives_a_restart_of_the_coordinator() -> None:
    # Prepare: a run whose round 1 closed with dev-0's hello, statuses and update seen
    store = MemoryStore()
    engine = make_engine(config(min_devices=1), store)
    engine.start(0.0)
    first = hello(engine, "dev-0")
    old_status = status("dev-0", "idle").model_copy(update={"sent_at_ms": first.sent_at_ms + 5})
    tasks = tasks_by_device(engine.handle(Received("dev-0", first, 1.0)))  # round 1 starts
    engine.handle(Received("dev-0", old_status, 1.5))
    newer = status("dev-0", "idle").model_copy(update={"sent_at_ms": first.sent_at_ms + 9})
    engine.handle(Received("dev-0", newer, 2.0))
    w = {k: np.ones(s, np.float32) for k, s in shapes_of(engine).items()}
    engine.handle(Received("dev-0", update("dev-0", 1, w, 100, task=tasks["dev-0"]), 3.0))
    assert engine.round == 2
    # Execute: the coordinator restarts; the older status and hello are replayed
    resumed = make_engine(engine.config, store)
    resumed.start(4.0)
    replayed = [
        resumed.handle(
            Received("dev-0", old_status.model_copy(update={"message_id": "9" * 32}), 5.0)
        ),
        resumed.handle(
            Received("dev-0", first.model_copy(update={"sent_at_ms": first.sent_at_ms - 1}), 5.0)
        ),
    ]
    # Assert: both refused as older than what the guard had seen before the restart
    assert all(r == [] for r in replayed)
    assert "dev-0" not in resumed.registry.online()
