"""The lab emulation: one real coordinator and N emulated devices in one process.

:func:`run_simulation` partitions a dataset across N devices, starts a broker (the
embedded amqtt broker, an external one, or the in-memory twin), and runs the
:class:`~coordinator.runtime.Coordinator` (the same code as ``python -m coordinator``)
and a :class:`~sim.fleet.Fleet` of N devices against it: each device runs the session a
real device runs (:class:`~edge_client.train.session.DeviceSession`) with its own id and
topics, carried over a bounded pool of broker connections; every message goes through
the broker. The fleet's byte counters give the per-round bytes (up = published by
devices, down = delivered to devices, as N separate devices would count them). After
each round every global model is evaluated on every device's test split (AMP / FM / WLP)
and on the dataset's test split. A fleet of several architectures (``--model
lenet5,resnet8``) gives them to the devices in turn; each group's models are evaluated
on every device's test split and reported as ``GROUP/ROLE`` (``lenet5/aca``); a fleet of
one architecture reports its models by role alone (``aca``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
from pydantic import Field, SecretStr, field_serializer, field_validator, model_validator

from coordinator.config import (
    CoordinatorConfig,
    FleetSettings,
    MonitorSettings,
    run_weight_format,
)
from coordinator.enrolment import FleetKeys
from coordinator.errors import ConfigError
from coordinator.monitor import monitoring
from coordinator.proxy import read_proxy_data
from coordinator.recording import peak_memory
from coordinator.report import RunReport
from coordinator.runtime import Coordinator, save_group_models
from coordinator.store import FileStore, MemoryStore, Store
from edge_client.config import ClientConfig
from edge_client.errors import ConfigError as DeviceConfigError
from edge_client.train.data import DeviceData
from models import ModelError, build_classifier, square_images
from models.devices import resolve_device
from protocol.auth import Keyring, KeySource, derive_device_key, new_key
from protocol.errors import BrokerError
from protocol.messages import WeightFormat
from protocol.signing import SigningKey, VerifyKey
from protocol.tensors import Precision
from protocol.transport import MemoryBroker, MemoryTransport, MqttConfig, MqttTransport, Transport
from sim.arrays import ArrayDataset, DatasetSplits
from sim.cohort.trainer import BatchedTrainer, Engine
from sim.datasets import load_dataset
from sim.errors import DatasetError, SimError
from sim.fleet import DEFAULT_MAX_COHORT, Fleet, FleetOptions, TrainerFactory
from sim.fleet.pacing import DEFAULT_RATE
from sim.partition import Federation, partition_dataset
from sim.poison import PoisoningTrainer, PoisonKind, poisoned_devices
from sim.progress import Progress
from sim.recorder import RoundRecorder, fleet_totals
from sim.shard import RoundSync, Shard, broadcast, current_shard, training_device
from sim.synthetic import synthetic_size

__all__ = ["RunInterrupted", "SimConfig", "build_federation", "device_data", "run_simulation"]

log = logging.getLogger(__name__)


class RunInterrupted(KeyboardInterrupt):
    """The run was interrupted (Ctrl-C) once its coordinator started: it stopped the
    coordinator, the devices and the broker, and :attr:`report` holds the rounds it
    finished (``final["interrupted"]`` is true). A :class:`KeyboardInterrupt`, so a
    caller that does not look for it is interrupted as before."""

    def __init__(self, report: RunReport) -> None:
        super().__init__(f"interrupted after {len(report.rounds)} rounds")
        self.report = report


class SimConfig(MonitorSettings, FleetSettings):
    """Settings of one emulated run (``python -m sim --help`` lists them as flags).

    The fleet's settings (strategy, precisions, rounds, training ...) and their defaults
    are the coordinator's (:class:`~coordinator.config.FleetSettings`); the fields here
    say how the emulation makes the devices, their data and their broker.
    """

    devices: int = Field(default=50, ge=1)
    """Emulated devices K."""
    silent_grace_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    """As the coordinator's --silent-grace, but 0 (off) by default: every emulated device
    is alive, and one queued behind a long cohort has sent nothing yet (it would be
    dropped as silent)."""
    dataset: str = "synthetic"
    """Dataset to partition across the devices."""
    data_dir: Path | None = None
    """Folder with the dataset's files."""
    samples_per_device: int | None = Field(default=None, ge=2)
    """synthetic only: samples generated per device, train and local test (unset: 100,
    and 10,000 at least in all)."""
    class_fraction: float = Field(default=1.0, gt=0, le=1)
    """Keep this share of each class of the train split (FedKF's EMNIST: 0.1)."""
    alpha: float = Field(default=0.5, gt=0)
    """Dirichlet label skew alpha; inf = IID."""
    min_samples: int = Field(default=10, ge=1)
    """Minimum train samples per device, for the partitioner."""
    test_fraction: float = Field(default=0.2, ge=0, lt=1)
    """Local test share of each device's data."""
    proxy_data: Path | None = None
    """The coordinator's unlabeled proxy data (feddf distils on them): a ``.npy`` array of
    samples of the models' shape, or a folder with the files of a dataset the readers
    know (its train images, labels ignored)."""
    proxy_size: int | None = Field(default=None, ge=2)
    """Proxy images to use, drawn at random (seeded by the run's seed) from the proxy
    dataset's train images (unset: all of them)."""
    device_precisions: tuple[str, ...] = ()
    """Comma-separated precisions the devices ask for, round robin: int8 (both ways) or
    int8/int4 (down/up); binary: a device that runs binarized weights (trained
    binarized, BinaryConnect) and transfers its float latent weights at fp32, or at the
    given precisions with binary:int8 or binary:int8/fp32; empty: every device takes the
    fleet's."""
    transport: Literal["mqtt", "inproc"] = "mqtt"
    """An MQTT broker (embedded amqtt unless broker_url) or the in-memory twin."""
    broker_url: str | None = None
    """External broker for transport mqtt: mqtt://host:port (unset: an embedded one)."""
    connections: int | None = Field(default=None, ge=1)
    """MQTT connections carrying the emulated devices, each device on one of them with
    its own id and topics (unset: min(devices, 16))."""
    max_rate: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    """Messages per second the emulated devices publish at most, all connections
    together; 0: no limit (unset: 500 through an MQTT broker, which drops what
    overflows its queue for the coordinator; no limit in process, where nothing is
    dropped)."""
    state_dir: Path | None = None
    """Keep the coordinator's and the devices' state here (unset: a temporary folder)."""
    fleet: str = "sim"
    """Fleet name of the emulated run (topics fl/FLEET/)."""
    engine: Engine = "auto"
    """How the devices of a round train: batched (all at once, sim.cohort), loop (one
    after the other, the per-device reference) or auto (batched on a GPU, loop on a CPU:
    sim.cohort.trainer.Engine)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the emulated devices train: auto = CUDA when a GPU is there, else the CPU."""
    max_cohort: int | None = Field(default=None, ge=1)
    """Most devices trained together: training jobs handed to the trainer at once and
    devices in one batched computation (unset: up to 1024 at once, in computations of at
    most half the free memory, 8 GiB on a GPU and 128 MiB on a CPU, of training
    estimates)."""
    poisoned: float = Field(default=0.0, ge=0, le=1)
    """Attack emulation: this share of the devices (drawn with the seed) poison their
    uploads (sim/poison.py); 0: none."""
    poison: PoisonKind = "constant"
    """Attack emulation: constant (every weight poison_scale) or sign_flip (the model
    received minus poison_scale x the honest delta)."""
    poison_scale: float = Field(default=3.0, allow_inf_nan=False)
    """Attack emulation: the constant, or the sign-flipped delta's factor."""
    enrol: bool = False
    """Devices enrol with a fleet token (docs/protocol.md, section 2.4): each one's key is
    derived from a token only the coordinator is given, and it enrols the devices as they
    say hello; off: the coordinator is given every device's key (operator registration)."""

    @field_serializer("alpha", when_used="json")
    def _alpha_as_json(self, alpha: float) -> float | str:
        """JSON has no infinity: an IID split (alpha inf) is written as ``"inf"``."""
        return "inf" if math.isinf(alpha) else alpha

    @field_validator("alpha", mode="before")
    @classmethod
    def _alpha_from_json(cls, value: Any) -> Any:
        return math.inf if value == "inf" else value

    @model_validator(mode="after")
    def _consistent(self) -> SimConfig:
        if self.connections is not None and self.connections > self.devices:
            raise ValueError(
                f"connections ({self.connections}) cannot exceed devices ({self.devices}): "
                "each connection carries at least one device"
            )
        if self.samples_per_device is not None and self.dataset != "synthetic":
            raise ValueError("samples_per_device applies to the synthetic dataset only")
        return self

    def proxy_images(self) -> np.ndarray | None:
        """The coordinator's proxy images (``proxy_size`` of them where set), or None.

        Raises:
            DatasetError: ``proxy_data`` is no plain ``.npy`` array and holds no known
                dataset, or its files are corrupt.
        """
        if self.proxy_data is None:
            return None
        try:  # the coordinator's reader: a .npy of any sample shape, or a dataset folder
            return read_proxy_data(self.proxy_data, size=self.proxy_size, seed=self.seed)
        except ConfigError as exc:
            raise DatasetError(str(exc)) from exc

    @field_validator("device_precisions")
    @classmethod
    def _known_precisions(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for token in value:
            parse_device(token)
        return value

    def coordinator_config(self, num_classes: int, shape: tuple[int, ...]) -> CoordinatorConfig:
        """The coordinator's settings for this emulation: the fleet's settings, the data
        shape from the federation (``shape``: one sample's), every device needed to start
        a round, no ONNX export."""
        fleet = {name: getattr(self, name) for name in FleetSettings.model_fields}
        images = square_images(shape)
        size = {"in_channels": shape[0], "image_size": shape[1]} if images else {}
        return CoordinatorConfig(
            **fleet,
            **size,
            input_shape=None if images else shape,
            fleet=self.fleet,
            num_classes=num_classes,
            min_devices=self.devices,
            export_onnx=False,
        )

    def device_architecture(self, index: int) -> str:
        """The architecture of device ``index``: the fleet's architectures in turn."""
        return self.architectures[index % len(self.architectures)]

    def device_link(self, index: int) -> DeviceLink:
        """What device ``index`` asks for and runs at (precisions None: the fleet's)."""
        if not self.device_precisions:
            return DeviceLink(None, None, "float")
        return parse_device(self.device_precisions[index % len(self.device_precisions)])

    def device_weight_format(self, index: int) -> WeightFormat:
        """The format device ``index`` runs its model at, as the coordinator trains it
        (:func:`coordinator.config.run_weight_format`)."""
        down, up, announced = self.device_link(index)
        return run_weight_format(
            announced,
            qat=self.training.qat,
            downlink=down or self.downlink_precision,
            uplink=up or self.uplink_precision,
        )

    def device_config(
        self,
        index: int,
        device_id: str,
        auth_key: bytes | None = None,
        coordinator_key: VerifyKey | None = None,
    ) -> ClientConfig:
        """The configuration of emulated device ``index``: it runs the fleet's
        architectures in turn (device ``index`` the ``index % len``-th), consents to share
        label counts (FedGen needs them), stops when the run finishes and keeps its state
        in ``state_dir/devices/ID`` (without fsync: the writes stay atomic) when the run
        has a state dir."""
        down, up, weight_format = self.device_link(index)
        state = None if self.state_dir is None else self.state_dir / "devices" / device_id
        return ClientConfig(
            device_id=device_id,
            fleet=self.fleet,
            model=self.device_architecture(index),
            exit_when_finished=True,
            share_label_counts=True,
            init_seed=self.seed,
            state_dir=state,
            fsync_state=False,
            downlink_precision=down,
            uplink_precision=up,
            weight_format=weight_format,
            auth_key=None if auth_key is None else SecretStr(auth_key.hex()),
            coordinator_key=None if coordinator_key is None else coordinator_key.public.hex(),
        )

    def trainer_factory(self) -> TrainerFactory:
        """Builds the trainer of the emulated devices: the engine on the device asked for.

        Raises:
            SimError: ``device`` is ``cuda`` and torch sees no GPU.
        """
        try:
            device = resolve_device(self.device)
        except ValueError as exc:
            raise SimError(str(exc)) from exc
        return functools.partial(
            BatchedTrainer, engine=self.engine, device=device, max_cohort=self.max_cohort
        )

    def fleet_options(self, shard: Shard | None = None) -> FleetOptions:
        """How the emulated devices are carried: connections, cohorts and pacing (in a
        sharded run, each rank's connections have client ids of their own). Through the
        in-memory broker the devices publish unpaced unless ``max_rate`` says otherwise:
        it queues whatever the coordinator has not read yet (the answer window still
        bounds the hellos and updates waiting for an answer)."""
        prefix = f"{self.fleet}-fleet" if shard is None else f"{self.fleet}-fleet-r{shard.rank}"
        rate = self.max_rate
        if rate is None:
            rate = DEFAULT_RATE if self.transport == "mqtt" else 0
        return FleetOptions(
            connections=self.connections,
            max_cohort=self.max_cohort or DEFAULT_MAX_COHORT,
            max_rate=rate or None,
            client_id_prefix=prefix,
        )


class DeviceLink(NamedTuple):
    """What an emulated device asks for and runs at (a ``device_precisions`` token)."""

    downlink: Precision | None
    """Precision of the models it receives (None: the fleet's)."""
    uplink: Precision | None
    """Precision of its updates (None: the fleet's)."""
    weight_format: WeightFormat
    """The format it runs its weights at (announced in its hello)."""


BINARY_TOKEN = "binary"
"""The ``device_precisions`` token of a device that runs binarized weights."""


def parse_device(token: str) -> DeviceLink:
    """``"int8"`` (both ways) or ``"int8/int4"`` (down/up): a float device with that
    link; ``"binary"``: a binary device that transfers at fp32 (its latent weights travel
    exactly); ``"binary:LINK"``: a binary device with that link.

    Raises:
        ValueError: none of these.
    """
    if token == BINARY_TOKEN:
        return DeviceLink(Precision.FP32, Precision.FP32, "binary")
    prefix = BINARY_TOKEN + ":"
    weight_format: WeightFormat = "binary" if token.startswith(prefix) else "float"
    parts = token.removeprefix(prefix).split("/")
    names = ", ".join(p.value for p in Precision)
    if len(parts) not in (1, 2) or any(p not in {x.value for x in Precision} for p in parts):
        raise ValueError(
            f"{token!r}: give PRECISION or DOWN/UP (each one of {names}), binary, or "
            "binary:PRECISION or binary:DOWN/UP"
        )
    return DeviceLink(Precision(parts[0]), Precision(parts[-1]), weight_format)


def _subsample(data: ArrayDataset, fraction: float, seed: int) -> ArrayDataset:
    """``fraction`` of each class of ``data`` (at least one sample per present class),
    drawn with ``seed``; the FedKF paper's "10 % of each class"."""
    rng = np.random.default_rng([seed, 0x5AB])
    keep = []
    for label in np.unique(data.y):
        members = np.flatnonzero(data.y == label)
        count = max(1, round(fraction * len(members)))
        keep.append(rng.choice(members, size=count, replace=False))
    index = np.sort(np.concatenate(keep))
    return ArrayDataset(data.x[index], data.y[index], data.num_classes, f"{data.name}[{fraction}]")


def build_federation(config: SimConfig) -> tuple[Federation, tuple[int, ...]]:
    """The run's dataset partitioned across its devices, and the shape of one sample.

    Raises:
        DatasetError: the dataset cannot be loaded or partitioned.
        SimError: its images are not square (a built-in classifier needs squares).
    """
    options: dict[str, int] = {}
    if config.dataset == "synthetic":
        options = synthetic_size(config.devices, config.samples_per_device)
    splits = load_dataset(config.dataset, config.data_dir, seed=config.seed, **options)
    if config.class_fraction < 1:
        train = _subsample(splits.train, config.class_fraction, config.seed)
        splits = DatasetSplits(train=train, test=splits.test)
    federation = partition_dataset(
        splits,
        config.devices,
        config.alpha,
        seed=config.seed,
        min_samples=config.min_samples,
        test_fraction=config.test_fraction,
        in_place=True,  # the splits are this function's: no second copy of the fleet's data
    )
    shape = tuple(int(d) for d in splits.train.x.shape[1:])
    if len(shape) == 3 and shape[1] != shape[2] and config.dataset != "npz":
        raise SimError(
            f"{config.dataset}: images are {shape[1]}x{shape[2]}; the models need squares"
        )
    return federation, shape


def device_data(federation: Federation, index: int) -> DeviceData:
    """Device ``index``'s split as the edge client's :class:`DeviceData`."""
    split = federation.devices[index]
    return DeviceData(
        device_id=split.device_id,
        x=split.train.x,
        y=split.train.y,
        x_test=split.test.x,
        y_test=split.test.y,
        num_classes=federation.num_classes,
    )


@contextlib.contextmanager
def _broker(config: SimConfig, shard: Shard | None) -> Iterator[Callable[[str], Transport]]:
    """Yields a factory of (unconnected) transports by client id. In a sharded run rank
    0 starts the broker (unless the run names one) and tells the other ranks its URL."""
    if shard is not None:
        url = config.broker_url
        if shard.leader and url is None:
            with _embedded_broker() as embedded:
                log.info("embedded MQTT broker at %s (for %d ranks)", embedded, shard.world)
                shared = broadcast(embedded)
                yield lambda client_id: MqttTransport(
                    MqttConfig.from_url(shared, client_id=client_id)
                )
            return
        shared = broadcast(url)
        yield lambda client_id: MqttTransport(MqttConfig.from_url(shared, client_id=client_id))
        return
    if config.transport == "inproc":
        memory = MemoryBroker()
        yield lambda client_id: MemoryTransport(memory, client_id)
        return
    if config.broker_url is not None:
        url = config.broker_url
        yield lambda client_id: MqttTransport(MqttConfig.from_url(url, client_id=client_id))
        return
    with _embedded_broker() as embedded:
        log.info("embedded MQTT broker at %s", embedded)
        yield lambda client_id: MqttTransport(MqttConfig.from_url(embedded, client_id=client_id))


@contextlib.contextmanager
def _embedded_broker() -> Iterator[str]:
    """The embedded broker's URL while it runs. A broker that does not stop in time once
    the run is over (amqtt still working through a large fleet's backlog) is left to end
    with the process: a warning, not an error that would lose the finished run's report.
    """
    from protocol.transport.broker import EmbeddedBroker

    embedded = EmbeddedBroker().start()
    try:
        yield embedded.url
    finally:
        try:
            embedded.stop()
        except BrokerError as exc:
            log.warning("%s; its thread ends with the process", exc)


_COORDINATOR_START_S = 5.0
"""How long the devices wait for the coordinator to leave ``starting`` (a run resumed in
the middle of a round stays there until the round closes)."""


def run_simulation(
    config: SimConfig,
    *,
    progress: Progress | None = None,
    final_models_dir: Path | None = None,
    trainer: TrainerFactory | None = None,
) -> RunReport:
    """Run the emulation described by ``config``; returns the report.

    Args:
        config: the run's settings.
        progress: told what the run does as it goes: setup steps, devices trained in
            each round, and each round's record as soon as it is measured.
        final_models_dir: where to save the final models (``.pt`` and ``.onnx``).
        trainer: builds the trainer of the devices' jobs (default:
            :meth:`SimConfig.trainer_factory`, the engine and device of ``config``).

    Raises:
        SimError: the dataset cannot be loaded or partitioned, or the run failed.
        TransportError / BrokerError / ConnectError: the broker cannot be started or
            reached.
        RunInterrupted: a KeyboardInterrupt (Ctrl-C) once the coordinator started; the run
            stopped its coordinator, devices and broker, and the exception holds the
            report of the rounds it finished (no final models are saved). One before
            that, while the data loads, is raised as it is.
    """
    started = time.perf_counter()
    shard = current_shard()
    if shard is not None:
        _check_shardable(config, shard)
        if not shard.leader:
            progress = None
        config = config.model_copy(update={"device": training_device(config.device, shard)})
    if trainer is None:
        trainer = config.trainer_factory()
    if progress is not None:
        progress.step(f"loading {config.dataset} and partitioning it across the devices")
    federation, shape = build_federation(config)
    test = federation.test  # the coordinator's held-out set (server steps report on it)
    ids = [d.device_id for d in federation.devices]
    poisoned = poisoned_devices(ids, config.poisoned, config.seed)
    if poisoned:
        log.warning("attack emulation: %d device(s) poison their uploads", len(poisoned))
        trainer = _poisoning(trainer, poisoned, config.poison, config.poison_scale)
    coordinator_config = config.coordinator_config(federation.num_classes, shape)
    token = fleet_token(shard)
    keyring = fleet_keyring(ids, token=token)
    signing_key = run_signing_key(token)
    coordinator_keys: KeySource = keyring
    if config.enrol:
        coordinator_keys = FleetKeys(Keyring(), token=token, max_enrolled=len(ids))
    proxy = config.proxy_images()
    try:
        scratch = {
            name: build_classifier(name, num_classes=federation.num_classes, input_shape=shape)
            for name in config.architectures
        }
    except ModelError as exc:
        raise SimError(str(exc)) from exc
    mine = range(len(federation.devices)) if shard is None else shard.devices(config.devices)
    devices = [
        (
            config.device_config(
                index,
                federation.devices[index].device_id,
                keyring[federation.devices[index].device_id],
                signing_key.verify_key,
            ),
            device_data(federation, index),
        )
        for index in mine
    ]
    with contextlib.ExitStack() as stack:
        if progress is not None and config.transport == "mqtt" and config.broker_url is None:
            progress.step("starting the embedded MQTT broker")
        make_transport = stack.enter_context(_broker(config, shard))
        if shard is not None and not shard.leader:
            return _follow(config, shard, devices, make_transport, trainer)
        store: Store = (
            FileStore(config.state_dir / "coordinator", fsync=False)
            if config.state_dir
            else MemoryStore()
        )
        try:
            coordinator = Coordinator(
                coordinator_config,
                make_transport(f"{config.fleet}-coordinator"),
                store,
                proxy_data=proxy,
                held_out=None if test is None else (test.x, test.y),
                keyring=coordinator_keys,
                signing_key=signing_key,
            )
            fleet = Fleet(
                devices, make_transport, trainer=trainer, options=config.fleet_options(shard)
            )
        except (ConfigError, DeviceConfigError) as exc:
            raise SimError(str(exc)) from exc
        recorder = RoundRecorder(config, federation, scratch, fleet, progress)
        recorder.evaluated = coordinator.telemetry.evaluated
        try:
            stack.enter_context(monitoring(coordinator.telemetry, config))
        except ConfigError as exc:
            raise SimError(str(exc)) from exc
        if shard is not None:
            recorder.sync = stack.enter_context(_ranks(shard, fleet))
        coordinator.add_observer(recorder)
        outcome: dict[str, Any] = {}
        served = threading.Event()

        def serve() -> None:
            try:
                outcome["models"] = coordinator.run()
            except BaseException as exc:  # reported by the caller
                outcome["error"] = exc
            finally:
                served.set()

        def subscribed(_device_id: str) -> None:
            if progress is not None and not recorder.round_started:
                progress.advance()  # (the first round may start before all subscribed)

        thread = threading.Thread(target=serve, name="sim-coordinator", daemon=True)
        thread.start()
        interrupted = False
        try:
            # Devices join a coordinator that is up, as in a deployed fleet: one that
            # joins while it says "starting" announces itself twice, and a selected
            # device then gets its task twice.
            deadline = time.monotonic() + _COORDINATOR_START_S
            while thread.is_alive() and time.monotonic() < deadline:
                if recorder.coordinator_up.wait(0.05):
                    break
            if progress is not None:
                progress.step("connecting devices", total=len(devices))
            fleet.start(subscribed)
            if progress is not None and not recorder.round_started:
                progress.step("waiting for the first round")
            # An event, not thread.join(): a join interrupted by Ctrl-C marks the thread
            # stopped while it still runs (CPython bpo-45274), and the join below would
            # no longer wait for it.
            served.wait()
        except KeyboardInterrupt:
            interrupted = True  # stop as at the end, and report the rounds finished
        finally:
            if progress is not None:
                progress.step("stopping")
            coordinator.stop()
            thread.join(timeout=10)
            fleet.close()
            recorder.finish()  # the last rounds' evaluations
        if "error" in outcome and not interrupted:
            raise SimError(f"the coordinator failed: {outcome['error']}") from outcome["error"]
        models = outcome.get("models")
        if final_models_dir is not None and models and not interrupted:
            save_group_models(models, scratch, final_models_dir, final=coordinator.final_model)
        records = recorder.records
        ranks = None
        if interrupted:  # the finished rounds' bytes; the other ranks are not asked
            totals = tuple(
                sum(getattr(r, key) for r in records)
                for key in ("bytes_up", "bytes_down", "wire_bytes_up", "wire_bytes_down")
            )
        else:
            totals = recorder.totals()
            ranks = None if recorder.sync is None else recorder.sync.ask("final")

    final: dict[str, Any] = {
        "rounds": len(records),
        "wall_s": time.perf_counter() - started,
        "mean_round_wall_s": sum(r.wall_s for r in records) / max(1, len(records)),
        "bytes_up": totals[0],
        "bytes_down": totals[1],
        "wire_bytes_up": totals[2],
        "wire_bytes_down": totals[3],
        **peak_memory(),
        "models": {k: v.to_dict() for k, v in records[-1].models.items()} if records else {},
        "final_model": coordinator.final_model,
        "num_classes": federation.num_classes,
        "poisoned_devices": len(poisoned),
        "rejected_updates": recorder.rejected,
        "interrupted": interrupted,
    }
    if ranks is not None:  # the whole fleet's footprint: every rank's peaks, summed
        final["ranks"] = ranks
        for key in ("peak_rss_bytes", "peak_gpu_bytes"):
            final[key] = sum(r[key] for r in ranks)
    config_dict = config.model_dump(mode="json")
    report = RunReport(config=config_dict, rounds=records, final=final)
    if interrupted:
        raise RunInterrupted(report)
    return report


def fleet_token(shard: Shard | None = None) -> bytes:
    """A fresh random fleet token for a run (rank 0's, shared with the other ranks of a
    sharded run, so every rank derives the same keys and nobody outside the run knows
    them)."""
    token = new_key() if shard is None or shard.leader else None
    if shard is not None:
        token = broadcast(token)
    assert token is not None
    return token


def run_signing_key(token: bytes) -> SigningKey:
    """The coordinator's signing key of a run, derived from its fleet ``token`` (so every
    rank of a sharded run holds its public half without another exchange, and nobody
    outside the run knows it)."""
    return SigningKey(hmac.new(token, b"edgefl-sim-signing-key", hashlib.sha256).digest())


def fleet_keyring(device_ids: Sequence[str], token: bytes | None = None) -> Keyring:
    """Keys for the emulated devices, as a fleet token provisions them: each device's key
    is derived from ``token`` for its id (:func:`~protocol.auth.derive_device_key`; a
    fresh token when None)."""
    token = new_key() if token is None else token
    return Keyring({d: derive_device_key(token, d) for d in device_ids})


def _poisoning(
    factory: TrainerFactory, poisoned: frozenset[str], kind: PoisonKind, scale: float
) -> TrainerFactory:
    """``factory`` whose trainers poison the uploads of ``poisoned`` (attack emulation)."""

    def build(devices: Any) -> PoisoningTrainer:
        return PoisoningTrainer(factory(devices), poisoned, kind, scale)

    return build


def _check_shardable(config: SimConfig, shard: Shard) -> None:
    """A sharded run needs a broker every rank reaches and no per-device evaluation.

    Raises:
        SimError: naming what does not work across ranks.
    """
    if config.transport != "mqtt":
        raise SimError("a sharded run (torchrun) needs --transport mqtt: ranks share a broker")
    if config.sharing == "head":
        raise SimError(
            "--sharing head evaluates every device's own model on rank 0; a sharded run "
            "(torchrun) keeps them on their ranks: run it in one process"
        )
    if config.devices < shard.world:
        raise SimError(f"{config.devices} devices cannot fill {shard.world} ranks")


def _rank_answer(shard: Shard, fleet: Fleet, count: int) -> Callable[[str], Any]:
    def answer(question: str) -> Any:
        if question == "traffic":
            return fleet_totals(fleet)
        return {"rank": shard.rank, "devices": count, **peak_memory()}

    return answer


@contextlib.contextmanager
def _ranks(shard: Shard, fleet: Fleet) -> Iterator[RoundSync]:
    """Rank 0's link to the other ranks; released on exit, whatever happened."""
    sync = RoundSync(shard, _rank_answer(shard, fleet, len(fleet.device_ids)))
    try:
        yield sync
    finally:
        sync.close()


def _follow(
    config: SimConfig,
    shard: Shard,
    devices: list[tuple[ClientConfig, DeviceData]],
    make_transport: Callable[[str], Transport],
    trainer: TrainerFactory,
) -> RunReport:
    """A rank other than 0: emulate this rank's devices until the run finishes, answering
    rank 0's questions (bytes, peak memory) meanwhile."""
    started = time.perf_counter()
    try:
        fleet = Fleet(devices, make_transport, trainer=trainer, options=config.fleet_options(shard))
    except (ConfigError, DeviceConfigError) as exc:
        raise SimError(str(exc)) from exc
    sync = RoundSync(shard, _rank_answer(shard, fleet, len(devices)))
    try:
        fleet.start()
        while not fleet.wait(0.5) and not sync.released.is_set():
            pass
    finally:
        sync.close()  # until rank 0 has asked everything
        fleet.close()
    final = {
        "rank": shard.rank,
        "devices": len(devices),
        "wall_s": time.perf_counter() - started,
        **peak_memory(),
    }
    return RunReport(config=config.model_dump(mode="json"), rounds=[], final=final)
