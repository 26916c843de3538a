"""`python -m sim partition` end to end, on the synthetic dataset."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sim.__main__ import main
from sim.partition import load_device_file
from sim.run import SimConfig

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "sim", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_partition_writes_device_files_and_summary(tmp_path: Path) -> None:
    out = tmp_path / "fed"

    result = run_cli(
        "partition", "--dataset", "synthetic", "--devices", "4", "--alpha", "0.5",
        "--out", str(out), "--seed", "3", "--min-samples", "20",
    )  # fmt: skip

    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "dev-000.npz", "dev-001.npz", "dev-002.npz", "dev-003.npz", "summary.json",
    ]  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["dataset"], summary["alpha"], summary["seed"]) == ("synthetic", 0.5, 3)
    assert summary["num_classes"] == 10 and summary["global_test_size"] == 2000
    devices = summary["devices"]
    assert sum(d["train_size"] + d["test_size"] for d in devices) == 10_000
    for entry in devices:
        loaded = load_device_file(out / entry["file"])
        assert loaded.device_id == entry["device_id"]
        assert loaded.train.label_counts().tolist() == entry["train_label_counts"]
        assert len(loaded.test) == entry["test_size"]
    entropies = []
    for entry in devices:
        p = np.array(entry["train_label_counts"], dtype=float) / entry["train_size"]
        entropies.append(-(p[p > 0] * np.log(p[p > 0])).sum())
    assert summary["mean_label_entropy_nats"] == pytest.approx(np.mean(entropies))
    assert "mean label entropy" in result.stdout and "dev-003.npz" in result.stdout


def test_bad_alpha_exits_2_with_one_line_error(tmp_path: Path) -> None:
    result = run_cli(
        "partition", "--dataset", "synthetic", "--devices", "4", "--alpha", "-1",
        "--out", str(tmp_path),
    )  # fmt: skip

    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "alpha must be > 0" in result.stderr
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["partition", "--dataset", "synthetic", "--alpha", "1"], "required: --devices, --out"),
        (["partition", "--dataset", "nope", "--devices", "2", "--alpha", "1", "--out", "x"],
         "invalid choice: 'nope'"),
        (["partition", "--dataset", "synthetic", "--devices", "two", "--alpha", "1", "--out",
          "x"], "invalid int value"),
        (["partition", "--dataset", "mnist", "--devices", "2", "--alpha", "1", "--out", "x"],
         "needs a data folder (--data-dir)"),
        (["partition", "--dataset", "synthetic", "--devices", "50", "--alpha", "1",
          "--min-samples", "300", "--out", "x"], "cannot give 50 devices 300 samples"),
    ],
)  # fmt: skip
def test_argument_and_data_errors_are_one_line_exit_2(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse exits itself on parse errors
        code = int(exc.code or 0)

    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and expected in err


def test_help_lists_both_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])

    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "partition" in out and "run" in out


def test_infinite_alpha_is_written_as_string(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["partition", "--dataset", "synthetic", "--devices", "2", "--alpha", "inf",
                 "--out", str(tmp_path)])  # fmt: skip

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert code == 0 and summary["alpha"] == "inf"
    assert summary["mean_label_entropy_nats"] == pytest.approx(math.log(10), abs=0.01)
    assert "2 devices, alpha=inf" in capsys.readouterr().out


def test_alpha_left_out_takes_the_runs_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["partition", "--dataset", "synthetic", "--devices", "2", "--out", str(tmp_path)])

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert code == 0 and summary["alpha"] == SimConfig().alpha == 0.5
    assert f"alpha={SimConfig().alpha}" in capsys.readouterr().out


def test_an_unwritable_out_fails_before_the_dataset_loads(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a folder")

    result = run_cli("partition", "--dataset", "synthetic", "--devices", "2", "--out", str(afile))

    assert result.returncode == 2, result.stderr
    assert "--out" in result.stderr and "is a file, not a folder" in result.stderr
    assert "loaded synthetic" not in result.stdout  # refused before any work
