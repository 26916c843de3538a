"""Traffic budget of a run: the bytes each device sends and receives, without the fleet.

:func:`estimate` answers "how many bytes does this configuration move?" for the settings
of a :class:`~sim.run.SimConfig`, with the very encoders a run uses, in about the time
the run's training takes (no broker: tens of seconds to minutes on 2 CPU cores,
docs/budget.md). It drives the real
:class:`~coordinator.engine.RoundEngine` (the strategy, the per-device transfers, the
selection) with a fake clock and, for each device, the real
:class:`~edge_client.train.session.DeviceSession` in the shell
:class:`~edge_client.train.runtime.EdgeClient` runs
(:class:`~edge_client.train.shell.DeviceShell`), synchronously. The devices train as
the fleet would (every local step the task asks, on the device's share of the run's
dataset, so lossy deltas quantize and compress as a run's do), all the devices of a round
at once with the batched cohort engine (:mod:`sim.cohort`): with a broker, codec threads
and the per-device loop left out, that is what makes it fast.

Every message is measured as the transports of ``python -m sim`` count it:
:class:`~protocol.codec.Codec` frame, :func:`~protocol.chunking.split_frame` at the
sender's maximum payload, :func:`~protocol.transport.wire.publish_packet_size` per MQTT
publish (QoS 1, MQTT 3.1.1). *Up* is what devices publish; *down* is what is delivered
to devices (their inbox and the coordinator's retained status). Devices join one after
the other once the coordinator is up, as in the emulator; see docs/budget.md.

Transfer times over a link (:data:`LINK_PROFILES`, :func:`transfer_time`) are wire bytes
at the link's rate plus its latency once per direction and device-round.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import torch

from coordinator.actions import Action, AggregateRequested, Finished, Publish, RoundStarted
from coordinator.context import ServerContext, resolve_server_device
from coordinator.engine import RoundEngine
from coordinator.errors import ConfigError
from coordinator.events import AggregateDone, Received
from coordinator.groups import ArchitectureGroup
from coordinator.proxy import server_proxy
from coordinator.runtime import build_models
from coordinator.store import MemoryStore
from coordinator.strategies.base import Strategy
from coordinator.strategies.registry import build_strategy
from edge_client.errors import ConfigError as DeviceConfigError
from edge_client.link import DeviceState, total_memory_bytes
from edge_client.train import exchange
from edge_client.train import session as dev
from edge_client.train.hello import ModelDescription
from edge_client.train.shell import DeviceShell
from edge_client.train.trainer import build_device_model, describe_model
from edge_client.train.transfer import TransferState
from models import Classifier
from models.devices import resolve_device
from protocol.chunking import DEFAULT_MAX_PAYLOAD, split_frame
from protocol.codec import Codec
from protocol.messages import (
    Ack,
    CoordinatorStatus,
    DeviceStatus,
    Message,
    ModelPayload,
    RoundTask,
)
from protocol.tensors import Precision
from protocol.topics import Topics, parse_topic
from protocol.transport.wire import MqttVersion, publish_packet_size
from sim.cohort.trainer import BatchedTrainer, Engine
from sim.errors import SimError
from sim.fleet import FleetDevice
from sim.partition import Federation
from sim.progress import Detailed, Progress
from sim.run import SimConfig, build_federation, device_data

__all__ = [
    "LINK_PROFILES",
    "RATE_SYNTAX",
    "Budget",
    "Bytes",
    "LinkProfile",
    "TransferTime",
    "budget_engine",
    "estimate",
    "estimate_with_reference",
    "link_profile",
    "reference_config",
    "transfer_time",
]

log = logging.getLogger(__name__)

QOS = 1  # every publish of the runtimes (protocol.channel.Channel's default)
MQTT_VERSION = MqttVersion.V311  # the transports' default
REPORTED_RSS = 256 * 2**20
"""Resident memory an emulated device reports in its statuses, bytes (a 4-byte value)."""


# -- links ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkProfile:
    """A device's network link: sustained application rates and one-way latency."""

    name: str
    up_bps: float
    """Device -> broker, bits per second."""
    down_bps: float
    """Broker -> device, bits per second."""
    latency_s: float
    """Paid once per transfer (per direction and device-round), seconds."""

    def __post_init__(self) -> None:
        rates = (self.up_bps, self.down_bps)
        if not all(math.isfinite(r) and r > 0 for r in rates) or not self.latency_s >= 0:
            raise SimError(f"link {self.name!r}: rates must be > 0 and latency >= 0")


