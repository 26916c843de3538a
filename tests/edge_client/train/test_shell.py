"""The device shell: every session action carried out once, in order, through a driver's
effects; an update's publishing attempts; the device's state folder.

The three drivers (the threaded client, the sim's fleet, the budget tool) are tested with
their own suites; these tests pin down what they share.
"""

from __future__ import annotations

import logging
import typing
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_client.config import ClientConfig
from edge_client.errors import ConfigError
from edge_client.train.client_state import MODEL_FILE, STATE_FILE, DeviceStore, SavedState
from edge_client.train.exchange import (
    Action,
    CommitUpload,
    CoordinatorStatusReceived,
    DecodeJob,
    Job,
    JobDone,
    Publish,
    Received,
    RunJob,
    SaveModel,
    SaveState,
    SaveUnacked,
    SendUpdate,
    SetStatus,
    Started,
    Stop,
    UpdateSent,
)
from edge_client.train.retry import RetrySchedule
from edge_client.train.shell import DeviceShell, Retry, Upload
from models import Classifier, build_classifier, state_arrays
from protocol import CoordinatorStatus, DeviceStatus, Message, Update
from protocol.errors import EncodeError, TransportError
from tests.edge_client.train.test_session import (
    DEVICE,
    FLEET,
    TOPICS,
    WEIGHTS,
    decoded,
    inbox,
    make_session,
    model_message,
    task_message,
    trained,
)


class Held:
    """A lock that says whether it is held."""

    def __init__(self) -> None:
        self.held = False

    def __enter__(self) -> None:
        assert not self.held, "the shell took its lock twice"
        self.held = True

    def __exit__(self, *_: object) -> None:
        self.held = False


