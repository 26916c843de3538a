"""The fleet driver: many device sessions over fewer broker connections.

The driver runs against the real coordinator through the in-memory twin, the embedded
amqtt broker and Mosquitto (skipped where it is not installed); a sniffer client sees
every message of the fleet. The batching rule is tested by hand with a fake clock.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from coordinator.actions import Action, RoundClosed
from coordinator.config import TrainingSettings
from coordinator.runtime import Coordinator
from edge_client.train.client_state import MODEL_FILE, STATE_FILE, read_state
from edge_client.train.exchange import Cancelled, DecodeJob, Failed, Job, JobResult, TrainJob
from edge_client.train.transfer import TransferState
from models import Classifier
from protocol.auth import Keyring
from protocol.channel import Channel
from protocol.messages import Ack, CoordinatorStatus, DeviceStatus, Hello, Message, Update
from protocol.signing import SigningKey
from protocol.transport import (
    MemoryBroker,
    MemoryTransport,
    MqttConfig,
    MqttTransport,
    Transport,
)
from protocol.transport.broker import EmbeddedBroker
from sim.__main__ import main
from sim.fleet import CohortQueue, Fleet, FleetDevice, FleetOptions, LoopTrainer
from sim.fleet.pacing import RateLimit
from sim.fleet.window import AnswerWindow
from sim.run import SimConfig, build_federation, device_data, fleet_keyring, run_simulation
from tests.protocol.brokers import Mosquitto

KEY = bytes(range(32))
SIGNING = SigningKey(bytes(range(32, 64)))
"""The coordinator's signing key in these tests; the devices hold its public half."""
"""A key for devices that talk to no coordinator here (the same key for all is fine)."""
QUICK = TrainingSettings(local_epochs=1, local_steps=2, batch_size=16)
MakeTransport = Callable[[str], Transport]


def settings(**overrides: object) -> SimConfig:
    base: dict[str, object] = {
        "devices": 5,
        "connections": 2,
        "rounds": 2,
        "participation": 0.6,
        "training": QUICK,
        "model": "mlp",
        "transport": "inproc",
    }
    base.update(overrides)
    return SimConfig(**base)


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


class Sniffer:
    """Keeps every message on the fleet's topics, in arrival order."""

    def __init__(self, transport: Transport, fleet: str) -> None:
        self._lock = threading.Lock()
        self._messages: list[tuple[str, Message]] = []
        transport.connect()
        self.transport = transport
        Channel(transport).subscribe(f"fl/{fleet}/#", self._keep)

    def _keep(self, topic: str, message: Message) -> None:
        with self._lock:
            self._messages.append((topic, message))

    def messages(self) -> list[tuple[str, Message]]:
        with self._lock:
            return list(self._messages)

    def of(self, kind: type) -> list[tuple[str, Message]]:
        with self._lock:
            return [(t, m) for t, m in self._messages if isinstance(m.body, kind)]

    def last_status(self) -> dict[str, DeviceStatus]:
        """Each device's latest status."""
        return {m.sender: m.body for _, m in self.of(DeviceStatus)}


@dataclass
class Run:
    """A coordinator and a fleet running against one broker, and what they did."""

    coordinator: Coordinator
    fleet: Fleet
    sniffer: Sniffer
    thread: threading.Thread
    closed: list[RoundClosed] = field(default_factory=list)

    def finish(self, timeout: float = 60.0) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the run did not finish"
        assert self.coordinator.final_models is not None


@contextlib.contextmanager
def running(
    config: SimConfig,
    make_transport: MakeTransport,
    trainer: Callable[..., object] = LoopTrainer,
    options: FleetOptions | None = None,
) -> Iterator[Run]:
    """The coordinator of ``config`` and its fleet, started on ``make_transport``'s broker
    (devices join once the coordinator is up), stopped at the end."""
    federation, shape = build_federation(config)
    keyring = fleet_keyring([d.device_id for d in federation.devices])
    coordinator = Coordinator(
        config.coordinator_config(federation.num_classes, shape),
        make_transport(f"{config.fleet}-coordinator"),
        keyring=keyring,
        signing_key=SIGNING,
    )
    devices = [
        (
            config.device_config(i, split.device_id, keyring[split.device_id], SIGNING.verify_key),
            device_data(federation, i),
        )
        for i, split in enumerate(federation.devices)
    ]
    options = options or config.fleet_options()
    fleet = Fleet(devices, make_transport, trainer=trainer, options=options)
    sniffer = Sniffer(make_transport(f"{config.fleet}-sniffer"), config.fleet)
    run = Run(coordinator, fleet, sniffer, threading.Thread(target=coordinator.run, daemon=True))

    def observe(action: Action) -> None:
        if isinstance(action, RoundClosed):
            run.closed.append(action)

    coordinator.add_observer(observe)
    try:
        run.thread.start()
        wait_for(lambda: any(m.body.state == "waiting" for _, m in sniffer.of(CoordinatorStatus)))
        fleet.start()
        yield run
    finally:
        coordinator.stop()
        run.thread.join(10)
        fleet.close()
        time.sleep(0.2)  # the sniffer's last messages
        sniffer.transport.disconnect()


