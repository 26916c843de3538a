"""The log while a round waits for --min-devices: "1 of 3 online" as devices join, each
change while few are online, then at most once a second (a flood of joins is a line a
second), beside the reminder once a minute."""

from __future__ import annotations

import logging

import pytest

from coordinator.actions import RoundStarted
from coordinator.engine import RoundEngine
from coordinator.events import Tick
from coordinator.liveness import ONLINE_LOG_EACH, ONLINE_LOG_S
from coordinator.store import MemoryStore
from protocol.messages import Message
from tests.coordinator.helpers import FLEET, config, hello, make_engine, received, status


def online_lines(caplog: pytest.LogCaptureFixture, wanted: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "coordinator.engine"
        and r.getMessage().endswith(f"of {wanted} online (--min-devices)")
    ]


def hellos(engine: RoundEngine, count: int) -> list[Message]:
    """Hellos of ``count`` devices (one built, the others copies under their ids)."""
    first = hello(engine, "dev-00000")
    return [
        Message(
            fleet=FLEET,
            sender=f"dev-{i:05d}",
            body=first.body.model_copy(update={"device_id": f"dev-{i:05d}"}),
        )
        for i in range(count)
    ]


def test_each_join_is_logged_while_few_are_online(caplog: pytest.LogCaptureFixture) -> None:
    engine = make_engine(config(min_devices=3), MemoryStore())
    engine.start(0.0)
    caplog.set_level(logging.INFO, logger="coordinator.engine")
    engine.handle(Tick(0.5))  # nobody online: the reminder alone

    engine.handle(received(hello(engine, "dev-0"), 1.0))
    engine.handle(received(hello(engine, "dev-1"), 1.01))
    engine.handle(Tick(1.02))  # no change: nothing more

    assert online_lines(caplog, 3) == [
        "round 1: 1 of 3 online (--min-devices)",
        "round 1: 2 of 3 online (--min-devices)",
    ]
    reminders = [r.getMessage() for r in caplog.records if "waits for 3 online" in r.getMessage()]
    assert len(reminders) == 1 and "0 of 0 registered online" in reminders[0]


def test_a_device_going_offline_is_logged_too(caplog: pytest.LogCaptureFixture) -> None:
    engine = make_engine(config(min_devices=3), MemoryStore())
    engine.start(0.0)
    caplog.set_level(logging.INFO, logger="coordinator.engine")
    engine.handle(received(hello(engine, "dev-0"), 1.0))
    engine.handle(received(hello(engine, "dev-1"), 1.1))

    engine.handle(received(status("dev-1", "offline"), 1.2))

    assert online_lines(caplog, 3)[-1] == "round 1: 1 of 3 online (--min-devices)"


def test_a_flood_of_joins_logs_a_line_a_second(caplog: pytest.LogCaptureFixture) -> None:
    devices = 400
    engine = make_engine(config(min_devices=1000), MemoryStore())
    engine.start(0.0)
    caplog.set_level(logging.INFO, logger="coordinator.engine")
    messages = hellos(engine, devices)

    for i, message in enumerate(messages):  # 400 joins over 2 s
        engine.handle(received(message, 1.0 + i * 2.0 / devices))
    engine.handle(Tick(3.5))  # the joins the rate limit held back are said once

    lines = online_lines(caplog, 1000)
    counts = [int(line.split(":")[1].split(" of ")[0]) for line in lines]
    assert counts[:ONLINE_LOG_EACH] == list(range(1, ONLINE_LOG_EACH + 1))
    later = counts[ONLINE_LOG_EACH:]
    assert 2 <= len(later) <= 2 / ONLINE_LOG_S + 1  # about one a second, not 390
    assert later == sorted(later) and counts[-1] == devices


def test_the_round_starts_without_another_online_line(caplog: pytest.LogCaptureFixture) -> None:
    engine = make_engine(config(min_devices=2), MemoryStore())
    engine.start(0.0)
    caplog.set_level(logging.INFO, logger="coordinator.engine")
    engine.handle(received(hello(engine, "dev-0"), 1.0))

    actions = engine.handle(received(hello(engine, "dev-1"), 1.1))

    assert any(isinstance(a, RoundStarted) for a in actions)
    assert online_lines(caplog, 2) == ["round 1: 1 of 2 online (--min-devices)"]
