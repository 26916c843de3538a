"""The device and broker faults of issue 17, each a short run over a private Mosquitto.

Every scenario runs ``python -m coordinator`` and ``python -m edge_client`` as separate
processes (synthetic data, ``--model mlp``, per-device keys) on :mod:`benchmarks.harness`,
as :mod:`benchmarks.faults` does, plus test-side MQTT clients: a :class:`Monitor` holding the keyring that records
tasks, updates, chunks and acknowledgements, and :class:`CraftedDevice`, a keyed device
played by hand that can stay silent or publish the chunks of its signed update as it
likes. The kinds:

``cut_upload``
    A device's link to the broker is slowed (:class:`ThrottledLink`), and the device is
    SIGKILLed once some but not all chunks of its update reached the broker; it restarts
    with its state dir. Its update must be accepted exactly once (in that round, or a
    later one if the round closed meanwhile), the partial transfer must harm nobody.
``chunks``
    A crafted device publishes its update's chunks duplicated and shuffled, then, after
    the round closed, again (the same transfer: dropped unanswered; a new one:
    acknowledged ``duplicate``): counted once. A second crafted device holds its update
    past the deadline and sends its chunks shuffled after the round closed: refused
    ``late``, nothing changes.
``churn``
    A crafted device is selected every round and never uploads: each round closes at its
    deadline with the others' updates. Meanwhile a keyed device starts mid-run and is
    selected in later rounds, and a device is SIGKILLed (its last will says offline) and
    is selected no more; no round outlives its deadline.

Each returns a :class:`ScenarioReport`: faults injected, rounds completed, updates tried,
acknowledged, rejected, ``lost`` (acknowledged but missing from the round's aggregate),
``twice`` (aggregated beyond those acknowledged) and ``delayed`` (an honest device's
update of a round it was tasked in that the round did not take on time).
``python -m benchmarks.faults`` runs them all after its coordinator-kill run.
"""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import (
    MLP_FEDAVG,
    Status,
    coordinator_command,
    edge_client_command,
    private_broker,
    processes,
    spawn,
    wait_status,
    write_fleet,
)
from models.registry import build_classifier
from protocol.auth import Keyring, new_key
from protocol.channel import Channel
from protocol.chunking import read_chunk_header
from protocol.errors import DecodeError
from protocol.messages import (
    Ack,
    CoordinatorStatus,
    DeviceStatus,
    Hello,
    Message,
    ModelPayload,
    ReasonCode,
    RoundTask,
    Update,
)
from protocol.signing import VerifyKey
from protocol.tensors import Precision
from protocol.tensorset import encode_tensors
from protocol.topics import Topics
from protocol.transport.base import Inbound
from protocol.transport.config import MqttConfig
from protocol.transport.mqtt import MqttTransport

FLEET = "faults"
"""The fleet of every fault run (the coordinator-kill run's too)."""
TOPICS = Topics(FLEET)
LOOPBACK = "127.0.0.1"
_TAKEN = (ReasonCode.OK, ReasonCode.DUPLICATE)


@dataclass
class ScenarioReport:
    """What one scenario measured (see the module docstring for the counts)."""

    kind: str
    faults: dict[str, int] = field(default_factory=dict)
    """Faults injected, by kind: ``cut_upload`` (device killed mid-upload), ``duplicated``
    and ``late`` (crafted chunk bursts), ``silent`` (rounds a silent device was selected
    in), ``join`` and ``leave`` (devices started and SIGKILLed mid-run)."""
    rounds: int = 0
    rounds_completed: int = 0
    finished: bool = False
    updates_tried: int = 0
    """Distinct update messages seen on the update topics."""
    updates_acknowledged: int = 0
    """Distinct (device, round) updates acknowledged as taken (ok or duplicate)."""
    updates_rejected: int = 0
    """Acknowledgements of updates with accepted = false."""
    lost: int = 0
    twice: int = 0
    delayed: int = 0
    wall_s: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)
    """Observations particular to the scenario (what its test checks)."""
    problems: list[str] = field(default_factory=list)