# Sustained application-level rates a single device can expect (not the radio's peak), and
# the one-way latency of a small message; rules of thumb, reasons in docs/budget.md.
#
# ======  ==========  ===========  =======  ===============================================
# name    up bit/s    down bit/s   latency  based on
# ======  ==========  ===========  =======  ===============================================
# nb-iot  20 k        25 k         2 s      3GPP Rel-13 Cat-NB1: peak ~62 k up (multi-tone),
#                                           ~26 k down; 3GPP latency target 10 s
# lte-m   250 k       300 k        0.2 s    Cat-M1 half-duplex FDD: peak ~375 k up, ~300 k
#                                           down; 100-200 ms round trips in the field
# 3g      1 M         3 M          0.1 s    HSPA (UMTS): peak ~5.7 M up (HSUPA Cat 6), ~14 M
#                                           down (HSDPA Cat 10); 100-200 ms round trips
# 4g      5 M         20 M         50 ms    LTE, typical user throughput in operator reports
# 5g      20 M        100 M        20 ms    5G NR sub-6 GHz, typical user throughput
# wifi    20 M        50 M         20 ms    802.11n/ac behind a consumer broadband uplink
# ======  ==========  ===========  =======  ===============================================
LINK_PROFILES: Mapping[str, LinkProfile] = MappingProxyType(
    {
        p.name: p
        for p in (
            LinkProfile("nb-iot", 20e3, 25e3, 2.0),
            LinkProfile("lte-m", 250e3, 300e3, 0.2),
            LinkProfile("3g", 1e6, 3e6, 0.1),
            LinkProfile("4g", 5e6, 20e6, 0.05),
            LinkProfile("5g", 20e6, 100e6, 0.02),
            LinkProfile("wifi", 20e6, 50e6, 0.02),
        )
    }
)
"""Named links of ``--link`` (see the table above)."""

_ALIASES = {
    "catnb1": "nbiot",
    "catm1": "ltem",
    "umts": "3g",
    "hspa": "3g",
    "lte": "4g",
    "nr": "5g",
    "wlan": "wifi",
}
_RATE = re.compile(
    r"^(\d+(?:\.\d*)?(?:e\d+)?)\s*([kmg]?)(bit/s|bits/s|bps|b/s|bit)?$", re.IGNORECASE
)
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}
_BYTES = re.compile(r"(B/s|Bps)$")
RATE_SYNTAX = "a rate in bit/s both ways (250000, 250k, 1.5M, 2Gbit/s, 2Gbps)"
"""How ``--link`` reads a rate, for its help and its errors."""


def link_profile(text: str) -> LinkProfile:
    """The link named ``text`` (a :data:`LINK_PROFILES` name or alias, case, spaces, ``_``
    and ``-`` ignored), or a rate in bits per second both ways with no latency
    (``250000``, ``250k``, ``1.5M``, ``2Gbit/s``, ``2Gbps``; the unit is optional except
    after ``G``).

    A number with a bare ``g``/``G`` (``3g``, ``6G``) is a mobile generation, never a rate:
    a profile where there is one (``3g``, ``4g``, ``5g``), refused otherwise, so that
    ``3g`` is not read as 3 Gbit/s. Bytes per second (``B/s``, ``Bps``) are refused too.

    Raises:
        SimError: neither a known name nor a positive rate in bits per second.
    """
    key = _normal(text)
    key = _ALIASES.get(key, key)
    for profile in LINK_PROFILES.values():
        if key == _normal(profile.name):
            return profile
    stripped = text.strip()
    match = _RATE.match(stripped)
    why = ""
    if match is not None and _BYTES.search(stripped):
        why = " (bytes per second: give bits, e.g. 8Mbit/s for 1 MB/s)"
    elif match is not None and match.group(2).lower() == "g" and not match.group(3):
        number = match.group(1)
        why = f" (a bare G names a mobile generation, not Gbit/s: {number}Gbit/s is a rate)"
    elif match is not None:
        rate = float(match.group(1)) * _SCALE[match.group(2).lower()]
        if math.isfinite(rate) and rate > 0:
            return LinkProfile(stripped, rate, rate, 0.0)
    names = ", ".join(LINK_PROFILES)
    raise SimError(f"unknown link {text!r}{why}: give one of {names}, or {RATE_SYNTAX}")


