"""A restart loses nothing and changes nothing: the learning state persisted with the model.

A device (the threaded :class:`~edge_client.train.runtime.EdgeClient` on the in-memory
broker, the test playing the coordinator) trains round 1, stops, starts again from its
state dir and trains round 2; its round-2 update must be bit-identical to that of a
device that ran both rounds without stopping. FedKF keeps its image generator and its
Adam moments across rounds (``learning_state.npz``); a lossy delta uplink keeps its
error-feedback residual (``residual.npz``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edge_client.config import ClientConfig
from edge_client.train.client_state import (
    LEARNING_STATE_FILE,
    MODEL_FILE,
    UNACKED_FILE,
    DeviceStore,
    read_learning_state,
    read_model,
)
from edge_client.train.data import DeviceData
from edge_client.train.runtime import EdgeClient
from edge_client.train.strategies import learning_state_entries, restore_learning_state
from edge_client.train.strategies.fedkf import GENERATOR_STATE_KEY, LocalGenerator
from edge_client.train.transfer import RESIDUAL_FILE
from models import build_classifier, state_arrays
from protocol import Ack, Message, ModelPayload, RoundTask, Update, UploadSpec, encode_tensors
from protocol.transport import MemoryBroker, MemoryTransport
from tests.edge_client.train.test_runtime import DEVICE, FLEET, Coordinator

FEDKF_HP: dict[str, Any] = {
    "local_epochs": 1,
    "batch_size": 16,
    "lr": 0.05,
    "gamma": 1.0,
    "generator_width": 2,
    "generator_noise_dim": 8,
    "generator_every": 1,  # a generator step every batch: 3 a round
    "sample_reuse": 1,
}


def make_data(n: int = 48) -> DeviceData:
    rng = np.random.default_rng(3)
    y = (np.arange(n) % 4).astype(np.int64)
    x = rng.random((n, 1, 8, 8), dtype=np.float32)
    return DeviceData(DEVICE, x, y, x[:8], y[:8], 4)


def classifier_arrays(seed: int) -> dict[str, np.ndarray]:
    torch.manual_seed(seed)
    return state_arrays(build_classifier("mlp", num_classes=4, in_channels=1, image_size=8))


def start_client(broker: MemoryBroker, state: Path, precision: str) -> EdgeClient:
    config = ClientConfig(
        device_id=DEVICE,
        fleet=FLEET,
        model="mlp",
        insecure_no_auth=True,
        state_dir=state,
        fsync_state=False,
        uplink_precision=precision,
    )
    client = EdgeClient(config, MemoryTransport(broker, DEVICE), make_data())
    client.start()
    return client


def fedkf_round(
    coordinator: Coordinator, client: EdgeClient, round_: int, precision: str, done: int
) -> Update:
    """Send round ``round_``'s student, teacher and task; wait for its update, ack it and
    wait until the device counts the round done and took the ack (nothing is left to
    send again at a restart)."""
    sets = {
        "student": encode_tensors(classifier_arrays(10 + round_)),
        "teacher": encode_tensors(classifier_arrays(20 + round_)),
    }
    model = coordinator.send("model", ModelPayload(sets=sets), round_)
    delta = precision != "fp32"
    uplink = UploadSpec(precision=precision, mode="delta", base="student") if delta else None
    task = RoundTask(
        strategy="fedkf",
        hyperparameters={**FEDKF_HP, "seed": 1000 + round_},
        deadline=time.time() + 60,
        payloads=("student", "teacher"),
        model_message=model.message_id,
        **({"uplink": uplink} if uplink is not None else {}),
    )
    sent = coordinator.send("task", task, round_)

    def answers() -> list[Message]:
        return [
            m
            for m in coordinator.messages(Update)
            if isinstance(m.body, Update) and m.body.task_message == sent.message_id
        ]

    coordinator.wait_until(lambda: bool(answers()))
    (message,) = answers()
    coordinator.send("ack", Ack(accepted=True, ref=message.message_id), round_)
    state = client.config.state_dir
    assert state is not None
    coordinator.wait_until(
        lambda: client.rounds_done == done + 1 and not (state / UNACKED_FILE).exists()
    )
    assert isinstance(message.body, Update)
    return message.body


@contextmanager
def wire() -> Iterator[tuple[MemoryBroker, Coordinator]]:
    broker = MemoryBroker()
    coordinator = Coordinator(broker)
    try:
        yield broker, coordinator
    finally:
        coordinator.transport.disconnect()


def two_rounds(
    state: Path, *, restart: bool, precision: str = "fp32", drop_learning_state: bool = False
) -> tuple[Update, dict[str, np.ndarray]]:
    """Rounds 1 and 2 of one device in ``state`` (with a restart in between); round 2's
    update and the device's model after it."""
    with wire() as (broker, coordinator):
        client = start_client(broker, state, precision)
        try:
            fedkf_round(coordinator, client, 1, precision, done=0)
            if restart:
                client.stop()
                if drop_learning_state:
                    (state / LEARNING_STATE_FILE).unlink()
                client = start_client(broker, state, precision)
                assert client.rounds_done == 1
            update = fedkf_round(coordinator, client, 2, precision, done=1)
            return update, state_arrays(client.model)
        finally:
            client.stop()


