"""A device's restart, end to end: real ``python -m coordinator`` and ``python -m edge_client``
processes over a real Mosquitto (the process helpers of :mod:`benchmarks.harness`), each
run compared with an uninterrupted reference run of the same seed on the same data.

* A device that sent its round-1 update while the coordinator was down (SIGKILLed as the
  round's tasks went out) and was itself SIGKILLed before any ack could come restarts
  from its state dir and sends that update again (``unacked.msgpack``): round 1 closes
  with both updates, long before its deadline, and the run ends where the reference did.
* A FedKF device SIGKILLed once its round-1 update was acknowledged and restarted from its
  state dir resumes its generator and Adam moments (``learning_state.npz``) with its
  model: the run ends where the reference did.

The runs are deterministic: every device trains from the model it is sent with the seed
its task carries (per device and round), round selection is seeded, and the coordinator
averages the updates in device-id order, not in their order of arrival (the fault
benchmark, :mod:`benchmarks.faults`, compares its SIGKILLed runs with a reference the same
way), so the final models must be bit-identical.
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.harness import (
    Status,
    coordinator_command,
    edge_client_command,
    identical,
    private_broker,
    processes,
    spawn,
    write_fleet,
)
from edge_client.train.client_state import LEARNING_STATE_FILE, UNACKED_FILE
from protocol.transport.base import Inbound
from protocol.transport.config import MqttConfig
from protocol.transport.mqtt import MqttTransport
from tests.protocol.brokers import Mosquitto, require_mosquitto

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow]

SEED = 0
ROUND_TIMEOUT_S = 120.0
"""Every run's deadline: a round that waited for it would show."""
FEDAVG = ("--strategy", "fedavg", "--model", "mlp", "--local-steps", "100", "--batch-size", "16")
"""100 local steps (about half a second): a device's training outlasts the gap between the
two devices' tasks, so the coordinator dies before the first update can reach it."""
FEDKF = (
    "--strategy", "fedkf", "--model", "mlp", "--local-steps", "2", "--batch-size", "16",
    "--generator-width", "2",
)  # fmt: skip
WAIT_S = 90.0
"""The most any one step of a run may take on a loaded host."""


# -- helpers ---------------------------------------------------------------------------------


class TaskWatch:
    """Watches the task topics of ``fleet`` (the topics alone: which device got a task)
    and calls ``then`` once, on the broker's delivery thread, as soon as every device of
    ``expect`` got one: a SIGKILL sent from there lands within a millisecond or two of the
    last task."""

    def __init__(self, url: str, fleet: str, expect: set[str], then: Callable[[], None]) -> None:
        self._fleet, self._expect, self._then = fleet, expect, then
        self._transport = MqttTransport(MqttConfig.from_url(url, client_id=f"watch-{fleet}"))
        self._lock = threading.Lock()
        self._tasked: set[str] = set()
        self.done = threading.Event()

    def start(self) -> None:
        self._transport.connect()
        self._transport.subscribe(f"fl/{self._fleet}/to/+/task", self._on_task)

    def stop(self) -> None:
        self._transport.disconnect()

    def _on_task(self, inbound: Inbound) -> None:
        with self._lock:
            self._tasked.add(inbound.topic.split("/")[-2])
            if self._tasked >= self._expect and not self.done.is_set():
                self._then()
                self.done.set()


def wait_for(what: str, ready: Callable[[], bool], timeout: float = WAIT_S) -> None:
    """Poll ``ready`` until it holds; fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.02)


def logged(log: Path, pattern: str) -> bool:
    """Whether a line of ``log`` matches ``pattern``."""
    try:
        text = log.read_text(errors="replace")
    except FileNotFoundError:
        return False
    return re.search(pattern, text, re.MULTILINE) is not None


def kill(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``process`` and reap it."""
    process.send_signal(signal.SIGKILL)
    process.wait(10)


def final(state: Path) -> dict[str, dict[str, Any]]:
    """Every final model a coordinator saved under its state dir (``aca``, ``oca`` ...)."""
    return {
        path.stem: dict(torch.load(path, weights_only=True))
        for path in sorted((state / "final").glob("*.pt"))
    }


@dataclass
class Fleet:
    """A keyed fleet of data files over one broker; each run gets a fleet name of its own."""

    url: str
    files: list[Path]
    keys: Path

    @property
    def ids(self) -> list[str]:
        return [path.stem for path in self.files]


