"""``python -m edge_client`` (run, the default command) as a process on a real MQTT broker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from models import build_classifier, state_arrays, state_shapes
from protocol import (
    Channel,
    DeviceStatus,
    Hello,
    Message,
    ModelPayload,
    RoundTask,
    Topics,
    Update,
    encode_tensors,
)
from protocol.auth import Keyring, new_key, write_key_file
from protocol.transport import EmbeddedBroker, MqttConfig, MqttTransport
from sim.partition import partition_dataset, save_device_file
from sim.synthetic import make_synthetic

ROOT = Path(__file__).resolve().parents[2]
FLEET = "clitest"


@pytest.fixture(scope="module")
def broker() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker() as running:
        yield running


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    splits = make_synthetic(train_samples=80, test_samples=10, image_size=8, num_classes=4)
    device = partition_dataset(splits, 1, float("inf"), seed=0).devices[0]
    path = tmp_path / "dev-000.npz"
    save_device_file(path, device)
    return path


class Recorder:
    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.cond = threading.Condition()

    def __call__(self, topic: str, message: Message) -> None:
        with self.cond:
            self.messages.append(message)
            self.cond.notify_all()

    def wait_for(self, predicate: object, timeout: float = 60.0) -> Message:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                found = [m for m in self.messages if predicate(m)]  # type: ignore[operator]
                if found:
                    return found[-1]
                remaining = deadline - time.monotonic()
                assert remaining > 0, [m.kind for m in self.messages]
                self.cond.wait(remaining)


def run_device(*args: str, cwd: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "edge_client", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_device_process_announces_trains_and_exits_0_on_sigterm(
    broker: EmbeddedBroker, data_file: Path, tmp_path: Path
) -> None:
    topics = Topics(FLEET)
    transport = MqttTransport(MqttConfig(host=broker.host, port=broker.port))
    transport.connect()
    key = new_key()
    write_key_file(tmp_path / "device.key", key)
    channel = Channel(transport, auth=Keyring({"dev-000": key}))  # the coordinator's side
    recorder = Recorder()
    channel.subscribe(topics.from_devices("#"), recorder)
    process = run_device(
        "--broker", f"mqtt://{broker.host}:{broker.port}", "--fleet", FLEET,
        "--data", str(data_file), "--state-dir", str(tmp_path / "state"), "--model", "mlp",
        "--auth-key-file", str(tmp_path / "device.key"), cwd=tmp_path,
    )  # fmt: skip
    try:
        hello = recorder.wait_for(lambda m: isinstance(m.body, Hello)).body
        assert isinstance(hello, Hello)
        torch.manual_seed(0)
        net = build_classifier("mlp", num_classes=4, in_channels=1, image_size=8)
        assert hello.device_id == "dev-000" and hello.fingerprint == net.fingerprint()
        assert hello.num_samples == 64

        model = Message(
            fleet=FLEET,
            sender="coordinator",
            round=0,
            body=ModelPayload(sets={"global": encode_tensors(state_arrays(net))}),
        )
        task = Message(
            fleet=FLEET,
            sender="coordinator",
            round=0,
            body=RoundTask(
                strategy="fedprox",
                hyperparameters={"local_epochs": 1, "batch_size": 16, "lr": 0.05, "mu": 0.1},
                deadline=time.time() + 60,
                payloads=("global",),
                model_message=model.message_id,
            ),
        )
        channel.send(topics.to_device("dev-000", "task"), task)
        channel.send(topics.to_device("dev-000", "model"), model)
        update = recorder.wait_for(lambda m: isinstance(m.body, Update)).body
        assert isinstance(update, Update) and update.task_message == task.message_id
        shapes = {k: v.shape for k, v in update.sets["weights"].to_arrays().items()}
        assert shapes == state_shapes(net)
        recorder.wait_for(lambda m: isinstance(m.body, DeviceStatus) and m.body.state == "idle")

        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
        transport.disconnect()

    assert process.returncode == 0, stderr
    assert "peak RSS" in stderr and "SIGTERM received" in stderr
    assert (tmp_path / "state" / "client_state.json").exists()
    recorder.wait_for(lambda m: isinstance(m.body, DeviceStatus) and m.body.state == "offline")
    assert np.isfinite(list(update.metrics.values())).all()


def test_bad_data_file_exits_2_and_unreachable_broker_exits_1(tmp_path: Path) -> None:
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"no zip")
    good = tmp_path / "good.npz"
    splits = make_synthetic(train_samples=20, test_samples=2, image_size=8, num_classes=4)
    save_device_file(good, partition_dataset(splits, 1, float("inf"), seed=0).devices[0])

    bad_data = run_device("--data", str(junk), cwd=tmp_path)
    bad_flag = run_device("run", "--data", str(good), "--threads", "0", cwd=tmp_path)
    with EmbeddedBroker() as probe:
        port = probe.port  # free once the broker stopped
    unreachable = run_device(
        "--broker", f"mqtt://127.0.0.1:{port}", "--data", str(good), "--model", "mlp",
        "--connect-retry", "1", "--insecure-no-auth", cwd=tmp_path,
    )  # fmt: skip
    (tmp_path / "short.key").write_text("abcd\n")
    no_key = run_device("--data", str(good), "--model", "mlp", cwd=tmp_path)
    short_key = run_device(
        "--data", str(good), "--model", "mlp", "--auth-key-file", str(tmp_path / "short.key"),
        cwd=tmp_path,
    )  # fmt: skip

    for process, code, text in (
        (bad_data, 2, "junk.npz"),
        (bad_flag, 2, "--threads"),
        (unreachable, 1, "no connection to the broker"),
        (no_key, 2, "has no key: give --auth-key-file"),
        (short_key, 2, "32-byte key"),
    ):
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == code, stderr
        last = stderr.strip().splitlines()[-1]
        assert last.startswith("error:") and text in last
        assert "Traceback" not in stderr


def test_precision_flags_offer_the_protocols_precisions() -> None:
    from edge_client.__main__ import _build_parser, _device_settings
    from protocol.tensors import Precision

    parser, commands = _build_parser()
    run = commands["run"]
    flags = run.get_default("settings_flags")
    arguments = ["run", "--data", "d.npz", "--precision", "bf16", "--uplink-precision", "int4"]
    args = parser.parse_args(arguments)

    precisions = [(k,) for k in ("precision", "downlink_precision", "uplink_precision")]
    offered = [a.choices for a in run._actions if flags.dests.get(a.dest) in precisions]
    assert offered == [[p.value for p in Precision]] * 3
    settings = _device_settings(args)
    assert (settings.precision, settings.uplink_precision) == (Precision.BF16, Precision.INT4)