# -- test-side clients -----------------------------------------------------------------


class Monitor:
    """Records, decoded with the keyring, every task, update and acknowledgement of the
    fleet, and the chunk headers of every update transfer."""

    def __init__(self, url: str, keyring: Keyring) -> None:
        self._lock = threading.Lock()
        self.tasks: list[tuple[str, int]] = []  # device, round
        self.acks: list[tuple[str, int, str | None, bool, ReasonCode]] = []
        self.updates: dict[str, tuple[str, int]] = {}  # message id -> device, round
        self.chunks: dict[tuple[str, bytes], tuple[int, set[int]]] = {}
        self._transport = MqttTransport(MqttConfig.from_url(url, client_id="faults-monitor"))
        self._raw = MqttTransport(MqttConfig.from_url(url, client_id="faults-chunks"))
        self._channel = Channel(self._transport, auth=keyring)

    def start(self) -> None:
        self._transport.connect()
        self._raw.connect()
        self._channel.subscribe(f"{TOPICS.root}/to/+/+", self._on_down)
        self._channel.subscribe(TOPICS.from_devices("update"), self._on_update)
        self._raw.subscribe(TOPICS.from_devices("update"), self._on_chunk)

    def stop(self) -> None:
        self._transport.disconnect()
        self._raw.disconnect()

    def _on_down(self, topic: str, message: Message) -> None:
        device = topic.split("/")[-2]
        with self._lock:
            if isinstance(message.body, RoundTask):
                self.tasks.append((device, message.round))
            elif isinstance(message.body, Ack):
                body = message.body
                self.acks.append((device, message.round, body.ref, body.accepted, body.reason))

    def _on_update(self, topic: str, message: Message) -> None:
        if isinstance(message.body, Update):
            with self._lock:
                self.updates[message.message_id] = (message.sender, message.round)

    def _on_chunk(self, inbound: Inbound) -> None:
        try:
            head = read_chunk_header(inbound.payload)
        except DecodeError:  # a whole frame, not a chunk
            return
        device = inbound.topic.split("/")[-2]
        with self._lock:
            _, seen = self.chunks.setdefault((device, head.transfer_id), (head.count, set()))
            seen.add(head.index)

    def tasked(self, device: str) -> list[int]:
        """Rounds ``device`` got a task in, in order, each once (a task sent again in its
        round, to a device that said hello twice, is the same round's)."""
        with self._lock:
            return list(dict.fromkeys(r for d, r in self.tasks if d == device))

    def update_acks(self, device: str | None = None) -> list[tuple[str, int, bool, ReasonCode]]:
        """(device, round of the update, accepted, reason) of every ack of an update."""
        with self._lock:
            return [
                (d, self.updates[ref][1], ok, reason)
                for d, _, ref, ok, reason in self.acks
                if ref in self.updates and (device is None or d == device)
            ]

    def taken(self) -> dict[int, set[str]]:
        """Round -> devices whose update of that round was acknowledged as taken."""
        out: dict[int, set[str]] = defaultdict(set)
        for device, round_number, ok, reason in self.update_acks():
            if ok and reason in _TAKEN:
                out[round_number].add(device)
        return out

    def transfers(self, device: str) -> list[tuple[int, int]]:
        """(chunks seen, chunk count) of each chunked transfer of ``device``."""
        with self._lock:
            return [(len(s), c) for (d, _), (c, s) in self.chunks.items() if d == device]


