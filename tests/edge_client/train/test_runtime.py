"""EdgeClient against the in-memory broker, with the test playing the coordinator."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edge_client.config import ClientConfig
from edge_client.errors import ConfigError, ConnectError
from edge_client.train.client_state import MODEL_FILE, UNACKED_FILE, read_model
from edge_client.train.data import DeviceData
from edge_client.train.runtime import STATE_FILE, EdgeClient
from edge_client.train.transfer import RESIDUAL_FILE
from models import build_classifier, state_arrays, state_shapes
from protocol import (
    Ack,
    Channel,
    Codec,
    CoordinatorStatus,
    DeviceStatus,
    Hello,
    Message,
    ModelPayload,
    ReasonCode,
    RoundTask,
    Topics,
    Update,
    UploadSpec,
    encode_tensors,
)
from protocol.arrays import content_fingerprint
from protocol.deltas import apply_delta_set, encode_delta
from protocol.tensors import Encoding
from protocol.transport import MemoryBroker, MemoryTransport

FLEET = "lab"
DEVICE = "dev-000"
HP = {"local_epochs": 1, "batch_size": 16, "lr": 0.05, "seed": 0}
WAIT = 20.0


def make_data(n: int = 64, device_id: str = DEVICE) -> DeviceData:
    rng = np.random.default_rng(3)
    y = (np.arange(n) % 4).astype(np.int64)
    x = rng.random((n, 1, 8, 8), dtype=np.float32)
    return DeviceData(device_id, x, y, x[:8], y[:8], 4)


def global_arrays() -> dict[str, np.ndarray]:
    torch.manual_seed(11)
    return state_arrays(build_classifier("mlp", num_classes=4, in_channels=1, image_size=8))


class Coordinator:
    """The test's side of the wire: records what devices publish, sends what a
    coordinator sends."""

    def __init__(self, broker: MemoryBroker) -> None:
        self.topics = Topics(FLEET)
        self.transport = MemoryTransport(broker, "coordinator")
        self.transport.connect()
        self.channel = Channel(self.transport)
        self.received: list[tuple[str, Message]] = []
        self.cond = threading.Condition()
        self.channel.subscribe(self.topics.from_devices("#"), self._record)

    def _record(self, topic: str, message: Message) -> None:
        with self.cond:
            self.received.append((topic, message))
            self.cond.notify_all()

    def bodies(self, kind: type[Any], device: str = DEVICE) -> list[Any]:
        with self.cond:
            return [
                m.body for _, m in self.received if isinstance(m.body, kind) and m.sender == device
            ]

    def messages(self, kind: type[Any]) -> list[Message]:
        with self.cond:
            return [m for _, m in self.received if isinstance(m.body, kind)]

    def wait_until(self, condition: Callable[[], bool], timeout: float = WAIT) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not condition():
                remaining = deadline - time.monotonic()
                assert remaining > 0, f"timed out; received {[m.kind for _, m in self.received]}"
                self.cond.wait(remaining)

    def wait_for(self, kind: type[Any], count: int, device: str = DEVICE) -> list[Any]:
        self.wait_until(lambda: len(self.bodies(kind, device)) >= count)
        return self.bodies(kind, device)

    def statuses(self) -> list[str]:
        return [s.state for s in self.bodies(DeviceStatus)]

    def send(self, leaf: str, body: Any, round_: int = -1, device: str = DEVICE) -> Message:
        message = Message(fleet=FLEET, sender="coordinator", body=body, round=round_)
        self.resend(leaf, message, device)
        return message

    def resend(self, leaf: str, message: Message, device: str = DEVICE) -> None:
        self.channel.send(self.topics.to_device(device, leaf), message)  # type: ignore[arg-type]

    def send_model(
        self, round_: int, arrays: dict[str, np.ndarray] | None = None, device: str = DEVICE
    ) -> Message:
        tensor_set = encode_tensors(arrays if arrays is not None else global_arrays())
        return self.send("model", ModelPayload(sets={"global": tensor_set}), round_, device)

    def send_task(
        self,
        round_: int,
        model: Message | None,
        strategy: str = "fedavg",
        hyperparameters: dict[str, Any] | None = None,
        device: str = DEVICE,
    ) -> Message:
        task = RoundTask(
            strategy=strategy,
            hyperparameters=HP if hyperparameters is None else hyperparameters,
            deadline=time.time() + 60,
            payloads=("global",),
            model_message=None if model is None else model.message_id,
        )
        return self.send("task", task, round_, device)

    def run_round(self, round_: int, updates_before: int) -> Update:
        """Model, task, and wait for the resulting update."""
        model = self.send_model(round_)
        task = self.send_task(round_, model)
        update: Update = self.wait_for(Update, updates_before + 1)[-1]
        assert update.task_message == task.message_id
        sent = self.messages(Update)[-1]
        self.send("ack", Ack(accepted=True, ref=sent.message_id), round_)
        self.transport.flush(WAIT)
        return update


@pytest.fixture
def broker() -> MemoryBroker:
    return MemoryBroker()


@pytest.fixture
def coordinator(broker: MemoryBroker) -> Iterator[Coordinator]:
    coord = Coordinator(broker)
    yield coord
    coord.transport.disconnect()


@pytest.fixture
def make_client(broker: MemoryBroker) -> Iterator[Callable[..., EdgeClient]]:
    clients: list[EdgeClient] = []

    def make(
        *, data: DeviceData | None = None, start: bool = True, gate: Any = None, **fields: Any
    ) -> EdgeClient:
        device_data = data if data is not None else make_data()
        fields = {
            "device_id": device_data.device_id,
            "fleet": FLEET,
            "model": "mlp",
            "insecure_no_auth": True,
            **fields,
        }
        config = ClientConfig(**fields)
        transport = MemoryTransport(broker, config.device_id)
        client = EdgeClient(config, transport, device_data, train_gate=gate)
        clients.append(client)
        if start:
            client.start()
        return client

    yield make
    for client in clients:
        client.stop()


def test_hello_and_online_status_announce_the_device(
    broker: MemoryBroker, coordinator: Coordinator, make_client: Callable[..., EdgeClient]
) -> None:
    client = make_client(share_label_counts=True, threads=2)

    hello: Hello = coordinator.wait_for(Hello, 1)[0]

    assert hello.device_id == DEVICE
    assert hello.architecture == "mlp"
    assert hello.fingerprint == client.model.fingerprint()
    assert hello.num_samples == 64 and hello.threads == 2 and hello.share_label_counts
    assert [p.value for p in hello.precisions] == ["fp32", "fp16", "bf16", "int8", "int4"]
    assert hello.memory_bytes > 0 and hello.software_version
    retained = broker.retained(coordinator.topics.device(DEVICE, "status"))
    assert retained is not None
    status = Codec().decode(retained).body
    assert isinstance(status, DeviceStatus) and status.state == "online"
    assert status.rss_bytes is not None and status.rss_bytes > 0


@pytest.mark.parametrize("task_first", [False, True])
def test_model_and_task_in_either_order_give_one_update(
    coordinator: Coordinator, make_client: Callable[..., EdgeClient], task_first: bool
) -> None:
    client = make_client()
    coordinator.wait_for(Hello, 1)
    arrays = global_arrays()
    model = Message(
        fleet=FLEET,
        sender="coordinator",
        round=3,
        body=ModelPayload(sets={"global": encode_tensors(arrays)}),
    )

    if task_first:
        task = coordinator.send_task(3, model)
        coordinator.resend("model", model)
    else:
        coordinator.resend("model", model)
        task = coordinator.send_task(3, model)
    (update,) = coordinator.wait_for(Update, 1)

    message = coordinator.messages(Update)[0]
    assert message.round == 3 and message.sender == DEVICE
    assert update.task_message == task.message_id
    assert update.num_samples == 64
    weights = update.sets["weights"].to_arrays()
    assert {k: v.shape for k, v in weights.items()} == state_shapes(client.model)
    assert all(np.isfinite(v).all() for v in weights.values())
    assert any(not np.array_equal(weights[k], arrays[k]) for k in arrays)  # it trained
    assert set(update.metrics) == {"loss", "accuracy"}
    assert {"train_s", "encode_s"} <= set(update.timings)
    coordinator.wait_until(lambda: coordinator.statuses()[-1:] == ["idle"])
    assert coordinator.statuses() == ["online", "training", "idle"]
    assert client.rounds_done == 1 and client.last_error is None


def test_a_duplicated_task_is_trained_once(
    coordinator: Coordinator, make_client: Callable[..., EdgeClient]
) -> None:
    client = make_client()
    model = coordinator.send_model(0)
    task = coordinator.send_task(0, model)
    coordinator.resend("task", task)  # QoS 1 redelivery while queued
    coordinator.wait_for(Update, 1)
    sent = coordinator.messages(Update)[0]
    coordinator.send("ack", Ack(accepted=True, ref=sent.message_id), 0)

    coordinator.resend("task", task)  # and after the acknowledged update
    coordinator.run_round(1, updates_before=1)

    assert next(u.task_message for u in coordinator.bodies(Update)) == task.message_id
    assert len(coordinator.bodies(Update)) == 2
    assert client.rounds_done == 2


def test_bad_and_foreign_input_changes_nothing(
    coordinator: Coordinator,
    make_client: Callable[..., EdgeClient],
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = make_client()
    coordinator.run_round(5, updates_before=0)
    weights_before = state_arrays(client.model)
    task_topic = coordinator.topics.to_device(DEVICE, "task")
    codec = Codec()
    caplog.set_level(logging.DEBUG, logger="edge_client")  # repeated refusals are DEBUG

    coordinator.transport.publish(task_topic, b"garbage bytes")
    coordinator.transport.publish(task_topic, b"FL\x07\x01" + b"\0" * 72)
    foreign_task = Message(
        fleet="other",
        sender="coordinator",
        round=6,
        body=RoundTask(strategy="fedavg", deadline=time.time(), hyperparameters=HP),
    )
    coordinator.transport.publish(task_topic, codec.encode(foreign_task))
    coordinator.send("task", Ack(accepted=True), 6)  # wrong kind on the task topic
    coordinator.send(
        "model",
        Hello(
            device_id="coordinator",
            architecture="mlp",
            fingerprint="0" * 16,
            precisions=("fp32",),
            memory_bytes=0,
            threads=1,
            software_version="x",
            num_samples=0,
        ),
        6,
    )
    coordinator.send_task(4, None)  # older than round 5, already done
    model = coordinator.send_model(6)
    coordinator.send_task(6, model, strategy="fedsgd")  # unknown strategy
    coordinator.send_task(6, model, hyperparameters={**HP, "epochs": 3})  # unknown key
    bad = global_arrays()
    bad["head.bias"] = np.zeros(9, np.float32)
    coordinator.send_task(6, coordinator.send_model(6, bad))  # wrong shapes
    renamed = {f"x.{k}": v for k, v in global_arrays().items()}
    coordinator.send_task(6, coordinator.send_model(6, renamed))  # wrong names
    coordinator.send("ack", Ack(accepted=False, reason=ReasonCode.LATE, detail="too late"), 6)
    assert client.transport.flush(5.0)

    assert all(np.array_equal(v, state_arrays(client.model)[k]) for k, v in weights_before.items())
    assert client.rounds_done == 1
    coordinator.run_round(6, updates_before=1)  # still works
    assert len(coordinator.bodies(Update)) == 2
    assert client.rounds_done == 2
    assert "error" not in coordinator.statuses()
    for expected in (
        "bad payload",
        "fleet 'other'",
        "round 5 is already done",
        "unknown strategy 'fedsgd'",
        "epochs",
        "does not fit",
        "rejected",
        "late too late",
        "ignored a ack message",
        "ignored a hello message",
    ):
        assert expected in caplog.text, expected


def test_a_task_whose_model_never_comes_is_dropped(
    coordinator: Coordinator,
    make_client: Callable[..., EdgeClient],
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = make_client(task_timeout_s=0.2)
    caplog.set_level(logging.WARNING, logger="edge_client")
    late = Message(
        fleet=FLEET,
        sender="coordinator",
        round=0,
        body=ModelPayload(sets={"global": encode_tensors(global_arrays())}),
    )
    coordinator.send_task(0, late)
    deadline = time.monotonic() + WAIT
    while "did not arrive" not in caplog.text:
        assert time.monotonic() < deadline
        time.sleep(0.05)

    coordinator.resend("model", late)
    coordinator.run_round(1, updates_before=0)

    assert len(coordinator.bodies(Update)) == 1 and client.rounds_done == 1


def test_the_client_says_hello_again_after_a_broker_restart(
    broker: MemoryBroker, coordinator: Coordinator, make_client: Callable[..., EdgeClient]
) -> None:
    client = make_client()
    coordinator.wait_for(Hello, 1)

    broker.stop()
    broker.start()
    coordinator.wait_for(Hello, 2)

    coordinator.run_round(0, updates_before=0)
    assert client.rounds_done == 1
    retained = broker.retained(coordinator.topics.device(DEVICE, "status"))
    assert retained is not None


def test_an_unacknowledged_update_is_sent_again_when_the_coordinator_asks(
    coordinator: Coordinator, make_client: Callable[..., EdgeClient]
) -> None:
    make_client()
    task = coordinator.send_task(0, coordinator.send_model(0))
    coordinator.wait_for(Update, 1)

    coordinator.resend("task", task)  # a resumed coordinator sends the same task again
    coordinator.wait_for(Update, 2)
    coordinator_status(coordinator, "starting")  # or (re)starts
    coordinator.wait_for(Update, 3)
    first = coordinator.messages(Update)[0]
    coordinator.send("ack", Ack(accepted=True, ref=first.message_id), 0)
    coordinator.transport.flush(WAIT)
    coordinator_status(coordinator, "starting")
    coordinator.wait_for(Hello, 3)

    ids = {m.message_id for m in coordinator.messages(Update)}
    assert ids == {first.message_id}  # the very same update, never retrained
    assert len(coordinator.messages(Update)) == 3  # nothing more once acknowledged


def test_a_starting_coordinator_triggers_a_hello_and_may_restart_round_numbers(
    coordinator: Coordinator, make_client: Callable[..., EdgeClient]
) -> None:
    client = make_client()
    coordinator.wait_for(Hello, 1)
    coordinator.run_round(3, updates_before=0)

    coordinator.channel.send(
        coordinator.topics.coordinator_status,
        Message(fleet=FLEET, sender="coordinator", body=CoordinatorStatus(state="starting")),
        retain=True,
    )

    coordinator.wait_for(Hello, 2)
    coordinator.run_round(0, updates_before=1)  # a new run numbers its rounds from 0
    assert client.rounds_done == 2


def coordinator_status(coordinator: Coordinator, state: str) -> None:
    coordinator.channel.send(
        coordinator.topics.coordinator_status,
        Message(fleet=FLEET, sender="coordinator", body=CoordinatorStatus(state=state)),
        retain=True,
    )


@pytest.mark.parametrize("exit_when_finished", [True, False])
def test_a_finished_run_stops_the_client_only_when_asked(
    broker: MemoryBroker,
    coordinator: Coordinator,
    make_client: Callable[..., EdgeClient],
    exit_when_finished: bool,
) -> None:
    client = make_client(exit_when_finished=exit_when_finished)
    coordinator.wait_for(Hello, 1)
    coordinator_status(coordinator, "running")

    coordinator_status(coordinator, "finished")

    if exit_when_finished:
        assert client.wait(WAIT)
        coordinator.wait_until(lambda: coordinator.statuses()[-1:] == ["offline"])
        assert not client.is_running
        assert DEVICE not in broker.connected_clients
    else:
        assert client.transport.flush(5.0)
        assert not client.wait(0.2) and client.is_running


def test_a_stopped_coordinator_or_a_stale_finished_run_does_not_stop_the_client(
    coordinator: Coordinator, make_client: Callable[..., EdgeClient]
) -> None:
    coordinator_status(coordinator, "finished")  # retained, from an earlier run
    client = make_client(exit_when_finished=True)
    coordinator.wait_for(Hello, 1)
    coordinator_status(coordinator, "running")
    coordinator_status(coordinator, "stopped")  # e.g. the coordinator's last will

    assert client.transport.flush(5.0)
    assert not client.wait(0.2) and client.is_running
    coordinator.run_round(0, updates_before=0)  # serves the resumed coordinator
    coordinator_status(coordinator, "finished")
    assert client.wait(WAIT)


def test_a_failing_training_reports_error_and_the_client_goes_on(
    coordinator: Coordinator, make_client: Callable[..., EdgeClient]
) -> None:
    class FailOnce:
        def __init__(self) -> None:
            self.entered = 0

        def __enter__(self) -> None:
            self.entered += 1
            if self.entered == 1:
                raise RuntimeError("out of memory (simulated)")

        def __exit__(self, *exc: object) -> None:
            return None

    gate = FailOnce()
    client = make_client(gate=gate)
    coordinator.send_task(0, coordinator.send_model(0))
    coordinator.wait_until(lambda: "error" in coordinator.statuses())

    error = next(s for s in coordinator.bodies(DeviceStatus) if s.state == "error")
    assert "out of memory (simulated)" in error.detail
    assert isinstance(client.last_error, RuntimeError)
    coordinator.run_round(1, updates_before=0)
    assert gate.entered == 2 and client.rounds_done == 1


def test_the_train_gate_is_held_while_training(
    coordinator: Coordinator, make_client: Callable[..., EdgeClient]
) -> None:
    gate = threading.Semaphore(1)
    clients = [make_client(data=make_data(device_id=f"dev-00{i}"), gate=gate) for i in range(3)]
    for i in range(3):
        model = coordinator.send_model(0, device=f"dev-00{i}")
        coordinator.send_task(0, model, device=f"dev-00{i}")

    for i in range(3):
        coordinator.wait_for(Update, 1, device=f"dev-00{i}")
    assert [c.rounds_done for c in clients] == [1, 1, 1]
    assert gate.acquire(blocking=False)  # released by every client


def test_handled_tasks_and_an_unacknowledged_update_survive_a_restart(
    tmp_path: Path, coordinator: Coordinator, make_client: Callable[..., EdgeClient]
) -> None:
    # Prepare: the device sends its update; no ack comes (the coordinator was down), and
    # the device stops
    first = make_client(state_dir=tmp_path / "state")
    model = coordinator.send_model(0)
    task = coordinator.send_task(0, model)
    coordinator.wait_for(Update, 1)
    first.stop()
    saved = json.loads((tmp_path / "state" / STATE_FILE).read_text())
    assert saved["rounds_done"] == 1 and task.message_id in saved["handled_tasks"]
    names = sorted(p.name for p in (tmp_path / "state").iterdir())
    assert names == sorted([STATE_FILE, MODEL_FILE, UNACKED_FILE])
    trained = state_arrays(first.model)
    (sent,) = coordinator.messages(Update)

    # Execute: it restarts from its state dir; the resumed coordinator resends its task
    second = make_client(state_dir=tmp_path / "state")
    coordinator.wait_for(Update, 2)
    coordinator.resend("model", model)
    coordinator.resend("task", task)
    coordinator.wait_for(Update, 3)

    # Assert: the local model came back; the very same update went out again, at the
    # start and for the task, until an ack referred to it
    for name, value in state_arrays(second.model).items():
        np.testing.assert_array_equal(value, trained[name])
    assert [m.message_id for m in coordinator.messages(Update)] == [sent.message_id] * 3
    coordinator.send("ack", Ack(accepted=True, ref=sent.message_id), 0)
    deadline = time.monotonic() + WAIT
    while (tmp_path / "state" / UNACKED_FILE).exists():  # removed when the ack came
        assert time.monotonic() < deadline
        time.sleep(0.02)
    coordinator.run_round(1, updates_before=3)
    assert second.rounds_done == 2


def test_a_corrupt_state_file_is_ignored(
    tmp_path: Path, coordinator: Coordinator, make_client: Callable[..., EdgeClient]
) -> None:
    (tmp_path / STATE_FILE).write_text("{not json")

    client = make_client(state_dir=tmp_path)
    coordinator.run_round(0, updates_before=0)
    coordinator.wait_until(lambda: coordinator.statuses()[-1:] == ["idle"])  # saved by then

    assert client.rounds_done == 1
    assert json.loads((tmp_path / STATE_FILE).read_text())["rounds_done"] == 1


def test_stop_publishes_offline_and_start_fails_without_a_broker(
    broker: MemoryBroker, coordinator: Coordinator, make_client: Callable[..., EdgeClient]
) -> None:
    client = make_client()
    coordinator.wait_for(Hello, 1)

    client.stop()
    client.stop()  # idempotent

    assert client.wait(0)
    coordinator.wait_until(lambda: coordinator.statuses()[-1:] == ["offline"])
    broker.stop()
    unreachable = make_client(
        start=False, connect_retry_s=0.3, connect_backoff_s=0.05, device_id="dev-009"
    )
    started = time.monotonic()
    with pytest.raises(ConnectError, match="no connection to the broker after"):
        unreachable.start()
    assert time.monotonic() - started < 5


def test_bad_configurations_are_config_errors(broker: MemoryBroker) -> None:
    config = ClientConfig(device_id=DEVICE, model="nonexistent")
    with pytest.raises(ConfigError, match="unknown classifier 'nonexistent'"):
        EdgeClient(config, MemoryTransport(broker, DEVICE), make_data())
    wide = make_data()
    wide = DeviceData(
        DEVICE,
        np.zeros((2, 1, 8, 6), np.float32),
        wide.y[:2],
        np.zeros((0, 1, 8, 6), np.float32),
        wide.y[:0],
        4,
    )
    with pytest.raises(ConfigError, match="square"):
        EdgeClient(
            ClientConfig(device_id=DEVICE, model="mlp"), MemoryTransport(broker, DEVICE), wide
        )
    with pytest.raises(ConfigError, match="mqtt:// or mqtts://"):
        ClientConfig.from_broker_url("http://x", device_id=DEVICE)
    config = ClientConfig.from_broker_url(
        "mqtts://broker.local", device_id=DEVICE, username="u", password="p", fleet=FLEET
    )
    assert config.broker.client_id == DEVICE and config.broker.port == 8883
    assert config.broker.tls is not None and config.broker.username == "u"


def test_a_delta_against_an_unknown_base_makes_the_device_ask_for_the_full_model(
    coordinator: Coordinator, make_client: Callable[..., EdgeClient]
) -> None:
    client = make_client()
    coordinator.wait_for(Hello, 1)
    other = {k: v + 1 for k, v in global_arrays().items()}
    stale = encode_delta(global_arrays(), other, content_fingerprint(other), "int8").tensors
    model = coordinator.send("model", ModelPayload(sets={"global": stale}), 0)
    task = RoundTask(
        strategy="fedavg",
        hyperparameters=HP,
        deadline=time.time() + 60,
        downlink_precision="int8",
        payloads=("global",),
        model_message=model.message_id,
    )
    task_message = coordinator.send("task", task, 0)

    hellos = coordinator.wait_for(Hello, 2)  # it says hello again, holding no base
    assert hellos[-1].held_base is None
    assert coordinator.bodies(Update) == []
    full = coordinator.send_model(0)  # the coordinator resends: same task, full model
    resent = task.model_copy(update={"model_message": full.message_id})
    coordinator.resend("task", task_message.model_copy(update={"body": resent}))

    (update,) = coordinator.wait_for(Update, 1)
    assert update.task_message == task_message.message_id and client.rounds_done == 1


def test_a_lossy_device_uploads_a_delta_and_keeps_its_base_and_residual(
    tmp_path: Path, coordinator: Coordinator, make_client: Callable[..., EdgeClient]
) -> None:
    state = tmp_path / "state"
    client = make_client(state_dir=state, uplink_precision="int4")
    model = coordinator.send_model(0)
    spec = UploadSpec(precision="int4", mode="delta", base="global")
    task = RoundTask(
        strategy="fedavg",
        hyperparameters=HP,
        deadline=time.time() + 60,
        uplink=spec,
        payloads=("global",),
        model_message=model.message_id,
    )
    coordinator.send("task", task, 0)

    (update,) = coordinator.wait_for(Update, 1)
    weights = update.sets["weights"]
    sent = global_arrays()
    assert weights.mode == "delta" and weights.base == content_fingerprint(sent)
    assert {t.encoding for t in weights if len(t.shape) >= 2} == {Encoding.INT4_CH}
    rebuilt = apply_delta_set(weights, sent)
    trained = state_arrays(client.model)
    coordinator.wait_until(lambda: client.rounds_done == 1)  # residual kept once sent
    residual = read_model(state / RESIDUAL_FILE)
    for name, value in trained.items():  # what the coordinator rebuilds + residual = trained
        np.testing.assert_allclose(rebuilt[name] + residual[name], value, atol=1e-5)
    client.stop()
    restarted = make_client(state_dir=state, uplink_precision="int4")
    coordinator.wait_for(Hello, 2)
    assert coordinator.bodies(Hello)[-1].held_base == content_fingerprint(sent)
    assert restarted.model is not None


class _HeldGate:
    """A train gate that holds training until the test releases it."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __enter__(self) -> None:
        self.entered.set()
        assert self.release.wait(30)

    def __exit__(self, *exc: object) -> None:
        return None


