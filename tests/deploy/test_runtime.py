"""The real coordinator and edge clients run a round through a kit's broker, with the
command lines docs/deploy.md gives: one device with a certificate, one with a password.

This is what keeps the ACL and the runtime in step: a topic the runtime starts to use
without the ACL granting it is dropped by the broker (silently, over MQTT 3.1.1), and the
broker logs every denial, so the log must hold none.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sim.datasets import load_dataset
from sim.partition import partition_dataset, save_device_file
from tests.deploy.kit_broker import KitBroker, kit_broker

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
FLEET = "plant-1"
TRAINING = ["--model", "mlp", "--local-steps", "2", "--batch-size", "16"]


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KitBroker]:
    kit = tmp_path_factory.mktemp("runtime") / "kit"
    with kit_broker(kit, FLEET, certificates=["dev-000"], passwords=["dev-001"]) as running:
        yield running


def launch(*args: str | Path) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", *map(str, args)]
    return subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)


def test_a_round_runs_through_the_kits_broker_without_a_denial(
    broker: KitBroker, tmp_path: Path
) -> None:
    federation = partition_dataset(load_dataset("synthetic", seed=0), 2, float("inf"), seed=0)
    data = {}
    for split in federation.devices:
        data[split.device_id] = tmp_path / f"{split.device_id}.npz"
        save_device_file(data[split.device_id], split)
    kit, certificate_url = broker.kit, f"mqtts://localhost:{broker.certificate_port}"
    device = kit / "devices"

    processes = [
        launch("coordinator", "--fleet", FLEET, "--broker", certificate_url,
               "--tls-ca", kit / "coordinator/ca.pem", "--tls-cert", kit / "coordinator/cert.pem",
               "--tls-key", kit / "coordinator/key.pem", "--strategy", "fedavg", "--rounds", "1",
               "--participation", "1.0", "--min-devices", "2", "--round-timeout", "60",
               "--state-dir", tmp_path / "state", *TRAINING,
               "--device-keys", kit / "coordinator/device-keys.json",
               "--signing-key-file", kit / "coordinator/signing.key"),
        launch("edge_client", "--broker", certificate_url, "--fleet", FLEET,
               "--device-id", "dev-000", "--tls-ca", device / "dev-000/ca.pem",
               "--tls-cert", device / "dev-000/cert.pem", "--tls-key", device / "dev-000/key.pem",
               "--auth-key-file", device / "dev-000/device.key",
               "--coordinator-key-file", device / "dev-000/coordinator.pub",
               "--data", data["dev-000"], "--state-dir", tmp_path / "dev-000",
               "--exit-when-finished", *TRAINING[:2]),
        launch("edge_client", "--broker", f"mqtts://localhost:{broker.password_port}",
               "--fleet", FLEET, "--device-id", "dev-001", "--username", "dev-001",
               "--password-file", device / "dev-001/password",
               "--tls-ca", device / "dev-001/ca.pem", "--data", data["dev-001"],
               "--auth-key-file", device / "dev-001/device.key",
               "--coordinator-key-file", device / "dev-001/coordinator.pub",
               "--state-dir", tmp_path / "dev-001", "--exit-when-finished", *TRAINING[:2]),
    ]  # fmt: skip
    logs = []
    for process in processes:
        try:
            _, err = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            _, err = process.communicate()
            pytest.fail(f"did not finish:\n{err[-3000:]}\nbroker:\n{broker.log[-3000:]}")
        logs.append(err)
        assert process.returncode == 0, err[-3000:]

    assert "2/2 updates on time" in logs[0]
    assert "Denied" not in broker.log