# -- the driver against each broker ----------------------------------------------------


class FleetContract:
    """What every broker must give: the test classes below provide ``make_transport``."""

    @pytest.fixture
    def make_transport(self) -> MakeTransport:
        raise NotImplementedError

    def test_every_device_keeps_its_identity_over_fewer_connections(
        self, make_transport: MakeTransport
    ) -> None:
        # Prepare: 5 devices over 2 connections, 2 rounds.
        config = settings(fleet="ident")

        # Execute
        with running(config, make_transport) as run:
            run.finish()
            assert run.fleet.wait(10)  # "finished" stopped every device
            assert run.fleet.connections == 2

        # Assert: 5 hellos from 5 senders, each on its own topic; updates too.
        ids = set(run.fleet.device_ids)
        assert len(ids) == 5 and set(run.coordinator.engine.registry.entries) == ids
        hellos = run.sniffer.of(Hello)
        assert {m.sender for _, m in hellos} == ids
        assert all(t == f"fl/ident/devices/{m.sender}/hello" for t, m in hellos)
        updates = run.sniffer.of(Update)
        assert len(updates) == 2 * 3 and all(t.split("/")[3] == m.sender for t, m in updates)
        assert [c.on_time for c in run.closed] == [3, 3]
        assert {d: s.state for d, s in run.sniffer.last_status().items()} == dict.fromkeys(
            ids, "offline"
        )
        assert sum(run.fleet.rounds_done(d) for d in ids) == 6

    def test_bytes_do_not_depend_on_how_many_connections_carry_the_devices(
        self, make_transport: MakeTransport
    ) -> None:
        # Prepare / Execute: the same run over one connection and over one per device.
        traffic = {}
        for connections in (1, 5):
            with running(settings(fleet=f"pool{connections}", connections=connections),
                         make_transport) as run:  # fmt: skip
                run.finish()
                assert run.fleet.wait(10)
            traffic[connections] = run.fleet.traffic()

        # Assert: the same messages both ways; bytes equal but for random message ids.
        (out_1, in_1), (out_5, in_5) = traffic[1], traffic[5]
        assert (out_1.messages, in_1.messages) == (out_5.messages, in_5.messages)
        for one, five in ((out_1, out_5), (in_1, in_5)):
            assert one.payload_bytes == pytest.approx(five.payload_bytes, rel=0.005)
            assert one.wire_bytes == pytest.approx(five.wire_bytes, rel=0.005)


class TestMemoryBroker(FleetContract):
    @pytest.fixture
    def make_transport(self) -> MakeTransport:
        broker = MemoryBroker()
        return lambda client_id: MemoryTransport(broker, client_id)


@pytest.fixture(scope="module")
def amqtt() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker() as broker:
        yield broker


@pytest.fixture(scope="module")
def mosquitto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    with Mosquitto(tmp_path_factory.mktemp("mosquitto")) as broker:
        yield broker


def mqtt_on(url: str) -> MakeTransport:
    return lambda client_id: MqttTransport(MqttConfig.from_url(url, client_id=client_id))


class TestEmbeddedBroker(FleetContract):
    @pytest.fixture
    def make_transport(self, amqtt: EmbeddedBroker) -> MakeTransport:
        return mqtt_on(amqtt.url)


@pytest.mark.mosquitto
class TestMosquitto(FleetContract):
    @pytest.fixture
    def make_transport(self, mosquitto: Mosquitto) -> MakeTransport:
        return mqtt_on(mosquitto.url)


