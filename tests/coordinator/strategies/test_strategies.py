"""FedKF and FedGen on the server: downlink sets, uploads, consent, generator state."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.config import TrainingSettings
from coordinator.errors import ConfigError
from coordinator.runtime import build_models
from coordinator.store import MemoryStore
from coordinator.strategies.fedgen import label_prior
from coordinator.strategies.registry import build_strategy
from models import state_arrays
from protocol.deltas import decode_sets
from protocol.messages import Ack, ModelPayload, ReasonCode, RoundTask
from tests.coordinator.helpers import (
    GROUP,
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


def acks(actions: list) -> list[Ack]:
    return [a.message.body for a in published(actions, "ack")]


def model_sets(actions: list, device: str) -> dict[str, dict[str, np.ndarray]]:
    for action in published(actions, "model"):
        if action.topic.split("/")[3] == device:
            body = action.message.body
            assert isinstance(body, ModelPayload)
            return decode_sets(body.sets)
    raise AssertionError(f"no model message for {device}")


def start(strategy: str, devices: int = 2, consent: bool = True, **overrides):
    cfg = config(strategy=strategy, min_devices=devices, **overrides)
    engine = make_engine(cfg, MemoryStore())
    engine.start(0.0)
    actions: list = []
    for i in range(devices):
        msg = hello(engine, f"dev-{i}", samples=100, share_label_counts=consent)
        actions = engine.handle(received(msg, 1.0))
    return engine, actions


# -- FedKF ------------------------------------------------------------------------------


def test_fedkf_dual_sends_aca_as_student_and_oca_as_teacher() -> None:
    engine, actions = start("fedkf", rounds=3, participation=0.5)
    first = tasks_by_device(actions)
    (device,) = first
    w = model_sets(actions, device)["student"]
    after = engine.handle(received(update(device, 1, shifted(w, 1.0), task=first[device]), 2.0))
    tasks = tasks_by_device(after)
    (nxt,) = tasks
    sets = model_sets(after, nxt)
    assert sorted(sets) == ["student", "teacher"]
    body = tasks[nxt].body
    assert isinstance(body, RoundTask) and body.payloads == ("student", "teacher")
    # one device in the cache and in the round: ACA == OCA == its weights
    for name, value in shifted(w, 1.0).items():
        np.testing.assert_allclose(sets["student"][name], value, rtol=1e-6)
        np.testing.assert_allclose(sets["teacher"][name], value, rtol=1e-6)
    hyper = body.hyperparameters
    assert hyper["gamma"] == 1.0 and hyper["lambda1"] == 0.1 and hyper["lambda2"] == 0.1
    assert hyper["local_epochs"] == 10 and hyper["batch_size"] == 64  # the paper's defaults


def test_fedkf_teacher_is_the_oca_not_the_aca() -> None:
    engine, actions = start("fedkf", devices=2, rounds=3, participation=0.5, seed=2)
    (a,) = tasks_by_device(actions)
    w0 = model_sets(actions, a)["student"]
    actions = engine.handle(
        received(update(a, 1, shifted(w0, 1.0), task=tasks_by_device(actions)[a]), 2.0)
    )
    (b,) = tasks_by_device(actions)
    assert b != a  # seed 2 selects dev-0, then dev-1
    actions = engine.handle(
        received(update(b, 2, shifted(w0, 3.0), samples=100, task=tasks_by_device(actions)[b]), 3.0)
    )
    (c,) = tasks_by_device(actions)
    sets = model_sets(actions, c)
    name = next(iter(w0))
    np.testing.assert_allclose(sets["student"][name], w0[name] + 3.0, rtol=1e-5)  # ACA: round 2
    np.testing.assert_allclose(sets["teacher"][name], w0[name] + 2.0, rtol=1e-5)  # OCA: both


def test_fedkf_single_sends_the_student_only() -> None:
    _, actions = start("fedkf", downlink="single")
    for device in tasks_by_device(actions):
        assert sorted(model_sets(actions, device)) == ["student"]


def test_final_model_defaults_to_oca_where_kept_and_refuses_oca_without_cache() -> None:
    assert build_strategy(config(strategy="fedkf"), templates(config())).final_model == "oca"
    cfg = config(strategy="fedkf", final_model="aca")
    assert build_strategy(cfg, templates(cfg)).final_model == "aca"
    assert build_strategy(config(), templates(config())).final_model == "aca"
    with pytest.raises(ConfigError, match="keeps no OCA"):
        build_strategy(config(final_model="oca"), templates(config()))


def test_training_defaults_come_from_the_strategy_unless_set() -> None:
    fedgen = build_strategy(config(strategy="fedgen"), templates(config()))
    assert fedgen.training.local_steps == 20 and fedgen.training.batch_size == 32
    cfg = config(strategy="fedgen", training=TrainingSettings(local_epochs=2))
    chosen = build_strategy(cfg, templates(cfg))
    assert chosen.training.local_epochs == 2 and chosen.training.local_steps == 0


# -- FedGen -----------------------------------------------------------------------------


def test_fedgen_refuses_a_device_without_label_count_consent() -> None:
    engine, actions = start("fedgen", devices=1, consent=False)

    (ack,) = acks(actions)
    assert not ack.accepted and ack.reason == ReasonCode.CONSENT_REQUIRED
    assert "label counts" in ack.detail and "--share-label-counts" in ack.detail
    assert "dev-0" not in engine.registry and not tasks_by_device(actions)


def test_fedgen_head_sharing_sends_and_takes_only_the_head() -> None:
    engine, actions = start("fedgen", devices=2, sharing="head", participation=1.0)
    tasks = tasks_by_device(actions)
    (template,) = build_models(engine.config).values()
    full = state_arrays(template)
    head = state_arrays(template, "head")
    for device, task in tasks.items():
        sets = model_sets(actions, device)
        assert sorted(sets) == ["head"]  # no generator before the first aggregation
        assert sorted(sets["head"]) == sorted(head)
        body = task.body
        assert isinstance(body, RoundTask)
        assert body.uplink.subset == "head" and body.uplink.label_counts

    dev0, dev1 = sorted(tasks)
    counts = (60, 40) + (0,) * (template.num_classes - 2)
    wrong = engine.handle(
        received(update(dev0, 1, full, task=tasks[dev0], label_counts=counts), 2.0)
    )
    assert acks(wrong)[0].reason == ReasonCode.FINGERPRINT_MISMATCH  # features never go up
    missing = engine.handle(received(update(dev0, 1, head, task=tasks[dev0]), 2.0))
    assert acks(missing)[0].reason == ReasonCode.CONSENT_REQUIRED
    bad_sum = (50,) + (0,) * (template.num_classes - 1)
    malformed = engine.handle(
        received(update(dev0, 1, head, task=tasks[dev0], label_counts=bad_sum), 2.0)
    )
    assert acks(malformed)[0].reason == ReasonCode.MALFORMED

    engine.handle(
        received(update(dev0, 1, shifted(head, 1.0), task=tasks[dev0], label_counts=counts), 2.0)
    )
    other = (0,) * (template.num_classes - 2) + (30, 70)
    closed = engine.handle(
        received(update(dev1, 1, shifted(head, 3.0), task=tasks[dev1], label_counts=other), 3.0)
    )
    next_tasks = tasks_by_device(closed)
    sets = model_sets(closed, next(iter(next_tasks)))
    assert sorted(sets) == ["generator", "head", "prior"]
    assert not any(name.startswith("features.") for s in sets.values() for name in s)
    for name, value in head.items():
        np.testing.assert_allclose(sets["head"][name], value + 2.0, rtol=1e-5)
    np.testing.assert_allclose(
        sets["prior"]["label_prior"], label_prior(np.array([counts, other])), rtol=1e-6
    )
    aca = engine.models()[GROUP]["aca"]
    for name in full:
        if name.startswith("features."):
            np.testing.assert_array_equal(aca[name], full[name])  # the server never had them
    hyper = next_tasks[next(iter(next_tasks))].body.hyperparameters
    assert hyper["generative_alpha"] == pytest.approx(10.0 * 0.98)


def test_fedgen_generator_survives_a_coordinator_restart() -> None:
    cfg = config(strategy="fedgen", min_devices=1, participation=1.0, rounds=3)
    store = MemoryStore()
    engine = make_engine(cfg, store)
    engine.start(0.0)
    actions = engine.handle(
        received(hello(engine, "dev-0", samples=100, share_label_counts=True), 1.0)
    )
    task = tasks_by_device(actions)["dev-0"]
    w = model_sets(actions, "dev-0")["global"]
    counts = (100,) + (0,) * 9
    closed = engine.handle(received(update("dev-0", 1, w, task=task, label_counts=counts), 2.0))
    generator = model_sets(closed, "dev-0")["generator"]

    resumed = make_engine(cfg, store)
    resumed.start(10.0)
    again = resumed.handle(
        received(hello(resumed, "dev-0", samples=100, share_label_counts=True), 11.0)
    )
    sets = model_sets(again, "dev-0")
    assert sorted(sets) == ["generator", "global", "prior"]
    for name, value in generator.items():
        np.testing.assert_array_equal(sets["generator"][name], value)
