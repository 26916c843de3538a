"""End to end over a real Mosquitto: one coordinator process, separate edge-client processes.

Also: the coordinator is killed with SIGKILL after a round and resumed with --resume while
the devices keep running; the run completes with every round.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from edge_client.serve.infer import OnnxClassifier
from protocol.auth import Keyring, new_key, write_key_file
from protocol.signing import SigningKey
from sim.datasets import load_dataset
from sim.partition import partition_dataset, save_device_file
from tests.protocol.brokers import Mosquitto

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow]

DEVICES = 3


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    with Mosquitto(tmp_path_factory.mktemp("mosquitto")) as mosquitto:
        yield mosquitto


@pytest.fixture(scope="module")
def device_files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    out = tmp_path_factory.mktemp("devices")
    federation = partition_dataset(load_dataset("synthetic", seed=0), DEVICES, float("inf"), seed=0)
    paths = []
    for split in federation.devices:
        path = out / f"{split.device_id}.npz"
        save_device_file(path, split)
        paths.append(path)
    keys = {split.device_id: new_key() for split in federation.devices}
    for device_id, key in keys.items():
        write_key_file(out / f"{device_id}.key", key)
    Keyring(keys).save(out / "keys.json")  # the devices' key files and the keyring
    SigningKey.generate().save(out / "coordinator.key")  # and coordinator.key.pub
    return paths


def keyring_of(files: list[Path]) -> Path:
    return files[0].parent / "keys.json"


def coordinator(
    broker: Mosquitto,
    fleet: str,
    state: Path,
    rounds: int,
    keys: Path,
    *extra: str,
    model: str = "mlp",
) -> subprocess.Popen[str]:
    command = [
        sys.executable,
        "-m",
        "coordinator",
        "--broker",
        broker.url,
        "--fleet",
        fleet,
        "--strategy",
        "fedavg_oca",
        "--model",
        model,
        "--rounds",
        str(rounds),
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
        "--state-dir",
        str(state),
        "--device-keys",
        str(keys),
        "--signing-key-file",
        str(keys.parent / "coordinator.key"),
        *extra,
    ]
    return subprocess.Popen(command, stderr=subprocess.PIPE, text=True)


def edge_clients(
    broker: Mosquitto, fleet: str, files: list[Path], root: Path, model: str = "mlp"
) -> list[subprocess.Popen[str]]:
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "edge_client",
                "--broker",
                broker.url,
                "--fleet",
                fleet,
                "--data",
                str(path),
                "--model",
                model,
                "--state-dir",
                str(root / path.stem),
                "--auth-key-file",
                str(path.with_suffix(".key")),
                "--coordinator-key-file",
                str(path.parent / "coordinator.key.pub"),
                "--exit-when-finished",
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        for path in files
    ]


def wait_all(processes: list[subprocess.Popen[str]], timeout: float) -> list[str]:
    logs = []
    for process in processes:
        try:
            _, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            _, err = process.communicate()
            pytest.fail(f"process did not finish in {timeout} s:\n{err[-3000:]}")
        logs.append(err)
    return logs


def read_until(process: subprocess.Popen[str], needle: str, timeout: float) -> str:
    seen = []
    deadline = time.monotonic() + timeout
    assert process.stderr is not None
    os.set_blocking(process.stderr.fileno(), True)
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return "".join(seen)
    process.kill()
    pytest.fail(f"{needle!r} not seen:\n{''.join(seen)[-3000:]}")


@pytest.mark.parametrize(
    "model",
    ["mlp", "tests.models.user_models:build_split"],  # a user's model, by import path
)
def test_separate_processes_complete_a_run_and_save_pt_and_onnx(
    broker: Mosquitto, device_files: list[Path], tmp_path: Path, model: str
) -> None:
    state = tmp_path / "state"
    fleet = f"e2e-{len(model)}"
    server = coordinator(broker, fleet, state, 2, keyring_of(device_files), model=model)
    devices = edge_clients(broker, fleet, device_files, tmp_path / "devices", model=model)

    (server_log,) = wait_all([server], 180)
    device_logs = wait_all(devices, 60)

    assert server.returncode == 0, server_log[-3000:]
    assert "round 2/2 closed" in server_log and f"{DEVICES}/{DEVICES} updates on time" in server_log
    assert all(p.returncode == 0 for p in devices), device_logs
    for name in ("aca", "oca"):
        weights = torch.load(state / "final" / f"{name}.pt", weights_only=True)
        assert all(torch.isfinite(t).all() for t in weights.values())
        model = OnnxClassifier((state / "final" / f"{name}.onnx").read_bytes())
        logits = model.predict_logits(np.zeros((2, 1, 28, 28), np.float32))
        assert logits.shape == (2, 10)


def test_coordinator_killed_after_a_round_resumes_and_finishes(
    broker: Mosquitto, device_files: list[Path], tmp_path: Path
) -> None:
    state = tmp_path / "state"
    server = coordinator(broker, "resume", state, 3, keyring_of(device_files))
    devices = edge_clients(broker, "resume", device_files, tmp_path / "devices")
    read_until(server, "round 1/3 closed", 120)
    server.send_signal(signal.SIGKILL)
    server.wait(10)

    again = coordinator(broker, "resume", state, 3, keyring_of(device_files), "--resume")
    (log,) = wait_all([again], 180)
    wait_all(devices, 60)

    assert again.returncode == 0, log[-3000:]
    assert "resuming: round" in log
    assert "round 3/3 closed" in log
    assert (state / "final" / "aca.pt").exists()


def test_reusing_a_state_dir_without_resume_is_refused(broker: Mosquitto, tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state).mkdir()
    from coordinator.store import FileStore

    FileStore(state).write("run", {"round": 1})

    result = subprocess.run(
        [sys.executable, "-m", "coordinator", "--broker", broker.url, "--state-dir", str(state)],
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert result.returncode == 2
    assert "--resume" in result.stderr


def test_a_users_model_on_series_trains_across_processes_and_exports_to_onnx(
    broker: Mosquitto, device_files: list[Path], tmp_path: Path
) -> None:
    """Samples of shape (9, 6) from an npz dataset, partitioned into device files, and a
    model of the user's that takes them: the coordinator is told the sample shape."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 240)
    x = rng.standard_normal((240, 9, 6)).astype(np.float32)
    x[:, :, 0] += 2.0 * y[:, None]
    np.savez(tmp_path / "watch.npz", x=x, y=y)
    keys = device_files[0].parent
    federation = partition_dataset(
        load_dataset("npz", tmp_path / "watch.npz"), DEVICES, float("inf"), seed=0
    )
    files = []
    for split in federation.devices:
        path = tmp_path / f"{split.device_id}.npz"
        save_device_file(path, split)
        path.with_suffix(".key").write_bytes(keys.joinpath(f"{split.device_id}.key").read_bytes())
        files.append(path)
    (tmp_path / "coordinator.key.pub").write_bytes((keys / "coordinator.key.pub").read_bytes())
    model = "tests.models.user_models:build_series"
    state = tmp_path / "state"
    shape = ("--input-shape", "9,6", "--num-classes", "3")
    server = coordinator(
        broker, "e2e-series", state, 2, keyring_of(device_files), *shape, model=model
    )
    devices = edge_clients(broker, "e2e-series", files, tmp_path / "devices", model=model)

    (server_log,) = wait_all([server], 180)
    device_logs = wait_all(devices, 60)

    assert server.returncode == 0, server_log[-3000:]
    assert "round 2/2 closed" in server_log
    assert all(p.returncode == 0 for p in devices), device_logs
    onnx = OnnxClassifier((state / "final" / "aca.onnx").read_bytes())
    assert onnx.predict_logits(x[:2]).shape == (2, 3)