def _normal(name: str) -> str:
    return re.sub(r"[\s_-]", "", name.lower())


# -- byte counts ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Bytes:
    """Bytes in both directions: MQTT payloads and whole PUBLISH packets (wire)."""

    up: int = 0
    down: int = 0
    wire_up: int = 0
    wire_down: int = 0

    def __add__(self, other: Bytes) -> Bytes:
        return Bytes(
            self.up + other.up,
            self.down + other.down,
            self.wire_up + other.wire_up,
            self.wire_down + other.wire_down,
        )

    def per(self, count: int) -> Bytes:
        """These counts divided by ``count``, rounded to whole bytes."""
        n = max(1, count)
        return Bytes(*(round(v / n) for v in self.to_dict().values()))

    def to_dict(self) -> dict[str, int]:
        return {
            "up": self.up,
            "down": self.down,
            "wire_up": self.wire_up,
            "wire_down": self.wire_down,
        }


@dataclass(frozen=True)
class TransferTime:
    """Seconds one device-round spends on the link (training time not included)."""

    up: float
    down: float

    @property
    def total(self) -> float:
        return self.up + self.down

    def to_dict(self) -> dict[str, float]:
        return {"up": self.up, "down": self.down, "total": self.total}


def transfer_time(counts: Bytes, link: LinkProfile) -> TransferTime:
    """``wire bytes * 8 / rate + latency`` per direction (no latency without bytes)."""
    up = counts.wire_up * 8 / link.up_bps + (link.latency_s if counts.wire_up else 0.0)
    down = counts.wire_down * 8 / link.down_bps + (link.latency_s if counts.wire_down else 0.0)
    return TransferTime(up, down)


@dataclass(frozen=True)
class Budget:
    """What one configuration moves over the whole run."""

    config: SimConfig
    device_rounds: int
    """Selected (device, round) pairs: a model and task down, an update up."""
    selected: Bytes
    """Bytes of the selected device-rounds: model, task and the update's ack down;
    training / idle statuses and the update up."""
    total: Bytes
    """Everything, also each device's announce (online status, hello and its ack), the
    coordinator statuses devices receive and the final offline statuses."""
    by_kind: dict[str, Bytes] = field(default_factory=dict)
    """``total`` split by message kind (``model``, ``update``, ``hello`` ...)."""

    @property
    def per_device_round(self) -> Bytes:
        """Mean over the selected device-rounds."""
        return self.selected.per(self.device_rounds)

    @property
    def per_round(self) -> Bytes:
        """The fleet's total over the number of rounds."""
        return self.total.per(self.config.rounds)


def reference_config(config: SimConfig) -> SimConfig:
    """The fp32 FedAvg run with ``config``'s model, fleet, rounds and data."""
    return config.model_copy(
        update={
            "strategy": "fedavg",
            "sharing": "full",
            "downlink": "dual",
            "final_model": None,
            "downlink_precision": Precision.FP32,
            "uplink_precision": Precision.FP32,
            "device_precisions": (),
        }
    )


# -- the emulation -------------------------------------------------------------------------


def estimate(
    config: SimConfig,
    *,
    progress: Progress | None = None,
    label: str = "budget",
) -> Budget:
    """The bytes the run ``config`` would move, measured on real messages.

    Args:
        config: the run (its transport, broker and thread settings do not matter).
        progress: told the steps as they go (data, devices, each round's devices).
        label: names this estimate in the progress steps.

    Raises:
        SimError: unknown model or strategy, options the strategy cannot honour, a
            dataset that cannot be loaded or partitioned, or a device that cannot run
            its task.
    """
    return _estimate(config, progress, label, None)[0]


