"""Quantized transfers through the round engine, with the device side's real
TransferState: per-device precisions, uplink deltas, downlink deltas, teacher budget."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from coordinator.actions import AggregateRequested
from coordinator.store import MemoryStore
from edge_client.train.transfer import TransferState
from protocol.arrays import content_fingerprint
from protocol.codec import Codec
from protocol.messages import Ack, Message, ModelPayload, ReasonCode, RoundTask, Update
from protocol.tensors import Encoding, Precision
from tests.coordinator.helpers import (
    FLEET,
    GROUP,
    config,
    hello,
    make_engine,
    published,
    received,
    shifted,
    tasks_by_device,
)

ALL = tuple(Precision)


def model_message(actions: list, device: str) -> Message:
    for action in published(actions, "model"):
        if action.topic.split("/")[3] == device:
            return action.message
    raise AssertionError(f"no model message for {device}")


def acks(actions: list) -> list[Ack]:
    return [a.message.body for a in published(actions, "ack")]


class Device:
    """A device at the message level: decodes with a real TransferState, 'trains' by a
    fixed shift, uploads as the task asks."""

    def __init__(self, device_id: str) -> None:
        self.id = device_id
        self.transfer = TransferState()
        self.received: dict[str, dict[str, np.ndarray]] = {}

    def take(self, actions: list) -> RoundTask:
        task = tasks_by_device(actions)[self.id]
        body = task.body
        assert isinstance(body, RoundTask)
        payload = model_message(actions, self.id).body
        assert isinstance(payload, ModelPayload)
        self.task_message = task
        self.received = self.transfer.decode(payload.sets, body.payloads)
        return body

    def answer(self, round_number: int, shift: float) -> tuple[Message, dict[str, np.ndarray]]:
        body = self.task_message.body
        assert isinstance(body, RoundTask)
        model = self.received[body.payloads[0]]
        rng = np.random.default_rng([round_number, int(self.id[1:])])
        trained = {  # a shift plus per-element noise: what local training looks like
            k: (v + shift + shift * rng.laplace(size=v.shape)).astype(v.dtype)
            for k, v in model.items()
        }
        weights = self.transfer.encode_upload(trained, body.uplink, self.received)
        update = Update(
            task_message=self.task_message.message_id, num_samples=100, sets={"weights": weights}
        )
        return Message(fleet=FLEET, sender=self.id, round=round_number, body=update), trained


def start(devices: dict[str, dict[str, Any]], **overrides: Any):
    cfg = config(min_devices=len(devices), **overrides)
    engine = make_engine(cfg, MemoryStore())
    engine.start(0.0)
    actions: list = []
    for device_id, fields in devices.items():
        actions = engine.handle(received(hello(engine, device_id, **fields), 1.0))
    return engine, actions


def test_a_lossy_device_gets_a_full_model_then_deltas_against_what_it_holds() -> None:
    engine, actions = start(
        {"d0": {"precisions": ALL}}, downlink_precision="int8", uplink_precision="int8"
    )
    device = Device("d0")
    task = device.take(actions)
    assert task.downlink_precision is Precision.INT8
    assert (task.uplink.precision, task.uplink.mode, task.uplink.base) == (
        "int8",
        "delta",
        "global",
    )
    first = model_message(actions, "d0").body.sets["global"]
    assert first.mode == "full"
    assert {t.encoding for t in first if len(t.shape) >= 2} == {Encoding.INT8_CH}
    held = device.received["global"]

    message, trained = device.answer(1, 0.01)
    after = engine.handle(received(message, 2.0))

    assert acks(after)[0].accepted
    aca = engine.models()[GROUP]["aca"]
    for name, value in trained.items():  # the coordinator rebuilt the update in fp32
        assert aca[name].dtype == np.float32
        step = np.abs(value - held[name]).max() / 127
        np.testing.assert_allclose(aca[name], value, atol=step / 2 + 1e-6)
    second = model_message(after, "d0").body.sets["global"]
    assert second.mode == "delta" and second.base == content_fingerprint(held)
    device.take(after)
    for name, value in aca.items():  # the device now holds the new model, closely
        scale = np.abs(value - held[name]).max()
        np.testing.assert_allclose(device.received["global"][name], value, atol=scale / 127 + 1e-6)


def test_an_update_against_an_unknown_base_is_rejected_and_changes_nothing() -> None:
    engine, actions = start({"d0": {"precisions": ALL}}, uplink_precision="int4")
    device = Device("d0")
    device.take(actions)
    device.received["global"] = shifted(device.received["global"], 0.5)  # not what was sent
    message, _ = device.answer(1, 0.01)
    before = engine.models()[GROUP]["aca"]

    after = engine.handle(received(message, 2.0))

    (ack,) = acks(after)
    assert not ack.accepted and ack.reason is ReasonCode.UNKNOWN_BASE
    assert engine.round == 1
    for name, value in engine.models()[GROUP]["aca"].items():
        np.testing.assert_array_equal(value, before[name])


def test_a_device_that_announces_another_base_gets_a_full_model() -> None:
    engine, actions = start(
        {"d0": {"precisions": ALL}}, downlink_precision="int4", participation=1.0
    )
    device = Device("d0")
    device.take(actions)
    message, _ = device.answer(1, 0.01)
    after = engine.handle(received(message, 2.0))
    assert model_message(after, "d0").body.sets["global"].mode == "delta"

    # the device restarted without its state: its hello holds no base; the task is resent
    again = engine.handle(received(hello(engine, "d0", precisions=ALL), 3.0))

    assert model_message(again, "d0").body.sets["global"].mode == "full"


@pytest.mark.parametrize("held", ["decoded", "previous"])
def test_a_device_that_says_hello_mid_round_keeps_its_delta_base(held: str) -> None:
    # Prepare: round 2 of an int8 fleet: the task carries a delta against what the device
    # holds, and its upload is a delta against the model it was sent
    engine, actions = start(
        {"d0": {"precisions": ALL}, "d1": {"precisions": ALL}},
        downlink_precision="int8",
        uplink_precision="int8",
        participation=1.0,
    )
    devices = {d: Device(d) for d in ("d0", "d1")}
    for device in devices.values():
        device.take(actions)
    previous = content_fingerprint(devices["d0"].received["global"])
    after = []
    for i, device in enumerate(devices.values()):
        message, _ = device.answer(1, 0.01)
        after = engine.handle(received(message, 2.0 + i))
    assert engine.round == 2
    d0 = devices["d0"]
    d0.take(after)
    first = model_message(after, "d0").body.sets["global"]
    decoded = content_fingerprint(d0.received["global"])
    # Execute: it reconnects (or saw a coordinator status) and says hello during round 2,
    # holding the model it decoded for its task, or, had it lost the task, the previous one
    fingerprint = decoded if held == "decoded" else previous
    again = engine.handle(received(hello(engine, "d0", precisions=ALL, held_base=fingerprint), 5.0))
    # Assert: the same task and model again, to the byte; its upload (a delta against the
    # model it decoded first) is accepted
    assert tasks_by_device(again)["d0"].message_id == d0.task_message.message_id
    resent = model_message(again, "d0").body.sets["global"]
    assert resent == first
    message, _ = d0.answer(2, 0.01)
    (ack,) = acks(engine.handle(received(message, 6.0)))
    assert ack.accepted, (ack.reason, ack.detail)


def test_precisions_follow_each_hello_and_qat_goes_to_int8_devices_only() -> None:
    _, actions = start(
        {
            "d0": {"precisions": ALL, "downlink_precision": "int8", "uplink_precision": "int8"},
            "d1": {"precisions": ALL, "downlink_precision": "fp16", "uplink_precision": "int4"},
            "d2": {"precisions": ALL},
        },
        training={"qat": True},
    )
    tasks = {d: m.body for d, m in tasks_by_device(actions).items()}

    links = {d: (t.downlink_precision.value, t.uplink.precision.value) for d, t in tasks.items()}
    assert links == {"d0": ("int8", "int8"), "d1": ("fp16", "int4"), "d2": ("fp32", "fp32")}
    assert tasks["d0"].hyperparameters.get("qat") is True
    assert "qat" not in tasks["d1"].hyperparameters and "qat" not in tasks["d2"].hyperparameters
    assert tasks["d2"].uplink.mode == "full"


def test_a_device_that_cannot_speak_the_fleets_precision_is_refused() -> None:
    engine = make_engine(config(downlink_precision="int8"), MemoryStore())
    engine.start(0.0)

    actions = engine.handle(received(hello(engine, "d0", precisions=("fp32",)), 1.0))

    (ack,) = acks(actions)
    assert not ack.accepted and ack.reason is ReasonCode.UNSUPPORTED_PRECISION
    assert "int8" in ack.detail and "d0" not in engine.registry


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8", "int4"])
def test_fedkf_dual_downlink_costs_at_most_1_3x_a_single_one(precision: str) -> None:
    devices = {f"d{i}": {"precisions": ALL} for i in range(4)}
    common = {"downlink_precision": precision, "participation": 0.5, "model": "lenet5", "rounds": 4}
    engine, actions = start(devices, strategy="fedkf", **common)
    fleet: dict[str, Device] = {}
    for round_number, shift in ((1, 0.02), (2, -0.03), (3, 0.01)):
        round_actions, actions = actions, []
        for device_id in tasks_by_device(round_actions):
            device = fleet.setdefault(device_id, Device(device_id))
            device.take(round_actions)
            message, _ = device.answer(round_number, shift * (1 + int(device_id[1:])))
            actions += engine.handle(received(message, 2.0 + round_number))
    codec = Codec()
    dual = [len(codec.encode(a.message)) for a in published(actions, "model")]
    sets = [a.message.body.sets for a in published(actions, "model")]
    assert all(s["teacher"].mode == "delta" and s["teacher"].base == "set:student" for s in sets)
    models = engine.models()["lenet5"]
    assert any(
        not np.allclose(models["aca"][k], models["oca"][k]) for k in models["aca"]
    )  # the teacher differs from the student

    _, single = start(devices, strategy="fedavg", **common)
    single_bytes = [len(codec.encode(a.message)) for a in published(single, "model")]
    assert max(dual) <= 1.3 * min(single_bytes)


@pytest.mark.parametrize("qat", [True, False])
def test_each_device_trains_and_is_aggregated_in_the_weight_format_it_runs(qat: bool) -> None:
    int8_link = {"precisions": ALL, "downlink_precision": "int8", "uplink_precision": "int8"}
    devices = {
        "d0": {"weight_format": "binary"},
        "d1": {"weight_format": "binary", **int8_link},
        "d2": {"weight_format": "int8"},
        "d3": int8_link,
        "d4": {},
    }
    engine = make_engine(
        config(min_devices=len(devices), training={"qat": qat}), MemoryStore(), inline=False
    )
    engine.start(0.0)
    actions: list = []
    for device_id, fields in devices.items():
        actions = engine.handle(received(hello(engine, device_id, **fields), 1.0))
    tasks = tasks_by_device(actions)

    asked = {
        d: {k for k in ("qat", "binarize") if m.body.hyperparameters.get(k)}
        for d, m in tasks.items()
    }
    int8 = {"qat"} if qat else set()
    assert asked == {
        "d0": {"binarize"},
        "d1": {"binarize"},  # binary wins over an int8 link: the two exclude each other
        "d2": int8,
        "d3": int8,  # the rule before hellos had a format: int8 links train int8 with qat
        "d4": set(),
    }
    for device_id in devices:
        device = Device(device_id)
        device.take(actions)
        message, _ = device.answer(tasks[device_id].round, 0.01)
        last = engine.handle(received(message, 2.0))
    (request,) = [a for a in last if isinstance(a, AggregateRequested)]
    formats = {c.device_id: c.weight_format for c in request.job.contributions()}
    assert formats == {
        "d0": "binary",
        "d1": "binary",
        "d2": "int8",
        "d3": "int8" if qat else "float",  # as trained: qat made it an int8 model
        "d4": "float",
    }
