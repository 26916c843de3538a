"""Frame authentication (protocol.auth) over a channel: real HMAC-SHA256, the in-memory
broker, an attacker who publishes raw bytes anywhere."""

from __future__ import annotations

import logging
import queue
from pathlib import Path

import pytest

from protocol.auth import (
    KEY_SIZE,
    ZERO_TAG,
    AuthError,
    Keyring,
    frame_tag,
    new_key,
    read_key_file,
    seal,
    verify,
    write_key_file,
)
from protocol.channel import Channel
from protocol.chunking import split_frame
from protocol.codec import signed_twin
from protocol.errors import DecodeError, EncodeError
from protocol.messages import CoordinatorStatus, DeviceStatus, Message, ModelPayload
from protocol.samples import sample_weights
from protocol.signing import SigningKey, VerifyKey
from protocol.tensorset import encode_tensors
from protocol.transport.memory import MemoryBroker, MemoryTransport

UP = "fl/lab/devices/dev-1/status"
DOWN = "fl/lab/to/dev-1/model"


def status() -> Message:
    return Message(fleet="lab", sender="dev-1", body=DeviceStatus(state="idle"))


def model() -> Message:
    sets = {"global": encode_tensors(sample_weights("resnet8_small"), "fp32")}
    return Message(fleet="lab", sender="coordinator", body=ModelPayload(sets=sets))


class Receiver:
    """A channel with ``keyring`` subscribed to everything, recording messages and errors."""

    def __init__(
        self, broker: MemoryBroker, keyring: Keyring | None, fleet_key: VerifyKey | None = None
    ) -> None:
        transport = MemoryTransport(broker, "receiver")
        transport.connect()
        self.messages: queue.Queue[Message] = queue.Queue()
        self.errors: queue.Queue[DecodeError] = queue.Queue()
        self.channel = Channel(transport, auth=keyring, fleet_key=fleet_key)
        self.channel.subscribe(
            "fl/#", lambda _t, m: self.messages.put(m), on_error=lambda _t, e: self.errors.put(e)
        )


def sender(
    broker: MemoryBroker,
    keyring: Keyring | None,
    fleet_key: SigningKey | None = None,
    client_id: str = "sender",
) -> Channel:
    transport = MemoryTransport(broker, client_id)
    transport.connect()
    return Channel(transport, auth=keyring, max_payload=32 * 1024, fleet_key=fleet_key)


def test_a_sealed_message_arrives_and_every_change_to_it_is_refused() -> None:
    # Prepare
    broker, key = MemoryBroker(), new_key()
    receiver = Receiver(broker, Keyring({"dev-1": key}))
    honest = sender(broker, Keyring({"dev-1": key}))
    frame = honest.encode(UP, status())
    raw = honest.transport
    # Execute: the sealed frame, then with one bit flipped in each region, then under
    # another key, then as an unauthenticated (zero-tag) frame
    honest.send(UP, status())
    for offset in (4, 20, 40, len(frame) - 1):
        tampered = bytearray(frame)
        tampered[offset] ^= 0x01
        raw.publish(UP, bytes(tampered))
    raw.publish(UP, seal(new_key(), UP, frame))
    raw.publish(UP, frame[:4] + ZERO_TAG + frame[36:])
    # Assert
    assert receiver.messages.get(timeout=5).kind == "device_status"
    errors = [receiver.errors.get(timeout=5) for _ in range(6)]
    assert all(isinstance(e, AuthError) and e.device_id == "dev-1" for e in errors)
    assert receiver.messages.empty()


def test_a_frame_moved_to_another_topic_or_direction_does_not_verify() -> None:
    # Prepare
    key = new_key()
    frame = seal(key, UP, Channel(MemoryTransport(MemoryBroker(), "x")).codec.encode(status()))
    # Execute, Assert
    verify(key, UP, frame)
    for topic in (
        "fl/lab/devices/dev-2/status",  # another device (with the same key, even)
        "fl/other/devices/dev-1/status",  # another fleet
        "fl/lab/to/dev-1/status",  # the other direction
        "fl/lab/devices/dev-1/hello",  # another leaf
    ):
        with pytest.raises(AuthError):
            verify(key, topic, frame)
    assert frame_tag(key, UP, frame) == frame[4:36]


