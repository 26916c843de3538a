"""The fixed messages frozen under tests/protocol/golden/ (shared by test and generator).

Regenerate with ``python -m tests.protocol.golden_cases`` only together with a protocol
version bump: these bytes are the wire format.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from protocol.auth import seal, topic_device
from protocol.codec import Codec, signed_twin
from protocol.messages import (
    Ack,
    CoordinatorStatus,
    DeviceStatus,
    Hello,
    Message,
    ModelPayload,
    ReasonCode,
    RoundTask,
    Update,
    UploadSpec,
)
from protocol.signing import SigningKey
from protocol.tensors import encode_array
from protocol.tensorset import TensorSet

GOLDEN_DIR = Path(__file__).parent / "golden"
GOLDEN_KEY = bytes(range(0x20, 0x40))
"""The key of device ``dev-001`` the golden frames are sealed with (protocol.auth)."""
GOLDEN_TOPICS = {
    "hello": "fl/lab/devices/dev-001/hello",
    "task": "fl/lab/to/dev-001/task",
    "model": "fl/lab/to/dev-001/model",
    "update": "fl/lab/devices/dev-001/update",
    "ack": "fl/lab/to/dev-001/ack",
    "device_status": "fl/lab/devices/dev-001/status",
    "coord_status": "fl/lab/coordinator/status",
}
"""The topic each golden frame is sealed for; ``coord_status`` is fleet-wide, so it is
signed with :data:`GOLDEN_SIGNING_SEED` instead (a frame of type 0x03)."""
GOLDEN_SIGNING_SEED = bytes(range(0x40, 0x60))
"""The coordinator's signing key (an Ed25519 private key) of the golden signed frames."""
BROADCAST_TOPIC = "fl/lab/broadcast/model"
"""The topic of the golden signed chunks: the golden model as a broadcast."""
TRANSFER_SENT_MS = 1_798_761_600_000
"""The golden chunks' send time, 2027-01-01 00:00 UTC in Unix milliseconds."""
TRANSFER_ID = TRANSFER_SENT_MS.to_bytes(8, "big") + bytes(range(8))
STUDENT_FINGERPRINT = "2e2182719fad8974"
"""Content fingerprint (docs/protocol.md, section 6) of the golden model's ``student`` set
as decoded: the ``base`` of the golden update, a delta against it (section 9, step 5)."""


def _weights() -> dict[str, np.ndarray]:
    w = np.array([[-1.0, -0.5, 0.0, 0.25], [0.5, 1.0, 1.5, 3.0], [2.0, 2.0, 2.0, 2.0]], np.float32)
    return {"w": w, "b": np.array([0.1, -0.2, 0.3], np.float32)}


def _all_encodings_set() -> TensorSet:
    w = _weights()["w"]
    return TensorSet(
        tensors=(
            encode_array("fp32", w, "fp32"),
            encode_array("fp32s", w, "fp32", shuffle=True),
            encode_array("fp16", w, "fp16"),
            encode_array("bf16", w, "bf16"),
            encode_array("int8", w, "int8"),
            encode_array("int8_ch", w, "int8_ch"),
            encode_array("int4_ch", w[:, :3], "int4_ch"),
            encode_array("steps", np.array(7, np.int64), "raw"),
            encode_array("mask", np.array([True, False]), "raw"),
        )
    )


