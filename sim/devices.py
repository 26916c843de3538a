"""The devices alone: ``python -m sim devices``, emulated devices for a coordinator run
elsewhere.

``python -m sim run`` runs a coordinator and its devices in one process. To measure a
coordinator on its own (its memory, its overhead: ``benchmarks/load.py``), the devices
run here instead, in their own process, against a coordinator started with ``python -m
coordinator`` on the same broker and fleet. The devices are those of a keyring file
(``--device-keys``, the coordinator's own), in sorted id order; device ``i`` gets the
``i``-th split of the dataset (Dirichlet(alpha) partition, as ``sim run`` does). Each
runs the device session of :class:`~sim.fleet.Fleet` over a pool of ``--connections``
broker connections and stops when the coordinator says the run finished.

The run ends with a :class:`DevicesReport`: per round, the training jobs and the seconds
the fleet's trainer spent on that round's jobs (decoding the models received, training,
encoding the updates: the devices' own compute), the bytes moved and this process's peak
RSS. The coordinator's settings (strategy, precisions, training) come with its tasks; the
model, seed and data shape given here must match the coordinator's.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

from coordinator.errors import ConfigError
from coordinator.output_paths import check_file
from edge_client.config import ClientConfig
from edge_client.errors import ConfigError as DeviceConfigError
from edge_client.train.data import DeviceData
from edge_client.train.exchange import Job, JobResult, TrainJob
from models import classifier_problem
from models.devices import resolve_device
from protocol.auth import Keyring
from protocol.flags import ModelFlags
from protocol.signing import VerifyKey
from protocol.transport import MqttConfig, MqttTransport, Transport
from sim.cohort.trainer import BatchedTrainer, Engine
from sim.datasets import dataset_names, load_dataset
from sim.errors import SimError
from sim.fleet import (
    DEFAULT_MAX_COHORT,
    Fleet,
    FleetDevice,
    FleetOptions,
    FleetTrainer,
    WrappedTrainer,
)
from sim.partition import partition_dataset
from sim.synthetic import SAMPLES_PER_DEVICE, synthetic_size

__all__ = ["DevicesConfig", "DevicesReport", "add_devices_parser", "run_devices"]

logger = logging.getLogger(__name__)


class DevicesConfig(BaseModel):
    """Settings of ``python -m sim devices`` (each field is a flag)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    broker_url: str
    """The coordinator's MQTT broker: mqtt://host:port (required)."""
    device_keys: Path
    """Keyring file (JSON: device id -> hex key), the coordinator's --device-keys: one
    emulated device per id (required)."""
    coordinator_key_file: Path
    """The coordinator's public signing key (its signing key file's .pub, e.g.
    STATE_DIR/coordinator-signing.key.pub): its status, which says when the run is
    finished, is signed with it (required)."""
    fleet: str = "sim"
    """Fleet name (topics fl/FLEET/): the coordinator's --fleet."""
    model: str = "lenet5"
    """Classifier the devices run: the coordinator's --model."""
    seed: int = 0
    """Seed of the data and the devices' initial models: the coordinator's --seed."""
    dataset: str = "synthetic"
    """Dataset to partition across the devices."""
    data_dir: Path | None = None
    """Folder with the dataset's files."""
    alpha: float = Field(default=0.5, gt=0)
    """Dirichlet label skew alpha; inf = IID."""
    samples_per_device: int | None = Field(default=None, ge=2)
    """synthetic only: samples generated per device, train and local test (unset: 100)."""
    image_size: int | None = Field(default=None, ge=4)
    """synthetic only: image side in pixels (unset: 28): the coordinator's --image-size."""
    connections: int | None = Field(default=None, ge=1)
    """MQTT connections carrying the devices (unset: min(devices, 16))."""
    engine: Engine = "auto"
    """How a round's devices train: batched, loop or auto (as sim run)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the devices train: auto = CUDA when a GPU is there, else the CPU."""
    max_cohort: int | None = Field(default=None, ge=1)
    """Most devices trained together (unset: as sim run)."""
    timeout_s: float = Field(default=3600.0, gt=0, allow_inf_nan=False)
    """Give up (exit 1) when the coordinator has not finished its run after this long."""