def test_chunks_of_an_unknown_device_are_dropped_before_reassembly() -> None:
    # Prepare: a chunked model on the downlink of a device the receiver has no key for
    broker = MemoryBroker()
    receiver = Receiver(broker, Keyring({"dev-2": new_key()}))
    attacker = sender(broker, None)
    frame = attacker.codec.encode(model())
    chunks = split_frame(frame, 32 * 1024)
    # Execute
    for chunk in chunks:
        attacker.transport.publish(DOWN, chunk)
    # Assert: every chunk refused on its own; nothing is held for reassembly
    errors = [receiver.errors.get(timeout=5) for _ in chunks]
    assert all(isinstance(e, AuthError) and "no key" in str(e) for e in errors)
    assert receiver.channel._reassembler.pending_bytes == 0
    assert receiver.messages.empty()


def test_a_chunked_message_is_authenticated_once_as_a_whole() -> None:
    # Prepare
    broker, key = MemoryBroker(), new_key()
    receiver = Receiver(broker, Keyring({"dev-1": key}))
    channel = sender(broker, Keyring({"dev-1": key}))
    message = model()
    # Execute
    sent = channel.send(DOWN, message)
    # Assert
    assert sent.frames > 1
    assert receiver.messages.get(timeout=5) == message
    assert receiver.errors.empty()


def test_every_chunk_is_sealed_and_forged_chunks_never_take_a_buffer() -> None:
    """Protocol v5: a chunk verifies on its own, so a flood of forged transfers on a
    device's own topic (more than its quota of 4) cannot evict its upload in flight."""
    # Prepare: dev-1's chunked model, its first chunk delivered; a forger without its key
    broker, key = MemoryBroker(), new_key()
    receiver = Receiver(broker, Keyring({"dev-1": key}))
    honest = sender(broker, Keyring({"dev-1": key}))
    message = model()
    frame = honest.encode(DOWN, message)
    chunks = [seal(key, DOWN, c) for c in split_frame(frame, 32 * 1024)]
    assert len(chunks) > 1 and all(verify(key, DOWN, c) is None for c in chunks)
    honest.transport.publish(DOWN, chunks[0])
    forger = honest.transport  # anyone on the broker: the client does not matter
    forged = [split_frame(honest.codec.encode(model()), 32 * 1024)[0] for _ in range(8)]
    forged.append(seal(new_key(), DOWN, forged[0]))  # sealed, with another key
    # Execute
    for chunk in forged:
        forger.publish(DOWN, chunk)
    errors = [receiver.errors.get(timeout=5) for _ in forged]
    held = receiver.channel._reassembler.pending_transfers
    for chunk in chunks[1:]:
        honest.transport.publish(DOWN, chunk)
    # Assert: every forged chunk refused on its tag; the honest transfer alone was held,
    # and completes
    assert all(isinstance(e, AuthError) and "bad authentication tag" in str(e) for e in errors)
    assert held == 1
    assert receiver.messages.get(timeout=5) == message
    assert receiver.errors.empty()


def test_input_failing_before_its_tag_is_checked_is_unauthenticated() -> None:
    # Prepare: a receiver holding dev-1's key; an attacker without it
    broker = MemoryBroker()
    receiver = Receiver(broker, Keyring({"dev-1": new_key()}))
    attacker = sender(broker, None)
    frame = attacker.codec.encode(status())
    chunk = bytearray(split_frame(frame + bytes(100), 128)[0])
    chunk[60:68] = (1 << 40).to_bytes(8, "big")  # a chunk announcing a terabyte
    bad = [b"", b"XX" + frame[2:], frame[:2] + b"\x03" + frame[3:], frame[:3] + b"\x09", chunk]
    # Execute: on dev-1's topic
    for payload in bad:
        attacker.transport.publish(UP, bytes(payload))
    # Assert: AuthErrors naming the device, whatever failed first; nothing held
    errors = [receiver.errors.get(timeout=5) for _ in bad]
    assert all(isinstance(e, AuthError) and e.device_id == "dev-1" for e in errors)
    assert "unauthenticated input" in str(errors[1]) and "bad magic" in str(errors[1])
    assert receiver.channel._reassembler.pending_transfers == 0
    assert receiver.messages.empty()


