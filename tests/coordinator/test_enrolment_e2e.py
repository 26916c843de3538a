"""Issue 17 end to end over a real Mosquitto: devices flashed with the fleet token enrol.

One ``python -m coordinator`` process holding the fleet token (and no device keys), real
``python -m edge_client`` processes: two flashed with the fleet's token, one with another
token. The token devices enrol and their updates are aggregated; the other never
registers, is never selected and leaves nothing in the state. A third id with a correctly
derived key is refused past ``--max-enrolled 2``. The coordinator is then killed and
resumed with the token withdrawn: the enrolled devices finish the run.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.enrolment import read_enrolled
from coordinator.store import MemoryStore
from protocol.auth import Keyring, derive_device_key, new_key, write_fleet_token
from protocol.channel import Channel
from protocol.signing import SigningKey
from protocol.topics import Topics
from protocol.transport import MqttConfig, MqttTransport
from sim.datasets import load_dataset
from sim.partition import partition_dataset, save_device_file
from tests.coordinator.helpers import FLEET, config, hello, make_engine
from tests.coordinator.test_auth import Inbox
from tests.coordinator.test_e2e import read_until, wait_all
from tests.protocol.brokers import Mosquitto

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow]

TOPICS = Topics(FLEET)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    with Mosquitto(tmp_path_factory.mktemp("mosquitto")) as mosquitto:
        yield mosquitto


def coordinator(broker: Mosquitto, state: Path, *extra: str) -> subprocess.Popen[str]:
    command = [
        sys.executable, "-m", "coordinator", "--broker", broker.url, "--fleet", FLEET,
        "--strategy", "fedavg", "--model", "mlp", "--rounds", "2", "--participation", "1.0",
        "--min-devices", "2", "--round-timeout", "60", "--local-steps", "2",
        "--batch-size", "16", "--state-dir", str(state), "--no-onnx",
        "--signing-key-file", str(state.parent / "coordinator.key"), *extra,
    ]  # fmt: skip
    return subprocess.Popen(command, stderr=subprocess.PIPE, text=True)


def edge_client(broker: Mosquitto, data: Path, token: Path, state: Path) -> subprocess.Popen[str]:
    command = [
        sys.executable, "-m", "edge_client", "--broker", broker.url, "--fleet", FLEET,
        "--data", str(data), "--model", "mlp", "--state-dir", str(state),
        "--fleet-token-file", str(token), "--exit-when-finished",
        "--coordinator-key-file", str(state.parent / "coordinator.key.pub"),
    ]  # fmt: skip
    return subprocess.Popen(command, stderr=subprocess.PIPE, text=True)


def read_all(process: subprocess.Popen[str], needles: list[str], timeout: float) -> str:
    """The process's stderr lines until every one of ``needles`` was seen (any order)."""
    text = ""
    for needle in needles:
        if needle not in text:
            text += read_until(process, needle, timeout)
    return text


def test_token_devices_enrol_and_survive_a_resume_without_the_token_strangers_never(
    broker: Mosquitto, tmp_path: Path
) -> None:
    # Prepare: three devices' data; the fleet's token and another one
    federation = partition_dataset(load_dataset("synthetic", seed=0), 3, float("inf"), seed=0)
    files = []
    for split in federation.devices:
        files.append(tmp_path / f"{split.device_id}.npz")
        save_device_file(files[-1], split)
    token, other = tmp_path / "fleet.token", tmp_path / "other.token"
    secret = new_key()
    write_fleet_token(token, secret)
    write_fleet_token(other, new_key())
    state = tmp_path / "state"
    SigningKey.generate().save(tmp_path / "coordinator.key")  # its .pub for the devices
    honest_ids = [f.stem for f in files[:2]]
    stranger_id = files[2].stem

    # Execute: the coordinator holds the token; two devices have it, one has another
    server = coordinator(broker, state, "--fleet-token-file", str(token), "--max-enrolled", "2")
    devices = [edge_client(broker, f, token, tmp_path / f.stem) for f in files[:2]]
    stranger = edge_client(broker, files[2], other, tmp_path / files[2].stem)
    first_log = read_until(server, "selected 2 of 2 online", 120)

    # Assert: both token devices enrolled (logged once each); the stranger did not
    # register and is not selected (2 of 2 online, not 3)
    enrolled = {d: k.hex() for d, k in read_enrolled(state).items()}
    assert enrolled == {d: derive_device_key(secret, d).hex() for d in honest_ids}
    for device_id in honest_ids:
        assert first_log.count(f"enrolled {device_id} with the fleet token") == 1
    assert f"registered {stranger_id}" not in first_log

    # Execute: the cap: a third id whose key is derived right says hello during round 1
    late = MqttTransport(MqttConfig.from_url(broker.url, client_id="late"))
    late.connect()
    late_channel = Channel(late, auth=Keyring({"dev-late": derive_device_key(secret, "dev-late")}))
    late_inbox = Inbox()
    late_channel.subscribe(TOPICS.device_inbox("dev-late"), late_inbox)
    late_channel.send(
        TOPICS.device("dev-late", "hello"), hello(make_engine(config(), MemoryStore()), "dev-late")
    )
    round_log = read_all(server, ["max-enrolled 2 reached", "round 1/2 closed"], 120)
    # ... and the coordinator dies right after round 1
    server.send_signal(signal.SIGKILL)
    server.wait(10)
    late.disconnect()

    # Assert: round 1 aggregated both token devices' updates; dev-late was refused
    (closed,) = [line for line in round_log.splitlines() if "round 1/2 closed" in line]
    assert "2/2 updates on time" in closed
    assert set(read_enrolled(state)) == set(honest_ids)
    assert not late_inbox.messages

    # Execute: the coordinator is resumed without the token
    again = coordinator(broker, state, "--resume")
    (log,) = wait_all([again], 120)
    device_logs = wait_all(devices, 60)

    # Assert: the enrolled devices finished the run; the stranger left nothing behind
    assert again.returncode == 0, log[-3000:]
    assert "2 device(s) enrolled earlier with the fleet token" in log
    assert "round 2/2 closed" in log and "2/2 updates on time" in log
    assert "enrolled " not in log.replace("enrolled earlier", "")
    assert all(p.returncode == 0 for p in devices), device_logs
    try:  # it may stop on the run's finished status: that is fleet-wide, for everyone
        _, stranger_log = stranger.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        stranger.kill()
        _, stranger_log = stranger.communicate(timeout=10)
    assert "coordinator accepted" not in stranger_log  # no ack, so no task, ever
    assert f"registered {stranger_id}" not in log
    assert set(read_enrolled(state)) == set(honest_ids)
    assert not [p for p in state.rglob("*") if stranger_id in p.name or "dev-late" in p.name]
    assert sorted(p.stem for p in (state / "registry").iterdir()) == sorted(honest_ids)