@dataclass
class Run:
    """The processes of one run under ``work``: a coordinator state dir, a state dir and a
    log per device, a log per coordinator start."""

    fleet: Fleet
    name: str
    work: Path
    strategy: Sequence[str]
    rounds: int
    started: list[subprocess.Popen[bytes]]
    coordinators: int = 0

    def __post_init__(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)

    @property
    def state(self) -> Path:
        return self.work / "state"

    def coordinator(self, *, resume: bool = False) -> subprocess.Popen[bytes]:
        extra = [
            *self.strategy, "--seed", str(SEED), "--silent-grace", "0",
            *(["--resume"] if resume else []),
        ]  # fmt: skip
        command = coordinator_command(
            self.fleet.url, self.name, rounds=self.rounds, min_devices=len(self.fleet.files),
            state=self.state, keys=self.fleet.keys, round_timeout_s=ROUND_TIMEOUT_S, extra=extra,
        )  # fmt: skip
        self.coordinators += 1
        process = spawn(command, self.work / f"coordinator-{self.coordinators}.log")
        self.started.append(process)
        return process

    def device_log(self, index: int) -> Path:
        return self.work / f"{self.fleet.ids[index]}.log"

    def device_state(self, index: int) -> Path:
        return self.work / self.fleet.ids[index]

    def device(self, index: int) -> subprocess.Popen[bytes]:
        data = self.fleet.files[index]
        extra = ("--model", "mlp", "--init-seed", str(SEED))
        command = edge_client_command(
            self.fleet.url, self.name, data, self.device_state(index), extra
        )
        process = spawn(command, self.device_log(index))
        self.started.append(process)
        return process

    def finish(self, coordinator: subprocess.Popen[bytes]) -> Status:
        """Wait for the run's end; its last status."""
        try:
            code = coordinator.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name}: the coordinator did not finish in {WAIT_S:.0f} s")
        log = self.work / f"coordinator-{self.coordinators}.log"
        assert code == 0, log.read_text(errors="replace")[-3000:]
        status = Status.read(self.state)
        assert status is not None and status.phase == "finished"
        return status


@contextmanager
def fleet(tmp_path: Path) -> Iterator[tuple[Fleet, list[subprocess.Popen[bytes]]]]:
    """A private Mosquitto, two keyed devices' data, and a list of processes killed on
    the way out."""
    require_mosquitto()
    with ExitStack() as stack:
        broker: Mosquitto = stack.enter_context(private_broker(tmp_path, "device restart"))
        files, keys = write_fleet(tmp_path / "fleet", 2, SEED)
        started = stack.enter_context(processes())
        yield Fleet(broker.url, files, keys), started


def reference(
    fleet: Fleet, started: list[subprocess.Popen[bytes]], work: Path, strategy: Sequence[str],
    rounds: int,
) -> tuple[Run, subprocess.Popen[bytes]]:  # fmt: skip
    """An uninterrupted run, started (its coordinator returned, to wait on)."""
    run = Run(fleet, "reference", work, strategy, rounds, started)
    coordinator = run.coordinator()
    for index in range(len(fleet.files)):
        run.device(index)
    return run, coordinator


# -- the tests -------------------------------------------------------------------------------