def estimate_with_reference(
    config: SimConfig, *, progress: Progress | None = None
) -> tuple[Budget, Budget]:
    """The budget of ``config`` and that of its fp32 FedAvg reference
    (:func:`reference_config`; the budget itself when ``config`` is the reference),
    both on the same partitioned dataset, loaded once.

    Raises:
        SimError: as :func:`estimate`.
    """
    budget, federation = _estimate(config, progress, "budget", None)
    settings = reference_config(config)
    if settings == config:
        return budget, budget
    # the reference differs in strategy and precisions only: the same data
    return budget, _estimate(settings, progress, "fp32 reference", federation)[0]


_Data = tuple[Federation, tuple[int, ...]]
"""A run's partitioned dataset and the shape of one sample (:func:`build_federation`)."""


def _estimate(
    config: SimConfig, progress: Progress | None, label: str, data: _Data | None
) -> tuple[Budget, _Data]:
    try:
        device = resolve_device(config.device)
    except ValueError as exc:
        raise SimError(str(exc)) from exc
    emulation = _Emulation(config, progress, label, device, data)
    return emulation.run(), emulation.data


def budget_engine(engine: Engine) -> Literal["batched", "loop"]:
    """How the budget trains: ``auto`` is the batched engine on any device. (A run's
    ``auto`` trains on the per-device path on a CPU, a device per core, because its
    wire needs the cores beside the training; the budget has no wire, and on this
    project's 2 CPU cores the batched engine took 52 s where the loop took 84 to 100 s,
    docs/budget.md.)"""
    return "batched" if engine == "auto" else engine


