"""Aggregation as a phase of the round engine: requested as an action, closed by an event."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from coordinator.actions import AggregateRequested, RoundClosed
from coordinator.context import ServerContext
from coordinator.engine import RoundEngine
from coordinator.errors import AggregationError
from coordinator.events import AggregateDone, Tick
from coordinator.runtime import Coordinator
from coordinator.store import FileStore, MemoryStore, Store
from coordinator.strategies.base import NothingToAggregate
from coordinator.strategies.feddf_settings import DistillSettings
from coordinator.strategies.registry import build_strategy
from models import state_arrays
from models.errors import ModelError
from protocol.messages import Ack, ReasonCode
from protocol.transport import MemoryBroker, MemoryTransport
from tests.coordinator.helpers import (
    GROUP,
    aggregate,
    config,
    hello,
    make_engine,
    published,
    received,
    shifted,
    tasks_by_device,
    templates,
    update,
)
from tests.coordinator.test_crash import CrashingStore, SimulatedCrashError

CPU = torch.device("cpu")


def acks(actions: list) -> list[Ack]:
    return [a.message.body for a in published(actions, "ack")]


def requested(actions: list) -> AggregateRequested:
    (request,) = [a for a in actions if isinstance(a, AggregateRequested)]
    return request


def round_one(store: Store, devices: int = 2, **overrides) -> tuple[RoundEngine, dict, list]:
    """A raw engine (aggregations not carried out) whose round 1 started on ``store``."""
    cfg = config(min_devices=devices, **overrides)
    engine = make_engine(cfg, store, inline=False)
    engine.start(0.0)
    actions: list = []
    for i in range(devices):
        msg = hello(engine, f"dev-{i}", samples=100 * (i + 1), share_label_counts=True)
        actions = engine.handle(received(msg, 1.0))
    return engine, tasks_by_device(actions), actions


def weights(engine: RoundEngine) -> dict[str, np.ndarray]:
    return engine.models()[GROUP]["aca"]


def test_the_round_closes_on_the_done_event_not_when_the_last_update_arrives() -> None:
    engine, tasks, _ = round_one(MemoryStore())
    w = weights(engine)
    engine.handle(received(update("dev-0", 1, shifted(w, 1.0), 100, tasks["dev-0"]), 5.0))

    last = engine.handle(received(update("dev-1", 1, shifted(w, 4.0), 200, tasks["dev-1"]), 6.0))

    request = requested(last)
    assert not any(isinstance(a, RoundClosed) for a in last)
    assert request.job.round == 1 and request.job.devices == ("dev-0", "dev-1")
    assert engine.round == 1 and engine.handle(Tick(500.0)) == []  # no deadline while it runs

    closing = engine.handle(aggregate(engine, request, 7.0))

    (closed,) = [a for a in closing if isinstance(a, RoundClosed)]
    assert closed.round == 1 and closed.on_time == 2 and closed.duration_s == pytest.approx(6.0)
    expected = shifted(w, (100 * 1.0 + 200 * 4.0) / 300)
    for name, value in closed.models[GROUP]["aca"].items():
        np.testing.assert_allclose(value, expected[name], atol=1e-5)
    assert engine.round == 2 and tasks_by_device(closing)


def test_updates_while_aggregating_are_duplicates_or_late() -> None:
    engine, tasks, _ = round_one(MemoryStore(), devices=2, strategy="fedavg_oca")
    w = weights(engine)
    first = update("dev-0", 1, shifted(w, 1.0), 100, tasks["dev-0"])
    engine.handle(received(first, 5.0))
    request = requested(engine.handle(Tick(62.0)))  # the deadline closes round 1

    again = engine.handle(received(first, 63.0))
    late = engine.handle(received(update("dev-1", 1, shifted(w, 3.0), 200), 64.0))
    closing = engine.handle(aggregate(engine, request, 65.0))

    assert [(a.accepted, a.reason) for a in acks(again) + acks(late)] == [
        (True, ReasonCode.DUPLICATE),
        (True, ReasonCode.LATE),
    ]
    assert request.job.devices == ("dev-0",)
    (closed,) = [a for a in closing if isinstance(a, RoundClosed)]
    assert closed.on_time == 1 and closed.late == 1
    np.testing.assert_allclose(
        closed.models[GROUP]["aca"]["head.bias"], w["head.bias"] + 1.0, atol=1e-6
    )
    expected_oca = w["head.bias"] + (100 * 1.0 + 200 * 3.0) / 300
    np.testing.assert_allclose(closed.models[GROUP]["oca"]["head.bias"], expected_oca, atol=1e-5)


@pytest.mark.parametrize("strategy", ["fedavg", "fedavg_oca", "fedkf", "fedgen"])
def test_nothing_to_aggregate_is_a_typed_result(strategy: str) -> None:
    cfg = config(strategy=strategy)
    fleet = templates(cfg)
    current = {GROUP: {"aca": state_arrays(fleet[GROUP])}}
    context = ServerContext.for_round(CPU, cfg.seed, 1)

    result = build_strategy(cfg, fleet).aggregate(current, iter(()), 1, context)

    assert isinstance(result, NothingToAggregate) and "round 1" in result.reason


def test_a_round_without_updates_closes_with_the_models_unchanged() -> None:
    engine, _, _ = round_one(MemoryStore(), devices=1)
    before = weights(engine)
    request = requested(engine.handle(Tick(100.0)))
    done = aggregate(engine, request, 100.0)
    assert isinstance(done.result, NothingToAggregate)

    closing = engine.handle(done)

    (closed,) = [a for a in closing if isinstance(a, RoundClosed)]
    assert closed.on_time == 0
    for name, value in closed.models[GROUP]["aca"].items():
        np.testing.assert_array_equal(value, before[name])


def fedgen_round_two(store: Store) -> tuple[RoundEngine, AggregateRequested]:
    """FedGen after round 1, its round 2 update in, with the stored generator corrupt."""
    engine, tasks, _ = round_one(store, devices=1, strategy="fedgen")
    w = weights(engine)
    counts = (100,) + (0,) * 9
    msg = update("dev-0", 1, w, 100, tasks["dev-0"], label_counts=counts)
    closing = engine.handle(aggregate(engine, requested(engine.handle(received(msg, 2.0))), 3.0))
    generator = store.read(f"models/r000002/{GROUP}/generator")
    assert generator is not None
    broken = {n: a[..., :1] if a.ndim else a for n, a in generator.arrays.items()}
    store.write(f"models/r000002/{GROUP}/generator", generator.meta, broken)
    resumed = make_engine(engine.config, store, inline=False)
    resumed.start(4.0)
    resumed.handle(received(hello(resumed, "dev-0", share_label_counts=True), 4.0))
    task = tasks_by_device(closing)["dev-0"]
    msg = update("dev-0", 2, w, 100, task, label_counts=counts)
    return resumed, requested(resumed.handle(received(msg, 5.0)))


def test_a_failing_server_step_raises_and_the_round_stays_open() -> None:
    store = MemoryStore()
    engine, request = fedgen_round_two(store)

    with pytest.raises(ModelError):  # a ValueError too: once read as "no update"
        aggregate(engine, request, 6.0)

    assert engine.round == 2
    run = store.read_meta("run")
    assert run is not None and run["phase"] == "aggregating" and run["aggregating"] == ["dev-0"]


def test_the_runtime_stops_with_an_aggregation_error_and_keeps_the_round() -> None:
    store = MemoryStore()
    engine, _ = fedgen_round_two(store)
    cfg = engine.config.model_copy(update={"server_device": "cpu"})
    coordinator = Coordinator(cfg, MemoryTransport(MemoryBroker(), "coordinator"), store)
    outcome: list[BaseException] = []

    def serve() -> None:
        try:
            coordinator.run()
        except AggregationError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    thread.join(30)

    assert not thread.is_alive()
    (error,) = outcome
    assert "round 2" in str(error) and isinstance(error.__cause__, ModelError)
    run = store.read_meta("run")
    assert run is not None and run["phase"] == "aggregating" and run["round"] == 2


def oca_round(store: Store) -> tuple[RoundEngine, AggregateRequested]:
    """fedavg_oca, round 1 of 2 with both updates in: the aggregation is requested."""
    engine, tasks, _ = round_one(store, strategy="fedavg_oca", rounds=2)
    w = weights(engine)
    engine.handle(received(update("dev-0", 1, shifted(w, 1.0), 100, tasks["dev-0"]), 5.0))
    last = engine.handle(received(update("dev-1", 1, shifted(w, 4.0), 200, tasks["dev-1"]), 6.0))
    return engine, requested(last)


def closed_models(engine: RoundEngine, done: AggregateDone) -> dict:
    """The models of the fleet's group in the RoundClosed that ``done`` leads to."""
    (closed,) = [a for a in engine.handle(done) if isinstance(a, RoundClosed)]
    return closed.models[GROUP]