def test_an_update_sent_to_a_dead_coordinator_survives_the_devices_own_crash(
    tmp_path: Path,
) -> None:
    """Round 1's tasks go out and the coordinator is SIGKILLed; one device sends its
    update into the void and is SIGKILLed too, before any ack could come. Both restart
    with their state dirs (the coordinator with ``--resume``): the device sends the update
    it kept (``unacked.msgpack``) again, and round 1 closes with both updates long before
    its deadline (120 s; ``--silent-grace 0``: only the deadline could close it
    otherwise)."""
    with fleet(tmp_path) as (devices, started):
        ref, ref_coordinator = reference(devices, started, tmp_path / "reference", FEDAVG, 2)
        ref.finish(ref_coordinator)

        run = Run(devices, "crash", tmp_path / "crash", FEDAVG, 2, started)
        honest, victim = 0, 1
        first: list[subprocess.Popen[bytes]] = []
        watch = TaskWatch(
            devices.url, run.name, set(devices.ids), lambda: first[0].send_signal(signal.SIGKILL)
        )
        watch.start()
        try:
            first.append(run.coordinator())
            run.device(honest)
            victim_process = run.device(victim)
            wait_for("round 1's tasks", watch.done.is_set)
            first[0].wait(10)  # SIGKILLed as the last task went out

            wait_for(
                "the victim's round-1 update",
                lambda: logged(run.device_log(victim), r"round 1: update sent"),
            )
            kill(victim_process)
            assert (run.device_state(victim) / UNACKED_FILE).exists()
            wait_for(
                "the honest device's round-1 update",
                lambda: logged(run.device_log(honest), r"round 1: update sent"),
            )
            # what the test is about: the coordinator took no update before it died, and
            # the victim saw no ack of its update
            assert not logged(run.work / "coordinator-1.log", r"round 1: update of")
            assert not logged(run.device_log(victim), r"coordinator accepted \S+ \(round 1\)")

            restarted = time.monotonic()
            coordinator = run.coordinator(resume=True)
            run.device(victim)  # the same state dir
            closed_after = None
            deadline = restarted + WAIT_S
            while closed_after is None and time.monotonic() < deadline:
                status = Status.read(run.state)
                if status is not None and status.pid == coordinator.pid and 1 in status.closed:
                    closed_after = time.monotonic() - restarted
                elif coordinator.poll() is not None:
                    break
                time.sleep(0.05)
            status = run.finish(coordinator)
        finally:
            watch.stop()

    # round 1 took both updates, and did not wait for its deadline
    close = status.closed[1]
    assert (close.on_time, close.selected, close.late) == (2, 2, 0)
    assert closed_after is not None and closed_after < ROUND_TIMEOUT_S / 4, closed_after
    assert close.duration_s < ROUND_TIMEOUT_S / 2, close.duration_s
    assert all(c.on_time == 2 for c in status.closed.values()) and len(status.closed) == 2
    # the restarted device sent the update it kept, and it was taken
    restart_log = run.device_log(victim).read_text(errors="replace").split("resumed:", 1)[-1]
    assert "round 1: sending the unacknowledged update again" in restart_log
    assert re.search(r"coordinator accepted \S+ \(round 1\)", restart_log)
    assert not (run.device_state(victim) / UNACKED_FILE).exists()
    # and the run ends where the uninterrupted one did, bit for bit
    models, expected = final(run.state), final(ref.state)
    assert models.keys() == expected.keys() and "aca" in models
    for name, model in models.items():
        assert identical(model, expected[name]), name


def test_a_fedkf_device_restarted_between_rounds_changes_nothing(tmp_path: Path) -> None:
    """A FedKF device is SIGKILLed once its round-1 update was acknowledged and restarted
    from its state dir before round 2's task. The other device is held (SIGSTOP) from the
    moment round 1's tasks went out until the victim is back, so round 1 cannot close and
    round 2 cannot start meanwhile. The victim resumes its generator and Adam moments
    (``learning_state.npz``) with its model, so rounds 2 and 3 are what they would have
    been: the final models (ACA and OCA) are bit-identical to the reference's."""
    rounds = 3
    with fleet(tmp_path) as (devices, started):
        ref, ref_coordinator = reference(devices, started, tmp_path / "reference", FEDKF, rounds)
        ref.finish(ref_coordinator)

        run = Run(devices, "restart", tmp_path / "restart", FEDKF, rounds, started)
        held, victim = 0, 1
        holding: list[subprocess.Popen[bytes]] = []
        watch = TaskWatch(
            devices.url, run.name, set(devices.ids), lambda: holding[0].send_signal(signal.SIGSTOP)
        )
        watch.start()
        try:
            coordinator = run.coordinator()
            holding.append(run.device(held))
            victim_process = run.device(victim)
            wait_for("round 1's tasks", watch.done.is_set)
            wait_for(
                "the ack of the victim's round-1 update",
                lambda: logged(run.device_log(victim), r"coordinator accepted \S+ \(round 1\)"),
            )
            kill(victim_process)
            at_kill = Status.read(run.state)
            assert (run.device_state(victim) / LEARNING_STATE_FILE).exists()
            run.device(victim)  # the same state dir
            wait_for(
                "the victim's restart",
                lambda: logged(run.device_log(victim), r"resumed: 1 rounds done(.|\n)* online in"),
            )
            holding[0].send_signal(signal.SIGCONT)
            status = run.finish(coordinator)
        finally:
            watch.stop()
            for process in holding:  # never left stopped, whatever failed
                process.send_signal(signal.SIGCONT)

    # the victim was killed while round 1 was open (the held device's update missing)
    assert at_kill is not None and 1 in at_kill.selected and not at_kill.closed
    assert len(status.closed) == rounds
    assert all((c.on_time, c.selected) == (2, 2) for c in status.closed.values())
    restart_log = run.device_log(victim).read_text(errors="replace").split("resumed:", 1)[-1]
    assert "resumed the learning state ['fedkf_generator']" in restart_log
    assert "round 2: update sent" in restart_log
    models, expected = final(run.state), final(ref.state)
    assert models.keys() == expected.keys() and "oca" in models
    for name, model in models.items():
        assert identical(model, expected[name]), name