def test_a_stop_during_the_upload_abandons_it_cleanly(
    tmp_path: Path,
    broker: MemoryBroker,
    coordinator: Coordinator,
    make_client: Callable[..., EdgeClient],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="edge_client")
    state = tmp_path / "state"
    gate = _HeldGate()
    client = make_client(state_dir=state, uplink_precision="int4", gate=gate)
    model = coordinator.send_model(0)
    spec = UploadSpec(precision="int4", mode="delta", base="global")
    task = RoundTask(
        strategy="fedavg",
        hyperparameters=HP,
        deadline=time.time() + 60,
        uplink=spec,
        payloads=("global",),
        model_message=model.message_id,
    )
    task_message = coordinator.send("task", task, 0)
    assert gate.entered.wait(30)
    broker.stop()  # the upload will fail and be retried ...
    gate.release.set()
    deadline = time.monotonic() + 30
    while "publishing the update failed" not in caplog.text:
        assert time.monotonic() < deadline, caplog.text
        time.sleep(0.05)
    client.stop()  # ... until SIGTERM's stop abandons it

    assert "upload abandoned, the device stops" in caplog.text
    # Nothing remembered: the task is redone after a restart if its round is still open.
    assert not (state / STATE_FILE).exists()
    assert task_message.message_id not in client._handled
    assert not (state / RESIDUAL_FILE).exists()  # the error feedback is as it was


