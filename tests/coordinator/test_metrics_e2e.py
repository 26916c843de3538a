"""The Prometheus exporter over a real Mosquitto: an emulated run (``sim``, three devices,
three rounds) with ``metrics_port``, scraped while its server is still up at the run's
end, agrees with the run's report and with a witness subscribed to the fleet's topics.

What must agree exactly (docs/metrics.md, "What the counters count"):

- rounds completed and accepted updates: the report's rounds and the sum of their
  ``active_devices``;
- the coordinator's update and model traffic, and everything it sent: the PUBLISH packets
  the witness saw on those topics (messages, payload bytes, wire bytes);
- the report's ``bytes_up`` (the devices' own counters): what the witness saw the devices
  publish, of which the exporter's update bytes are the part the coordinator counts
  exactly (the devices' status messages keep flowing after the coordinator stopped).
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import coordinator.metrics
from coordinator.config import TrainingSettings
from coordinator.metrics import MetricsServer
from protocol.transport import MqttConfig, MqttTransport
from protocol.transport.base import Inbound
from protocol.transport.stats import Counts
from sim.run import SimConfig, run_simulation
from tests.protocol.brokers import Mosquitto

if TYPE_CHECKING:
    from coordinator.report import RoundRecord

pytestmark = [pytest.mark.mosquitto]

FLEET = "metrics-e2e"
ROUNDS = 3
DEVICES = 3


class ScrapeAtTheEnd:
    """A :class:`~sim.progress.Progress` that scrapes the exporter when the run says it is
    stopping: the coordinator returned (its last snapshot is the one of its Finished),
    its devices and the exporter still run."""

    def __init__(self, servers: list[MetricsServer]) -> None:
        self.servers = servers
        self.text: str | None = None
        self.rounds: list[int] = []

    def step(self, text: str, total: int | None = None) -> None:
        if text == "stopping" and self.servers:
            with urllib.request.urlopen(self.servers[0].url, timeout=10) as response:
                self.text = response.read().decode("utf-8")

    def advance(self, units: int = 1) -> None:
        pass

    def round_closed(self, record: RoundRecord) -> None:
        self.rounds.append(record.round)


class Witness:
    """An MQTT client subscribed to the whole fleet tree before the run: its transport
    counts every PUBLISH it is handed, by topic."""

    def __init__(self, url: str) -> None:
        self.transport = MqttTransport(MqttConfig.from_url(url, client_id="metrics-witness"))
        self.transport.connect()
        self.transport.subscribe(f"fl/{FLEET}/#", self._take)

    def _take(self, message: Inbound) -> None:
        pass  # its transport's stats count it

    def counts(self, *patterns: str) -> Counts:
        """What it received on the topics ``fl/FLEET/<pattern>`` (``+`` for one level)."""
        total = Counts()
        for topic, counts in self.transport.stats.snapshot()["in"].items():
            if any(_matches(f"fl/{FLEET}/{p}", topic) for p in patterns):
                total = total + counts
        return total


def _matches(pattern: str, topic: str) -> bool:
    """Whether ``topic`` matches the MQTT filter ``pattern``."""
    want, have = pattern.split("/"), topic.split("/")
    for i, level in enumerate(want):
        if level == "#":
            return True
        if i >= len(have) or level not in ("+", have[i]):
            return False
    return len(want) == len(have)


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def total(
    scraped: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **want: str
) -> float:
    """The sum of ``name``'s samples whose labels include ``want``."""
    return sum(v for (n, labels), v in scraped.items() if n == name and set(want.items()) <= labels)