# -- the driver on the in-memory twin ----------------------------------------------------


@pytest.fixture
def memory() -> MemoryBroker:
    return MemoryBroker()


def on(broker: MemoryBroker) -> MakeTransport:
    return lambda client_id: MemoryTransport(broker, client_id)


class FailingFor(LoopTrainer):
    """The loop trainer, but training fails on one device."""

    failing = "dev-002"

    def run_many(self, jobs: Sequence[tuple[str, Job]]) -> list[JobResult]:
        results = super().run_many([(d, j) for d, j in jobs])
        for index, (device_id, job) in enumerate(jobs):
            if device_id == self.failing and isinstance(job, TrainJob):
                results[index] = Failed(job.message.message_id, RuntimeError("out of memory"))
        return results


def test_a_device_whose_training_fails_reports_it_and_the_run_goes_on(
    memory: MemoryBroker,
) -> None:
    # Prepare: every device trains every round; one of them always fails.
    config = settings(fleet="fails", participation=1.0, round_timeout_s=4.0)

    # Execute
    with running(config, on(memory), trainer=FailingFor) as run:
        run.finish()

    # Assert: both rounds closed at their deadline without the failing device.
    assert [(c.selected, c.on_time) for c in run.closed] == [(5, 4), (5, 4)]
    errors = [m.body for _, m in run.sniffer.of(DeviceStatus) if m.body.state == "error"]
    assert len(errors) == 2 and all("RuntimeError: out of memory" in e.detail for e in errors)
    assert {m.sender for _, m in run.sniffer.of(Update)} == {
        d for d in run.fleet.device_ids if d != FailingFor.failing
    }


class Blocking(LoopTrainer):
    """The loop trainer, but training waits until the test releases it."""

    training = threading.Event()
    release = threading.Event()
    threads: list[int] = []  # noqa: RUF012

    def run_many(self, jobs: Sequence[tuple[str, Job]]) -> list[JobResult]:
        if any(isinstance(job, TrainJob) for _, job in jobs):
            Blocking.threads.append(threading.active_count())
            Blocking.training.set()
            Blocking.release.wait(30)
        return super().run_many(jobs)


def test_training_does_not_hold_up_inbound_messages_and_threads_stay_few(
    memory: MemoryBroker,
) -> None:
    # Prepare: 30 devices over 3 connections; training blocks.
    config = settings(fleet="busy", devices=30, connections=3, rounds=1, participation=0.2)
    Blocking.training.clear()
    Blocking.release.clear()
    before = threading.active_count()  # (earlier tests may leave idle threads behind)
    with running(config, on(memory), trainer=Blocking) as run:
        assert Blocking.training.wait(30)
        hellos = len(run.sniffer.of(Hello))

        # Execute: the coordinator (restarted, say) says "starting" while training blocks.
        body = CoordinatorStatus(state="starting")
        status = Message(fleet="busy", sender="sim-coordinator", body=body)
        with MemoryTransport(memory, "restarted") as transport:
            transport.connect()
            signed = Channel(transport, auth=Keyring(), fleet_key=SIGNING)
            signed.send("fl/busy/coordinator/status", status, retain=True)

        # Assert: every device announced itself again meanwhile.
        wait_for(lambda: len(run.sniffer.of(Hello)) == hellos + 30)
        Blocking.release.set()
        run.finish()
    # coordinator (2), sniffer (1), 3 connections (2 each), the fleet (2); slack 2
    assert max(Blocking.threads) - before <= 2 + 1 + 3 * 2 + 2 + 2 < config.devices


def test_status_reaching_several_devices_of_a_connection_counts_once_per_device(
    memory: MemoryBroker,
) -> None:
    # Prepare: a coordinator status retained before the fleet starts, one more after.
    config = settings(fleet="fan", devices=6, connections=2)
    federation, *_ = build_federation(config)
    devices = [
        (config.device_config(i, s.device_id, KEY, SIGNING.verify_key), device_data(federation, i))
        for i, s in enumerate(federation.devices)
    ]
    status = Message(fleet="fan", sender="coordinator", body=CoordinatorStatus(state="waiting"))
    coordinator = MemoryTransport(memory, "coordinator")
    coordinator.connect()
    channel = Channel(coordinator, auth=Keyring(), fleet_key=SIGNING)
    sent = channel.send("fl/fan/coordinator/status", status, retain=True)
    fleet = Fleet(devices, on(memory), options=config.fleet_options())

    # Execute
    fleet.start()
    channel.send("fl/fan/coordinator/status", status, retain=True)
    wait_for(lambda: fleet.traffic()[1].messages == 2 * 6)  # (no coordinator: no acks)
    fleet.close()

    # Assert: each of the 6 devices received both statuses; up: each announced itself.
    out, inn = fleet.traffic()
    status_in = 2 * 6
    assert inn.messages == status_in and inn.payload_bytes == status_in * sent.payload_bytes
    assert out.messages == 6 * 3  # online, hello, offline
    coordinator.disconnect()


