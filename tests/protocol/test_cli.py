"""`python -m protocol`: inspect (exit 2 and one line on bad input) and demo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from protocol.codec import Codec
from protocol.errors import DecodeError
from protocol.inspect import bytes_after_frame, summarize
from protocol.messages import Message, ModelPayload
from protocol.tensorset import encode_tensors
from tests.protocol.golden_cases import GOLDEN_DIR

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "protocol", *args],
        cwd=ROOT,
        input=stdin,
        capture_output=True,
        timeout=120,
    )


def test_inspect_summarizes_a_message_from_a_file_and_from_stdin() -> None:
    frame = GOLDEN_DIR / "update.frame"
    for done in (run("inspect", str(frame)), run("inspect", "-", stdin=frame.read_bytes())):
        assert done.returncode == 0, done.stderr
        summary = json.loads(done.stdout)
        assert summary["kind"] == "update" and summary["round"] == 3
        assert summary["sender"] == "dev-001"
        tensors = summary["tensor_sets"]["weights"]["tensors"]
        assert [(t["name"], t["shape"], t["encoding"]) for t in tensors] == [
            ("w", [3, 4], "int8_ch"),
            ("b", [3], "fp16"),
        ]
        assert all("values" not in t for t in tensors)


def test_inspect_values_prints_every_tensor_dequantized() -> None:
    # Prepare
    frame = GOLDEN_DIR / "model.frame"
    # Execute
    done = run("inspect", "--values", str(frame))
    # Assert
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    values = {t["name"]: t["values"] for t in summary["tensor_sets"]["student"]["tensors"]}
    w = [[-1.0, -0.5, 0.0, 0.25], [0.5, 1.0, 1.5, 3.0], [2.0, 2.0, 2.0, 2.0]]
    assert values["fp32"] == values["fp32s"] == values["fp16"] == values["bf16"] == w
    # int4_ch: offset [-1, 0.5, 2], scale [1/15, 1/15, 0], codes [0, 7, 15] (section 8)
    step = float(np.float32(1 / 15))
    assert values["int4_ch"] == [
        [-1.0, float(np.float32(-1) + np.float32(7 * step)), 0.0],
        [0.5, float(np.float32(0.5) + np.float32(7 * step)), 1.5],
        [2.0, 2.0, 2.0],
    ]
    assert np.allclose(values["int8_ch"], w, atol=3.0 / 255 / 2 + 1e-6)
    assert values["steps"] == 7 and values["mask"] == [True, False]


def test_inspect_values_spells_non_finite_floats_as_strings() -> None:
    # Prepare
    arrays = {"w": np.array([np.nan, np.inf, -np.inf, 1.5], np.float32)}
    message = Message(
        fleet="lab", sender="coordinator", body=ModelPayload(sets={"g": encode_tensors(arrays)})
    )
    # Execute
    done = run("inspect", "--values", "--compact", "-", stdin=Codec().encode(message))
    # Assert
    assert done.returncode == 0, done.stderr
    assert b"NaN" not in done.stdout and b"Infinity" not in done.stdout
    tensor = json.loads(done.stdout)["tensor_sets"]["g"]["tensors"][0]
    assert tensor["values"] == ["nan", "inf", "-inf", 1.5]


def test_inspect_reassembles_chunks_given_in_any_order() -> None:
    chunks = sorted(str(p) for p in GOLDEN_DIR.glob("model.chunk*"))
    done = run("inspect", "--compact", *reversed(chunks))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["kind"] == "model"
    single = json.loads(run("inspect", chunks[1]).stdout)
    assert single["frame"] == "chunk" and single["index"] == 1 and single["count"] == 5


@pytest.mark.parametrize(
    ("files", "after"),
    [
        (("model.chunk0", "model.chunk1"), 200),  # two chunk files of one transfer
        (("model.chunk3", "model.chunk4"), 145),
        (("broadcast.chunk0", "broadcast.chunk3"), 200),  # signed chunks
        (("update.frame", "model.frame"), None),  # two message frames
    ],
)
def test_inspect_refuses_a_file_holding_two_frames(
    tmp_path: Path, files: tuple[str, ...], after: int | None
) -> None:
    both = tmp_path / "both.bin"
    both.write_bytes(b"".join((GOLDEN_DIR / name).read_bytes() for name in files))
    after = after or len((GOLDEN_DIR / files[1]).read_bytes())

    done = run("inspect", str(both))

    assert done.returncode == 2 and done.stdout == b""
    message = done.stderr.decode()
    assert f"{both} holds {after} bytes after its frame: one payload per file" in message
    assert message.count("\n") == 1


def test_a_frame_with_bytes_after_it_is_refused_and_one_frame_is_not() -> None:
    chunk = (GOLDEN_DIR / "model.chunk4").read_bytes()  # the last chunk: 45 bytes of data
    frame = (GOLDEN_DIR / "update.frame").read_bytes()

    assert [bytes_after_frame(p) for p in (chunk, frame, b"hello")] == [0, 0, 0]
    assert bytes_after_frame(frame + b"extra") == 5
    assert bytes_after_frame(chunk + bytes(500)) is None  # more data than its transfer
    with pytest.raises(DecodeError, match="more than its whole transfer"):
        summarize([chunk + bytes(500)])
    with pytest.raises(DecodeError, match=r"^cap\.bin holds 5 bytes after its frame"):
        summarize([frame + b"extra"], names=["cap.bin"])


@pytest.mark.parametrize("payload", [b"", b"hello", b"FL\x07\x01" + b"\0" * 72, b"FL\x07\x01xx"])
def test_bad_input_exits_2_with_one_line_and_no_traceback(payload: bytes) -> None:
    done = run("inspect", "-", stdin=payload)
    assert done.returncode == 2
    assert done.stdout == b""
    lines = done.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:")


def test_missing_file_and_no_command() -> None:
    done = run("inspect", "/nonexistent/payload.bin")
    assert done.returncode == 2 and b"cannot read" in done.stderr
    assert run().returncode == 2


def test_demo_sends_every_precision_through_a_real_broker() -> None:
    done = run("demo", "--json")
    assert done.returncode == 0, done.stderr
    rows = {r["precision"]: r for r in json.loads(done.stdout)}
    assert list(rows) == ["fp32", "fp16", "bf16", "int8", "int4"]
    assert rows["fp32"]["max_abs_error"] == 0.0 and rows["fp32"]["chunks"] == 2
    assert rows["int8"]["ratio_vs_fp32"] > 3.5 and rows["int4"]["ratio_vs_fp32"] > 7
    assert all(r["wire_bytes"] > r["payload_bytes"] for r in rows.values())
