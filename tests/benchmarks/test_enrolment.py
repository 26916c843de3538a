"""benchmarks/enrolment.py on a few ids: it enrols every one, forgeries none, and prints
every figure its docstring names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_enrolment_benchmark_prints_its_figures_for_a_small_fleet() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.enrolment",
            "--devices",
            "12",
            "--repeats",
            "5",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)
    assert row["devices"] == 12
    assert set(row) == {
        "devices", "derive_us", "forged_registered_us", "forged_token_us",
        "enrol_ms_first", "enrol_ms_last", "enrol_s_total", "journal_bytes",
    }  # fmt: skip
    assert row["journal_bytes"] > 12 * 64  # twelve keys of 64 hex digits
