"""`python -m protocol`: inspect (exit 2 and one line on bad input) and demo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
        tensors = summary["tensor_sets"]["model"]["tensors"]
        assert [(t["name"], t["shape"], t["encoding"]) for t in tensors] == [
            ("w", [3, 4], "int8_ch"),
            ("b", [3], "fp16"),
        ]


def test_inspect_reassembles_chunks_given_in_any_order() -> None:
    chunks = sorted(str(p) for p in GOLDEN_DIR.glob("model.chunk*"))
    done = run("inspect", "--compact", *reversed(chunks))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["kind"] == "model"
    single = json.loads(run("inspect", chunks[1]).stdout)
    assert single["frame"] == "chunk" and single["index"] == 1 and single["count"] == 4


@pytest.mark.parametrize("payload", [b"", b"hello", b"FL\x02\x01" + b"\0" * 40, b"FL\x07\x01xx"])
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