def test_a_reconnected_connection_announces_each_of_its_devices_again(
    memory: MemoryBroker,
) -> None:
    # Prepare: a fleet of 4 devices over 2 connections, and a sniffer.
    config = settings(fleet="again", devices=4, connections=2)
    federation, *_ = build_federation(config)
    devices = [
        (config.device_config(i, s.device_id, KEY, SIGNING.verify_key), device_data(federation, i))
        for i, s in enumerate(federation.devices)
    ]
    fleet = Fleet(devices, on(memory), options=config.fleet_options())
    sniffer = Sniffer(MemoryTransport(memory, "sniffer"), "again")
    fleet.start()
    wait_for(lambda: len(sniffer.of(Hello)) == 4)

    # Execute: the broker restarts (the sniffer reconnects as well).
    memory.stop()
    memory.start()

    # Assert
    wait_for(lambda: len(sniffer.of(Hello)) == 8)
    assert sorted(m.sender for _, m in sniffer.of(Hello)) == sorted(fleet.device_ids * 2)
    fleet.close()


def test_devices_join_and_upload_a_window_at_a_time(memory: MemoryBroker) -> None:
    # Prepare: 8 devices, all trained; at most 2 hellos or updates unanswered at a time.
    config = settings(fleet="window", devices=8, rounds=1, participation=1.0)
    options = config.fleet_options().model_copy(update={"window": 2})

    # Execute
    with running(config, on(memory), options=options) as run:
        run.finish()

    # Assert: every device joined and trained; never more than 2 messages ahead of acks.
    assert set(run.coordinator.engine.registry.entries) == set(run.fleet.device_ids)
    assert [c.on_time for c in run.closed] == [8]
    waiting: set[str] = set()
    most = 0
    for _, message in run.sniffer.messages():
        if isinstance(message.body, (Hello, Update)):
            waiting.add(message.message_id)
        elif isinstance(message.body, Ack):
            waiting.discard(message.body.ref)
        most = max(most, len(waiting))
    assert most <= 2


def test_the_window_admits_as_messages_are_answered_or_time_out() -> None:
    clock = Clock()
    window: AnswerWindow[str] = AnswerWindow(size=2, timeout_s=30, clock=clock)
    for device in ("a", "b", "c", "d"):
        window.queue(device)

    assert window.admit() == ["a", "b"]
    window.sent("hello-a")
    window.sent("hello-b")
    assert window.admit() == [] and window.next_expiry() == pytest.approx(130)
    window.answered("hello-a")
    assert window.admit() == ["c"]
    window.sent("hello-c")
    clock.now += 30  # b and c were never answered
    assert window.admit() == ["d"] and len(window) == 0 and window.next_expiry() is None


def test_devices_keep_their_state_in_the_state_dir_and_resume_from_it(tmp_path: Path) -> None:
    # Prepare / Execute: a run that keeps its state.
    config = settings(fleet="kept", state_dir=tmp_path)
    run_simulation(config)

    # Assert: each device that trained saved its handled tasks and its model.
    saved = {
        d.name: read_state(d / STATE_FILE)
        for d in sorted((tmp_path / "devices").iterdir())
        if (d / STATE_FILE).exists()
    }
    assert sum(s.rounds_done for s in saved.values()) == 2 * 3
    assert all((tmp_path / "devices" / d / MODEL_FILE).exists() for d in saved)

    # A fleet built on the same state dirs resumes: its sessions know the rounds done.
    federation, *_ = build_federation(config)
    devices = [
        (config.device_config(i, s.device_id, KEY, SIGNING.verify_key), device_data(federation, i))
        for i, s in enumerate(federation.devices)
    ]
    fleet = Fleet(devices, on(MemoryBroker()), options=config.fleet_options())
    assert {d: fleet.rounds_done(d) for d in saved} == {d: s.rounds_done for d, s in saved.items()}


