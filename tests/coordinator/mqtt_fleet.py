"""Test helper: one keyed federation run over a real broker, a coordinator and edge clients
in this process (threads), as the hostile end-to-end tests need it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from coordinator.actions import Publish, RoundClosed
from coordinator.config import CoordinatorConfig, TrainingSettings
from coordinator.runtime import Coordinator
from edge_client.config import ClientConfig
from edge_client.train.data import DeviceData
from edge_client.train.runtime import EdgeClient
from protocol.auth import Keyring
from protocol.messages import Ack
from protocol.signing import SigningKey
from protocol.transport import MqttConfig, MqttTransport
from sim.datasets import load_dataset
from sim.partition import partition_dataset

DEADLINE_S = 60.0


@dataclass
class FleetRun:
    """What one run did."""

    closed: list[RoundClosed] = field(default_factory=list)
    acks: list[Ack] = field(default_factory=list)
    finished: bool = False
    """The coordinator returned its models and every device stopped at ``finished``."""
    elapsed_s: float = 0.0


def device_ids(devices: int) -> list[str]:
    """The ids :func:`run_fleet`'s devices have."""
    return [f"dev-{i:03d}" for i in range(devices)]


def run_fleet(
    url: str,
    fleet: str,
    rounds: int,
    keys: dict[str, bytes],
    signing: SigningKey,
    *,
    observer: Callable[[object], None] | None = None,
    client_options: dict[str, Any] | None = None,
    **overrides: Any,
) -> FleetRun:
    """A run from scratch (a fresh coordinator, fresh devices, the ``mlp`` on synthetic
    data, every device every round, deadlines of :data:`DEADLINE_S`): the coordinator
    keyed with ``keys`` (one per device, :func:`device_ids`) and signing with
    ``signing``, each device holding its key and the public key. ``observer`` sees every
    action of the coordinator; ``overrides`` go to the coordinator's config,
    ``client_options`` to each device's."""
    synthetic = load_dataset("synthetic", seed=0, train_samples=400)
    splits = partition_dataset(synthetic, len(keys), float("inf"), seed=0).devices
    config = CoordinatorConfig(
        fleet=fleet,
        strategy="fedavg",
        model="mlp",
        rounds=rounds,
        participation=1.0,
        min_devices=len(keys),
        round_timeout_s=DEADLINE_S,
        training=TrainingSettings(local_steps=2, batch_size=16),
        **overrides,
    )
    coordinator = Coordinator(
        config,
        MqttTransport(MqttConfig.from_url(url, client_id=f"{fleet}-coordinator")),
        keyring=Keyring(keys),
        signing_key=signing,
    )
    run = FleetRun()

    def observe(action: object) -> None:
        if isinstance(action, RoundClosed):
            run.closed.append(action)
        elif isinstance(action, Publish) and isinstance(action.message.body, Ack):
            run.acks.append(action.message.body)
        if observer is not None:
            observer(action)

    coordinator.add_observer(observe)
    clients = [
        EdgeClient(
            ClientConfig.from_broker_url(
                url,
                device_id=split.device_id,
                fleet=fleet,
                model="mlp",
                auth_key=keys[split.device_id].hex(),
                coordinator_key=signing.verify_key.public.hex(),
                exit_when_finished=True,
                **(client_options or {}),
            ),
            MqttTransport(MqttConfig.from_url(url, client_id=split.device_id)),
            DeviceData(
                split.device_id, split.train.x, split.train.y, split.test.x, split.test.y, 10
            ),
        )
        for split in splits
    ]
    outcome: dict[str, object] = {}
    thread = threading.Thread(
        target=lambda: outcome.setdefault("models", coordinator.run()), daemon=True
    )
    started = time.monotonic()
    thread.start()
    for client in clients:
        client.start()
    thread.join(rounds * DEADLINE_S)
    stopped = [client.wait(30) for client in clients]
    run.elapsed_s = time.monotonic() - started
    run.finished = not thread.is_alive() and "models" in outcome and all(stopped)
    return run