def test_with_a_keyring_a_topic_outside_the_layout_is_refused_before_decoding() -> None:
    # Prepare: a well-formed, unsealed message on topics no device id can name
    broker = MemoryBroker()
    receiver = Receiver(broker, Keyring({"dev-1": new_key()}))
    attacker = sender(broker, None)
    frame = attacker.codec.encode(status())
    topics = ["fl/lab/devices/bad id!/status", "fl/lab/devices/dev-1/status/x", "fl/lab/x"]
    # Execute
    for topic in topics:
        attacker.transport.publish(topic, frame)
    # Assert
    errors = [receiver.errors.get(timeout=5) for _ in topics]
    assert all(isinstance(e, AuthError) and "outside the layout" in str(e) for e in errors)
    assert receiver.messages.empty()
    # without a keyring (insecure) the same message is decoded as before
    insecure = Receiver(broker, None)
    attacker.transport.publish(topics[0], frame)
    assert insecure.messages.get(timeout=5).kind == "device_status"


STATUS = "fl/lab/coordinator/status"
BROADCAST = "fl/lab/broadcast/model"


def coordinator_status() -> Message:
    return Message(fleet="lab", sender="coordinator", body=CoordinatorStatus(state="finished"))


def test_fleet_wide_frames_are_signed_by_the_coordinator_and_checked_by_devices() -> None:
    # Prepare: the coordinator's channel holds the signing key, the device's its public half
    broker, signing = MemoryBroker(), SigningKey.generate()
    device = Receiver(broker, Keyring({"dev-1": new_key()}), signing.verify_key)
    coordinator = sender(broker, Keyring({"dev-1": new_key()}), signing)
    # Execute: a status and a chunked broadcast model, both signed
    coordinator.send(STATUS, coordinator_status())
    sent = coordinator.send(BROADCAST, model())
    # Assert
    assert device.messages.get(timeout=5).kind == "coord_status"
    assert device.messages.get(timeout=5).kind == "model"
    assert sent.frames > 1 and device.errors.empty()
    frame = coordinator.encode(STATUS, coordinator_status())
    assert frame[:4] == b"FL\x07\x03" and frame[4:68] != bytes(64)


def test_forged_fleet_wide_frames_are_refused_before_any_buffer() -> None:
    # Prepare: anyone on the broker (here with a device's key, or another signing key)
    broker, signing = MemoryBroker(), SigningKey.generate()
    device = Receiver(broker, Keyring({"dev-1": new_key()}), signing.verify_key)
    attacker = sender(broker, None)  # writes unsigned frames
    impostor = sender(broker, Keyring({"dev-1": new_key()}), SigningKey.generate(), "impostor")
    honest = sender(broker, Keyring({"dev-1": new_key()}), signing, "coordinator").encode(
        STATUS, coordinator_status()
    )
    # Execute: unsigned, signed by another key, a genuine status moved to another topic,
    # a tampered one, and a forged chunked model
    attacker.send(STATUS, coordinator_status())
    impostor.send(STATUS, coordinator_status())
    attacker.transport.publish(BROADCAST, honest)
    attacker.transport.publish(STATUS, honest[:-5] + bytes([honest[-5] ^ 1]) + honest[-4:])
    forged_chunks = impostor.send(BROADCAST, model()).frames
    # Assert: every one refused as unauthenticated, nothing delivered or buffered
    errors = [device.errors.get(timeout=5) for _ in range(4 + 1)]
    assert all(isinstance(e, AuthError) for e in errors)
    assert forged_chunks > 1  # the rest were remembered as refused, or refused one by one
    assert device.messages.empty()
    assert device.channel._reassembler.pending_transfers == 0