def test_a_crash_while_aggregating_resumes_without_losing_or_double_counting(
    tmp_path: Path,
) -> None:
    reference, request = oca_round(MemoryStore())
    expected = closed_models(reference, aggregate(reference, request, 7.0))
    oca_weight = 300.0

    oca_round(FileStore(tmp_path))  # the coordinator dies before the aggregation is done
    resumed = make_engine(
        config(strategy="fedavg_oca", rounds=2, min_devices=2), FileStore(tmp_path), inline=False
    )
    again = requested(resumed.start(8.0))
    models = closed_models(resumed, aggregate(resumed, again, 9.0))

    assert again.job.devices == request.job.devices
    for name in ("aca", "oca"):
        for key, value in expected[name].items():
            np.testing.assert_allclose(models[name][key], value, rtol=1e-6)
    oca = FileStore(tmp_path).read(f"oca/{GROUP}")
    assert oca is not None and oca.meta["weight"] == pytest.approx(oca_weight)
    assert sorted(oca.meta["applied"]) == ["dev-0", "dev-1"]


def test_a_crash_at_any_write_of_the_round_close_resumes_to_the_same_models(
    tmp_path: Path,
) -> None:
    reference, request = oca_round(MemoryStore())
    expected = closed_models(reference, aggregate(reference, request, 7.0))
    writes = 0
    for crash_at in range(1, 20):
        directory = tmp_path / f"crash-{crash_at}"
        engine, request = oca_round(FileStore(directory))
        crashing = CrashingStore(FileStore(directory), crash_at)
        engine = make_engine(engine.config, crashing, inline=False)
        request = requested(engine.start(7.0))
        try:
            engine.handle(aggregate(engine, request, 7.0))
        except SimulatedCrashError:
            pass
        else:
            writes = crashing.mutations
            break
        resumed = make_engine(engine.config, FileStore(directory), inline=False)
        actions = resumed.start(8.0)
        again = [a for a in actions if isinstance(a, AggregateRequested)]
        if again:  # the crash came before the commit point: aggregate again
            actions = resumed.handle(aggregate(resumed, again[0], 9.0))
        assert resumed.round == 2
        oca = FileStore(directory).read(f"oca/{GROUP}")
        assert oca is not None and oca.meta["weight"] == pytest.approx(300.0)
        for key, value in expected["aca"].items():
            np.testing.assert_allclose(resumed.models()[GROUP]["aca"][key], value, rtol=1e-6)
    assert writes > 2  # every write of the close was crashed once


