"""Keeping a served ONNX model current: ModelRefresher and the Follower device."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from edge_client.config import ClientConfig
from edge_client.errors import ConfigError, OnnxTemplateError
from edge_client.serve.follower import Follower, ModelRefresher
from edge_client.serve.infer import OnnxClassifier
from models import build_classifier, load_state_arrays, state_arrays
from models.onnx_export import export_onnx
from models.onnx_template import export_template
from protocol.auth import Keyring, new_key
from protocol.channel import Channel
from protocol.errors import DecodeError
from protocol.messages import DeviceStatus, Message, ModelPayload
from protocol.signing import SigningKey
from protocol.tensorset import encode_tensors
from protocol.topics import Topics
from protocol.transport import MemoryBroker, MemoryTransport

FLEET = "serve"
SHAPE = (1, 28, 28)


def classifier(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_classifier("lenet5", num_classes=10, in_channels=1, image_size=28)


def broadcast(arrays: dict[str, np.ndarray], round_: int, precision: str = "fp32") -> Message:
    body = ModelPayload(sets={"global": encode_tensors(arrays, precision)})
    return Message(fleet=FLEET, sender="coordinator", round=round_, body=body)


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("templates")
    model = classifier(0)
    out = {}
    for precision in ("fp32", "int8"):
        path = root / f"{precision}.onnx"
        path.write_bytes(export_template(model, SHAPE, precision=precision, model_name="lenet5"))
        out[precision] = path
    return out


IMAGES = np.random.default_rng(0).random((32, *SHAPE), dtype=np.float32)


def test_a_broadcast_becomes_the_served_model(templates: dict[str, Path], tmp_path: Path) -> None:
    served = tmp_path / "served" / "model.onnx"
    refresher = ModelRefresher(templates["fp32"], served)
    assert refresher.round == -1 and refresher.precision == "fp32"
    trained = classifier(7)
    assert refresher.apply(broadcast(state_arrays(trained), 3))
    expected = OnnxClassifier(export_onnx(trained, SHAPE)).predict_logits(IMAGES)
    logits = OnnxClassifier(served).predict_logits(IMAGES)
    np.testing.assert_allclose(logits, expected, atol=1e-5)
    info = json.loads((tmp_path / "served" / "model.onnx.json").read_text())
    assert info["round"] == 3 and info["fleet"] == FLEET and info["precision"] == "fp32"
    assert not list(served.parent.glob(".*.tmp"))  # written through a temporary, renamed


def test_redeliveries_are_skipped_across_restarts_and_a_new_run_is_served(
    templates: dict[str, Path], tmp_path: Path
) -> None:
    served = tmp_path / "model.onnx"
    first, second = state_arrays(classifier(1)), state_arrays(classifier(2))
    assert ModelRefresher(templates["int8"], served).apply(broadcast(first, 5))
    before = served.read_bytes()
    restarted = ModelRefresher(templates["int8"], served)
    assert restarted.round == 5
    assert not restarted.apply(broadcast(first, 5))  # the retained broadcast, again
    assert restarted.apply(broadcast(second, 1))  # a new coordinator run starts at round 1
    assert served.read_bytes() != before and restarted.round == 1
    # a served file that does not match its record is refreshed
    served.write_bytes(b"garbage")
    assert ModelRefresher(templates["int8"], served).round == -1


def test_bad_broadcasts_change_nothing(templates: dict[str, Path], tmp_path: Path) -> None:
    served = tmp_path / "model.onnx"
    refresher = ModelRefresher(templates["fp32"], served)
    good = state_arrays(classifier(1))
    refresher.apply(broadcast(good, 1))
    before = served.read_bytes()
    nan = {k: v.copy() for k, v in good.items()}
    next(iter(nan.values())).flat[0] = np.nan
    with pytest.raises(OnnxTemplateError):
        refresher.apply(broadcast(nan, 2))
    missing = dict(list(good.items())[1:])
    with pytest.raises(OnnxTemplateError):
        refresher.apply(broadcast(missing, 2))
    status = Message(fleet=FLEET, sender="coordinator", body=DeviceStatus(state="idle"))
    with pytest.raises(DecodeError, match="expected a model message"):
        refresher.apply(status)
    assert served.read_bytes() == before and refresher.round == 1


def test_an_earlier_broadcast_replayed_does_not_roll_the_served_model_back(
    templates: dict[str, Path], tmp_path: Path
) -> None:
    # Prepare: round 3's model served; round 2's genuine broadcast was captured
    served = tmp_path / "model.onnx"
    refresher = ModelRefresher(templates["fp32"], served)
    older = broadcast(state_arrays(classifier(2)), 2)
    newer = broadcast(state_arrays(classifier(3)), 3)
    older = older.model_copy(update={"sent_at_ms": newer.sent_at_ms - 1000})
    assert refresher.apply(newer)
    before = served.read_bytes()
    # Execute: replayed, also to a restarted device
    again = [refresher.apply(older), ModelRefresher(templates["fp32"], served).apply(older)]
    # Assert: skipped both times; a newer broadcast (a new run's round 1) is served
    assert again == [False, False] and served.read_bytes() == before
    fresh = broadcast(state_arrays(classifier(4)), 1)
    assert refresher.apply(fresh) and refresher.round == 1


def test_templates_and_settings_are_checked(tmp_path: Path) -> None:
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x00\x01not an onnx model")
    with pytest.raises(ConfigError, match="ONNX template"):
        ModelRefresher(junk, tmp_path / "m.onnx")
    with pytest.raises(ValueError, match="given together"):
        ClientConfig(device_id="d", serve_onnx=tmp_path / "m.onnx")


@pytest.fixture
def broker() -> Iterator[MemoryBroker]:
    yield MemoryBroker()


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_follower_serves_the_retained_broadcast_and_reports_its_status(
    templates: dict[str, Path], tmp_path: Path, broker: MemoryBroker
) -> None:
    topics = Topics(FLEET)
    coordinator = MemoryTransport(broker, "coordinator")
    coordinator.connect()
    key, signing = new_key(), SigningKey.generate()
    channel = Channel(coordinator, auth=Keyring({"cam-1": key}), fleet_key=signing)
    statuses: list[DeviceStatus] = []
    lock = threading.Lock()

    def on_status(topic: str, message: Message) -> None:
        assert isinstance(message.body, DeviceStatus)
        with lock:
            statuses.append(message.body)

    channel.subscribe(topics.device("cam-1", "status"), on_status)
    arrays = state_arrays(classifier(3))
    # int8: one frame, so retained (fp32 LeNet-5 needs chunks), and sent before it starts
    message = broadcast(arrays, 4, "int8")
    assert channel.send(topics.broadcast_model, message, latest=True).frames == 1
    assert isinstance(message.body, ModelPayload)
    decoded = message.body.sets["global"].to_arrays()

    served = tmp_path / "model.onnx"
    config = ClientConfig(
        device_id="cam-1",
        fleet=FLEET,
        serve_onnx=served,
        onnx_template=templates["fp32"],
        auth_key=key.hex(),
        coordinator_key=signing.verify_key.public.hex(),
    )
    follower = Follower(
        config, MemoryTransport(broker, "cam-1"), ModelRefresher(templates["fp32"], served)
    )
    follower.start()
    try:
        wait_until(lambda: any(s.detail == "serving round 4" for s in statuses))
        model = classifier(0)
        load_state_arrays(model, decoded)
        expected = OnnxClassifier(export_onnx(model, SHAPE)).predict(IMAGES)
        assert (OnnxClassifier(served).predict(IMAGES) == expected).all()
        bad = {k: v[..., :1] for k, v in arrays.items()}
        channel.send(topics.broadcast_model, broadcast(bad, 5))
        wait_until(lambda: any(s.state == "error" for s in statuses))
        assert "round 5" in statuses[-1].detail
        assert (OnnxClassifier(served).predict(IMAGES) == expected).all()  # unchanged
    finally:
        follower.stop()
    wait_until(lambda: statuses[-1].state == "offline")
    assert follower.wait(0)


def test_a_follower_serves_only_what_the_coordinator_signed(
    templates: dict[str, Path],
    tmp_path: Path,
    broker: MemoryBroker,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare: a follower with the coordinator's public key; an attacker on the broker
    # publishes models unsigned, signed by another key, and a genuine status moved there
    topics, signing = Topics(FLEET), SigningKey.generate()
    coordinator = MemoryTransport(broker, "coordinator")
    coordinator.connect()
    genuine = Channel(coordinator, auth=Keyring(), fleet_key=signing)
    attacker = MemoryTransport(broker, "attacker")
    attacker.connect()
    forged = broadcast(state_arrays(classifier(9)), 7, "int8")
    unsigned = Channel(attacker).encode(topics.broadcast_model, forged)
    impostor = Channel(attacker, auth=Keyring(), fleet_key=SigningKey.generate())
    served = tmp_path / "model.onnx"
    config = ClientConfig(
        device_id="cam-2",
        fleet=FLEET,
        serve_onnx=served,
        onnx_template=templates["int8"],
        coordinator_key=signing.verify_key.public.hex(),
    )
    refresher = ModelRefresher(templates["int8"], served)
    follower = Follower(config, MemoryTransport(broker, "cam-2"), refresher)
    caplog.set_level(logging.DEBUG, logger="edge_client.serve.follower")
    follower.start()
    try:
        # Execute
        attacker.publish(topics.broadcast_model, unsigned)
        impostor.send(topics.broadcast_model, forged)
        moved = genuine.encode(topics.coordinator_status, broadcast({}, 7))
        attacker.publish(topics.broadcast_model, moved)
        real = state_arrays(classifier(4))
        genuine.send(topics.broadcast_model, broadcast(real, 2, "int8"))
        wait_until(lambda: refresher.round == 2)
    finally:
        follower.stop()
    # Assert: three refusals, one line each, the first of the topic's minute at WARNING
    # (a flood cannot fill the device's log); the signed model is the one served
    refusals = [r for r in caplog.records if "dropped a message on" in r.getMessage()]
    assert len(refusals) == 3
    assert [r.levelno for r in refusals] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert any("unsigned frame" in r.getMessage() for r in refusals)
    assert sum("bad coordinator signature" in r.getMessage() for r in refusals) == 2
    assert refresher.round == 2


def test_a_follower_without_the_coordinator_key_refuses_to_start(
    templates: dict[str, Path], tmp_path: Path, broker: MemoryBroker
) -> None:
    served = tmp_path / "model.onnx"
    config = ClientConfig(
        device_id="cam-3", fleet=FLEET, serve_onnx=served, onnx_template=templates["fp32"]
    )
    with pytest.raises(ConfigError, match="--coordinator-key-file"):
        Follower(
            config, MemoryTransport(broker, "cam-3"), ModelRefresher(templates["fp32"], served)
        )