class CraftedDevice:
    """A keyed device played by the test: it says hello, records its tasks, models and
    acks, and publishes whatever the scenario asks (or nothing)."""

    def __init__(self, url: str, device_id: str, key: bytes, coordinator: VerifyKey) -> None:
        self.device_id = device_id
        self.transport = MqttTransport(MqttConfig.from_url(url, client_id=f"crafted-{device_id}"))
        self.channel = Channel(
            self.transport, auth=Keyring({device_id: key}), fleet_key=coordinator
        )
        self._cond = threading.Condition()
        self.tasks: dict[int, Message] = {}
        self.models: dict[str, ModelPayload] = {}
        self.acks: list[Ack] = []
        self._rng = np.random.default_rng(7)
        self._said_hello = False

    @property
    def update_topic(self) -> str:
        return TOPICS.device(self.device_id, "update")

    def start(self) -> None:
        """Connect; the hello goes out when the coordinator is seen live (as a real device,
        it says hello again whenever the coordinator says ``starting``)."""
        self.transport.connect()
        for leaf in ("task", "model", "ack"):
            self.channel.subscribe(TOPICS.to_device(self.device_id, leaf), self._on)
        self.channel.subscribe(TOPICS.coordinator_status, self._on_coordinator)

    def _on_coordinator(self, topic: str, message: Message) -> None:
        body = message.body
        if not isinstance(body, CoordinatorStatus) or body.state in ("finished", "stopped"):
            return
        if body.state != "starting" and self._said_hello:
            return
        self._said_hello = True
        template = build_classifier("mlp")
        hello = Hello(
            device_id=self.device_id,
            architecture=template.architecture,
            fingerprint=template.fingerprint(),
            precisions=(Precision.FP32,),
            memory_bytes=0,
            threads=1,
            software_version="crafted",
            num_samples=100,
        )
        self.channel.send(TOPICS.device(self.device_id, "hello"), self._message(hello))
        online = self._message(DeviceStatus(state="online"))
        self.channel.send(TOPICS.device(self.device_id, "status"), online)

    def stop(self) -> None:
        self.transport.disconnect()

    def _message(self, body: Any, round_number: int = 0) -> Message:
        return Message(fleet=FLEET, sender=self.device_id, round=round_number, body=body)

    def _on(self, topic: str, message: Message) -> None:
        with self._cond:
            if isinstance(message.body, RoundTask):
                self.tasks[message.round] = message
            elif isinstance(message.body, ModelPayload):
                self.models[message.message_id] = message.body
            elif isinstance(message.body, Ack):
                self.acks.append(message.body)
            self._cond.notify_all()

    def wait_task(self, round_number: int, timeout: float) -> bool:
        """Whether the task of ``round_number`` and its model arrived within ``timeout`` s."""

        def ready() -> bool:
            task = self.tasks.get(round_number)
            if task is None or not isinstance(task.body, RoundTask):
                return False
            return task.body.model_message is None or task.body.model_message in self.models

        with self._cond:
            return self._cond.wait_for(ready, timeout)

    def wait_ack(self, ref: str, timeout: float) -> Ack | None:
        def found() -> Ack | None:
            return next((a for a in self.acks if a.ref == ref), None)

        with self._cond:
            self._cond.wait_for(lambda: found() is not None, timeout)
            return found()

    def acks_of(self, ref: str) -> list[Ack]:
        with self._cond:
            return [a for a in self.acks if a.ref == ref]

    def update(self, round_number: int) -> Message:
        """A valid update of ``round_number``: the model it was sent, moved a little."""
        with self._cond:
            task = self.tasks[round_number]
            assert isinstance(task.body, RoundTask)
            model = self.models[task.body.model_message or next(reversed(self.models))]
        weights = model.sets.get("weights") or next(iter(model.sets.values()))
        moved = {
            name: (value + 1e-3 * self._rng.standard_normal(value.shape)).astype(value.dtype)
            for name, value in weights.to_arrays().items()
        }
        body = Update(
            task_message=task.message_id,
            num_samples=100,
            sets={"weights": encode_tensors(moved, Precision.FP32)},
        )
        return self._message(body, round_number)

    def chunks(
        self, message: Message, max_payload: int, transfer_id: bytes | None = None
    ) -> list[bytes]:
        """The chunk frames of ``message`` (sealed with the device's key)."""
        frame = self.channel.encode(self.update_topic, message)
        return self.channel.split(self.update_topic, frame, max_payload, transfer_id=transfer_id)

    def publish(self, frames: list[bytes]) -> None:
        for frame in frames:
            self.transport.publish(self.update_topic, frame, qos=1)
        self.transport.flush(10)