def feddf_round(store: Store) -> tuple[RoundEngine, AggregateRequested]:
    """feddf, round 1 of 2 with both updates in: the distillation is requested."""
    cfg = config(strategy="feddf", rounds=2, min_devices=2)
    strategy = build_strategy(cfg, templates(cfg))
    strategy.distillation = DistillSettings(max_steps=20, eval_every=10)
    engine = make_engine(cfg, store, inline=False, strategy=strategy)
    engine.start(0.0)
    actions: list = []
    for i in range(2):
        msg = hello(engine, f"dev-{i}", samples=100 * (i + 1), share_label_counts=True)
        actions = engine.handle(received(msg, 1.0))
    tasks, w = tasks_by_device(actions), weights(engine)
    engine.handle(received(update("dev-0", 1, shifted(w, 0.1), 100, tasks["dev-0"]), 5.0))
    last = engine.handle(received(update("dev-1", 1, shifted(w, -0.1), 200, tasks["dev-1"]), 6.0))
    return engine, requested(last)


def distilled(engine: RoundEngine, request: AggregateRequested) -> dict:
    """Carry out a feddf request as the runtime does, on fixed proxy images."""
    images = torch.rand((96, 1, 28, 28), generator=torch.Generator().manual_seed(0))
    job = request.job
    context = ServerContext.for_round(CPU, engine.config.seed, job.round, proxy_data=images)
    return closed_models(engine, AggregateDone(job.round, job.run(context), 9.0))


def test_a_crash_during_server_side_distillation_resumes_to_the_same_models(
    tmp_path: Path,
) -> None:
    reference, request = feddf_round(MemoryStore())
    expected = distilled(reference, request)

    feddf_round(FileStore(tmp_path))  # the coordinator dies while it distils
    cfg = config(strategy="feddf", rounds=2, min_devices=2)
    strategy = build_strategy(cfg, templates(cfg))
    strategy.distillation = DistillSettings(max_steps=20, eval_every=10)
    resumed = make_engine(cfg, FileStore(tmp_path), inline=False, strategy=strategy)
    again = requested(resumed.start(8.0))
    models = distilled(resumed, again)

    assert again.job.devices == request.job.devices  # the same updates, each once
    for key, value in expected["aca"].items():
        np.testing.assert_allclose(models["aca"][key], value, rtol=1e-6, atol=1e-7)