class _Emulation:
    """One run: the engine, the emulated devices and the byte counters."""

    def __init__(
        self,
        config: SimConfig,
        progress: Progress | None,
        label: str,
        device: torch.device,
        shared: _Data | None,
    ) -> None:
        self.config = config
        self._progress = progress
        self._label = label
        self.codec = Codec()
        self.topics = Topics(config.fleet)
        if shared is None:
            self._step(f"loading {config.dataset} and partitioning it across the devices")
            shared = build_federation(config)
        self.data = shared
        federation, shape = shared
        coordinator = config.coordinator_config(federation.num_classes, shape)
        try:  # as coordinator.runtime.Coordinator builds its engine
            templates = build_models(coordinator)
            strategy: Strategy = build_strategy(coordinator, templates)
            self._server_device = resolve_server_device(coordinator.server_device)
            self._proxy = server_proxy(config.proxy_images(), strategy, coordinator)
        except ConfigError as exc:
            raise SimError(str(exc)) from exc
        self.engine = RoundEngine(
            coordinator,
            strategy,
            MemoryStore(),
            {name: ArchitectureGroup.of(t) for name, t in templates.items()},
        )
        self.devices: dict[str, _Device] = {}
        specs: list[FleetDevice] = []
        fingerprints: dict[tuple[object, ...], tuple[str, ModelDescription]] = {}
        memory_bytes = total_memory_bytes()
        self._step("building the devices", total=len(federation.devices))
        for index, split in enumerate(federation.devices):
            data = device_data(federation, index)
            # as sim.run configures its devices; an estimate persists nothing
            client = config.device_config(index, split.device_id).model_copy(
                update={"state_dir": None}
            )
            key = (client.model, data.sample_shape, data.num_classes)
            if key not in fingerprints:
                try:
                    model = build_device_model(client, data)
                    fingerprints[key] = model.fingerprint(), describe_model(model)
                except DeviceConfigError as exc:
                    raise SimError(str(exc)) from exc
            session = dev.DeviceSession(
                client,
                fingerprint=fingerprints[key][0],
                model=fingerprints[key][1],
                num_samples=data.num_samples,
                label_counts=tuple(int(c) for c in data.label_counts()),
                memory_bytes=memory_bytes,
            )
            specs.append(FleetDevice(client, data, TransferState()))
            self.devices[split.device_id] = _Device(self, split.device_id, session)
            if progress is not None:
                progress.advance()
        self.trainer = BatchedTrainer(
            specs,
            engine=budget_engine(config.engine),
            device=device,
            max_cohort=config.max_cohort,
            workers=1,
            progress=None if progress is None else _TrainingProgress(progress),
        )
        self._training: list[tuple[_Device, exchange.TrainJob]] = []  # deferred to the cohort
        self._joined: list[_Device] = []
        self._retained: Message | None = None  # the coordinator's retained status
        self._inbox: deque[tuple[_Device, str, Message, bool]] = deque()  # to, topic, ..., selected
        self._update_ids: set[str] = set()
        self._finished = False
        self._now = time.time()
        self.selected = Bytes()
        self.total = Bytes()
        self.by_kind: dict[str, Bytes] = {}
        self.device_rounds = 0

    def run(self) -> Budget:
        self._execute(self.engine.start(self._clock()))
        for device in self.devices.values():  # devices join one by one, as in the sim
            self._joined.append(device)
            if self._retained is not None:
                status_topic = self.topics.coordinator_status
                self._inbox.append((device, status_topic, self._retained, False))
            device.shell.handle(exchange.Started())
            self._drain()
        self.trainer.close()
        if not self._finished:
            raise SimError("the emulated run stopped before its last round (a bug)")
        log.info(
            "%s %s: %d device-rounds, %d B up, %d B down",
            self.config.strategy,
            self.config.downlink_precision.value,
            self.device_rounds,
            self.total.up,
            self.total.down,
        )
        return Budget(
            self.config,
            self.device_rounds,
            self.selected,
            self.total,
            self.by_kind,
        )

    def _step(self, text: str, total: int | None = None) -> None:
        if self._progress is not None:
            self._progress.step(f"{self._label}: {text}", total)

    def _clock(self) -> float:
        self._now += 0.001
        return self._now

    # -- counting ------------------------------------------------------------------------

    def _count(self, topic: str, message: Message, *, up: bool, selected: bool) -> None:
        """Count ``message`` published on ``topic`` once, as the transports count it."""
        parts = split_frame(self.codec.encode(message), DEFAULT_MAX_PAYLOAD)
        payload = sum(len(p) for p in parts)
        wire = sum(publish_packet_size(topic, len(p), QOS, MQTT_VERSION) for p in parts)
        counts = Bytes(up=payload, wire_up=wire) if up else Bytes(down=payload, wire_down=wire)
        self.total += counts
        self.by_kind[message.kind] = self.by_kind.get(message.kind, Bytes()) + counts
        if selected:
            self.selected += counts

    # -- the coordinator side ------------------------------------------------------------

    def _execute(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, AggregateRequested):  # at once, on this thread
                job = action.job
                seed = self.engine.config.seed
                context = ServerContext.for_round(self._server_device, seed, job.round, self._proxy)
                done = AggregateDone(job.round, job.run(context), self._clock())
                self._execute(self.engine.handle(done))
            elif isinstance(action, Finished):
                self._finished = True
            elif isinstance(action, RoundStarted):
                rounds, selected = self.config.rounds, len(action.selected)
                expected = self.device_rounds + selected * (rounds - action.round + 1)
                self._step(
                    f"round {action.round}/{rounds} ({self.device_rounds}/{expected} device-rounds "
                    "done): devices trained",
                    selected,
                )
            if not isinstance(action, Publish):
                continue
            message, topic = action.message, action.topic
            device_id = parse_topic(topic).device_id  # None: the coordinator's status
            if device_id is None:
                self._retained = message
                receivers = list(self._joined)
            else:
                receivers = [self.devices[device_id]]
            for device in receivers:
                if not device.stopped:
                    self._inbox.append((device, topic, message, self._in_round(message)))

    def _in_round(self, message: Message) -> bool:
        body = message.body
        if isinstance(body, Ack):
            return body.ref in self._update_ids
        return isinstance(body, (ModelPayload, RoundTask))

    def _publish(self, device: _Device, topic: str, message: Message, *, selected: bool) -> None:
        """``device`` publishes ``message`` on ``topic``; the engine receives it."""
        self._count(topic, message, up=True, selected=selected)
        if not self._finished:  # the coordinator is gone once the run finished
            self._execute(self.engine.handle(Received(device.device_id, message, self._clock())))

    def _message(self, device: _Device, body: Any, round_: int = -1) -> Message:
        return Message(fleet=self.config.fleet, sender=device.device_id, body=body, round=round_)

    # -- the device side (each device's session, as EdgeClient runs it) ------------------

    def _drain(self) -> None:
        """Deliver every queued message; then train the cohort the deliveries started
        (all devices that were given a task) and deliver what that leads to, until
        nothing is left."""
        while self._inbox or self._training:
            while self._inbox:
                device, topic, message, selected = self._inbox.popleft()
                self._count(topic, message, up=False, selected=selected)
                event: exchange.Event
                if isinstance(message.body, CoordinatorStatus):
                    event = exchange.CoordinatorStatusReceived(topic, message)
                else:
                    event = exchange.Received(topic, message, self._now)
                device.shell.handle(event)
            if self._training:
                cohort, self._training = self._training, []
                jobs = [(device.device_id, job) for device, job in cohort]
                for (device, job), result in zip(cohort, self.trainer.run_many(jobs), strict=True):
                    self._check(device, job, result)
                    device.shell.handle(exchange.JobDone(result))

    def _check(self, device: _Device, job: exchange.Job, result: exchange.JobResult) -> None:
        """An emulated device that cannot run its task stops the estimate."""
        cannot = f"{device.device_id} cannot run its round {job.message.round} task"
        if isinstance(result, (exchange.NeedsBase, exchange.Rejected)):
            raise SimError(f"{cannot}: {result.reason}")
        if isinstance(result, exchange.Failed):
            raise SimError(f"{cannot}: {result.error}") from result.error

    def _status(self, device: _Device, state: DeviceState, *, selected: bool = False) -> None:
        body = DeviceStatus(state=state, rss_bytes=REPORTED_RSS)
        topic = self.topics.device(device.device_id, "status")
        self._publish(device, topic, self._message(device, body), selected=selected)


