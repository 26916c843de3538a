"""A refused or misdirected device says why and exits, end to end: a real ``python -m
coordinator`` and real ``python -m edge_client --exit-when-finished`` processes over a real
Mosquitto (issue 27).

* A device whose data have 26 classes, in a fleet whose lenet5 has 10: the coordinator's
  authenticated nack names both numbers, the device logs it with its own model and exits 3.
* A device whose key the coordinator does not hold: the coordinator stays silent (it
  cannot authenticate the device), the device sees the coordinator's signed status but no
  ack, and after ``--hello-timeout`` logs that its key is likely wrong and exits 4.
* A device with a mistyped ``--fleet``: nobody listens and no coordinator status comes;
  the device names the fleet as likely wrong and exits 4.

The three devices run side by side against one coordinator, with a 3 s hello timeout.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from benchmarks.harness import coordinator_command, processes, spawn, write_fleet
from edge_client.__main__ import EXIT_REFUSED, EXIT_UNANSWERED
from protocol.auth import new_key, write_key_file
from protocol.topics import Topics
from protocol.transport import MqttConfig, MqttTransport
from tests.protocol.brokers import Mosquitto, require_mosquitto

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow]

FLEET = "lab"
HELLO_TIMEOUT_S = 3
WAIT_S = 60.0
"""The most a device may take to start, say hello and exit on a loaded host."""


@dataclass
class Setup:
    url: str
    root: Path
    files: list[Path]
    keys: Path
    started: list[subprocess.Popen[bytes]]

    def device(
        self, name: str, data: Path, key: Path, *, fleet: str = FLEET, device_id: str | None = None
    ) -> tuple[subprocess.Popen[bytes], Path]:
        """``python -m edge_client --exit-when-finished`` on ``data`` with ``key``; its log."""
        log = self.root / f"{name}.log"
        command = [
            sys.executable, "-m", "edge_client", "--broker", self.url, "--fleet", fleet,
            "--data", str(data), "--auth-key-file", str(key),
            "--coordinator-key-file", str(self.keys.parent / "coordinator.key.pub"),
            "--exit-when-finished", "--hello-timeout", str(HELLO_TIMEOUT_S),
            *(["--device-id", device_id] if device_id else []),
        ]  # fmt: skip
        process = spawn(command, log)
        self.started.append(process)
        return process, log


def wait_for_retained(url: str, topic: str, timeout: float) -> None:
    """Return once ``topic`` holds a retained message (fail the test after ``timeout``)."""
    seen = threading.Event()
    transport = MqttTransport(MqttConfig.from_url(url, client_id="refusal-watch"))
    transport.connect()
    try:
        transport.subscribe(topic, lambda inbound: seen.set() if inbound.payload else None)
        assert seen.wait(timeout), f"no coordinator status on {topic} in {timeout:.0f} s"
    finally:
        transport.disconnect()


def finish(process: subprocess.Popen[bytes], log: Path) -> tuple[int, str]:
    """The exit status and log of a device that must exit by itself."""
    try:
        code = process.wait(WAIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{log.stem} still runs after {WAIT_S:.0f} s: {log.read_text()[-3000:]}")
    return code, log.read_text(errors="replace")


def write_26_class_data(source: Path, target: Path, device_id: str) -> None:
    """``source``'s images with labels of 26 classes (an EMNIST-letters-like file)."""
    with np.load(source, allow_pickle=False) as data:
        arrays = {key: data[key] for key in ("x", "y", "x_test", "y_test")}
    arrays["y"] = np.arange(len(arrays["y"]), dtype=np.int64) % 26
    arrays["y_test"] = np.arange(len(arrays["y_test"]), dtype=np.int64) % 26
    np.savez(target, **arrays, num_classes=np.int64(26), device_id=np.str_(device_id))


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """A Mosquitto, a keyed fleet of two devices' data and keys, and a lenet5 coordinator
    of fleet ``lab`` waiting for more devices than will come."""
    require_mosquitto()
    root = tmp_path_factory.mktemp("refusal")
    (root / "mosquitto").mkdir()
    with Mosquitto(root / "mosquitto") as broker, processes() as started:
        files, keys = write_fleet(root / "fleet", 2, 0)
        coordinator = coordinator_command(
            broker.url, FLEET, rounds=1, min_devices=5, state=root / "state", keys=keys,
            extra=("--model", "lenet5"),
        )  # fmt: skip
        started.append(spawn(coordinator, root / "coordinator.log"))
        wait_for_retained(broker.url, Topics(FLEET).coordinator_status, WAIT_S)
        yield Setup(broker.url, root, files, keys, started)


def test_refused_and_misdirected_devices_say_why_and_exit(setup: Setup) -> None:
    registered = setup.files[0]
    wide = setup.root / "wide.npz"
    write_26_class_data(setup.files[1], wide, setup.files[1].stem)  # a registered id
    stranger_key = setup.root / "stranger.key"
    write_key_file(stranger_key, new_key())

    refused = setup.device("refused", wide, setup.files[1].with_suffix(".key"))
    stranger = setup.device("stranger", registered, stranger_key, device_id="stranger")
    lost = setup.device("lost", registered, registered.with_suffix(".key"), fleet="labx")

    # 26 classes in a 10-class fleet: the coordinator's nack names both, and so does the
    # device, which exits 3 at once (not after the hello timeout)
    code, log = finish(*refused)
    assert code == EXIT_REFUSED, log[-3000:]
    (line,) = [x for x in log.splitlines() if "refused this device" in x]
    assert " ERROR " in line and "fingerprint_mismatch" in line
    assert "lenet5 (10 classes, input 1x28x28" in line  # the fleet's, from the nack
    # the difference, from the model the device's hello describes
    assert "the device's data have 26 classes, the fleet's model 10" in line
    assert "this device: lenet5, 26 classes, input 1x28x28" in line  # the device's own
    assert "--model" in line and "the device stops" in line
    assert "no answer from" not in log

    # an unregistered key: the coordinator is up (its signed status came) but silent
    code, log = finish(*stranger)
    assert code == EXIT_UNANSWERED, log[-3000:]
    (line,) = [x for x in log.splitlines() if "no answer from a coordinator" in x]
    assert " ERROR " in line
    assert f"no answer from a coordinator of fleet {FLEET} in {HELLO_TIMEOUT_S} s" in line
    assert "check --fleet, the broker and the device key" in line
    assert re.search(r"is up \(status (starting|waiting)\) but silent", line)
    assert "the device key is likely wrong or not registered" in line
    assert "device stranger" in line and "the device stops" in line

    # a mistyped fleet: nobody answers, and no coordinator status is seen on it
    code, log = finish(*lost)
    assert code == EXIT_UNANSWERED, log[-3000:]
    (line,) = [x for x in log.splitlines() if "no answer from a coordinator" in x]
    assert "no answer from a coordinator of fleet labx" in line
    assert "no coordinator status on fleet labx either" in line
    assert "the fleet name (--fleet labx) or the broker" in line
    assert "key is likely wrong" not in line

    # the coordinator refused the wide device once, and never heard of the stranger's
    coordinator_log = (setup.root / "coordinator.log").read_text(errors="replace")
    assert "refused hello of dev-001" in coordinator_log
    assert "registered stranger" not in coordinator_log