class ThrottledLink:
    """A TCP relay to the broker that passes at most ``rate`` bytes per second from the
    client to the broker (a slow uplink); the other way is not slowed."""

    def __init__(self, broker_port: int, rate: float) -> None:
        self._broker_port, self._rate = broker_port, rate
        self._listener = socket.create_server((LOOPBACK, 0))
        self._listener.settimeout(0.2)
        self.port: int = self._listener.getsockname()[1]
        self._stopped = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"mqtt://{LOOPBACK}:{self.port}"

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                continue
            upstream = socket.create_connection((LOOPBACK, self._broker_port))
            self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, slow: bool) -> None:
        try:
            while data := source.recv(4096):
                sink.sendall(data)
                if slow:
                    time.sleep(len(data) / self._rate)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._stopped.set()
        self._listener.close()
        for s in self._sockets:
            s.close()


# -- one run ---------------------------------------------------------------------------


class FaultRun:
    """A private Mosquitto, a keyed fleet (data devices and crafted ones), the monitor,
    and the processes of one scenario; everything is stopped on the way out."""

    def __init__(self, work: Path, devices: int, crafted: tuple[str, ...] = (), seed: int = 0):
        self.work, self.seed = work, seed
        self._stack = ExitStack()
        try:
            self._start(devices, crafted)
        except BaseException:
            self._stack.close()
            raise

    def _start(self, devices: int, crafted: tuple[str, ...]) -> None:
        work = self.work
        self.broker = self._stack.enter_context(private_broker(work, "faults"))
        self.files, self.keys_path = write_fleet(work / "fleet", devices, self.seed)
        keyring = Keyring.load(self.keys_path)
        self.crafted_keys = {name: new_key() for name in crafted}
        for name, key in self.crafted_keys.items():
            keyring = keyring.with_key(name, key)
        keyring.save(self.keys_path)
        self.ids = [path.stem for path in self.files]
        self.monitor = Monitor(self.broker.url, keyring)
        self.monitor.start()
        self._stack.callback(self.monitor.stop)
        self.processes = self._stack.enter_context(processes())
        self.coordinator_log = work / "coordinator.log"
        self.coordinator: subprocess.Popen[bytes] | None = None
        self.started = time.monotonic()

    def __enter__(self) -> FaultRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def crafted(self, name: str) -> CraftedDevice:
        coordinator = VerifyKey.load(self.keys_path.parent / "coordinator.key.pub")
        device = CraftedDevice(self.broker.url, name, self.crafted_keys[name], coordinator)
        device.start()
        self._stack.callback(device.stop)
        return device

    def start_coordinator(self, rounds: int, min_devices: int, timeout_s: float) -> None:
        command = coordinator_command(
            self.broker.url, FLEET, rounds=rounds, min_devices=min_devices,
            state=self.work / "state", keys=self.keys_path, round_timeout_s=timeout_s,
            extra=[*MLP_FEDAVG, "--seed", str(self.seed)],
        )  # fmt: skip
        self.coordinator = spawn(command, self.coordinator_log)
        self.processes.append(self.coordinator)

    def start_device(self, index: int, url: str | None = None) -> subprocess.Popen[bytes]:
        """Edge client ``index`` (its data file, key and state dir), through ``url``."""
        path = self.files[index]
        extra = ("--model", "mlp", "--init-seed", str(self.seed))
        command = edge_client_command(
            url or self.broker.url, FLEET, path, self.work / path.stem, extra
        )
        process = spawn(command, self.work / f"{path.stem}.log")
        self.processes.append(process)
        return process

    def wait_round(self, round_number: int, timeout: float) -> bool:
        """Whether the coordinator started round ``round_number`` within ``timeout`` s."""
        assert self.coordinator is not None
        ready = wait_status(
            self.work / "state", self.coordinator, lambda s: round_number in s.selected, timeout
        )
        return ready is not None

    def finish(self, report: ScenarioReport, honest: set[str], timeout: float = 120) -> None:
        """Wait for the coordinator's end and fill in ``report``'s counts."""
        assert self.coordinator is not None
        try:
            self.coordinator.wait(timeout)
        except subprocess.TimeoutExpired:
            report.problems.append("the coordinator did not finish in time")
        report.finished = self.coordinator.returncode == 0
        if not report.finished:
            report.problems.append(f"the coordinator ended with {self.coordinator.returncode}")
        report.wall_s = time.monotonic() - self.started
        status = Status.read(self.work / "state")
        closes = {} if status is None else status.closed
        report.notes["closes"] = {
            r: {"s": c.duration_s, "on_time": c.on_time, "selected": c.selected}
            for r, c in closes.items()
        }
        taken = self.monitor.taken()
        report.rounds_completed = len(closes)
        report.updates_tried = len(self.monitor.updates)
        report.updates_acknowledged = sum(len(devices) for devices in taken.values())
        report.updates_rejected = sum(1 for *_, ok, _ in self.monitor.update_acks() if not ok)
        for r, close in closes.items():
            report.lost += max(0, len(taken.get(r, ())) - close.on_time)
            report.twice += max(0, close.on_time - len(taken.get(r, ())))
        for device, r in set(self.monitor.tasks):
            if device in honest and r in closes and device not in taken.get(r, ()):
                report.delayed += 1


