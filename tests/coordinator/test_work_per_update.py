"""The coordinator's work per event does not grow with the fleet: an update, its
duplicate, a screened-out update, a hello (joining, or of a selected device), a status,
a tick, the resend of an update the last round counted and a late one cost the same
number of store calls whether 20 or 200 devices take part, none of them rewrites the
``run`` record (its selected devices and task ids are O(devices)), walks the registry or
walks one of the run record's device lists (a walk per update is O(devices^2) a round).
Counted in calls, not seconds (``benchmarks/coordinator_scale.py`` has the seconds)."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from coordinator.engine import RoundEngine
from coordinator.events import Tick
from coordinator.registry import DeviceRegistry
from coordinator.store import MemoryStore, Record
from protocol.messages import Ack, Hello, Message, ReasonCode
from tests.coordinator.helpers import (
    GROUP,
    config,
    hello,
    make_engine,
    published,
    received,
    shifted,
    status,
    tasks_by_device,
    update,
)

Work = dict[str, int]


class CountingStore(MemoryStore):
    """A MemoryStore that counts its calls by method, and the writes of ``run``."""

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
        self.calls["write run"] += key == "run"
        super().write(key, meta, arrays)

    def delete(self, key: str) -> None:
        self.calls["delete"] += 1
        super().delete(key)


class CountingRegistry(DeviceRegistry):
    """A DeviceRegistry that counts the calls that walk every device."""

    def __init__(self, walks: Counter[str]) -> None:
        super().__init__()
        self.walks = walks

    def online(self) -> list[str]:
        self.walks["registry"] += 1
        return super().online()

    @property
    def entries(self) -> dict[str, Hello]:
        self.walks["registry"] += 1
        return super().entries


class WalkCountingList(list[str]):
    """A list of device ids that counts walks over it (iteration, ``in``); copies of it
    (``dataclasses.asdict`` makes them as the run record is saved) count nothing."""

    def __init__(self, items: Iterable[str] = (), walks: Counter[str] | None = None) -> None:
        super().__init__(items)
        self.walks = walks if walks is not None else Counter()

    def __iter__(self) -> Iterator[str]:
        self.walks["run lists"] += 1
        return super().__iter__()

    def __contains__(self, item: object) -> bool:
        self.walks["run lists"] += 1
        return super().__contains__(item)


def watch_run_lists(engine: RoundEngine, walks: Counter[str]) -> None:
    """Count the walks over the run record's device lists from here on."""
    run = engine._require_run()
    run.selected = WalkCountingList(run.selected, walks)
    run.counted = WalkCountingList(run.counted, walks)
    run.aggregating = WalkCountingList(run.aggregating, walks)
    run.screened_out = WalkCountingList(run.screened_out, walks)


def acks(actions: list[Any]) -> list[Ack]:
    bodies = [a.message.body for a in published(actions, "ack")]
    return [b for b in bodies if isinstance(b, Ack)]


def work_per_event(devices: int) -> dict[str, Work]:
    """Store calls and walks of each kind of event in a fleet of ``devices``, every one
    of them selected (round 1 stays open until the measured events are in)."""
    store = CountingStore()
    walks: Counter[str] = Counter()
    engine = make_engine(config(min_devices=devices, rounds=3), store)
    engine.start(0.0)
    engine.registry = CountingRegistry(walks)
    out: dict[str, Work] = {}

    def measure(name: str, event: Message | None, now: float) -> list[Any]:
        store.calls.clear()
        walks.clear()
        actions = engine.handle(Tick(now) if event is None else received(event, now))
        out[name] = {**store.calls, **walks}
        return actions

    ids = [f"dev-{i}" for i in range(devices)]
    for device_id in ids[:-2]:
        engine.handle(received(hello(engine, device_id, samples=100), 1.0))
    measure("hello, joining", hello(engine, ids[-2], samples=100), 1.0)
    measure("status", status(ids[0], "idle"), 1.0)
    measure("tick, waiting", None, 1.0)
    tasks = tasks_by_device(engine.handle(received(hello(engine, ids[-1], samples=100), 1.0)))
    assert len(tasks) == devices  # the last hello started the round: everyone selected

    watch_run_lists(engine, walks)
    weights = engine.models()[GROUP]["aca"]
    first = update(ids[0], 1, shifted(weights, 0.01), task=tasks[ids[0]])
    engine.handle(received(first, 2.0))
    for device_id in ids[1:-4]:  # the index is built and warm
        message = update(device_id, 1, shifted(weights, 0.01), task=tasks[device_id])
        engine.handle(received(message, 2.0))
    message = update(ids[-4], 1, shifted(weights, 0.01), task=tasks[ids[-4]])
    assert acks(measure("update", message, 3.0))[0].reason is ReasonCode.OK
    assert acks(measure("duplicate", message, 3.0))[0].reason is ReasonCode.DUPLICATE
    nan = {k: np.full_like(v, np.nan) for k, v in weights.items()}
    screened = update(ids[-3], 1, nan, task=tasks[ids[-3]])
    assert acks(measure("screened out", screened, 3.0))[0].reason is ReasonCode.NON_FINITE
    measure("hello, selected", hello(engine, ids[-2], samples=100), 3.0)
    measure("tick, training", None, 3.0)
    assert engine.round == 1  # still open: two devices have not answered

    for device_id in ids[-2:]:  # the round closes, round 2 starts
        message = update(device_id, 1, shifted(weights, 0.01), task=tasks[device_id])
        engine.handle(received(message, 4.0))
    assert engine.round == 2
    watch_run_lists(engine, walks)
    assert acks(measure("resend, counted", first, 5.0))[0].reason is ReasonCode.DUPLICATE
    late = screened.model_copy(update={"message_id": uuid.uuid4().hex})
    assert acks(measure("late", late, 5.0))[0].reason is ReasonCode.LATE
    return out


def test_work_per_event_does_not_grow_with_the_fleet() -> None:
    small, large = work_per_event(20), work_per_event(200)
    assert small == large
    assert small["update"]["write"] == 1  # the update is written: the count is of real work
    assert small["screened out"]["write"] == 1  # its mark, not the run record
    for name, work in small.items():
        assert work.get("write run", 0) == 0, name
        assert work.get("registry", 0) == 0, name
        assert work.get("run lists", 0) == 0, name