def assert_same_arrays(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        assert value.dtype == b[name].dtype, name
        assert np.array_equal(value, b[name]), name


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_a_restarted_fedkf_device_sends_the_very_same_round_2_update(
    tmp_path: Path, precision: str
) -> None:
    # Execute: one device trains both rounds; another stops after round 1 and restarts
    uninterrupted, model_a = two_rounds(tmp_path / "a", restart=False, precision=precision)
    restarted, model_b = two_rounds(tmp_path / "b", restart=True, precision=precision)

    # Assert: the same bytes on the wire, the same model, the same learning state (and,
    # with a lossy uplink, the same error-feedback residual)
    assert uninterrupted.sets["weights"] == restarted.sets["weights"]
    assert uninterrupted.metrics == restarted.metrics
    assert_same_arrays(model_a, model_b)
    for name in (MODEL_FILE, LEARNING_STATE_FILE):
        assert_same_arrays(read_model(tmp_path / "a" / name), read_model(tmp_path / "b" / name))
    saved = read_learning_state(tmp_path / "b" / LEARNING_STATE_FILE)
    generator = saved.entries[GENERATOR_STATE_KEY]
    assert generator.settings["steps"] == [6] * len(generator.settings["steps"])  # 2 x 3
    if precision != "fp32":
        assert_same_arrays(
            read_model(tmp_path / "a" / RESIDUAL_FILE), read_model(tmp_path / "b" / RESIDUAL_FILE)
        )


def test_without_its_learning_state_a_restarted_fedkf_device_drifts(tmp_path: Path) -> None:
    # the check above is not vacuous: a generator started afresh changes round 2
    uninterrupted, _ = two_rounds(tmp_path / "a", restart=False)
    fresh, _ = two_rounds(tmp_path / "b", restart=True, drop_learning_state=True)

    assert uninterrupted.sets["weights"] != fresh.sets["weights"]


def test_a_corrupt_learning_state_is_ignored_with_a_warning_and_training_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: round 1 saved a learning state, which is then damaged
    state = tmp_path / "state"
    with wire() as (broker, coordinator):
        client = start_client(broker, state, "fp32")
        fedkf_round(coordinator, client, 1, "fp32", done=0)
        client.stop()
        (state / LEARNING_STATE_FILE).write_bytes(b"PK\x03\x04 not a zip")

        # Execute
        with caplog.at_level(logging.WARNING, logger="edge_client"):
            client = start_client(broker, state, "fp32")
        try:
            update = fedkf_round(coordinator, client, 2, "fp32", done=1)
        finally:
            client.stop()

    # Assert: one warning, a fresh generator, a round trained and a new state saved
    warnings = [r for r in caplog.records if "learning state" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "ignored the saved learning state" in warnings[0].getMessage()
    assert update.num_samples == 48 and np.isfinite(update.metrics["loss"])
    steps = read_learning_state(state / LEARNING_STATE_FILE).entries[GENERATOR_STATE_KEY]
    assert steps.settings["steps"] == [3] * len(steps.settings["steps"])  # fresh: round 2 only


def saved_generator(tmp_path: Path) -> tuple[DeviceStore, dict[str, np.ndarray]]:
    """A store holding a model and a FedKF generator trained one round."""
    state = tmp_path / "state"
    with wire() as (broker, coordinator):
        client = start_client(broker, state, "fp32")
        try:
            fedkf_round(coordinator, client, 1, "fp32", done=0)
        finally:
            client.stop()
    return DeviceStore(state, fsync=False), read_model(state / MODEL_FILE)


def test_a_learning_state_saved_with_another_model_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # a crash between the model's write and the learning state's leaves them apart
    store, model = saved_generator(tmp_path)
    assert store.load_learning_state(model) is not None
    other = {name: value + 1 if value.dtype.kind == "f" else value for name, value in model.items()}

    assert store.load_learning_state(other) is None
    assert "it goes with another model" in caplog.text


def test_a_generator_for_other_images_does_not_restore(tmp_path: Path) -> None:
    store, model = saved_generator(tmp_path)
    saved = store.load_learning_state(model)
    assert saved is not None
    cpu = torch.device("cpu")
    fits = build_classifier("mlp", num_classes=4, in_channels=1, image_size=8)
    restored = restore_learning_state(saved.entries, fits, cpu)[GENERATOR_STATE_KEY]
    assert isinstance(restored, LocalGenerator)
    # what it stores again is what it was restored from, bit for bit
    again = learning_state_entries({GENERATOR_STATE_KEY: restored})[GENERATOR_STATE_KEY]
    assert_same_arrays(dict(again.arrays), dict(saved.entries[GENERATOR_STATE_KEY].arrays))
    assert dict(again.settings) == dict(saved.entries[GENERATOR_STATE_KEY].settings)

    rgb = build_classifier("mlp", num_classes=4, in_channels=3, image_size=8)
    with pytest.raises(
        ValueError, match=r"makes samples of shape \(1, 8, 8\), the model takes \(3, 8, 8\)"
    ):
        restore_learning_state(saved.entries, rgb, cpu)
    entry = saved.entries[GENERATOR_STATE_KEY]
    shrunk = {k: v[..., :1] if k.startswith("exp_avg/") else v for k, v in entry.arrays.items()}
    damaged = {GENERATOR_STATE_KEY: type(entry)(entry.settings, shrunk)}
    with pytest.raises(ValueError, match="Adam moment"):
        restore_learning_state(damaged, fits, cpu)


def test_state_no_strategy_can_restore_is_refused_when_saved() -> None:
    with pytest.raises(TypeError, match="has no stored form"):
        learning_state_entries({"momentum": torch.zeros(2)})
