"""The coordinator started before its broker (a service beside it, under systemd or in a
container) waits for it with a bounded backoff, and says so in the log."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.runtime import Coordinator
from protocol.auth import Keyring, new_key
from protocol.errors import TransportError
from protocol.transport import MqttConfig, MqttTransport
from tests.protocol.brokers import Mosquitto, free_port

pytestmark = pytest.mark.mosquitto


def coordinator(port: int, retry_s: float) -> Coordinator:
    config = CoordinatorConfig(fleet="wait", model="mlp", rounds=1, connect_retry_s=retry_s)
    url = f"mqtt://127.0.0.1:{port}"
    transport = MqttTransport(MqttConfig.from_url(url, client_id="wait-coordinator"))
    return Coordinator(config, transport, keyring=Keyring({"dev-1": new_key()}))


def test_a_broker_that_starts_later_is_waited_for(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: nothing listens on the port yet
    port = free_port()
    server = coordinator(port, retry_s=60)
    caplog.set_level(logging.INFO, logger="coordinator.runtime")
    thread = threading.Thread(target=server.run, daemon=True)
    # Execute: the broker comes up 2.5 s after the coordinator
    thread.start()
    time.sleep(2.5)
    with Mosquitto(tmp_path, port=port):
        deadline = time.monotonic() + 30
        while not server.transport.is_connected and time.monotonic() < deadline:
            time.sleep(0.05)
        connected = server.transport.is_connected
        server.stop()
        thread.join(15)
    # Assert: it connected, after saying what it waited for
    assert connected and not thread.is_alive()
    waits = [
        r.getMessage() for r in caplog.records if "waiting for the MQTT broker" in r.getMessage()
    ]
    assert waits and "--connect-retry" in waits[0]
    assert any("connected to the MQTT broker at attempt" in r.getMessage() for r in caplog.records)


def test_the_wait_is_bounded() -> None:
    # Prepare
    server = coordinator(free_port(), retry_s=2)
    started = time.monotonic()
    # Execute, Assert: it gives up after about the retry time, naming its attempts
    with pytest.raises(TransportError, match=r"after \d+ attempt\(s\) in 2 s"):
        server.run()
    assert 1.5 < time.monotonic() - started < 15


def test_no_retry_is_one_attempt() -> None:
    server = coordinator(free_port(), retry_s=0)
    started = time.monotonic()
    with pytest.raises(TransportError):
        server.run()
    assert time.monotonic() - started < 10
