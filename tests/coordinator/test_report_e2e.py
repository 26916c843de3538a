"""The coordinator's run report end to end over a real Mosquitto: ``python -m coordinator
--json-out --report-dir --eval-data`` with two ``python -m edge_client`` processes writes
the report of both rounds (bytes from its transport, the held-out accuracy), logs the
devices coming online, and refuses an output path it could not write before the run."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from coordinator.report import RunReport
from sim.datasets import load_dataset
from sim.partition import partition_dataset, save_device_file
from tests.protocol.brokers import Mosquitto

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow]

DEVICES = 2
ROUNDS = 2


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    with Mosquitto(tmp_path_factory.mktemp("mosquitto")) as mosquitto:
        yield mosquitto


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], Path]:
    """The devices' files, and a held-out .npz of 200 synthetic test images (uint8)."""
    out = tmp_path_factory.mktemp("data")
    splits = load_dataset("synthetic", seed=0)
    federation = partition_dataset(splits, DEVICES, float("inf"), seed=0)
    paths = []
    for split in federation.devices:
        path = out / f"{split.device_id}.npz"
        save_device_file(path, split)
        paths.append(path)
    assert splits.test is not None
    held_out = out / "held-out.npz"
    pixels = np.round(splits.test.x[:200, 0] * 255).astype(np.uint8)  # (N, H, W) uint8
    np.savez(held_out, x=pixels, y=splits.test.y[:200].astype(np.int32))
    return paths, held_out


def coordinator_command(broker: Mosquitto, fleet: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "coordinator",
        "--broker",
        broker.url,
        "--fleet",
        fleet,
        "--model",
        "mlp",
        "--rounds",
        str(ROUNDS),
        "--participation",
        "1.0",
        "--min-devices",
        str(DEVICES),
        "--round-timeout",
        "60",
        "--local-steps",
        "2",
        "--batch-size",
        "16",
        "--insecure-no-auth",
        "--no-onnx",
        *extra,
    ]


def edge_client(broker: Mosquitto, fleet: str, data: Path, root: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edge_client",
            "--broker",
            broker.url,
            "--fleet",
            fleet,
            "--data",
            str(data),
            "--model",
            "mlp",
            "--state-dir",
            str(root / data.stem),
            "--insecure-no-auth",
            "--exit-when-finished",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen[str], timeout: float) -> str:
    try:
        _, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
        pytest.fail(f"process did not finish in {timeout} s:\n{err[-3000:]}")
    return err


def test_the_coordinator_writes_the_report_of_its_rounds_with_held_out_accuracy(
    broker: Mosquitto, data: tuple[list[Path], Path], tmp_path: Path
) -> None:
    files, held_out = data
    json_out, report_dir = tmp_path / "out" / "run.json", tmp_path / "report"
    server = subprocess.Popen(
        coordinator_command(
            broker,
            "report",
            "--json-out",
            str(json_out),
            "--report-dir",
            str(report_dir),
            "--eval-data",
            str(held_out),
        ),
        stderr=subprocess.PIPE,
        text=True,
    )
    devices = [edge_client(broker, "report", path, tmp_path / "devices") for path in files]

    log = finish(server, 180)
    device_logs = [finish(device, 60) for device in devices]

    assert server.returncode == 0, log[-3000:]
    assert all(d.returncode == 0 for d in devices), [d[-2000:] for d in device_logs]
    assert f"1 of {DEVICES} online" in log
    report = RunReport.from_json_dict(json.loads(json_out.read_text()))
    assert [r.round for r in report.rounds] == [1, 2]
    final = report.final
    assert final["rounds"] == ROUNDS and final["interrupted"] is False
    for key in ("bytes_up", "bytes_down", "wire_bytes_up", "wire_bytes_down"):
        per_round = [getattr(r, key) for r in report.rounds]
        assert all(n > 0 for n in per_round), (key, per_round)
        # the transport's totals: the rounds' bytes, and the start-up and shutdown messages
        assert 0 < sum(per_round) <= final[key], (key, per_round, final[key])
    assert final["wire_bytes_up"] >= final["bytes_up"]
    for record in report.rounds:
        assert record.active_devices == DEVICES and record.closed_s is not None
        metrics = record.models["aca"]
        assert metrics.global_acc is not None and 0.0 <= metrics.global_acc <= 100.0
        assert metrics.amp == metrics.wlp == metrics.global_acc and metrics.fm == 0.0
    assert report.config["eval_data"] == str(held_out)
    with (report_dir / "rounds.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [row["round"] for row in rows] == ["1", "2"]
    assert rows[-1]["aca_global_acc"] != ""


def test_an_output_path_it_could_not_write_exits_2_before_the_run(
    broker: Mosquitto, data: tuple[list[Path], Path], tmp_path: Path
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a folder")

    done = subprocess.run(
        coordinator_command(broker, "badpath", "--json-out", str(afile / "run.json")),
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert done.returncode == 2, done.stderr[-3000:]
    assert f"--json-out {afile / 'run.json'}: {afile} is a file, not a folder" in done.stderr
    assert "round 1" not in done.stderr and not (tmp_path / "afile.json").exists()


def test_bad_held_out_data_exits_2_before_the_run(broker: Mosquitto, tmp_path: Path) -> None:
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.zeros((4, 3, 28, 28), np.float32), y=np.zeros(4, np.int64))

    done = subprocess.run(
        coordinator_command(broker, "baddata", "--eval-data", str(bad)),
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert done.returncode == 2, done.stderr[-3000:]
    assert "--eval-data" in done.stderr and "(N, 1, 28, 28)" in done.stderr
