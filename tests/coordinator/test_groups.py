"""A fleet of two architectures: models keyed by (group, role), a downlink per device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from coordinator.actions import RoundClosed
from coordinator.errors import ConfigError
from coordinator.groups import ArchitectureGroup
from coordinator.runtime import build_models
from coordinator.store import MemoryStore, Store
from coordinator.strategies.registry import build_strategy
from models import Classifier, build_classifier
from protocol.messages import Ack, ModelPayload, ReasonCode, RoundTask
from protocol.tensors import Encoding, Precision
from tests.coordinator.helpers import (
    config,
    hello,
    make_engine,
    published,
    received,
    shifted,
    tasks_by_device,
    update,
)

SPEAKS = (Precision.FP32, Precision.INT8)
DEVICES = {"dev-a": "mlp", "dev-b": "lenet5", "dev-c": "mlp"}


def two_groups(**overrides) -> dict[str, Classifier]:
    cfg = config(**overrides)
    torch.manual_seed(7)
    lenet = build_classifier("lenet5", num_classes=cfg.num_classes)
    return {"mlp": build_models(cfg)["mlp"], "lenet5": lenet}


def hello_as(engine, device_id: str, group: Classifier, **fields):
    fields = {"architecture": group.architecture, "fingerprint": group.fingerprint(), **fields}
    return hello(engine, device_id, samples=300, share_label_counts=True, **fields)


def start(store: Store | None = None, **overrides):
    """Round 1 of a fleet of two mlp devices and one lenet5 device (int8 downlink)."""
    cfg = config(min_devices=3, **overrides)
    fleet = two_groups(**overrides)
    engine = make_engine(cfg, store or MemoryStore(), fleet=fleet)
    engine.start(0.0)
    actions: list = []
    for device_id, group in DEVICES.items():
        down = Precision.INT8 if group == "lenet5" else None
        message = hello_as(
            engine, device_id, fleet[group], precisions=SPEAKS, downlink_precision=down
        )
        actions = engine.handle(received(message, 1.0))
    return engine, fleet, actions


def model_of(actions: list, device_id: str) -> ModelPayload:
    (publish,) = [a for a in published(actions, "model") if a.topic.split("/")[3] == device_id]
    body = publish.message.body
    assert isinstance(body, ModelPayload)
    return body


def acks(actions: list) -> list[Ack]:
    return [a.message.body for a in published(actions, "ack")]


def test_each_device_gets_its_groups_model_at_its_precision() -> None:
    engine, _, actions = start()

    initial = engine.models()
    for device_id, group in DEVICES.items():
        sets = model_of(actions, device_id).sets
        assert list(sets) == ["global"]
        arrays = sets["global"].to_arrays()
        assert arrays.keys() == initial[group]["aca"].keys()
        encodings = {t.encoding for t in sets["global"]}
        if group == "lenet5":
            assert Encoding.INT8_CH in encodings and Encoding.FP32 not in encodings
        else:
            assert encodings == {Encoding.FP32}
            for name, value in arrays.items():
                np.testing.assert_array_equal(value, initial[group]["aca"][name])
    assert set(initial) == {"mlp", "lenet5"}
    assert initial["mlp"]["aca"].keys() != initial["lenet5"]["aca"].keys()


def test_each_group_averages_its_own_devices_only() -> None:
    engine, _, actions = start()
    tasks = tasks_by_device(actions)
    initial = engine.models()
    shifts = {"dev-a": 1.0, "dev-b": 5.0, "dev-c": 3.0}
    samples = {"dev-a": 100, "dev-b": 100, "dev-c": 300}

    closing: list = []
    for device_id, group in DEVICES.items():
        weights = shifted(initial[group]["aca"], shifts[device_id])
        message = update(device_id, 1, weights, samples[device_id], tasks[device_id])
        closing = engine.handle(received(message, 2.0))

    (closed,) = [a for a in closing if isinstance(a, RoundClosed)]
    assert closed.on_time == 3 and set(closed.models) == {"mlp", "lenet5"}
    expected = {"mlp": (100 * 1.0 + 300 * 3.0) / 400, "lenet5": 5.0}
    for group, shift in expected.items():
        for name, value in closed.models[group]["aca"].items():
            np.testing.assert_allclose(value, initial[group]["aca"][name] + shift, atol=1e-5)
    next_tasks = tasks_by_device(closing)
    for device_id, group in DEVICES.items():
        assert device_id in next_tasks
        task = next_tasks[device_id].body
        assert isinstance(task, RoundTask) and task.payloads == ("global",)
        names = {t.name for t in model_of(closing, device_id).sets["global"]}
        assert names == set(initial[group]["aca"])


def test_hello_and_updates_are_checked_against_the_devices_group() -> None:
    engine, fleet, actions = start()
    tasks = tasks_by_device(actions)
    resnet = build_classifier("resnet8")

    unknown = engine.handle(received(hello_as(engine, "dev-d", resnet), 2.0))
    switched = engine.handle(received(hello_as(engine, "dev-a", fleet["lenet5"]), 2.0))
    other = update("dev-a", 1, engine.models()["lenet5"]["aca"], 100, tasks["dev-a"])
    wrong_tensors = engine.handle(received(other, 2.0))

    (refused,) = acks(unknown)
    assert not refused.accepted and refused.reason is ReasonCode.FINGERPRINT_MISMATCH
    assert "mlp (" in refused.detail and "lenet5 (" in refused.detail
    assert "dev-d" not in engine.registry
    (kept,) = acks(switched)
    assert not kept.accepted and "keeps its architecture" in kept.detail
    assert engine.registry["dev-a"].architecture == "mlp"
    assert acks(wrong_tensors)[0].reason is ReasonCode.FINGERPRINT_MISMATCH


def test_each_group_has_its_own_oca_cache_and_a_resume_loads_every_group() -> None:
    store = MemoryStore()
    engine, fleet, actions = start(store, strategy="fedavg_oca")
    tasks = tasks_by_device(actions)
    initial = engine.models()
    for device_id, group in DEVICES.items():
        weights = shifted(initial[group]["aca"], 2.0)
        engine.handle(received(update(device_id, 1, weights, 100, tasks[device_id]), 2.0))

    assert set(store.keys("oca")) == {"oca/lenet5", "oca/mlp"}
    assert sorted(store.read_meta("oca/mlp")["applied"]) == ["dev-a", "dev-c"]
    assert sorted(store.read_meta("oca/lenet5")["applied"]) == ["dev-b"]
    resumed = make_engine(engine.config, store, fleet=fleet)
    resumed.start(3.0)
    for group in ("mlp", "lenet5"):
        for name, value in resumed.models()[group]["oca"].items():
            np.testing.assert_allclose(value, initial[group]["aca"][name] + 2.0, atol=1e-5)


def test_fedgen_and_the_broadcast_run_one_architecture() -> None:
    fleet = two_groups()
    groups = {name: ArchitectureGroup.of(t) for name, t in fleet.items()}

    with pytest.raises(ConfigError, match="one architecture"):
        build_strategy(config(strategy="fedgen"), fleet)
    cfg = config(broadcast_model=True)
    with pytest.raises(ConfigError, match="one architecture"):
        type(make_engine(cfg, MemoryStore()))(
            cfg, build_strategy(cfg, fleet), MemoryStore(), groups
        )


def test_each_device_is_its_own_registry_record_and_a_resume_knows_them_all() -> None:
    store = MemoryStore()
    engine, fleet, _ = start(store)

    # One record per device (registering one writes O(1), whatever the fleet's size).
    assert store.keys("registry") == sorted(f"registry/{d}" for d in DEVICES)
    record = store.read_meta("registry/dev-b")
    assert record is not None and record["architecture"] == "lenet5"
    resumed = make_engine(engine.config, store, fleet=fleet)
    resumed.start(3.0)
    assert len(resumed.registry) == len(DEVICES)
    assert all(resumed.registry.get(d) == engine.registry.get(d) for d in DEVICES)
