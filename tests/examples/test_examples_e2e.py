"""Each worked example as its page runs it (docs/example-wearable.md,
docs/example-tabular.md), over a real Mosquitto: its dataset, partitioned into device
files, keys, an ONNX template of its model, a coordinator process and one edge-client
process per device (FedAvg), an ``edge_client follow`` device serving the broadcast
model, and ``edge_client infer`` classifying the test split with what it serves, to the
accuracy the coordinator's final model has."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from edge_client.serve.infer import OnnxClassifier
from tests.protocol.brokers import Mosquitto

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DEVICES = 3
EXAMPLES = {
    # name: (module, model, sample shape flag, classes, chance in percent)
    "wearable": ("edgefl_examples.wearable", "edgefl_examples.wearable:build_cnn", "6,100", 4, 25),
    "tabular": ("edgefl_examples.tabular", "edgefl_examples.tabular:build_mlp", "30", 2, 63),
}


def python(command: str, timeout: float = 300) -> str:
    """``python COMMAND`` in the repository (its words split at spaces, as the example pages
    writes them), asserted to succeed; its stdout."""
    args = command.split()
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    assert done.returncode == 0, f"{args}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def start(command: str) -> subprocess.Popen[str]:
    """``python COMMAND`` started in the background, its stderr kept."""
    args = [sys.executable, *command.split()]
    return subprocess.Popen(args, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def finish(process: subprocess.Popen[str], timeout: float) -> str:
    try:
        _, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
        pytest.fail(f"{process.args} did not finish in {timeout} s:\n{err[-3000:]}")
    assert process.returncode == 0, err[-3000:]
    return err


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_example_runs_over_mosquitto_and_is_served(name: str, tmp_path: Path) -> None:
    module, model, shape, classes, chance = EXAMPLES[name]
    data, devices = tmp_path / f"{name}.npz", tmp_path / "devices"
    python(f"-m {module} --out {data}")
    python(
        f"-m sim partition --dataset npz --data-dir {data} --devices {DEVICES} --alpha 0.5 "
        f"--out {devices}"
    )
    files = sorted(devices.glob("dev-*.npz"))
    assert len(files) == DEVICES
    ids = " ".join(f.stem for f in files)
    keyring, signing = tmp_path / "keys.json", tmp_path / "coordinator.key"
    python(f"-m protocol keys {ids} --keyring {keyring} --out {devices}")
    python(f"-m protocol keys --new-signing-key {signing}")
    template = tmp_path / "template.onnx"
    python(
        f"-m edge_client template --model {model} --num-classes {classes} "
        f"--input-shape {shape} --out {template}"
    )
    served = tmp_path / "served" / "model.onnx"
    state = tmp_path / "coordinator"
    fleet = f"example-{name}"

    (tmp_path / "mosquitto").mkdir()
    with Mosquitto(tmp_path / "mosquitto") as broker:
        at = f"--broker {broker.url} --fleet {fleet}"
        follower = start(
            f"-m edge_client follow {at} --device-id viewer "
            f"--coordinator-key-file {signing}.pub --serve-onnx {served} "
            f"--onnx-template {template}"
        )
        server = start(
            f"-m coordinator {at} --model {model} --input-shape {shape} "
            f"--num-classes {classes} --strategy fedavg --rounds 5 --participation 1 "
            f"--min-devices {DEVICES} --local-epochs 2 --batch-size 8 --lr 0.05 "
            f"--round-timeout 60 --broadcast-model --device-keys {keyring} "
            f"--signing-key-file {signing} --state-dir {state}"
        )
        clients = [
            start(
                f"-m edge_client {at} --data {path} --model {model} "
                f"--state-dir {tmp_path / path.stem} --auth-key-file {path.with_suffix('.key')} "
                f"--coordinator-key-file {signing}.pub --exit-when-finished"
            )
            for path in files
        ]
        server_log = finish(server, 300)
        for client in clients:
            finish(client, 60)
        meta = served.with_name("model.onnx.json")
        deadline = time.monotonic() + 30
        while not (meta.is_file() and json.loads(meta.read_text())["round"] == 5):
            assert time.monotonic() < deadline, "the follower never served round 5"
            time.sleep(0.2)
        follower.terminate()
        follower.communicate(timeout=30)

    assert "round 5/5 closed" in server_log
    arrays = np.load(data)
    x_test, y_test = arrays["x_test"], arrays["y_test"]
    batch = tmp_path / "x_test.npy"
    np.save(batch, x_test)
    out = json.loads(python(f"-m edge_client infer --model {served} --input {batch}"))
    predictions = np.array(out["predictions"])
    final = OnnxClassifier((state / "final" / "aca.onnx").read_bytes())
    np.testing.assert_array_equal(predictions, final.predict(x_test))  # the final model, served
    accuracy = 100.0 * float((predictions == y_test).mean())
    assert accuracy > chance + 15, accuracy
