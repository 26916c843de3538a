"""An ``edge_client follow`` device over a real Mosquitto with no ACL (anyone may publish
on ``fl/{fleet}/broadcast/model``): it serves the model a real coordinator run broadcasts
(``broadcast_model``, signed with the coordinator's key), and nothing else: a forged model,
unsigned or signed by another key, whole or chunked, and a genuine broadcast of an earlier
round replayed, each leave one log line and the served model as it was (docs/protocol.md,
sections 2.5 and 4).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from coordinator.actions import Publish
from edge_client.config import ClientConfig
from edge_client.serve.follower import Follower, ModelRefresher
from edge_client.serve.template import OnnxTemplate
from models import build_classifier, seeded, state_arrays
from models.onnx_template import export_template
from protocol.arrays import content_fingerprint
from protocol.auth import Keyring, new_key
from protocol.channel import Channel
from protocol.chunking import Reassembler, read_chunk_header
from protocol.codec import Codec, read_frame_header
from protocol.deltas import decode_sets
from protocol.messages import Message, ModelPayload
from protocol.sets import GLOBAL_SET
from protocol.signing import SigningKey
from protocol.tensorset import encode_tensors
from protocol.topics import Topics
from protocol.transport import Inbound, MqttConfig, MqttTransport
from tests.coordinator.mqtt_fleet import device_ids, run_fleet
from tests.protocol.brokers import Mosquitto

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow]

FLEET = "follow"
ROUNDS, DEVICES = 2, 2
SHAPE = (1, 28, 28)  # the coordinator's mlp on the synthetic data (its config's defaults)
WHOLE = 1 << 22
"""A ``max_payload`` that sends the mlp's model (~0.8 MB in fp32) in one frame."""
SMALL = 1 << 16
"""A ``max_payload`` that chunks it."""
REFUSED = "dropped a message on"
REPLAYED = "sent before the one served"
STALE_CHUNK = "a redelivery or a replay"


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    with Mosquitto(tmp_path_factory.mktemp("follow")) as running:
        yield running


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def global_arrays(message: Message) -> dict[str, np.ndarray]:
    assert isinstance(message.body, ModelPayload)
    return decode_sets(message.body.sets, [GLOBAL_SET])[GLOBAL_SET]


class Recorder:
    """Anyone on the broker: records every frame published on the broadcast topic, each
    transfer's chunks as they came and each broadcast's whole (reassembled) frame."""

    def __init__(self, url: str) -> None:
        self.topic = Topics(FLEET).broadcast_model
        self.transport = MqttTransport(MqttConfig.from_url(url, client_id="recorder"))
        self.transport.connect()
        self.chunks: dict[bytes, list[bytes]] = {}
        self.wholes: list[bytes] = []
        self._reassembler = Reassembler()
        self._lock = threading.Lock()
        self.transport.subscribe(self.topic, self._seen, qos=1)

    def _seen(self, inbound: Inbound) -> None:
        payload = bytes(inbound.payload)
        with self._lock:
            if read_frame_header(payload).chunk:
                transfer = read_chunk_header(payload).transfer_id
                self.chunks.setdefault(transfer, []).append(payload)
            whole = self._reassembler.feed(inbound.topic, payload)
            if whole is not None:
                self.wholes.append(bytes(whole))


class Log:
    """The follower's log lines, as caplog records them (from the MQTT client's thread)."""

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        self._caplog = caplog
        self.mark = 0

    def lines(self, text: str) -> list[str]:
        """Lines holding ``text`` since the last :meth:`next`."""
        messages = [r.getMessage() for r in self._caplog.records[self.mark :]]
        return [m for m in messages if text in m]

    def next(self) -> None:
        self.mark = len(self._caplog.records)

    def wait(self, text: str, count: int = 1) -> list[str]:
        """The lines holding ``text`` since the last :meth:`next`, once there are
        ``count``."""
        wait_until(lambda: len(self.lines(text)) >= count, f"{count} lines with {text!r}")
        return self.lines(text)