@pytest.mark.parametrize(
    ("fields", "flag"),
    [
        ({"exit_when_finished": True}, "--exit-when-finished"),
        (
            {"serve_onnx": Path("m.onnx"), "onnx_template": Path("t.onnx")},
            "--serve-onnx",
        ),
    ],
)
def test_what_needs_the_coordinators_status_or_models_needs_its_public_key(
    broker: MemoryBroker, fields: dict[str, Any], flag: str
) -> None:
    # the coordinator signs its status and broadcast models: a keyed device without its
    # public key could never read "finished", nor check a model it would serve
    config = ClientConfig(device_id="dev-k", fleet=FLEET, model="mlp", auth_key="11" * 32, **fields)
    with pytest.raises(ConfigError, match=f"{flag} needs the coordinator's public key"):
        EdgeClient(config, MemoryTransport(broker, "dev-k"), make_data())


def test_a_keyed_device_without_the_coordinators_key_still_trains_and_says_why(
    broker: MemoryBroker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="edge_client.train.runtime")
    config = ClientConfig(device_id="dev-k", fleet=FLEET, model="mlp", auth_key="11" * 32)
    EdgeClient(config, MemoryTransport(broker, "dev-k"), make_data())
    assert any("no coordinator public key" in r.getMessage() for r in caplog.records)