class _TrainingProgress:
    """The cohort trainer's progress as the estimate's: each device trained advances the
    round's count, each local step of a batched computation is the step's detail."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._detailed = progress if isinstance(progress, Detailed) else None

    def trained(self, devices: int) -> None:
        self._progress.advance(devices)

    def steps(self, done: int, total: int) -> None:
        if self._detailed is not None:
            self._detailed.detail(f"local step {done}/{total}")


class _Device:
    """One emulated edge client: its shell, and what the emulation does for it (the
    shell's :class:`~edge_client.train.shell.DeviceEffects`), at once and depth first:
    what an action leads to is carried out before the session's next action. An
    estimate persists nothing (the shell has no store)."""

    def __init__(self, emulation: _Emulation, device_id: str, session: dev.DeviceSession) -> None:
        self.device_id = device_id
        self.shell = DeviceShell(session, self)
        self.stopped = False
        self._emulation = emulation

    def publish(self, action: exchange.Publish) -> None:
        self._emulation._publish(self, action.topic, action.message, selected=False)

    def set_status(self, action: exchange.SetStatus) -> None:
        if action.state == "error":
            raise SimError(f"{self.device_id}: {action.detail}")
        selected = action.state in ("training", "idle")
        self._emulation._status(self, action.state, selected=selected)

    def send_update(self, action: exchange.SendUpdate) -> None:
        self._emulation._update_ids.add(action.message.message_id)
        self._emulation._publish(self, action.topic, action.message, selected=True)
        self.shell.handle(exchange.UpdateSent(action.task_id, ok=True))

    def run_job(self, job: exchange.Job) -> None:
        emulation = self._emulation
        if isinstance(job, exchange.TrainJob):  # trained with the round's cohort
            emulation._training.append((self, job))
            return
        emulation.device_rounds += 1
        result = emulation.trainer.run_many([(self.device_id, job)])[0]
        emulation._check(self, job, result)
        self.shell.handle(exchange.JobDone(result))

    def commit_upload(self) -> None:
        self._emulation.trainer.commit_upload(self.device_id)

    def trained_model(self) -> Classifier:
        return self._emulation.trainer.model(self.device_id)

    def learning_state(self) -> Mapping[str, Any]:
        return self._emulation.trainer.trainer(self.device_id).learning_state

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self._emulation._status(self, "offline")