def test_a_follower_serves_the_coordinators_broadcast_and_refuses_forgeries_and_replays(
    broker: Mosquitto, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: the device's fp32 template of the fleet's mlp, a follower with the
    # coordinator's public key, someone recording the broadcast topic
    caplog.set_level(
        logging.DEBUG, logger="edge_client.serve.follower"
    )  # refusals after the first a minute are DEBUG
    caplog.set_level(logging.DEBUG, logger="protocol.chunking")
    template = tmp_path / "mlp.onnx"
    with seeded(0):
        model = build_classifier("mlp", num_classes=10, in_channels=1, image_size=SHAPE[1])
    template.write_bytes(export_template(model, SHAPE, precision="fp32", model_name="mlp"))
    signing = SigningKey.generate()
    topic = Topics(FLEET).broadcast_model
    served = tmp_path / "served" / "model.onnx"
    config = ClientConfig.from_broker_url(
        broker.url,
        device_id="cam-1",
        fleet=FLEET,
        serve_onnx=served,
        onnx_template=template,
        coordinator_key=signing.verify_key.public.hex(),
    )
    refresher = ModelRefresher(template, served, fsync=False)
    follower = Follower(config, MqttTransport(config.broker), refresher)
    recorder = Recorder(broker.url)
    broadcasts: list[Message] = []

    def observe(action: object) -> None:
        if isinstance(action, Publish) and action.topic == topic:
            broadcasts.append(action.message)

    follower.start()
    attacker = MqttTransport(MqttConfig.from_url(broker.url, client_id="attacker"))
    attacker.connect()
    try:
        # Execute 1: a real run broadcasts its model after each round
        keys = {device: new_key() for device in device_ids(DEVICES)}
        run = run_fleet(
            broker.url, FLEET, ROUNDS, keys, signing, observer=observe, broadcast_model=True
        )
        assert run.finished
        # Assert 1: the follower serves the last round's genuine model, as the template
        # renders it; every broadcast was chunked, and signed by the coordinator
        assert [m.round for m in broadcasts] == list(range(1, ROUNDS + 1))
        final = global_arrays(broadcasts[-1])
        wait_until(lambda: refresher.round == ROUNDS, f"round {ROUNDS} served")
        genuine = served.read_bytes()
        info = json.loads(served.with_name("model.onnx.json").read_text())
        assert genuine == OnnxTemplate.read(template).render(final)
        assert info["content"] == content_fingerprint(final) and info["round"] == ROUNDS
        wait_until(lambda: len(recorder.wholes) == ROUNDS, "the recorded broadcasts")
        recorded = [Codec().decode(frame) for frame in recorder.wholes]
        assert [(m.message_id, m.sent_at_ms) for m in recorded] == [
            (m.message_id, m.sent_at_ms) for m in broadcasts
        ]
        assert len(recorder.chunks) == ROUNDS and all(len(c) > 1 for c in recorder.chunks.values())
        for frame in recorder.wholes:
            signing.verify_key.verify(topic, frame)
        assert not Log(caplog).lines(REFUSED) and not Log(caplog).lines(REPLAYED)
        recorder.transport.disconnect()  # from now on, only the follower reassembles

        # Execute 2: anyone publishes a newer model (other weights that fit the template)
        # unsigned and signed by a key of its own, whole and chunked
        with seeded(9):
            other = build_classifier("mlp", num_classes=10, in_channels=1, image_size=SHAPE[1])
        body = ModelPayload(sets={GLOBAL_SET: encode_tensors(state_arrays(other), "fp32")})
        forged = Message(fleet=FLEET, sender="coordinator", round=ROUNDS + 1, body=body)
        impostor_key = SigningKey.generate()
        forgers = {
            "unsigned": Channel(attacker, max_payload=WHOLE),
            "signed by another key": Channel(
                attacker, max_payload=WHOLE, auth=Keyring(), fleet_key=impostor_key
            ),
            "unsigned, chunked": Channel(attacker, max_payload=SMALL),
            "signed by another key, chunked": Channel(
                attacker, max_payload=SMALL, auth=Keyring(), fleet_key=impostor_key
            ),
        }
        log = Log(caplog)
        for name, channel in forgers.items():
            log.next()
            frames = channel.send(topic, forged).frames
            assert (frames > 1) == name.endswith("chunked"), (name, frames)
            # Assert 2: one log line a frame (each chunk is checked before it is kept)
            refusals = log.wait(REFUSED, frames)
            reason = "unsigned frame" if name.startswith("unsigned") else "bad coordinator"
            assert len(refusals) == frames, (name, refusals)
            assert all(reason in line for line in refusals), (name, refusals)

        # Execute 3: the genuine broadcast of round 1, recorded, replayed: its chunks as
        # they were, and its whole frame (its signature verifies) in one publish
        log.next()
        first_transfer = next(iter(recorder.chunks.values()))
        for chunk in first_transfer:
            attacker.publish(topic, chunk, qos=1)
        # the first chunk ignored as a replay, the others with its transfer
        assert len(log.wait(STALE_CHUNK)) == 1
        log.wait("the transfer was dropped", len(first_transfer) - 1)
        assert not log.lines(REFUSED)
        log.next()
        attacker.publish(topic, recorder.wholes[0], qos=1)
        # Assert 3: each ignored with a log line; nothing refused as forged
        assert "round 1" in log.wait(REPLAYED)[0]
        assert not log.lines(REFUSED)

        # Assert 4: the genuine model is still served, byte for byte, with its record
        assert served.read_bytes() == genuine
        assert json.loads(served.with_name("model.onnx.json").read_text()) == info
        assert refresher.round == ROUNDS

        # Control: the follower still listened all along: a newer broadcast the
        # coordinator signs is served
        newer = Message(fleet=FLEET, sender="coordinator", round=1, body=body)
        Channel(attacker, auth=Keyring(), fleet_key=signing).send(topic, newer)
        # the model file is replaced before its record: wait for the record too
        expected = content_fingerprint(state_arrays(other))
        record = served.with_name("model.onnx.json")
        wait_until(
            lambda: json.loads(record.read_text())["content"] == expected,
            "the newer signed model's record",
        )
        assert served.read_bytes() != genuine
    finally:
        attacker.disconnect()
        recorder.transport.disconnect()
        follower.stop()
