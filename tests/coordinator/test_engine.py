"""The round state machine, driven by hand (no broker)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from coordinator.actions import Finished, Publish, RoundClosed, RoundStarted
from coordinator.events import Tick
from coordinator.store import MemoryStore
from coordinator.strategies.fedavg import FedAvg
from protocol.messages import Ack, CoordinatorStatus, Message, ModelPayload, ReasonCode, RoundTask
from protocol.tensors import Precision
from tests.coordinator.helpers import (
    FLEET,
    GROUP,
    config,
    hello,
    make_engine,
    published,
    received,
    shifted,
    status,
    tasks_by_device,
    templates,
    update,
)


def acks(actions: list) -> list[Ack]:
    return [a.message.body for a in published(actions, "ack")]


def only(items: list):
    assert len(items) == 1, items
    return items[0]


def started(devices: int, **overrides):
    """An engine whose round 1 started with ``devices`` registered, all online."""
    cfg = config(min_devices=devices, **overrides)
    store = MemoryStore()
    engine = make_engine(cfg, store)
    engine.start(0.0)
    actions: list = []
    for i in range(devices):
        actions = engine.handle(received(hello(engine, f"dev-{i}", samples=100 * (i + 1)), 1.0))
    return engine, store, actions


def global_weights(actions: list) -> dict[str, np.ndarray]:
    model = published(actions, "model")[0].message.body
    assert isinstance(model, ModelPayload)
    return model.sets["global"].to_arrays()


def test_start_announces_the_coordinator_retained() -> None:
    engine = make_engine(config(), MemoryStore())

    action = only(engine.start(0.0))

    assert isinstance(action, Publish) and action.retain
    assert action.topic == f"fl/{FLEET}/coordinator/status"
    assert isinstance(action.message.body, CoordinatorStatus)
    assert action.message.body.state == "starting"


def test_waits_for_min_devices_then_sends_model_and_task_to_each_selected() -> None:
    engine = make_engine(config(min_devices=2), MemoryStore())
    engine.start(0.0)

    first = engine.handle(received(hello(engine, "dev-0"), 1.0))
    second = engine.handle(received(hello(engine, "dev-1"), 2.0))

    assert only(acks(first)).accepted and not tasks_by_device(first)
    tasks = tasks_by_device(second)
    assert sorted(tasks) == ["dev-0", "dev-1"]
    models = {a.message.message_id for a in published(second, "model")}
    for task in tasks.values():
        body = task.body
        assert isinstance(body, RoundTask) and body.strategy == "fedavg"
        assert body.model_message in models and body.payloads == ("global",)
        assert body.deadline == pytest.approx(2.0 + 60.0)
        assert task.round == 1
    assert any(isinstance(a, RoundStarted) for a in second)


def test_selects_participation_share_of_registered_devices_deterministically() -> None:
    picks = []
    for _ in range(2):
        _, _, actions = started(6, participation=0.5, seed=3)
        picks.append(sorted(tasks_by_device(actions)))

    assert len(picks[0]) == 3
    assert picks[0] == picks[1]


def test_offline_devices_are_not_selected() -> None:
    engine = make_engine(config(min_devices=2, participation=1.0), MemoryStore())
    engine.start(0.0)
    engine.handle(received(hello(engine, "dev-0"), 1.0))
    engine.handle(received(status("dev-0", "offline"), 1.5))

    actions = engine.handle(received(hello(engine, "dev-1"), 2.0))
    assert not tasks_by_device(actions)  # only one online, two needed
    actions = engine.handle(received(hello(engine, "dev-2"), 3.0))

    assert sorted(tasks_by_device(actions)) == ["dev-1", "dev-2"]


def test_an_update_brings_a_device_marked_offline_back_online() -> None:
    # Prepare: round 1 with two devices; dev-0's offline status taken while it trains
    # (a stale one replayed, or a broker that lost its connection for a moment)
    engine, _, actions = started(2, participation=1.0)
    w = global_weights(actions)
    tasks = tasks_by_device(actions)
    engine.handle(received(status("dev-0", "offline"), 2.0))
    assert engine.registry.online_count() == 1
    # Execute: its update arrives
    engine.handle(received(update("dev-0", 1, shifted(w, 1.0), 100, tasks["dev-0"]), 3.0))
    # Assert: it is online again, so the next round selects it
    assert engine.registry.online() == ["dev-0", "dev-1"]
    closing = engine.handle(received(update("dev-1", 1, shifted(w, 1.0), 200, tasks["dev-1"]), 4.0))
    assert sorted(tasks_by_device(closing)) == ["dev-0", "dev-1"]


def test_fedavg_round_is_the_sample_weighted_average() -> None:
    engine, _, actions = started(2)
    w = global_weights(actions)
    tasks = tasks_by_device(actions)

    engine.handle(received(update("dev-0", 1, shifted(w, 1.0), 100, tasks["dev-0"]), 5.0))
    closing = engine.handle(received(update("dev-1", 1, shifted(w, 4.0), 200, tasks["dev-1"]), 6.0))

    closed = only([a for a in closing if isinstance(a, RoundClosed)])
    assert closed.round == 1 and closed.on_time == 2 and closed.selected == 2
    expected = shifted(w, (100 * 1.0 + 200 * 4.0) / 300)
    for name, value in closed.models[GROUP]["aca"].items():
        np.testing.assert_allclose(value, expected[name], atol=1e-5)
    assert engine.round == 2
    assert tasks_by_device(closing)  # round 2 started at once


def test_deadline_closes_round_with_the_on_time_updates_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine, _, actions = started(2)
    w = global_weights(actions)
    engine.handle(received(update("dev-0", 1, shifted(w, 2.0), 100), 5.0))

    assert engine.handle(Tick(30.0)) == []
    with caplog.at_level(logging.WARNING, logger="coordinator.engine"):
        closing = engine.handle(Tick(62.0))
    late = engine.handle(received(update("dev-1", 1, shifted(w, 9.0), 200), 63.0))

    closed = only([a for a in closing if isinstance(a, RoundClosed)])
    assert closed.on_time == 1
    np.testing.assert_allclose(
        closed.models[GROUP]["aca"]["head.bias"], shifted(w, 2.0)["head.bias"], atol=1e-6
    )
    ack = only(acks(late))
    assert not ack.accepted and ack.reason is ReasonCode.LATE
    assert "round 1 deadline passed; missing 1 of 2 devices: dev-1" in caplog.text


def test_a_missed_deadline_names_ten_missing_devices_and_counts_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine, _, _ = started(13)

    with caplog.at_level(logging.WARNING, logger="coordinator.engine"):
        engine.handle(Tick(100.0))

    (line,) = [r.getMessage() for r in caplog.records if "deadline passed" in r.message]
    assert line.startswith("round 1 deadline passed; missing 13 of 13 devices: dev-")
    assert line.endswith(" and 3 more") and line.count("dev-") == 10


def test_round_without_updates_keeps_the_model() -> None:
    engine, _, actions = started(1)
    w = global_weights(actions)

    closing = engine.handle(Tick(100.0))

    closed = only([a for a in closing if isinstance(a, RoundClosed)])
    assert closed.on_time == 0
    for name, value in closed.models[GROUP]["aca"].items():
        np.testing.assert_array_equal(value, w[name])


def test_late_update_goes_into_the_oca_cache_but_not_the_round() -> None:
    engine, _, actions = started(2, strategy="fedavg_oca")
    w = global_weights(actions)
    engine.handle(received(update("dev-0", 1, shifted(w, 1.0), 100), 5.0))
    engine.handle(Tick(62.0))

    late = engine.handle(received(update("dev-1", 1, shifted(w, 3.0), 200), 63.0))

    ack = only(acks(late))
    assert ack.accepted and ack.reason is ReasonCode.LATE
    models = engine.models()[GROUP]
    np.testing.assert_allclose(models["aca"]["head.bias"], shifted(w, 1.0)["head.bias"], atol=1e-6)
    np.testing.assert_allclose(
        models["oca"]["head.bias"], shifted(w, (100 + 600) / 300)["head.bias"], atol=1e-5
    )


def test_duplicate_update_is_acknowledged_and_changes_nothing() -> None:
    engine, store, actions = started(2)
    w = global_weights(actions)
    message = update("dev-0", 1, shifted(w, 1.0), 100)
    engine.handle(received(message, 5.0))
    before = store.snapshot()

    again = engine.handle(received(message, 6.0))

    ack = only(acks(again))
    assert ack.accepted and ack.reason is ReasonCode.DUPLICATE
    assert store.keys() == before.keys()
    assert store.read("updates/dev-0/r000001").meta == before.read("updates/dev-0/r000001").meta


def test_a_resend_of_an_update_the_closed_round_counted_is_a_duplicate_not_late(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare: round 1 closes with dev-0's update only (dev-1 misses the deadline); the
    # coordinator then crashes and resumes, so dev-0 never saw its ack
    engine, store, actions = started(2)
    w = global_weights(actions)
    counted = update("dev-0", 1, shifted(w, 1.0), 100)
    engine.handle(received(counted, 5.0))
    engine.handle(Tick(62.0))
    resumed = make_engine(engine.config, store)
    resumed.start(63.0)
    before, models = store.snapshot(), resumed.models()

    # Execute: dev-0 sends its update again; dev-1 sends one for the closed round; dev-0's
    # other update of round 1 (a replay of a copy the attacker made it send) is no resend
    caplog.set_level(logging.DEBUG, logger="coordinator.engine")
    again = only(acks(resumed.handle(received(counted, 64.0))))
    late = only(acks(resumed.handle(received(update("dev-1", 1, shifted(w, 2.0), 200), 64.0))))
    other = only(acks(resumed.handle(received(update("dev-0", 1, shifted(w, 3.0), 100), 64.0))))

    # Assert: the first is acknowledged as counted, the second refused; nothing changed
    assert again.accepted and again.reason is ReasonCode.DUPLICATE
    assert again.ref == counted.message_id
    assert any(  # every input refused or ignored leaves a line
        "a duplicate, counted in round 1" in r.getMessage() for r in caplog.records
    )
    assert not late.accepted and late.reason is ReasonCode.LATE
    assert not other.accepted and other.reason is ReasonCode.LATE
    assert store.keys() == before.keys()
    for name, value in resumed.models()[GROUP]["aca"].items():
        np.testing.assert_array_equal(value, models[GROUP]["aca"][name])


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (
            lambda w: {k: v for k, v in w.items() if k != "head.bias"},
            ReasonCode.FINGERPRINT_MISMATCH,
        ),
        (lambda w: {**w, "extra": np.zeros(2, np.float32)}, ReasonCode.FINGERPRINT_MISMATCH),
        (lambda w: {**w, "head.bias": np.zeros(3, np.float32)}, ReasonCode.SHAPE_MISMATCH),
        (lambda w: {**w, "head.bias": np.full_like(w["head.bias"], np.nan)}, ReasonCode.NON_FINITE),
        (lambda w: {**w, "head.bias": np.full_like(w["head.bias"], np.inf)}, ReasonCode.NON_FINITE),
        # a compromised key's integer tensors: right names and shapes, and they once passed
        # the norm screen (which skipped them) and wrecked the model
        (lambda w: {k: np.rint(v * 1e4).astype(np.int64) for k, v in w.items()}, "dtype"),
        (lambda w: {**w, "head.bias": w["head.bias"].astype(np.int32)}, "dtype"),
        (lambda w: {**w, "head.bias": w["head.bias"] > 0}, "dtype"),
    ],
)
def test_invalid_weights_are_rejected_without_state_change(mutate, reason) -> None:
    reason = ReasonCode.DTYPE_MISMATCH if reason == "dtype" else reason
    engine, store, actions = started(2)
    w = global_weights(actions)
    before = store.keys()

    result = engine.handle(received(update("dev-0", 1, mutate(w), 100), 5.0))

    ack = only(acks(result))
    assert not ack.accepted and ack.reason is reason
    marks = ["screened/r000001/dev-0"] if reason is ReasonCode.NON_FINITE else []
    assert store.keys() == sorted([*before, *marks])  # a value rejection marks the device only


def test_rejections_by_round_sender_and_samples() -> None:
    engine, store, actions = started(2, participation=0.5)
    w = global_weights(actions)
    chosen = only(list(tasks_by_device(actions)))
    other = "dev-1" if chosen == "dev-0" else "dev-0"
    before = store.keys()
    cases = [
        (update(other, 1, w, 100), ReasonCode.NOT_SELECTED),
        (update(chosen, 2, w, 100), ReasonCode.WRONG_ROUND),
        (update("dev-9", 1, w, 100), ReasonCode.UNKNOWN_DEVICE),
        (update(chosen, 1, w, 10_000), ReasonCode.MALFORMED),  # more than announced
    ]
    for message, reason in cases:
        ack = only(acks(engine.handle(received(message, 5.0))))
        assert not ack.accepted and ack.reason is reason, (message.sender, reason)
    assert store.keys() == before


def test_foreign_sender_or_fleet_is_dropped_silently() -> None:
    engine, store, actions = started(2)
    w = global_weights(actions)
    before = store.snapshot()
    spoofed = update("dev-0", 1, w, 100)
    foreign = Message(fleet="other", sender="dev-0", round=1, body=spoofed.body)

    assert engine.handle(received(spoofed, 5.0, topic_device="dev-1")) == []
    assert engine.handle(received(foreign, 5.0)) == []
    assert store.keys() == before.keys()


def test_hello_with_another_architecture_is_refused() -> None:
    engine = make_engine(config(), MemoryStore())
    engine.start(0.0)

    result = engine.handle(received(hello(engine, "dev-0", fingerprint="0" * 16), 1.0))

    ack = only(acks(result))
    assert not ack.accepted and ack.reason is ReasonCode.FINGERPRINT_MISMATCH
    assert "dev-0" not in engine.registry and not tasks_by_device(result)


def test_fedprox_sends_mu_and_devices_get_distinct_seeds() -> None:
    _, _, actions = started(2, strategy="fedprox")

    tasks = [t.body for t in tasks_by_device(actions).values()]

    assert all(t.hyperparameters["mu"] == pytest.approx(0.01) for t in tasks)
    assert tasks[0].hyperparameters["seed"] != tasks[1].hyperparameters["seed"]


def test_run_finishes_after_the_last_round() -> None:
    engine, _, actions = started(1, rounds=2)
    for round_number in (1, 2):
        w = global_weights(actions)
        actions = engine.handle(
            received(update("dev-0", round_number, shifted(w, 1.0), 100), 5.0 * round_number)
        )

    finished = only([a for a in actions if isinstance(a, Finished)])
    assert engine.finished and set(finished.models[GROUP]) == {"aca"}
    statuses = [
        a.message.body.state
        for a in published(actions)
        if isinstance(a.message.body, CoordinatorStatus)
    ]
    assert statuses == ["finished"]
    late = engine.handle(received(update("dev-0", 3, w, 100), 20.0))
    assert only(acks(late)).reason is ReasonCode.WRONG_ROUND


def test_oca_incremental_sum_equals_direct_average_over_many_rounds() -> None:
    rng = np.random.default_rng(0)
    engine, _, actions = started(5, strategy="fedavg_oca", participation=0.4, rounds=12)
    latest: dict[str, tuple[dict[str, np.ndarray], int]] = {}
    shapes = {k: v.shape for k, v in global_weights(actions).items()}
    now = 2.0
    for round_number in range(1, 13):
        for device_id in tasks_by_device(actions):
            weights = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
            samples = int(rng.integers(1, 100))
            latest[device_id] = (weights, samples)
            now += 1.0
            result = engine.handle(received(update(device_id, round_number, weights, samples), now))
            if any(isinstance(a, RoundClosed) for a in result):
                actions = result

    oca = engine.models()[GROUP]["oca"]
    total = sum(n for _, n in latest.values())
    for name in shapes:
        direct = sum(w[name].astype(np.float64) * n for w, n in latest.values()) / total
        np.testing.assert_allclose(oca[name], direct, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_broadcast_model_publishes_the_final_model_after_each_round(precision: str) -> None:
    engine = make_engine(
        config(min_devices=2, broadcast_model=True, downlink_precision=precision), MemoryStore()
    )
    engine.start(0.0)
    speaks = (Precision.FP32, Precision(precision))
    for i in range(2):
        hi = hello(engine, f"dev-{i}", samples=100 * (i + 1), precisions=speaks)
        actions = engine.handle(received(hi, 1.0))
    assert not [a for a in published(actions) if "broadcast" in a.topic]
    w = global_weights(actions)
    tasks = tasks_by_device(actions)
    engine.handle(received(update("dev-0", 1, shifted(w, 1.0), 100, tasks["dev-0"]), 5.0))
    closing = engine.handle(received(update("dev-1", 1, shifted(w, 4.0), 200, tasks["dev-1"]), 6.0))
    closed = only([a for a in closing if isinstance(a, RoundClosed)])
    broadcast = only([a for a in closing if a.__class__ is Publish and "broadcast" in a.topic])
    assert broadcast.topic == f"fl/{FLEET}/broadcast/model"
    assert broadcast.latest and not broadcast.retain
    assert broadcast.message.round == 1
    body = broadcast.message.body
    assert isinstance(body, ModelPayload) and list(body.sets) == ["global"]
    sent = body.sets["global"]
    encodings = {t.encoding.value for t in sent.tensors}
    assert sent.mode == "full"
    assert encodings == {"fp32"} if precision == "fp32" else "int8_ch" in encodings
    arrays = sent.to_arrays()
    assert arrays.keys() == closed.models[GROUP]["aca"].keys()
    for name, value in closed.models[GROUP]["aca"].items():
        np.testing.assert_allclose(arrays[name], value, atol=0 if precision == "fp32" else 0.05)


def test_no_broadcast_unless_asked_and_never_with_head_sharing() -> None:
    engine, _, actions = started(1)
    w = global_weights(actions)
    task = tasks_by_device(actions)["dev-0"]
    closing = engine.handle(received(update("dev-0", 1, shifted(w, 1.0), 100, task), 5.0))
    assert not [a for a in published(closing) if "broadcast" in a.topic]
    with pytest.raises(ValueError, match="broadcast_model needs sharing full"):
        config(strategy="fedgen", sharing="head", broadcast_model=True)


class OwnModel(FedAvg):
    """A strategy whose devices start from a model of their own (as DENSE's will)."""

    def downlink(self, models):
        return {}


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_a_strategy_without_a_downlink_sends_the_task_alone(precision: str) -> None:
    cfg = config(min_devices=1, uplink_precision=precision)
    engine = make_engine(cfg, MemoryStore(), strategy=OwnModel(cfg, templates(cfg)))
    engine.start(0.0)

    actions = engine.handle(
        received(hello(engine, "dev-0", precisions=(Precision.FP32, Precision.INT8)), 1.0)
    )

    assert not published(actions, "model")
    task = only(list(tasks_by_device(actions).values())).body
    assert isinstance(task, RoundTask)
    assert task.payloads == () and task.model_message is None
    assert (task.uplink.mode, task.uplink.precision.value) == ("full", precision)


def test_a_silent_selected_device_is_dropped_after_the_grace_once_the_rest_answered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare: three devices selected; two answer at t=5; dev-2 never sends anything
    engine, _, actions = started(3, silent_grace_s=30.0, round_timeout_s=600.0)
    w = global_weights(actions)
    for device_id in ("dev-0", "dev-1"):
        engine.handle(received(update(device_id, 1, shifted(w, 0.1), 100), 5.0))
    caplog.set_level(logging.WARNING, logger="coordinator.engine")
    # Execute, Assert: not before the grace; at it, the round closes without dev-2
    assert engine.handle(Tick(34.9)) == [] and engine.round == 1
    engine.handle(Tick(35.0))
    assert engine.round == 2
    assert any("dropped 1 silent of 3 selected" in r.getMessage() for r in caplog.records)
    assert "dev-2" in caplog.text


def test_a_device_heard_from_during_the_round_is_waited_for_to_the_deadline() -> None:
    # Prepare: as above, but dev-2 said it is training (a slow device, not a dead one)
    engine, _, actions = started(3, silent_grace_s=30.0, round_timeout_s=600.0)
    w = global_weights(actions)
    engine.handle(received(status("dev-2", "training"), 2.0))
    for device_id in ("dev-0", "dev-1"):
        engine.handle(received(update(device_id, 1, shifted(w, 0.1), 100), 5.0))
    # Execute, Assert: the grace passes, the round stays open; the deadline closes it
    engine.handle(Tick(100.0))
    assert engine.round == 1
    engine.handle(Tick(602.0))
    assert engine.round == 2


def test_a_device_gone_offline_mid_round_is_dropped_after_the_grace() -> None:
    # Prepare: dev-2 said it trains, then its last will said it is offline (killed)
    engine, _, actions = started(3, silent_grace_s=30.0, round_timeout_s=600.0)
    w = global_weights(actions)
    engine.handle(received(status("dev-2", "training"), 2.0))
    engine.handle(received(status("dev-2", "offline"), 3.0))
    for device_id in ("dev-0", "dev-1"):
        engine.handle(received(update(device_id, 1, shifted(w, 0.1), 100), 5.0))
    # Execute, Assert: the round does not wait for it to the deadline
    engine.handle(Tick(34.9))
    assert engine.round == 1
    engine.handle(Tick(35.0))
    assert engine.round == 2


def test_a_device_back_online_mid_round_is_waited_for_again() -> None:
    engine, _, actions = started(3, silent_grace_s=30.0, round_timeout_s=600.0)
    w = global_weights(actions)
    engine.handle(received(status("dev-2", "offline"), 2.0))
    engine.handle(received(status("dev-2", "training"), 3.0))  # it reconnected
    for device_id in ("dev-0", "dev-1"):
        engine.handle(received(update(device_id, 1, shifted(w, 0.1), 100), 5.0))
    engine.handle(Tick(100.0))
    assert engine.round == 1


def test_without_a_grace_a_silent_device_holds_the_round_to_its_deadline() -> None:
    engine, _, actions = started(2, silent_grace_s=0.0, round_timeout_s=600.0)
    w = global_weights(actions)
    engine.handle(received(update("dev-0", 1, shifted(w, 0.1), 100), 5.0))
    engine.handle(Tick(500.0))
    assert engine.round == 1


def test_the_log_says_why_no_round_starts_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    engine = make_engine(config(min_devices=3), MemoryStore())
    engine.start(0.0)
    caplog.set_level(logging.INFO, logger="coordinator.engine")
    engine.handle(received(hello(engine, "dev-0"), 1.0))
    for t in (2.0, 30.0, 61.5, 62.0):
        engine.handle(Tick(t))
    lines = [r.getMessage() for r in caplog.records if "waits for 3 online" in r.getMessage()]
    assert len(lines) == 2 and "1 of 1 registered online" in lines[0]
