"""The coordinator's work per update does not grow with the fleet: an update, a
duplicate of it and a hello of a selected device cost the same number of store calls
whether 20 or 200 devices were selected (a walk over the selected devices per update is
O(devices^2) a round). Counted in store calls, not seconds."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from coordinator.store import MemoryStore, Record
from tests.coordinator.helpers import (
    GROUP,
    config,
    hello,
    make_engine,
    received,
    shifted,
    tasks_by_device,
    update,
)


class CountingStore(MemoryStore):
    """A MemoryStore that counts its calls by method."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def exists(self, key: str) -> bool:
        self.calls["exists"] += 1
        return super().exists(key)

    def keys(self, prefix: str = "") -> list[str]:
        self.calls["keys"] += 1
        return super().keys(prefix)

    def read(self, key: str) -> Record | None:
        self.calls["read"] += 1
        return super().read(key)

    def write(self, key: str, meta: Mapping[str, Any], arrays: Mapping[str, Any] = {}) -> None:
        self.calls["write"] += 1
        super().write(key, meta, arrays)


def store_calls_per_event(devices: int) -> dict[str, int]:
    """Store calls of one on-time update, a duplicate of it, and a hello again, with
    ``devices`` selected (the round stays open: one device never answers)."""
    store = CountingStore()
    engine = make_engine(config(min_devices=devices), store)
    engine.start(0.0)
    tasks = {}
    for i in range(devices):
        tasks |= tasks_by_device(
            engine.handle(received(hello(engine, f"dev-{i}", samples=100), 1.0))
        )
    assert len(tasks) == devices  # every device selected
    weights = engine.models()[GROUP]["aca"]
    for i in range(devices - 2):  # the index is built and warm
        message = update(f"dev-{i}", 1, shifted(weights, 0.01), task=tasks[f"dev-{i}"])
        engine.handle(received(message, 2.0))
    out = {}
    last = f"dev-{devices - 2}"
    message = update(last, 1, shifted(weights, 0.01), task=tasks[last])
    for name, event in (
        ("update", message),
        ("duplicate", message),
        ("hello", hello(engine, last, samples=100)),
    ):
        store.calls.clear()
        engine.handle(received(event, 3.0))
        out[name] = sum(store.calls.values())
    assert engine.round == 1  # still open: the last device never answered
    return out


def test_store_calls_per_update_do_not_grow_with_the_selected_devices() -> None:
    small, large = store_calls_per_event(20), store_calls_per_event(200)
    assert small == large
    assert small["update"] >= 1  # the update is written: the count is of real work