def cases() -> dict[str, Message]:
    """Name -> message, with fixed ids and timestamps."""
    common = {"fleet": "lab", "sent_at_ms": 1_700_000_000_000}

    def mid(i: int) -> str:
        return f"{i:032x}"

    w = _weights()
    return {
        "hello": Message(
            sender="dev-001",
            message_id=mid(1),
            **common,
            body=Hello(
                device_id="dev-001",
                architecture="lenet5",
                fingerprint="0123456789abcdef",
                precisions=("fp32", "int8"),
                memory_bytes=4 << 30,
                threads=4,
                software_version="0.1.0",
                num_samples=600,
                share_label_counts=True,
                platform="linux_aarch64",
                downlink_precision="int8",
                uplink_precision="int8",
                held_base="fedcba9876543210",
            ),
        ),
        "task": Message(
            sender="coordinator",
            round=3,
            message_id=mid(2),
            **common,
            body=RoundTask(
                strategy="fedkf",
                hyperparameters={
                    "local_epochs": 2,
                    "batch_size": 32,
                    "lr": 0.01,
                    "gamma": 1.0,
                    "qat": True,
                },
                deadline=1_700_000_060.5,
                downlink_precision="int8",
                uplink=UploadSpec(precision="int8", mode="delta", base="student"),
                payloads=("student", "teacher"),
                model_message=mid(3),
            ),
        ),
        "model": Message(
            sender="coordinator",
            round=3,
            message_id=mid(3),
            **common,
            body=ModelPayload(sets={"student": _all_encodings_set()}),
        ),
        "update": Message(
            sender="dev-001",
            round=3,
            message_id=mid(4),
            **common,
            body=Update(
                task_message=mid(2),
                num_samples=600,
                sets={
                    "weights": TensorSet(
                        mode="delta",
                        base=STUDENT_FINGERPRINT,
                        tensors=(
                            encode_array("w", w["w"], "int8_ch"),
                            encode_array("b", w["b"], "fp16"),
                        ),
                    )
                },
                label_counts=(10, 0, 590),
                metrics={"loss": 0.25, "accuracy": 0.875},
                timings={"train_s": 1.5},
            ),
        ),
        "ack": Message(
            sender="coordinator",
            round=3,
            message_id=mid(5),
            **common,
            body=Ack(accepted=False, reason=ReasonCode.LATE, ref=mid(4), detail="after deadline"),
        ),
        "device_status": Message(
            sender="dev-001",
            message_id=mid(6),
            **common,
            body=DeviceStatus(state="offline", session="0123456789abcdef"),
        ),
        "coord_status": Message(
            sender="coordinator",
            round=3,
            message_id=mid(7),
            **common,
            body=CoordinatorStatus(
                state="running",
                strategy="fedavg",
                rounds_total=10,
                devices_registered=20,
                devices_online=18,
            ),
        ),
    }


def sealed_frame(codec: Codec, name: str, message: Message) -> bytes:
    """The golden frame of case ``name``: encoded, sealed with :data:`GOLDEN_KEY` for its
    topic where that names a device, else signed with :data:`GOLDEN_SIGNING_SEED`."""
    frame = codec.encode(message)
    topic = GOLDEN_TOPICS[name]
    if topic_device(topic) is None:
        return SigningKey(GOLDEN_SIGNING_SEED).sign(topic, signed_twin(frame))
    return seal(GOLDEN_KEY, topic, frame)


def write_all() -> None:  # pragma: no cover - run by hand with a version bump
    codec = Codec()
    GOLDEN_DIR.mkdir(exist_ok=True)
    for name, message in cases().items():
        (GOLDEN_DIR / f"{name}.msgpack").write_bytes(codec.pack(message))
        (GOLDEN_DIR / f"{name}.frame").write_bytes(sealed_frame(codec, name, message))
    for i, chunk in enumerate(golden_chunks(sealed_frame(codec, "model", cases()["model"]))):
        (GOLDEN_DIR / f"model.chunk{i}").write_bytes(chunk)
    for i, chunk in enumerate(golden_signed_chunks(codec.encode(cases()["model"]))):
        (GOLDEN_DIR / f"broadcast.chunk{i}").write_bytes(chunk)


def golden_chunks(frame: bytes) -> list[bytes]:
    """The golden model frame's chunks (200-byte payloads), each sealed for its topic."""
    from protocol.chunking import split_frame

    parts = split_frame(frame, 200, transfer_id=TRANSFER_ID)
    return [seal(GOLDEN_KEY, GOLDEN_TOPICS["model"], part) for part in parts]


def golden_signed_chunks(frame: bytes) -> list[bytes]:
    """The golden model frame (unsealed) as a broadcast: signed as a type 0x03 frame on
    :data:`BROADCAST_TOPIC`, then split into signed chunks (type 0x04, 200-byte
    payloads), each signed for the topic."""
    from protocol.chunking import split_frame

    key = SigningKey(GOLDEN_SIGNING_SEED)
    signed = key.sign(BROADCAST_TOPIC, signed_twin(frame))
    parts = split_frame(signed, 200, transfer_id=TRANSFER_ID)
    return [key.sign(BROADCAST_TOPIC, part) for part in parts]


if __name__ == "__main__":  # pragma: no cover
    write_all()
