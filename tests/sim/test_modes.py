"""FedKF and FedGen end to end through a real Mosquitto: real coordinator, real edge
clients; a sniffer client sees every message on the fleet's topics."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.config import CoordinatorConfig, TrainingSettings
from coordinator.runtime import Coordinator
from edge_client.config import ClientConfig
from edge_client.train.data import DeviceData
from edge_client.train.runtime import EdgeClient
from protocol.auth import Keyring, new_key
from protocol.channel import Channel
from protocol.messages import Ack, Message, ModelPayload, ReasonCode, RoundTask, Update
from protocol.transport import MqttConfig, MqttTransport
from sim.datasets import load_dataset
from sim.partition import partition_dataset
from sim.run import SimConfig, run_simulation
from tests.protocol.brokers import Mosquitto

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow]

QUICK = TrainingSettings(local_steps=3, batch_size=16)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    with Mosquitto(tmp_path_factory.mktemp("mosquitto")) as mosquitto:
        yield mosquitto


class Sniffer:
    """Subscribes to every topic of a fleet and keeps the decoded messages."""

    def __init__(self, url: str, fleet: str) -> None:
        self.messages: list[tuple[str, Message]] = []
        self._lock = threading.Lock()
        self._transport = MqttTransport(MqttConfig.from_url(url, client_id=f"sniffer-{fleet}"))
        self._fleet = fleet

    def __enter__(self) -> Sniffer:
        self._transport.connect()
        Channel(self._transport).subscribe(f"fl/{self._fleet}/#", self._keep)
        return self

    def __exit__(self, *exc: object) -> None:
        self._transport.disconnect()

    def _keep(self, topic: str, message: Message) -> None:
        with self._lock:
            self.messages.append((topic, message))

    def tensor_names(self) -> dict[str, set[str]]:
        """Set name -> every tensor name seen in model and update messages."""
        names: dict[str, set[str]] = {}
        with self._lock:
            for _, message in self.messages:
                for set_name, tensor_set in message.tensor_sets().items():
                    names.setdefault(set_name, set()).update(t.name for t in tensor_set)
        return names

    def snapshot(self) -> list[tuple[str, Message]]:
        """Every (topic, message) seen so far."""
        with self._lock:
            return list(self.messages)

    def bodies(self, kind: type) -> list:
        with self._lock:
            return [m.body for _, m in self.messages if isinstance(m.body, kind)]


def run(broker: Mosquitto, fleet: str, tmp_path: Path, **overrides: object):
    config = SimConfig(
        devices=4,
        rounds=2,
        participation=0.5,
        model="lenet5",
        training=QUICK,
        transport="mqtt",
        broker_url=broker.url,
        fleet=fleet,
        state_dir=tmp_path,
        **overrides,
    )
    with Sniffer(broker.url, fleet) as sniffer:
        report = run_simulation(config)
    return report, sniffer


def test_fedkf_dual_round_through_mosquitto(broker: Mosquitto, tmp_path: Path) -> None:
    report, sniffer = run(broker, "kf", tmp_path, strategy="fedkf")

    assert [r.active_devices for r in report.rounds] == [2, 2]
    assert set(report.rounds[-1].models) == {"aca", "oca"}
    sets = sniffer.tensor_names()
    assert {"student", "teacher", "weights"} <= set(sets)
    assert sets["student"] == sets["teacher"] == sets["weights"]
    updates = sniffer.bodies(Update)
    assert len(updates) == 4
    assert all(u.metrics["kd_loss"] >= 0 and "generator_loss" in u.metrics for u in updates)
    assert report.final["final_model"] == "oca"
    # dual downlink: two models per selected device where FedAvg sends one
    models = sniffer.bodies(ModelPayload)
    assert all(sorted(m.sets) == ["student", "teacher"] for m in models)


def test_fedgen_head_only_never_puts_a_feature_tensor_on_the_wire(
    broker: Mosquitto, tmp_path: Path
) -> None:
    report, sniffer = run(broker, "gen", tmp_path, strategy="fedgen", sharing="head")

    assert [r.active_devices for r in report.rounds] == [2, 2]
    sets = sniffer.tensor_names()
    assert set(sets) == {"head", "generator", "prior", "weights"}
    every = set().union(*sets.values())
    assert not [name for name in every if name.startswith("features.")]
    assert sets["weights"] == {"head.weight", "head.bias"}
    updates = sniffer.bodies(Update)
    assert updates and all(u.label_counts is not None for u in updates)
    assert all(sum(u.label_counts) == u.num_samples for u in updates)
    # round 2's models carry the generator trained on round 1's heads
    assert any("generator" in m.sets for m in sniffer.bodies(ModelPayload))
    assert 0 <= report.rounds[-1].models["aca"].amp <= 100


def test_fedgen_full_sharing_round_through_mosquitto(broker: Mosquitto, tmp_path: Path) -> None:
    report, sniffer = run(broker, "genfull", tmp_path, strategy="fedgen")

    sets = sniffer.tensor_names()
    assert set(sets) == {"global", "generator", "prior", "weights"}
    assert sets["weights"] == sets["global"]
    assert report.rounds[-1].models["aca"].global_acc is not None


def test_fedgen_refuses_a_device_without_consent_and_says_why(broker: Mosquitto) -> None:
    fleet = "consent"
    config = CoordinatorConfig(fleet=fleet, strategy="fedgen", model="mlp", rounds=1)
    synthetic = load_dataset("synthetic", seed=0, train_samples=200)
    split = partition_dataset(synthetic, 1, 1.0, seed=0).devices[0]
    key = new_key()
    coordinator = Coordinator(
        config,
        MqttTransport(MqttConfig.from_url(broker.url, client_id="consent-coord")),
        keyring=Keyring({split.device_id: key}),
    )
    data = DeviceData(split.device_id, split.train.x, split.train.y, split.test.x, split.test.y, 10)
    client = EdgeClient(
        ClientConfig.from_broker_url(
            broker.url, device_id=split.device_id, fleet=fleet, model="mlp", auth_key=key.hex()
        ),
        MqttTransport(MqttConfig.from_url(broker.url, client_id="consent-dev")),
        data,
    )
    thread = threading.Thread(target=coordinator.run, daemon=True)
    with Sniffer(broker.url, fleet) as sniffer:
        thread.start()
        client.start()
        deadline = time.monotonic() + 30
        while not sniffer.bodies(Ack) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # no round may start after the refusal
        coordinator.stop()
        client.stop()
        thread.join(10)

    acks = sniffer.bodies(Ack)  # one per hello (the device greets again on "starting")
    assert acks and all(a.reason == ReasonCode.CONSENT_REQUIRED for a in acks)
    assert not any(a.accepted for a in acks) and "--share-label-counts" in acks[0].detail
    assert not sniffer.bodies(RoundTask) and not sniffer.bodies(Update)
    assert split.device_id not in coordinator.engine.registry