def test_the_exported_counters_agree_with_the_report_and_the_wire(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    servers: list[MetricsServer] = []
    serve = coordinator.metrics.serve_metrics

    def serve_and_keep(*args: Any) -> MetricsServer:
        servers.append(serve(*args))
        return servers[-1]

    monkeypatch.setattr(coordinator.metrics, "serve_metrics", serve_and_keep)
    progress = ScrapeAtTheEnd(servers)
    (tmp_path / "mosquitto").mkdir()
    with Mosquitto(tmp_path / "mosquitto") as broker:
        witness = Witness(broker.url)
        try:
            config = SimConfig(
                devices=DEVICES,
                rounds=ROUNDS,
                participation=1.0,
                model="mlp",
                strategy="fedavg",
                samples_per_device=40,
                training=TrainingSettings(local_epochs=1, local_steps=2, batch_size=16),
                transport="mqtt",
                broker_url=broker.url,
                fleet=FLEET,
                metrics_port="127.0.0.1:0",
                device="cpu",
            )
            report = run_simulation(config, progress=progress)
            device_out = report.final["bytes_up"]
            deadline = time.monotonic() + 10  # the devices' last statuses reach the witness
            while witness.counts("devices/#").payload_bytes < device_out:
                assert time.monotonic() < deadline, "the witness missed device messages"
                time.sleep(0.05)
            seen_up = {leaf: witness.counts(f"devices/+/{leaf}") for leaf in ("update", "hello")}
            seen_up_all = witness.counts("devices/#")
            seen_model = witness.counts("to/+/model", "broadcast/model")
            seen_down = witness.counts("to/#", "broadcast/#", "coordinator/#")
        finally:
            witness.transport.disconnect()

    # Prepare: the exporter was served, and scraped while the run was stopping
    assert len(servers) == 1 and progress.text is not None
    scraped = samples(progress.text)
    assert progress.rounds == list(range(1, ROUNDS + 1))
    with pytest.raises(OSError):  # the run closed it: the port is free, nothing answers
        urllib.request.urlopen(servers[0].url, timeout=2)

    # rounds and updates: exactly the report's
    assert total(scraped, "edgefl_rounds_completed_total") == report.final["rounds"] == ROUNDS
    assert total(scraped, "edgefl_round") == ROUNDS
    assert total(scraped, "edgefl_round_phase", phase="finished") == 1
    assert total(scraped, "edgefl_round_duration_seconds_count") == ROUNDS
    accepted = sum(r.active_devices for r in report.rounds)
    assert accepted == ROUNDS * DEVICES
    assert total(scraped, "edgefl_updates_total", outcome="accepted") == accepted
    assert total(scraped, "edgefl_updates_total") == accepted  # none late, doubled, rejected
    assert total(scraped, "edgefl_devices_registered") == DEVICES
    assert total(scraped, "edgefl_info", fleet=FLEET, strategy="fedavg") == 1

    # uplink: every update the devices published, as the coordinator counted it
    update = seen_up["update"]
    assert update.messages >= accepted  # (chunks: an mlp's update takes a few PUBLISHes)
    for name, want in (
        ("edgefl_messages_total", update.messages),
        ("edgefl_payload_bytes_total", update.payload_bytes),
        ("edgefl_wire_bytes_total", update.wire_bytes),
    ):
        assert total(scraped, name, direction="up", kind="update") == want
    # the report's bytes_up is the devices' own count of what they published: all of what
    # the witness saw them publish; the updates' part of it is the exporter's
    assert seen_up_all.payload_bytes == device_out
    assert sum(r.bytes_up for r in report.rounds) <= device_out
    up_control = total(scraped, "edgefl_payload_bytes_total", direction="up", kind="control")
    assert seen_up["hello"].payload_bytes <= up_control <= device_out - update.payload_bytes

    # downlink: everything the coordinator published, models among it, PUBLISH for PUBLISH
    for name, want in (
        ("edgefl_messages_total", seen_model.messages),
        ("edgefl_payload_bytes_total", seen_model.payload_bytes),
        ("edgefl_wire_bytes_total", seen_model.wire_bytes),
    ):
        assert total(scraped, name, direction="down", kind="model") == want
    assert seen_model.messages >= accepted  # a model to each device each round, chunked
    for name, want in (
        ("edgefl_messages_total", seen_down.messages),
        ("edgefl_payload_bytes_total", seen_down.payload_bytes),
        ("edgefl_wire_bytes_total", seen_down.wire_bytes),
    ):
        assert total(scraped, name, direction="down") == want

    # the models' metrics: the latest evaluation a snapshot took in, the report's numbers
    amp = total(scraped, "edgefl_model_accuracy_ratio", model="aca", metric="amp")
    reported = [r.models["aca"].amp / 100 for r in report.rounds]
    if amp:
        assert any(amp == pytest.approx(a, abs=1e-12) for a in reported), (amp, reported)