@dataclass
class RoundWork:
    """What the devices did for one round."""

    train_jobs: int = 0
    """Devices that trained for the round."""
    busy_s: float = 0.0
    """Seconds the fleet's trainer spent on the round's jobs (decode, train, encode; one
    batch after another, so this is the devices' compute on the round's critical path)."""


@dataclass
class DevicesReport:
    """What a ``python -m sim devices`` run did."""

    devices: int
    connections: int
    finished: bool = False
    """Every device stopped because the coordinator's run finished."""
    wall_s: float = 0.0
    rounds: dict[int, RoundWork] = field(default_factory=dict)
    messages_out: int = 0
    messages_in: int = 0
    wire_bytes_out: int = 0
    wire_bytes_in: int = 0
    peak_rss_bytes: int = 0

    def to_json(self) -> str:
        """The report as one JSON object (round numbers as keys)."""
        data = asdict(self)
        data["rounds"] = {str(r): w for r, w in data["rounds"].items()}
        return json.dumps(data, indent=1)


class TimedTrainer(WrappedTrainer):
    """A :class:`~sim.fleet.FleetTrainer` that times the jobs of each round."""

    def __init__(self, inner: FleetTrainer) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self.rounds: dict[int, RoundWork] = defaultdict(RoundWork)

    def run_many(self, jobs: Sequence[tuple[str, Job]]) -> list[JobResult]:
        start = time.perf_counter()
        results = self._inner.run_many(jobs)
        seconds = time.perf_counter() - start
        rounds = [job.message.round for _, job in jobs]
        with self._lock:
            for r in set(rounds):  # a batch of several rounds: shared by job count
                self.rounds[r].busy_s += seconds * rounds.count(r) / len(rounds)
            for _, job in jobs:
                if isinstance(job, TrainJob):
                    self.rounds[job.message.round].train_jobs += 1
        return results


def _check_data_options(config: DevicesConfig) -> None:
    """Raises SimError: synthetic-only settings given with a file dataset."""
    synthetic_only = config.samples_per_device is not None or config.image_size is not None
    if config.dataset != "synthetic" and synthetic_only:
        raise SimError("--samples-per-device and --image-size apply to --dataset synthetic only")


def load_keyring(path: Path) -> Keyring:
    """The devices' keyring.

    Raises:
        SimError: the file cannot be read, is not a keyring, or holds no device.
    """
    try:
        keyring = Keyring.load(path)
    except ValueError as exc:
        raise SimError(str(exc)) from exc
    if not keyring:
        raise SimError(f"keyring {path} holds no device")
    return keyring


def _device_data(config: DevicesConfig, ids: Sequence[str]) -> list[DeviceData]:
    """Device ``i``'s data is the ``i``-th split of the partitioned dataset.

    Raises:
        SimError: synthetic-only settings with a file dataset; the dataset cannot be loaded
            or partitioned (DatasetError, PartitionError).
    """
    options: dict[str, Any] = {}
    _check_data_options(config)
    if config.dataset == "synthetic":
        per_device = config.samples_per_device or SAMPLES_PER_DEVICE
        options = synthetic_size(len(ids), per_device)
        if config.image_size is not None:
            options["image_size"] = config.image_size
    splits = load_dataset(config.dataset, config.data_dir, seed=config.seed, **options)
    federation = partition_dataset(splits, len(ids), config.alpha, seed=config.seed, in_place=True)
    return [
        DeviceData(
            device_id=device_id,
            x=split.train.x,
            y=split.train.y,
            x_test=split.test.x,
            y_test=split.test.y,
            num_classes=federation.num_classes,
        )
        for device_id, split in zip(ids, federation.devices, strict=True)
    ]


def coordinator_key(config: DevicesConfig) -> str:
    """The coordinator's public key, as hex, from ``coordinator_key_file``.

    Raises:
        SimError: the file cannot be read or holds no public key.
    """
    try:
        return VerifyKey.load(config.coordinator_key_file).public.hex()
    except ValueError as exc:
        raise SimError(str(exc)) from exc


