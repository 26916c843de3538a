"""Genuine chunks replayed over a real Mosquitto with no ACL (anyone may record and publish):
a device's upload in flight keeps its reassembly slot (docs/protocol.md, section 2.2).

The hole this closes (protocol 6 and earlier): valid first chunks recorded from a device's
earlier uploads, published again as its next upload starts, filled its 4 per-source
reassembly slots at the coordinator and evicted the real transfer; the update was lost
and the round waited its deadline. (The coordinator remembered the ids of the last 1,024
transfers, in memory: uploads recorded in an earlier run, or before a restart, passed.)
Since version 7 a transfer id carries its send time, so the coordinator ignores a
transfer sent before the newest one completed from the device, or before its transfer
in flight.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import paho.mqtt.client as mqtt
import pytest

from protocol.auth import new_key
from protocol.chunking import read_chunk_header
from protocol.codec import read_frame_header
from protocol.signing import SigningKey
from protocol.transport import Inbound, MqttConfig, MqttTransport
from tests.coordinator.mqtt_fleet import DEADLINE_S, device_ids, run_fleet
from tests.protocol.brokers import Mosquitto

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow]

FLEET = "replayed"
DEVICES = 2
RECORDED_ROUNDS, ROUNDS = 6, 3


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    with Mosquitto(tmp_path_factory.mktemp("replayed")) as running:
        yield running


class Recorder:
    """Anyone on the broker: records the first chunk of every device's uploads in one
    run; in a later run, the moment a device starts an upload, publishes every first
    chunk recorded from it again (more than the 4 transfers a device's slots hold)."""

    def __init__(self, url: str, port: int) -> None:
        self.transport = MqttTransport(MqttConfig.from_url(url, client_id="recorder"))
        self.transport.connect()
        # a bare client publishes each burst back to back (no wait for each PUBACK), so
        # the replays reach the coordinator between two chunks of the upload in flight
        self.burst = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="recorder-burst")
        self.burst.connect("127.0.0.1", port)
        self.burst.loop_start()
        self.recorded: dict[str, list[bytes]] = {}
        self.replaying = False
        self.replayed = 0
        self._lock = threading.Lock()
        self.transport.subscribe(f"fl/{FLEET}/devices/+/update", self._seen, qos=1)

    def _seen(self, inbound: Inbound) -> None:
        payload = bytes(inbound.payload)
        if not read_frame_header(payload).chunk or read_chunk_header(payload).index != 0:
            return
        with self._lock:
            if not self.replaying:
                self.recorded.setdefault(inbound.topic, []).append(payload)
                return
            if payload in self.recorded.get(inbound.topic, []):
                return  # its own replay, coming back
            replays = list(self.recorded.get(inbound.topic, []))
        for frame in replays:
            self.burst.publish(inbound.topic, frame, qos=1)
        with self._lock:
            self.replayed += len(replays)

    def close(self) -> None:
        self.burst.loop_stop()
        self.burst.disconnect()
        self.transport.disconnect()


def test_first_chunks_of_an_earlier_run_never_evict_an_upload_in_flight(
    broker: Mosquitto,
) -> None:
    # Prepare: a run recorded whole (6 uploads of each device, 200 chunks each)
    signing = SigningKey.generate()
    keys = {device: new_key() for device in device_ids(DEVICES)}
    small = {"max_payload": 4096}  # many chunks an upload: the replays meet it in flight
    recorder = Recorder(broker.url, broker.port)
    assert run_fleet(
        broker.url, FLEET, RECORDED_ROUNDS, keys, signing, client_options=small
    ).finished
    # every upload's first chunk (one more where a device sent an upload again after
    # its connection dropped: a legitimate resend, replayed all the same)
    assert len(recorder.recorded) == DEVICES
    assert all(len(firsts) >= RECORDED_ROUNDS for firsts in recorder.recorded.values())
    # Execute: the next run (a fresh coordinator remembers no transfer), each upload
    # met by the 6 recorded first chunks of its device
    recorder.replaying = True
    run = run_fleet(broker.url, FLEET, ROUNDS, keys, signing, client_options=small)
    recorder.close()
    # Assert: every round closed with every update, none near its deadline, no update
    # refused, and every upload met its replays
    assert run.finished
    assert [(c.round, c.on_time, c.selected) for c in run.closed] == [
        (r, DEVICES, DEVICES) for r in range(1, ROUNDS + 1)
    ]
    assert all(c.duration_s < DEADLINE_S / 4 for c in run.closed), [
        c.duration_s for c in run.closed
    ]
    assert all(a.accepted for a in run.acks), [(a.reason, a.detail) for a in run.acks]
    assert run.elapsed_s < ROUNDS * DEADLINE_S / 4
    assert recorder.replayed >= ROUNDS * DEVICES * RECORDED_ROUNDS