def test_without_a_coordinator_key_fleet_wide_frames_are_refused_and_not_sent() -> None:
    # Prepare: a device channel with its own key only
    broker, signing = MemoryBroker(), SigningKey.generate()
    device = Receiver(broker, Keyring({"dev-1": new_key()}))
    channel = sender(broker, Keyring({"dev-1": new_key()}))
    # Execute, Assert: it cannot check the coordinator's frames, nor publish fleet-wide
    sender(broker, Keyring(), signing, "coordinator").send(STATUS, coordinator_status())
    assert isinstance(device.errors.get(timeout=5), AuthError)
    assert device.messages.empty()
    with pytest.raises(EncodeError, match="signing key"):
        channel.send(STATUS, coordinator_status())
    with pytest.raises(EncodeError, match="no key"):
        channel.send("fl/lab/devices/dev-9/status", status())


def test_a_signed_frame_on_a_device_topic_is_refused() -> None:
    # Prepare
    broker, key, signing = MemoryBroker(), new_key(), SigningKey.generate()
    receiver = Receiver(broker, Keyring({"dev-1": key}), signing.verify_key)
    raw = sender(broker, None)
    frame = signing.sign(UP, signed_twin(raw.codec.encode(status())))
    # Execute
    raw.transport.publish(UP, frame)
    # Assert
    assert isinstance(receiver.errors.get(timeout=5), AuthError)
    assert receiver.messages.empty()


def test_an_insecure_channel_writes_zero_tags_and_checks_none() -> None:
    # Prepare
    broker = MemoryBroker()
    receiver = Receiver(broker, None)
    channel = sender(broker, None)
    # Execute
    channel.transport.publish(UP, seal(new_key(), UP, channel.codec.encode(status())))
    channel.send(UP, status())
    # Assert
    assert receiver.messages.get(timeout=5).kind == "device_status"
    assert receiver.messages.get(timeout=5).kind == "device_status"
    assert channel.encode(UP, status())[4:36] == ZERO_TAG


def test_keyring_and_key_files_round_trip_with_mode_0600(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare
    keys = {"dev-1": new_key(), "dev-2": new_key()}
    path, key_file = tmp_path / "keys.json", tmp_path / "dev-1.key"
    # Execute
    Keyring(keys).save(path)
    write_key_file(key_file, keys["dev-1"])
    # Assert
    assert dict(Keyring.load(path)) == keys
    assert read_key_file(key_file) == keys["dev-1"]
    assert path.stat().st_mode & 0o777 == 0o600 and key_file.stat().st_mode & 0o777 == 0o600
    assert len(keys["dev-1"]) == KEY_SIZE and keys["dev-1"] != keys["dev-2"]
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="protocol.auth"):
        Keyring.load(path)
    assert "chmod 600" in caplog.text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[]", "JSON object"),
        ('{"dev-1": "abcd"}', "32 bytes"),
        ('{"dev-1": "zz"}', "not hex"),
        ('{"dev/1": "' + "00" * 32 + '"}', "invalid device id"),
        ("{", "cannot read"),
    ],
)
def test_a_bad_keyring_is_refused_with_a_clear_error(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "keys.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        Keyring.load(path)


def test_python_m_protocol_keys_writes_key_files_and_the_keyring(tmp_path: Path) -> None:
    from protocol.__main__ import main

    # Execute: two devices, then one more into the same keyring; then a bad id
    assert (
        main(
            [
                "keys",
                "dev-0",
                "dev-1",
                "--keyring",
                str(tmp_path / "k.json"),
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert (
        main(["keys", "dev-2", "--keyring", str(tmp_path / "k.json"), "--out", str(tmp_path)]) == 0
    )
    assert (
        main(["keys", "dev/3", "--keyring", str(tmp_path / "k.json"), "--out", str(tmp_path)]) == 2
    )
    # Assert
    keyring = Keyring.load(tmp_path / "k.json")
    assert sorted(keyring) == ["dev-0", "dev-1", "dev-2"]
    assert all(read_key_file(tmp_path / f"{d}.key") == keyring[d] for d in keyring)