def run_devices(config: DevicesConfig) -> DevicesReport:
    """Emulate the keyring's devices until the coordinator's run finishes.

    Raises:
        SimError: the keyring or the coordinator's public key cannot be read, the keyring
            is empty, the data cannot be made, or the devices cannot be built.
        ConnectError: the broker cannot be reached.
    """
    started = time.perf_counter()
    keyring = load_keyring(config.device_keys)
    public = coordinator_key(config)
    if (problem := classifier_problem(config.model)) is not None:
        raise SimError(problem)
    try:
        device = resolve_device(config.device)
    except ValueError as exc:
        raise SimError(str(exc)) from exc
    ids = sorted(keyring)
    devices = [
        (
            ClientConfig(
                device_id=data.device_id,
                fleet=config.fleet,
                model=config.model,
                exit_when_finished=True,
                share_label_counts=True,
                init_seed=config.seed,
                auth_key=SecretStr(keyring[data.device_id].hex()),
                coordinator_key=public,
            ),
            data,
        )
        for data in _device_data(config, ids)
    ]
    timed: list[TimedTrainer] = []

    def trainer(specs: Sequence[FleetDevice]) -> TimedTrainer:
        inner = BatchedTrainer(
            specs, engine=config.engine, device=device, max_cohort=config.max_cohort
        )
        timed.append(TimedTrainer(inner))
        return timed[0]

    def transport(client_id: str) -> Transport:
        return MqttTransport(MqttConfig.from_url(config.broker_url, client_id=client_id))

    options = FleetOptions(
        connections=config.connections,
        max_cohort=config.max_cohort or DEFAULT_MAX_COHORT,
        client_id_prefix=f"{config.fleet}-devices",
    )
    try:
        fleet = Fleet(devices, transport, trainer=trainer, options=options)
    except (DeviceConfigError, ValueError) as exc:
        raise SimError(str(exc)) from exc
    report = DevicesReport(devices=len(devices), connections=fleet.connections)
    try:
        fleet.start()
        report.finished = fleet.wait(config.timeout_s)
    finally:
        fleet.close()
    out, inn = fleet.traffic()
    report.rounds = dict(sorted(timed[0].rounds.items()))
    report.messages_out, report.messages_in = out.messages, inn.messages
    report.wire_bytes_out, report.wire_bytes_in = out.wire_bytes, inn.wire_bytes
    report.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report.wall_s = time.perf_counter() - started
    return report


def add_devices_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``devices`` command to the subparsers ``sub``; returns its parser."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "devices",
        help="emulate only the devices, for a coordinator run elsewhere",
        description="Emulate the devices of a keyring file against a coordinator started "
        "elsewhere (python -m coordinator) on the same broker and fleet, until its run "
        "finishes; --json-out writes the devices' report (per round: training jobs and "
        "the seconds the devices' compute took).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    flags = ModelFlags()
    parser.set_defaults(handler=devices_from_args, settings_flags=flags)
    flags.add(
        parser,
        DevicesConfig,
        flags={"broker_url": "--broker"},
        choices={"dataset": dataset_names()},
        metavars={
            "broker_url": "URL",
            "device_keys": "FILE",
            "coordinator_key_file": "FILE",
            "connections": "K",
        },
    )
    parser.add_argument("--json-out", type=Path, help="write the devices' report here")
    return parser


def devices_from_args(args: argparse.Namespace) -> int:
    """Handler of ``python -m sim devices``: 0 when the coordinator's run finished, 1 when
    the timeout passed first."""
    import torch

    from edge_client.errors import ConnectError
    from sim.run_cli import BrokerUnreachableError, broker_unreachable

    try:
        config = DevicesConfig(**args.settings_flags.given(args))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise SimError(f"invalid settings: {problems}") from exc
    if args.json_out is not None:
        try:  # not after the run: its report would be lost
            check_file("--json-out", args.json_out)
        except ConfigError as exc:
            raise SimError(str(exc)) from exc
    load_keyring(config.device_keys)  # bad input fails before anything connects
    coordinator_key(config)
    _check_data_options(config)
    problem = broker_unreachable(config.broker_url)
    if problem is not None:
        raise BrokerUnreachableError(problem)
    torch.set_num_threads(1)
    try:
        report = run_devices(config)
    except ConnectError as exc:
        raise BrokerUnreachableError(f"MQTT broker: {exc}") from exc
    if args.json_out is not None:
        args.json_out.write_text(report.to_json() + "\n")
    if not report.finished:
        print(
            f"python -m sim devices: the run did not finish within {config.timeout_s:g} s",
            file=sys.stderr,
        )
        return 1
    return 0