# -- the scenarios ---------------------------------------------------------------------


def cut_upload(work: Path, seed: int = 0) -> ScenarioReport:
    """A device SIGKILLed mid chunked upload, restarted with its state dir."""
    report = ScenarioReport("cut_upload", rounds=2)
    with FaultRun(work, 2, seed=seed) as run:
        honest, victim = run.ids
        link = ThrottledLink(run.broker.port, rate=64 * 1024)
        try:
            run.start_coordinator(report.rounds, min_devices=2, timeout_s=60)
            run.start_device(0)
            process = run.start_device(1, link.url)
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and not run.monitor.transfers(victim):
                time.sleep(0.02)
            process.send_signal(signal.SIGKILL)
            process.wait(10)
        finally:
            link.close()
        report.faults["cut_upload"] = 1
        time.sleep(0.5)  # whatever was on its way has arrived
        report.notes["transfer_at_kill"] = run.monitor.transfers(victim)
        run.start_device(1)  # back, on a good link, with its state dir
        run.finish(report, {honest})
        report.notes["victim_acks"] = [
            (r, ok, reason.value) for _, r, ok, reason in run.monitor.update_acks(victim)
        ]
        report.notes["victim_taken"] = sorted(
            r for r, ds in run.monitor.taken().items() if victim in ds
        )
    return report


