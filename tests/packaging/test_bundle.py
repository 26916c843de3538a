"""Device profiles and offline bundles, end to end on this machine's own platform.

``python -m edge_client bundle`` builds a train and an infer bundle (pip downloads from
the package index once; torch from pip's configured source). Each is installed by its
``install.sh`` into a fresh virtual environment with ``pip --no-index`` and no pip
configuration, so nothing comes from the network. Then, over a real Mosquitto:

- the train profile's client (``run --config``) completes a round of a coordinator
  process run with ``--broadcast-model`` and refreshes its served ONNX model;
- the infer profile's client (``follow --config``) refreshes its served ONNX model from
  the same broadcast, and ``infer`` classifies with it;
- both served models predict what the coordinator's final ``model.onnx`` predicts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from edge_client.serve.infer import OnnxClassifier
from tests.packaging.helpers import (
    ROOT,
    SIDE,
    bundle_command,
    coordinator_public_key,
    provision_keys,
    run,
    run_coordinator,
    write_fleet_files,
)
from tests.protocol.brokers import Mosquitto

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow]

FLEET = "bundled"


@dataclass(frozen=True)
class Installed:
    bundle: Path
    python: Path
    config_dir: Path


def build_and_install(root: Path, profile: str, config: Path, template: Path) -> Installed:
    bundle = root / f"bundle-{profile}"
    flags = ["--config", str(config), "--onnx-template", str(template)]
    flags += ["--coordinator-key", str(coordinator_public_key(root))]
    if profile == "train":  # torch: the version installed here, from pip's own source
        flags += ["--torch-index", "default", "--torch-version", torch.__version__]
    run(bundle_command(bundle, profile, *flags), cwd=ROOT)
    prefix, config_dir = root / f"opt-{profile}", root / f"etc-{profile}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PYTHONPATH"] = ""
    run(
        [
            "sh",
            str(bundle / "install.sh"),
            "--prefix",
            str(prefix),
            "--config-dir",
            str(config_dir),
            "--python",
            sys.executable,
            "--no-service",
        ],
        env=env,
    )
    return Installed(bundle, prefix / "venv" / "bin" / "python", config_dir)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    root = tmp_path_factory.mktemp("bundles")
    with Mosquitto(root) as broker:
        data, template = write_fleet_files(root)
        common = (
            f'broker = "{broker.url}"\nfleet = "{FLEET}"\nconnect_retry = 30\n'
            f'onnx_template = "{root}/etc-PROFILE/template.onnx"\n'
            f'coordinator_key_file = "{root}/etc-PROFILE/coordinator.pub"\n'
        )
        provision_keys(root, "pi-1")
        train_config = root / "train.toml"
        train_config.write_text(
            common.replace("PROFILE", "train")
            + f'device_id = "pi-1"\ndata = "{data}"\nmodel = "mlp"\n'
            f'auth_key_file = "{root}/pi-1.key"\n'
            f'state_dir = "{root}/state-pi-1"\nserve_onnx = "{root}/served-pi-1/model.onnx"\n'
            "exit_when_finished = true\n"
        )
        infer_config = root / "infer.toml"
        infer_config.write_text(
            common.replace("PROFILE", "infer")
            + f'device_id = "cam-1"\nserve_onnx = "{root}/served-cam-1/model.onnx"\n'
        )
        yield {
            "root": root,
            "broker": broker,
            "data": data,
            "train": build_and_install(root, "train", train_config, template),
            "infer": build_and_install(root, "infer", infer_config, template),
        }


IMPORTS = ("torch", "onnxruntime", "onnx", "amqtt", "matplotlib")
MUST = {
    "train": {"torch", "edge_client.train.runtime", "edge_client.serve.follower"},
    "infer": {"onnxruntime", "edge_client.serve.follower", "edge_client.serve.infer"},
}
COMMON = ("numpy", "paho.mqtt.client", "msgpack", "zstandard", "pydantic")


@pytest.mark.parametrize("profile", ["train", "infer"])
def test_each_profile_imports_what_it_must_and_nothing_it_must_not(
    setup: dict[str, object], profile: str
) -> None:
    installed = setup[profile]
    assert isinstance(installed, Installed)
    modules = sorted({*IMPORTS, *COMMON, *MUST[profile]})
    probe = (
        "import importlib, json, sys\n"
        "ok = {}\n"
        f"for name in {modules!r}:\n"
        "    try:\n"
        "        importlib.import_module(name); ok[name] = True\n"
        "    except ImportError:\n"
        "        ok[name] = False\n"
        "print(json.dumps(ok))\n"
    )
    found = json.loads(run([str(installed.python), "-c", probe], cwd="/"))
    expected = {name: name in MUST[profile] or name in COMMON for name in modules}
    # neither profile has the ONNX exporter, the embedded broker or plotting; the train
    # profile has no onnxruntime and the infer profile no torch
    assert found == expected


@pytest.mark.parametrize("profile", ["train", "infer"])
def test_the_bundle_describes_itself_and_its_service(
    setup: dict[str, object], profile: str, tmp_path: Path
) -> None:
    installed = setup[profile]
    assert isinstance(installed, Installed)
    manifest = json.loads((installed.bundle / "BUNDLE.json").read_text())
    assert manifest["profile"] == profile
    for name, entry in manifest["files"].items():
        data = (installed.bundle / name).read_bytes()
        assert len(data) == entry["bytes"]
        assert hashlib.sha256(data).hexdigest() == entry["sha256"]
    wheels = [n for n in manifest["files"] if n.startswith("wheels/")]
    assert any(n.startswith("wheels/edgefl-") for n in wheels)
    assert any(n.startswith("wheels/torch-") for n in wheels) == (profile == "train")
    unit = (installed.bundle / "edgefl-client.service").read_text()
    command = "run" if profile == "train" else "follow"
    assert f"-m edge_client {command} --config @CONFIG_DIR@/edgefl.toml" in unit
    for line in ("Restart=on-failure", "RestartPreventExitStatus=2 3", "KillSignal=SIGTERM"):
        assert line in unit.splitlines()
    assert "MemoryMax=" in unit and "CPUQuota=300%" in unit
    if shutil.which("systemd-analyze"):  # what install.sh writes, checked by systemd
        prefix = installed.python.parents[2]
        rendered = tmp_path / "edgefl-client.service"
        rendered.write_text(
            unit.replace("@PREFIX@", str(prefix)).replace("@CONFIG_DIR@", str(installed.config_dir))
        )
        run(["systemd-analyze", "verify", str(rendered)])
    assert (installed.config_dir / "edgefl.toml").is_file()
    assert (installed.config_dir / "template.onnx").is_file()
    assert (installed.config_dir / "coordinator.pub").read_bytes() == (
        installed.bundle / "coordinator.pub"
    ).read_bytes()


def test_bundled_devices_complete_a_round_and_serve_the_fleet_model(
    setup: dict[str, object], tmp_path: Path
) -> None:
    broker, train, infer = setup["broker"], setup["train"], setup["infer"]
    root = setup["root"]
    assert isinstance(broker, Mosquitto) and isinstance(root, Path)
    assert isinstance(train, Installed) and isinstance(infer, Installed)
    neutral = {"cwd": "/", "stderr": subprocess.PIPE, "text": True}
    follower = subprocess.Popen(  # type: ignore[call-overload]
        [
            str(infer.python),
            "-m",
            "edge_client",
            "follow",
            "--config",
            str(infer.config_dir / "edgefl.toml"),
            "--log-format",
            "journald",
        ],
        **neutral,
    )
    device = subprocess.Popen(  # type: ignore[call-overload]
        [str(train.python), "-m", "edge_client", "--config", str(train.config_dir / "edgefl.toml")],
        **neutral,
    )
    state = tmp_path / "coordinator"
    server = run_coordinator(broker.url, FLEET, state, root / "keys.json")
    try:
        _, device_log = device.communicate(timeout=120)
    finally:
        device.kill()
    assert server.returncode == 0, server.stderr[-3000:]
    assert "round 1/1 closed" in server.stderr and "1/1 updates on time" in server.stderr
    assert device.returncode == 0, device_log[-3000:]
    assert "memory check passed" in device_log and "round 1: update sent" in device_log

    served = {name: root / f"served-{name}" / "model.onnx" for name in ("pi-1", "cam-1")}
    deadline = time.monotonic() + 60
    while not all(p.with_name("model.onnx.json").is_file() for p in served.values()):
        assert time.monotonic() < deadline, "no served model"
        time.sleep(0.2)
    follower.terminate()
    _, follower_log = follower.communicate(timeout=30)
    assert follower.returncode == 0, follower_log[-3000:]
    assert "<6>edge_client.serve.follower: round 1: served model refreshed" in follower_log
    for path in served.values():
        assert json.loads(path.with_name("model.onnx.json").read_text())["round"] == 1
    assert served["pi-1"].read_bytes() == served["cam-1"].read_bytes()

    images = np.random.default_rng(0).random((16, 1, SIDE, SIDE), dtype=np.float32)
    batch = tmp_path / "x.npy"
    np.save(batch, images)
    out = run(
        [
            str(infer.python),
            "-m",
            "edge_client",
            "infer",
            "--model",
            str(served["cam-1"]),
            "--input",
            str(batch),
        ],
        cwd="/",
    )
    final = OnnxClassifier(state / "final" / "model.onnx")
    assert json.loads(out)["predictions"] == final.predict(images).tolist()