class Recorder:
    """Effects that record each call (and whether the shell's lock was held)."""

    def __init__(self, lock: Held | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.under_lock: list[str] = []
        self.shell: DeviceShell | None = None
        self.model: Classifier = build_classifier("mlp", num_classes=4)
        self._lock = lock

    def _record(self, name: str, arg: Any = None) -> None:
        self.calls.append((name, arg))
        if self._lock is not None and self._lock.held:
            self.under_lock.append(name)

    def publish(self, action: Publish) -> None:
        self._record("publish", action)

    def set_status(self, action: SetStatus) -> None:
        self._record("set_status", action.state)

    def send_update(self, action: SendUpdate) -> None:
        self._record("send_update", action)
        assert self.shell is not None
        self.shell.handle(UpdateSent(action.task_id, ok=True))  # as the budget tool does

    def run_job(self, job: Job) -> None:
        self._record("run_job", job)

    def commit_upload(self) -> None:
        self._record("commit_upload")

    def trained_model(self) -> Classifier:
        self._record("trained_model")
        return self.model

    def learning_state(self) -> dict[str, Any]:
        return {}  # read with the trained model, not recorded apart

    def stop(self) -> None:
        self._record("stop")

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


def config(tmp_path: Path | None = None, **fields: Any) -> ClientConfig:
    return ClientConfig(
        device_id=DEVICE, fleet=FLEET, model="mlp", state_dir=tmp_path, fsync_state=False, **fields
    )


# -- every action -------------------------------------------------------------------------

SAVED = SavedState(fleet=FLEET, device_id=DEVICE, rounds_done=1, handled_tasks=["t1"])
MESSAGE = Message(fleet=FLEET, sender=DEVICE, body=DeviceStatus(state="idle"))
UPDATE_TOPIC = TOPICS.device(DEVICE, "update")
UPDATE = Message(
    fleet=FLEET, sender=DEVICE, round=1, body=Update(num_samples=10, sets={"weights": WEIGHTS})
)
ONE_OF_EACH: dict[type, tuple[Action, str]] = {
    Publish: (Publish(TOPICS.device(DEVICE, "status"), MESSAGE), "publish"),
    SetStatus: (SetStatus("idle"), "set_status"),
    SendUpdate: (SendUpdate(UPDATE_TOPIC, MESSAGE, "t1"), "send_update"),
    RunJob: (RunJob(DecodeJob(MESSAGE, task_message(None).body)), "run_job"),
    SaveState: (SaveState(SAVED), "store"),
    SaveUnacked: (SaveUnacked(UPDATE), "unacked"),
    SaveModel: (SaveModel(), "trained_model"),
    CommitUpload: (CommitUpload(), "commit_upload"),
    Stop: (Stop(), "stop"),
}


def test_the_cases_cover_every_action_type() -> None:
    assert set(ONE_OF_EACH) == set(typing.get_args(Action))


@pytest.mark.parametrize("kind", list(ONE_OF_EACH), ids=lambda kind: kind.__name__)
def test_each_action_is_carried_out_by_one_effect(kind: type, tmp_path: Path) -> None:
    # Prepare
    action, expected = ONE_OF_EACH[kind]
    effects = Recorder()
    store = DeviceStore(tmp_path, fsync=False)
    shell = DeviceShell(make_session(), effects, store=store)
    effects.shell = shell

    # Execute
    shell.carry_out(action)

    # Assert: exactly one effect, with the action's content; persistence in the store
    if expected == "store":
        assert effects.calls == [] and store.load_state() == SAVED
    elif expected == "unacked":  # kept until acknowledged, the very same message
        assert effects.calls == [] and store.load_unacked(FLEET, DEVICE) == UPDATE
        shell.carry_out(SaveUnacked(None))
        assert store.load_unacked(FLEET, DEVICE) is None
    elif expected == "trained_model":
        assert effects.names() == ["trained_model"]
        saved = store.load_model()
        assert saved is not None and set(saved) == set(state_arrays(effects.model))
    else:
        assert effects.names() == [expected]  # the UpdateSent is ignored: nothing runs
        (argument,) = [arg for _, arg in effects.calls]
        if isinstance(action, RunJob):
            assert argument is action.job
        elif isinstance(action, SetStatus):
            assert argument == action.state
        elif argument is not None:
            assert argument is action


def test_without_a_store_nothing_is_persisted(tmp_path: Path) -> None:
    effects = Recorder()
    shell = DeviceShell(make_session(), effects)
    shell.carry_out(SaveState(SAVED))
    shell.carry_out(SaveModel())
    assert effects.calls == [] and list(tmp_path.iterdir()) == []


# -- a round through the shell ------------------------------------------------------------


def received(message: Message) -> Received:
    return Received(TOPICS.device_inbox(DEVICE)[:-1] + message.kind, message, 0.0)


def coordinator_status(state: str) -> CoordinatorStatusReceived:
    return CoordinatorStatusReceived(
        TOPICS.coordinator_status, inbox(CoordinatorStatus(state=state))
    )


def test_a_round_carries_out_the_sessions_actions_in_order(tmp_path: Path) -> None:
    # Prepare
    lock = Held()
    effects = Recorder(lock)
    store = DeviceStore(tmp_path, fsync=False)
    shell = DeviceShell(make_session(), effects, store=store, lock=lock)
    effects.shell = shell
    model = model_message()
    task = task_message(model)

    # Execute: start, a task and its model, the decode and training results
    shell.handle(Started())
    shell.handle(coordinator_status("running"))
    shell.handle(received(model))
    shell.handle(received(task))
    shell.handle(JobDone(decoded(effects.calls[-1][1])))
    shell.handle(JobDone(trained(effects.calls[-1][1], loss=0.5)))

    # Assert: in the session's order; what touches only the device's own state under
    # the lock; the round persisted in the store
    assert effects.names() == [
        "set_status",  # online
        "publish",  # hello
        "run_job",  # decode
        "set_status",  # training
        "run_job",  # train
        "trained_model",  # SaveModel
        "send_update",
        "commit_upload",  # the update went out
        "set_status",  # idle
    ]
    assert effects.under_lock == ["trained_model", "commit_upload"]
    assert [arg for n, arg in effects.calls if n == "set_status"] == ["online", "training", "idle"]
    saved = store.load_state()
    assert saved is not None and saved.rounds_done == 1
    assert saved.handled_tasks == [task.message_id]
    assert store.load_model() is not None


def test_a_finished_coordinator_stops_the_device_through_its_effects() -> None:
    effects = Recorder()
    shell = DeviceShell(make_session(exit_when_finished=True), effects)
    shell.handle(coordinator_status("running"))
    shell.handle(coordinator_status("finished"))
    assert effects.names() == ["stop"]


# -- an update's publishing attempts -----------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def upload(deadline_s: float = 20.0) -> tuple[Upload, Clock]:
    clock = Clock()
    schedule = RetrySchedule(upload_deadline_s=deadline_s, ack_timeout_s=30.0, max_resends=3)
    return Upload(SendUpdate(UPDATE_TOPIC, MESSAGE, "t1"), schedule, clock), clock


def failing(error: Exception) -> Any:
    def send(topic: str, message: Message) -> None:
        raise error

    return send


def sent(log: list[tuple[str, Message]]) -> Any:
    def send(topic: str, message: Message) -> None:
        log.append((topic, message))

    return send


def test_an_update_that_goes_out_is_sent() -> None:
    attempt, _ = upload()
    log: list[tuple[str, Message]] = []
    assert attempt.attempt(sent(log), lambda: False) == UpdateSent("t1", ok=True)
    assert log == [(UPDATE_TOPIC, MESSAGE)] and attempt.error is None


def test_publishing_backs_off_then_gives_up_at_the_deadline() -> None:
    # Prepare: a broker that stays unreachable
    attempt, clock = upload(deadline_s=20.0)
    down = failing(TransportError("broker unreachable"))

    # Execute: wait out each retry
    delays = []
    while isinstance(step := attempt.attempt(down, lambda: False), Retry):
        delays.append(step.delay_s)
        clock.now += step.delay_s

    # Assert: 0.5 s doubling up to 10 s, no attempt starting past the deadline
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert step == UpdateSent("t1", ok=False)
    assert isinstance(attempt.error, TransportError)


def test_the_delay_stops_growing_at_its_maximum() -> None:
    schedule = RetrySchedule(upload_deadline_s=300.0, ack_timeout_s=30.0, max_resends=3)
    delays = [schedule.first_delay_s]
    for _ in range(6):
        delays.append(schedule.next_delay(delays[-1]))
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_an_update_that_cannot_be_encoded_is_given_up_at_once() -> None:
    attempt, _ = upload()
    assert attempt.attempt(failing(EncodeError("too big")), lambda: False) == UpdateSent(
        "t1", ok=False
    )


def test_a_device_that_stops_abandons_its_upload_untold(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="edge_client")
    attempt, _ = upload()
    assert attempt.attempt(failing(TransportError("gone")), lambda: True) is None
    assert "upload abandoned, the device stops" in caplog.text


def test_the_schedule_is_the_devices() -> None:
    schedule = RetrySchedule.of(config(upload_retry_s=12.0, ack_timeout_s=3.0, max_resends=5))
    assert (schedule.upload_deadline_s, schedule.ack_timeout_s, schedule.max_resends) == (
        12.0,
        3.0,
        5,
    )


# -- the state folder --------------------------------------------------------------------


def test_a_store_is_made_only_with_a_state_dir(tmp_path: Path) -> None:
    assert DeviceStore.of(config()) is None
    store = DeviceStore.of(config(tmp_path / "a" / "b"))
    assert store is not None and store.state_dir.is_dir()


def test_a_state_dir_that_cannot_be_made_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="cannot create state dir"):
        DeviceStore.of(config(blocker / "dir"))