def chunks(work: Path, seed: int = 0) -> ScenarioReport:
    """Duplicated and shuffled chunks of a crafted device's update, and late ones: after
    round 1 closed, its chunks again (the same transfer, and a new one), and the chunks of
    a second crafted device's round-1 update that missed the deadline."""
    report = ScenarioReport("chunks", rounds=2)
    timeout_s = 5.0
    with FaultRun(work, 1, crafted=("crafted-0", "crafted-1"), seed=seed) as run:
        run.start_coordinator(report.rounds, min_devices=3, timeout_s=timeout_s)
        device, tardy = run.crafted("crafted-0"), run.crafted("crafted-1")
        run.start_device(0)
        rng = random.Random(seed)
        if not (device.wait_task(1, 90) and tardy.wait_task(1, 10)):
            report.problems.append("no task for round 1")
            run.finish(report, {*run.ids, device.device_id})
            return report
        first = device.update(1)
        frames = device.chunks(first, 16 * 1024)
        burst = frames * 2
        rng.shuffle(burst)  # each chunk twice, in no order
        device.publish(burst)
        report.faults["duplicated"] = 1
        ack = device.wait_ack(first.message_id, 30)
        report.notes["chunks"] = len(frames)
        report.notes["burst_ack"] = None if ack is None else ack.reason.value
        missed = tardy.update(1)  # held back until round 1 closed at its deadline
        if not (device.wait_task(2, 60) and tardy.wait_task(2, 10)):
            report.problems.append("no task for round 2")
        device.publish(frames[::-1] + device.chunks(first, 16 * 1024))  # same transfer, new one
        late = tardy.chunks(missed, 16 * 1024)
        rng.shuffle(late)
        tardy.publish(late)
        report.faults["late"] = 2
        tardy.wait_ack(missed.message_id, 30)
        time.sleep(0.5)  # the same transfer's chunks are dropped silently: nothing to wait for
        report.notes["late_copy_acks"] = [
            (a.accepted, a.reason.value) for a in device.acks_of(first.message_id)
        ][1:]
        report.notes["late_acks"] = [
            (a.accepted, a.reason.value) for a in tardy.acks_of(missed.message_id)
        ]
        for crafted in (device, tardy):
            crafted.channel.send(crafted.update_topic, crafted.update(2))
        run.finish(report, {*run.ids, device.device_id})
        report.notes["timeout_s"] = timeout_s
        taken = run.monitor.taken()
        for crafted in (device, tardy):
            name = crafted.device_id
            report.notes[f"{name}_taken"] = sorted(r for r, ds in taken.items() if name in ds)
    return report


def churn(work: Path, seed: int = 0) -> ScenarioReport:
    """A device that never answers, a device joining mid-run and one leaving (SIGKILLed:
    its last will says offline), in one run: the silent device makes every round last
    until its deadline, which paces the run while the new device starts up."""
    report = ScenarioReport("churn", rounds=8)
    timeout_s = 4.0
    with FaultRun(work, 3, crafted=("silent-0",), seed=seed) as run:
        leaver, stayer, joiner = run.ids
        run.start_coordinator(report.rounds, min_devices=3, timeout_s=timeout_s)
        run.crafted("silent-0")
        leaving = run.start_device(0)
        run.start_device(1)
        if run.wait_round(1, 90):
            run.start_device(2)  # a new process, mid-run
            report.faults["join"] = 1
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not run.monitor.tasked(joiner):
            time.sleep(0.05)
        leaving.send_signal(signal.SIGKILL)
        leaving.wait(10)
        report.faults["leave"] = 1
        report.notes["leaver_rounds_at_kill"] = run.monitor.tasked(leaver)
        run.finish(report, {stayer, joiner})
        report.faults["silent"] = len(run.monitor.tasked("silent-0"))
        report.notes["timeout_s"] = timeout_s
        report.notes["silent_rounds"] = run.monitor.tasked("silent-0")
        report.notes["joiner_rounds"] = run.monitor.tasked(joiner)
        report.notes["leaver_rounds"] = run.monitor.tasked(leaver)
        # the warning an operator sees for each round closed at its deadline (the status
        # file does not say why a round closed)
        report.notes["deadline_logs"] = run.coordinator_log.read_text().count("deadline passed")
    return report


SCENARIOS: dict[str, Callable[[Path, int], ScenarioReport]] = {
    "cut_upload": cut_upload,
    "chunks": chunks,
    "churn": churn,
}
"""Every scenario by kind, in the order the benchmark runs them."""


def run_scenarios(work: Path, seed: int = 0) -> list[ScenarioReport]:
    """Run every scenario, each in its own folder under ``work``."""
    return [scenario(work / kind, seed) for kind, scenario in SCENARIOS.items()]
