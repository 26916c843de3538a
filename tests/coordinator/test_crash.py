"""Crash safety: kill the coordinator between any two writes, resume, and get the same run.

A scripted run (3 devices, fedavg_oca, a late update that only the OCA cache takes) is
played once without interruption. Then, for every write k of that run, it is played again
on a FileStore whose k-th write raises (nothing of that write reaches the disk); a new
engine resumes from the directory, the devices say hello again, and the events from the
interrupted one on are delivered again (a device resends what was not acknowledged).
Every resumed run must end with the same models, the same OCA contents, and each update
counted once.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.actions import Finished
from coordinator.engine import RoundEngine
from coordinator.errors import StateMismatchError
from coordinator.events import Event, Received, Tick
from coordinator.state import STATE_FORMAT
from coordinator.store import FileStore, Record, Store
from tests.coordinator.helpers import (
    GROUP,
    config,
    hello,
    make_engine,
    update,
)

DEVICES = ("dev-0", "dev-1", "dev-2")
ROUNDS = 3


class SimulatedCrashError(Exception):
    pass


class CrashingStore(Store):
    """Delegates to ``inner`` and raises instead of performing mutation number ``crash_at``."""

    def __init__(self, inner: Store, crash_at: int | None) -> None:
        self.inner, self.crash_at, self.mutations = inner, crash_at, 0

    def _mutate(self) -> None:
        self.mutations += 1
        if self.mutations == self.crash_at:
            raise SimulatedCrashError(self.mutations)

    def read(self, key: str) -> Record | None:
        return self.inner.read(key)

    def write(self, key: str, meta: Mapping[str, Any], arrays: Mapping[str, Any] = {}) -> None:
        self._mutate()
        self.inner.write(key, meta, arrays)

    def delete(self, key: str) -> None:
        self._mutate()
        self.inner.delete(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def keys(self, prefix: str = "") -> list[str]:
        return self.inner.keys(prefix)


def weights_for(engine: RoundEngine, device: str, round_number: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([round_number, DEVICES.index(device)])
    return {
        k: rng.normal(size=v.shape).astype(np.float32)
        for k, v in engine.models()[GROUP]["aca"].items()
    }


def script(engine: RoundEngine) -> list[Event]:
    """Hellos, then per round an update from every device at times well inside the
    deadline, except dev-2 in round 2: the deadline closes that round, then its update
    arrives late."""
    events: list[Event] = [Received(d, hello(engine, d, samples=50), 1.0) for d in DEVICES]
    now = 2.0
    for r in range(1, ROUNDS + 1):
        for d in DEVICES:
            if (r, d) == (2, "dev-2"):
                continue
            now += 1
            events.append(
                Received(
                    d, update(d, r, weights_for(engine, d, r), 10 + 5 * DEVICES.index(d) + r), now
                )
            )
        if r == 2:
            now += 120
            events.append(Tick(now))  # deadline of round 2 passes
            now += 1
            events.append(
                Received("dev-2", update("dev-2", 2, weights_for(engine, "dev-2", 2), 33), now)
            )
    return events


def _time(event: Event) -> float:
    return event.now


def play(engine: RoundEngine, events: list[Event]) -> Finished | None:
    finished = None
    for event in events:
        for action in engine.handle(event):
            if isinstance(action, Finished):
                finished = action
    return finished


def outcome(engine: RoundEngine, store: Store, finished: Finished) -> dict[str, Any]:
    oca = store.read(f"oca/{GROUP}")
    assert oca is not None
    return {
        "models": finished.models[GROUP],
        "applied": oca.meta["applied"],
        "weight": oca.meta["weight"],
        "keys": store.keys(),
    }


def reference(tmp_path: Path) -> tuple[dict[str, Any], int]:
    cfg = config(strategy="fedavg_oca", rounds=ROUNDS, min_devices=3, state_dir=tmp_path)
    counting = CrashingStore(FileStore(tmp_path), crash_at=None)
    engine = make_engine(cfg, counting)
    engine.start(0.0)
    finished = play(engine, script(engine))
    assert finished is not None
    return outcome(engine, counting.inner, finished), counting.mutations


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["applied"] == b["applied"]
    assert a["weight"] == pytest.approx(b["weight"])
    assert a["keys"] == b["keys"]
    for name in ("aca", "oca"):
        for key, value in a["models"][name].items():
            np.testing.assert_allclose(value, b["models"][name][key], rtol=1e-6, atol=1e-6)


def test_reference_run_counts_the_late_update_in_the_oca_only(tmp_path: Path) -> None:
    result, mutations = reference(tmp_path)

    assert mutations > 20
    assert result["applied"]["dev-2"][0] == 3
    assert result["weight"] == pytest.approx(sum(10 + 5 * i + 3 for i in range(3)))


def test_resume_after_a_crash_before_any_write(tmp_path: Path) -> None:
    expected, total = reference(tmp_path / "reference")
    cfg = config(strategy="fedavg_oca", rounds=ROUNDS, min_devices=3, state_dir=tmp_path / "run")

    for crash_at in range(1, total + 1):
        directory = tmp_path / f"crash-{crash_at}"
        cfg_k = cfg.model_copy(update={"state_dir": directory})
        engine = make_engine(cfg_k, CrashingStore(FileStore(directory), crash_at))
        events = None
        try:
            engine.start(0.0)
            events = script(engine)
            for index, event in enumerate(events):
                position = index
                engine.handle(event)
        except SimulatedCrashError:
            pass
        else:  # pragma: no cover - every write index must crash
            pytest.fail(f"no crash at write {crash_at}")

        resumed_store = FileStore(directory)
        resumed = make_engine(cfg_k.model_copy(update={"resume": True}), resumed_store)
        at_start = resumed.start(0.0)
        replay = script(resumed)
        if events is not None:  # hello again (at the time of the crash), then resend
            at = _time(replay[position])
            hellos = [Received(d, hello(resumed, d, samples=50), at) for d in DEVICES]
            replay = hellos + replay[position:]
        finished = play(resumed, replay) or next(
            (a for a in at_start if isinstance(a, Finished)), None
        )
        assert finished is not None, f"run did not finish after a crash at write {crash_at}"
        assert_same(outcome(resumed, resumed_store, finished), expected)


def test_resume_refuses_a_state_dir_of_another_run(tmp_path: Path) -> None:
    engine = make_engine(config(state_dir=tmp_path), FileStore(tmp_path))
    engine.start(0.0)

    other = make_engine(config(state_dir=tmp_path, seed=99, resume=True), FileStore(tmp_path))

    with pytest.raises(StateMismatchError, match="another run"):
        other.start(0.0)


@pytest.mark.parametrize("found", [None, 0, 2])
def test_resume_refuses_a_state_dir_of_another_state_format(
    tmp_path: Path, found: int | None
) -> None:
    engine = make_engine(config(state_dir=tmp_path), FileStore(tmp_path))
    engine.start(0.0)
    store = FileStore(tmp_path)
    meta = store.read_meta("run")
    assert meta is not None and meta["state_format"] == STATE_FORMAT
    if found is None:
        del meta["state_format"]  # written before formats were numbered
    else:
        meta["state_format"] = found
    store.write("run", meta)

    resumed = make_engine(config(state_dir=tmp_path, resume=True), FileStore(tmp_path))

    with pytest.raises(StateMismatchError, match=f"reads state format {STATE_FORMAT}"):
        resumed.start(0.0)
    assert store.read_meta("run") == meta  # nothing rewritten