def test_the_store_reads_back_what_it_wrote(tmp_path: Path) -> None:
    store = DeviceStore(tmp_path, fsync=False)
    assert store.load_state() is None and store.load_model() is None
    arrays = {"w": np.arange(4, dtype=np.float32)}
    store.save_state(SAVED)
    store.save_model(arrays)
    assert store.load_state() == SAVED
    loaded = store.load_model()
    assert loaded is not None and np.array_equal(loaded["w"], arrays["w"])


def test_unreadable_files_are_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / STATE_FILE).write_text("{not json")
    (tmp_path / MODEL_FILE).write_bytes(b"not a zip")
    store = DeviceStore(tmp_path, fsync=False)
    assert store.load_state() is None and store.load_model() is None
    assert "ignored the unreadable client state" in caplog.text
    assert "ignored the saved model" in caplog.text


def test_a_failed_write_is_logged_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    errors: list[OSError] = []
    store = DeviceStore(tmp_path / "missing", fsync=False, on_error=errors.append)
    store.save_state(SAVED)
    store.save_model({"w": np.zeros(2, dtype=np.float32)})
    assert len(errors) == 2 and all(isinstance(e, OSError) for e in errors)
    assert "could not save the client state" in caplog.text
    assert "could not save the model" in caplog.text