def test_the_loop_trainer_builds_a_model_only_for_devices_that_need_one() -> None:
    config = settings(devices=3)
    federation, *_ = build_federation(config)
    specs = [
        FleetDevice(
            config.device_config(i, s.device_id, KEY, SIGNING.verify_key),
            device_data(federation, i),
            TransferState(),
        )
        for i, s in enumerate(federation.devices)
    ]
    trainer = LoopTrainer(specs)

    model: Classifier = trainer.model("dev-001")

    assert model is trainer.model("dev-001")
    assert set(trainer._trainers) == {"dev-001"}
    trainer.close()
    job = _fake(DecodeJob, msg("t1"))
    assert isinstance(trainer.run_many([("dev-000", job)])[0], Cancelled)


def test_the_cli_refuses_more_connections_than_devices_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["--devices", "3", "--connections", "4", "--transport", "inproc"])

    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "connections (4) cannot exceed devices (3)" in err


def test_options_refuse_more_connections_than_devices() -> None:
    with pytest.raises(ValueError, match="connections"):
        SimConfig(devices=3, connections=4)
    with pytest.raises(ValueError, match="4 connections for 3 devices"):
        FleetOptions(connections=4).pool_size(3)
    assert FleetOptions().pool_size(3) == 3 and FleetOptions().pool_size(1000) == 16


# -- the batching rule ---------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _fake(kind: type, message: Message) -> Job:
    if kind is DecodeJob:
        return DecodeJob(message, None)
    return TrainJob(message, None, None, 0.0)


def test_decode_jobs_go_out_at_once() -> None:
    clock = Clock()
    queue = CohortQueue(max_cohort=4, linger_s=0.1, clock=clock)

    queue.submit("a", _fake(DecodeJob, msg("t1")))
    queue.submit("b", _fake(DecodeJob, msg("t2")))

    batch, _ = queue.take()
    assert [d for d, _ in batch] == ["a", "b"]
    assert queue.take() == ([], None)


def test_training_jobs_wait_for_a_quiet_linger_then_go_together() -> None:
    clock = Clock()
    queue = CohortQueue(max_cohort=4, linger_s=0.1, clock=clock)
    queue.submit("a", _fake(TrainJob, msg("t1")))
    clock.now += 0.08
    queue.submit("b", _fake(TrainJob, msg("t2")))

    clock.now += 0.05
    assert queue.take() == ([], pytest.approx(0.05))
    clock.now += 0.04
    queue.touch()  # a message arrived: still busy
    clock.now += 0.09
    assert queue.take()[0] == []
    clock.now += 0.01

    batch, _ = queue.take()
    assert [d for d, _ in batch] == ["a", "b"]


def test_a_full_cohort_goes_at_once_and_before_decoding() -> None:
    clock = Clock()
    queue = CohortQueue(max_cohort=2, linger_s=10, clock=clock)
    for device in "abc":
        queue.submit(device, _fake(TrainJob, msg(device)))
    queue.submit("d", _fake(DecodeJob, msg("d")))

    assert [d for d, _ in queue.take()[0]] == ["a", "b"]
    assert [d for d, _ in queue.take()[0]] == ["d"]
    assert queue.take() == ([], pytest.approx(10))
    queue.close()
    assert queue.next_batch() is None


def msg(task: str) -> Message:
    """A message whose id is made of ``task`` (any body: the queue looks at ids only)."""
    message_id = task.encode().hex().ljust(32, "0")[:32]
    return Message(
        fleet="f", sender="c", body=CoordinatorStatus(state="running"), message_id=message_id
    )


def test_the_rate_limit_lets_a_burst_through_then_spreads_the_rest() -> None:
    clock = Clock()
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        clock.now += seconds

    limit = RateLimit(rate=10, burst=3, clock=clock, sleep=sleep)

    assert [limit.acquire() for _ in range(3)] == [0, 0, 0]
    assert limit.acquire() == pytest.approx(0.1)
    assert limit.acquire() == pytest.approx(0.1)
    clock.now += 10  # idle: the bucket refills up to the burst only
    assert [limit.acquire() for _ in range(3)] == [0, 0, 0] and limit.acquire() > 0
