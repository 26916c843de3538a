"""docs/protocol.md is enough: a decoder written from it alone (independent_decoder.py)
decodes every golden payload exactly as the `protocol` package does, recomputes the
content fingerprint byte by byte, and rejects what the reference rejects."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zstandard

from protocol.arrays import content_fingerprint
from protocol.auth import AuthError, Keyring, derive_device_key, new_key, seal, verify
from protocol.chunking import split_frame
from protocol.codec import Codec, signed_twin
from protocol.errors import DecodeError
from protocol.messages import Message, ModelPayload
from protocol.signing import SigningKey
from protocol.tensors import encode_array
from protocol.tensorset import TensorSet
from tests.protocol import independent_decoder as spec
from tests.protocol.golden_cases import (
    BROADCAST_TOPIC,
    GOLDEN_DIR,
    GOLDEN_KEY,
    GOLDEN_SIGNING_SEED,
    GOLDEN_TOPICS,
    STUDENT_FINGERPRINT,
    TRANSFER_ID,
    TRANSFER_SENT_MS,
    cases,
)

MODULE = Path(spec.__file__)
ALLOWED_IMPORTS = {
    "__future__",
    "typing",
    "hashlib",
    "hmac",
    "struct",
    "msgpack",
    "numpy",
    "zstandard",
    "cryptography",  # Ed25519 (RFC 8032), section 2.5: any implementation would do
}
NAMES = sorted(cases())


def reference_tensors(frame: bytes) -> dict[str, dict[str, np.ndarray]]:
    message = Codec().decode(frame)
    return {name: s.to_arrays() for name, s in message.tensor_sets().items()}


def independent_tensors(frame: bytes) -> dict[str, list[spec.Tensor]]:
    env = spec.decode_message_frame(frame)
    return {name: spec.decode_set(s) for name, s in spec.tensor_sets(env).items()}


def assert_same_tensors(frame: bytes) -> int:
    """Every tensor decodes to the same dtype, shape and bytes both ways; returns how many."""
    ours, theirs = independent_tensors(frame), reference_tensors(frame)
    assert list(ours) == list(theirs)
    count = 0
    for name, tensors in ours.items():
        assert [t.name for t in tensors] == list(theirs[name])
        for t in tensors:
            reference = theirs[name][t.name]
            assert t.values.dtype == reference.dtype, t.name
            assert t.values.shape == reference.shape == t.shape, t.name
            assert t.values.tobytes() == reference.tobytes(), t.name
            count += 1
    return count


def test_the_decoder_imports_nothing_of_protocol() -> None:
    # Prepare
    tree = ast.parse(MODULE.read_text())
    imported = {
        alias.name.split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, ast.Import)
        for alias in n.names
    }
    imported |= {
        n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
    }
    probe = (
        "import importlib.util, sys\n"
        f"s = importlib.util.spec_from_file_location('independent', {str(MODULE)!r})\n"
        "s.loader.exec_module(importlib.util.module_from_spec(s))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('protocol', 'tests')))\n"
    )  # fmt: skip
    # Execute
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    # Assert
    assert imported <= ALLOWED_IMPORTS, imported - ALLOWED_IMPORTS
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("name", NAMES)
def test_every_golden_frame_decodes_to_its_envelope(name: str) -> None:
    # Prepare
    frame = (GOLDEN_DIR / f"{name}.frame").read_bytes()
    golden = msgpack.unpackb((GOLDEN_DIR / f"{name}.msgpack").read_bytes(), raw=False)
    reference = Codec().decode(frame)
    # Execute
    env = spec.decode_message_frame(frame)
    # Assert
    assert env == golden
    assert (env["kind"], env["fleet"], env["round"], env["sender"]) == (
        reference.kind,
        reference.fleet,
        reference.round,
        reference.sender,
    )
    assert (env["id"].hex(), env["ts"]) == (reference.message_id, reference.sent_at_ms)


def test_every_golden_tensor_decodes_as_the_reference_does() -> None:
    # Prepare
    frames = {n: (GOLDEN_DIR / f"{n}.frame").read_bytes() for n in ("model", "update")}
    # Execute
    counts = {n: assert_same_tensors(frame) for n, frame in frames.items()}
    # Assert: fp32 (plain and shuffled), fp16, bf16, int8, int8_ch, int4_ch, raw int64
    # and bool in the model; int8_ch and fp16 in the update
    assert counts == {"model": 9, "update": 2}
    student = {t.name: t for t in independent_tensors(frames["model"])["student"]}
    assert student["mask"].values.tolist() == [True, False]
    assert student["steps"].dtype == "int64" and student["steps"].values.tolist() == 7


def test_golden_chunks_reassemble_in_any_order_with_duplicates() -> None:
    # Prepare
    frame = (GOLDEN_DIR / "model.frame").read_bytes()
    chunks = [(GOLDEN_DIR / f"model.chunk{i}").read_bytes() for i in range(5)]
    topic = GOLDEN_TOPICS["model"]
    # Execute
    heads = [spec.read_chunk(c) for c in chunks]
    rebuilt = spec.reassemble([*reversed(chunks), chunks[1]])
    # Assert
    assert rebuilt == frame
    assert {(h.transfer_id, h.count, h.total_size) for h in heads} == {(TRANSFER_ID, 5, len(frame))}
    assert {h.sent_ms for h in heads} == {TRANSFER_SENT_MS}  # 2027-01-01, UTC
    assert [h.index for h in heads] == [0, 1, 2, 3, 4]
    # the maximum (200 here) includes the 100-byte chunk header (section 2.2)
    assert [len(c) for c in chunks] == [200, 200, 200, 200, len(frame) - 4 * 100 + 100]
    # every chunk carries its own tag (section 2.3), on its topic only
    for chunk in chunks:
        spec.check_tag(GOLDEN_KEY, topic, chunk)
        with pytest.raises(spec.RejectedError):
            spec.check_tag(GOLDEN_KEY, topic.replace("dev-001", "dev-002"), chunk)


def test_the_content_fingerprint_by_the_spec_matches_the_reference() -> None:
    # Prepare
    model = independent_tensors((GOLDEN_DIR / "model.frame").read_bytes())["student"]
    update_env = spec.decode_message_frame((GOLDEN_DIR / "update.frame").read_bytes())
    reference = reference_tensors((GOLDEN_DIR / "model.frame").read_bytes())["student"]
    # Execute
    ours = spec.content_fingerprint(model)
    # Assert: the golden update is a delta against the golden student as decoded
    assert ours == content_fingerprint(reference) == STUDENT_FINGERPRINT
    assert update_env["body"]["sets"]["weights"]["base"] == ours


DTYPES = ["float32", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"]


@pytest.mark.parametrize("seed", range(5))
def test_the_content_fingerprint_by_the_spec_on_random_sets(seed: int) -> None:
    # Prepare: every dtype, scalars, empty tensors, non-ASCII names, big-endian input
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray] = {}
    for i, dtype in enumerate(DTYPES):
        shape = tuple(int(d) for d in rng.integers(0, 4, size=int(rng.integers(0, 4))))
        values = rng.standard_normal(shape) * 100
        array = (values > 0) if dtype == "bool" else values.astype(dtype)
        arrays[f"t{i}.ä{'x' * int(rng.integers(0, 300))}"] = array
    arrays["be"] = np.arange(6, dtype=">i4").reshape(2, 3)
    tensors = [spec.Tensor(name, np.dtype(a.dtype).name, a.shape, a) for name, a in arrays.items()]
    # Execute
    ours = spec.content_fingerprint(tensors)
    # Assert
    assert ours == content_fingerprint(arrays)


def raw_values(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    if dtype == "bool":
        return rng.random(shape) > 0.5
    if dtype.startswith("float"):
        return (rng.standard_normal(shape) * 1e3).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


def model_frame(*tensors: object) -> bytes:
    sets = {"s": TensorSet(tensors=tuple(tensors))}  # type: ignore[arg-type]
    return Codec().encode(Message(fleet="lab", sender="coordinator", body=ModelPayload(sets=sets)))


@pytest.mark.parametrize("shape", [(5, 7), (3,), (), (0, 4), (2, 3, 3)])
def test_every_encoding_of_random_values_decodes_as_the_reference_does(
    shape: tuple[int, ...],
) -> None:
    # Prepare
    rng = np.random.default_rng(len(shape))
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    tensors = [
        encode_array(f"{encoding}{'s' * shuffle}", x, encoding, shuffle=shuffle)
        for encoding in ("fp32", "fp16", "bf16")
        for shuffle in (False, True)
    ]
    tensors += [
        encode_array(encoding, x, encoding, rng=rng) for encoding in ("int8", "int8_ch", "int4_ch")
    ]
    tensors += [
        encode_array(f"raw_{dtype}{'s' * shuffle}", raw_values(rng, dtype, shape), "raw", shuffle=shuffle)
        for dtype in DTYPES
        for shuffle in (False, True)
    ]  # fmt: skip
    frame = model_frame(*tensors)
    # Execute
    count = assert_same_tensors(frame)
    # Assert
    assert count == len(tensors)
    chunks = split_frame(frame, 300)
    assert spec.reassemble(chunks[::-1]) == frame


def _with_tensor_data(data: bytes, tensor: list[object]) -> bytes:
    env = Codec().envelope(
        Message(fleet="lab", sender="c", body=ModelPayload(sets={"m": TensorSet()}))
    )
    env["body"]["sets"]["m"]["tensors"] = [[*tensor[:5], data, *tensor[6:]]]  # type: ignore[index]
    raw = msgpack.packb(env, use_bin_type=True)
    return b"FL\x07\x01" + bytes(32) + zstandard.ZstdCompressor(write_checksum=True).compress(raw)


def _streamed(raw: bytes) -> bytes:
    """A zstd frame with a checksum but without Frame_Content_Size."""
    comp = zstandard.ZstdCompressor(write_checksum=True, write_content_size=False).compressobj()
    return comp.compress(raw) + comp.flush()


def _bad_frames() -> dict[str, bytes]:
    ack = (GOLDEN_DIR / "ack.frame").read_bytes()
    raw = (GOLDEN_DIR / "ack.msgpack").read_bytes()
    bool_t = encode_array("m", np.array([True, False]), "raw").to_wire()
    int4_t = encode_array("q", np.arange(3, dtype=np.float32), "int4_ch").to_wire()
    int4_data = int4_t[5]
    assert isinstance(int4_data, bytes)
    return {
        "version 3": b"FL\x03\x01" + ack[36:],
        "version 5": b"FL\x05\x01" + ack[4:],
        "frame type 5": b"FL\x07\x05" + ack[4:],
        "no checksum": b"FL\x07\x01" + bytes(32) + zstandard.ZstdCompressor().compress(raw),
        "no content size": b"FL\x07\x01" + bytes(32) + _streamed(raw),
        "corrupt checksum": ack[:-1] + bytes([ack[-1] ^ 1]),
        # Dictionary_ID_flag 1 with a 1-byte Dictionary_ID of 0: zstd itself would accept it
        "dictionary flag": ack[:40] + bytes([ack[40] | 1, 0]) + ack[41:],
        "trailing byte": ack + b"\0",
        "bool byte 2": _with_tensor_data(b"\x01\x02", bool_t),
        "int4 padding": _with_tensor_data(int4_data[:-1] + bytes([int4_data[-1] | 0x10]), int4_t),
    }


@pytest.mark.parametrize("case", sorted(_bad_frames()))
def test_both_decoders_reject_the_same_non_canonical_frames(case: str) -> None:
    # Prepare
    frame = _bad_frames()[case]
    # Execute, Assert
    with pytest.raises(spec.RejectedError):
        spec.decode_message_frame(frame)
    with pytest.raises(DecodeError):
        Codec().decode(frame)


@pytest.mark.parametrize("name", sorted(n for n in GOLDEN_TOPICS if n != "coord_status"))
def test_the_spec_verifies_the_tag_of_every_golden_device_frame(name: str) -> None:
    # Prepare
    frame = (GOLDEN_DIR / f"{name}.frame").read_bytes()
    topic = GOLDEN_TOPICS[name]
    other = topic.replace("dev-001", "dev-002")
    # Execute, Assert: the right key on the right topic verifies, nothing else does
    spec.check_tag(GOLDEN_KEY, topic, frame)
    with pytest.raises(spec.RejectedError):
        spec.check_tag(GOLDEN_KEY, other, frame)
    with pytest.raises(spec.RejectedError):
        spec.check_tag(bytes(32), topic, frame)


def test_the_spec_and_the_reference_agree_on_tags_of_random_keys_and_topics() -> None:
    # Prepare
    frame = (GOLDEN_DIR / "update.frame").read_bytes()
    for i in range(20):
        key, topic = new_key(), f"fl/f{i}/devices/d{i}/update"
        # Execute
        sealed = seal(key, topic, frame)
        # Assert
        spec.check_tag(key, topic, sealed)
        verify(key, topic, sealed)
        tampered = sealed[:-5] + bytes([sealed[-5] ^ 1]) + sealed[-4:]
        with pytest.raises(spec.RejectedError):
            spec.check_tag(key, topic, tampered)
        with pytest.raises(AuthError):
            verify(key, topic, tampered)
    assert len(Keyring({"d0": new_key()})) == 1


def test_a_frame_sealed_with_a_derived_key_verifies_under_the_spec_derivation() -> None:
    # Prepare: a fleet token; the reference derives each device's key and seals with it
    frame = (GOLDEN_DIR / "update.frame").read_bytes()
    token = new_key()
    for device_id in ("d0", "dev-001", "a.b_c-9"):
        topic = f"fl/lab/devices/{device_id}/update"
        # Execute
        sealed = seal(derive_device_key(token, device_id), topic, frame)
        # Assert: the key by section 2.4 verifies it; another id's or token's does not
        spec.check_tag(spec.derived_key(token, device_id), topic, sealed)
        with pytest.raises(spec.RejectedError):
            spec.check_tag(spec.derived_key(token, device_id + "x"), topic, sealed)
        with pytest.raises(spec.RejectedError):
            spec.check_tag(spec.derived_key(new_key(), device_id), topic, sealed)


def test_the_spec_verifies_the_coordinator_signature_of_fleet_wide_frames() -> None:
    # Prepare: the golden status (signed, type 0x03) and the broadcast's signed chunks
    public = SigningKey(GOLDEN_SIGNING_SEED).verify_key.public
    status = (GOLDEN_DIR / "coord_status.frame").read_bytes()
    chunks = sorted(GOLDEN_DIR.glob("broadcast.chunk*"), key=lambda p: int(p.name[15:]))
    payloads = [p.read_bytes() for p in chunks]
    # Execute
    spec.check_signature(public, GOLDEN_TOPICS["coord_status"], status)
    for payload in payloads:
        spec.check_signature(public, BROADCAST_TOPIC, payload)
    whole = spec.reassemble(payloads[::-1])
    spec.check_signature(public, BROADCAST_TOPIC, whole)
    # Assert: it decodes as the reference does, and nothing else verifies
    assert spec.decode_message_frame(status) == msgpack.unpackb(
        (GOLDEN_DIR / "coord_status.msgpack").read_bytes(), raw=False
    )
    assert_same_tensors(whole)
    with pytest.raises(spec.RejectedError, match="bad coordinator signature"):
        spec.check_signature(public, BROADCAST_TOPIC, status)  # the topic is signed
    with pytest.raises(spec.RejectedError, match="bad coordinator signature"):
        spec.check_signature(SigningKey.generate().verify_key.public, BROADCAST_TOPIC, whole)
    unsigned = Codec().encode(cases()["coord_status"])
    with pytest.raises(spec.RejectedError, match="not a signed frame"):
        spec.check_signature(public, GOLDEN_TOPICS["coord_status"], unsigned)


def test_the_spec_and_the_reference_agree_on_signatures_of_random_keys_and_topics() -> None:
    frame = Codec().encode(cases()["coord_status"])
    for i in range(10):
        key, topic = SigningKey.generate(), f"fl/f{i}/coordinator/status"
        signed = key.sign(topic, signed_twin(frame))
        spec.check_signature(key.verify_key.public, topic, signed)
        tampered = signed[:-5] + bytes([signed[-5] ^ 1]) + signed[-4:]
        with pytest.raises(spec.RejectedError):
            spec.check_signature(key.verify_key.public, topic, tampered)
        with pytest.raises(AuthError):
            key.verify(topic, tampered)
