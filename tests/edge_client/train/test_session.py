"""The device session, driven by hand (no broker, no threads, no trainer)."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import pytest

from edge_client.config import ClientConfig
from edge_client.train.client_state import SavedState
from edge_client.train.exchange import (
    Action,
    Cancelled,
    CommitUpload,
    CoordinatorStatusReceived,
    Decoded,
    DecodeJob,
    Failed,
    Job,
    JobDone,
    NeedsBase,
    Publish,
    Received,
    Reconnected,
    Rejected,
    RunJob,
    SaveModel,
    SaveState,
    SaveUnacked,
    SendUpdate,
    SetStatus,
    Started,
    Stop,
    Tick,
    Trained,
    TrainJob,
    UpdateSent,
)
from edge_client.train.session import DeviceSession
from edge_client.train.task import LocalTask
from protocol import (
    Ack,
    CoordinatorStatus,
    Hello,
    Message,
    ModelPayload,
    RoundTask,
    Topics,
    Update,
    UploadSpec,
    encode_tensors,
)

FLEET = "fleet-s"
DEVICE = "dev-001"
TOPICS = Topics(FLEET)
WEIGHTS = encode_tensors({"w": np.ones((2, 2), dtype=np.float32)})


def make_session(
    saved: SavedState | None = None, unacked: Message | None = None, **fields: Any
) -> DeviceSession:
    config = ClientConfig(device_id=DEVICE, fleet=FLEET, model="mlp", **fields)
    return DeviceSession(
        config,
        fingerprint="0123456789abcdef",
        num_samples=40,
        label_counts=(10, 10, 10, 10),
        memory_bytes=2**30,
        saved=saved,
        unacked=unacked,
    )


def inbox(body: Any, round_: int = 0) -> Message:
    return Message(fleet=FLEET, sender="coordinator", body=body, round=round_)


def deliver(session: DeviceSession, message: Message, now: float = 0.0) -> list[Action]:
    return session.handle(Received(TOPICS.device_inbox(DEVICE)[:-1] + message.kind, message, now))


def model_message(round_: int = 0) -> Message:
    return inbox(ModelPayload(sets={"global": WEIGHTS}), round_)


def task_message(model: Message | None, round_: int = 0, **fields: Any) -> Message:
    task = RoundTask(
        strategy="fedavg",
        hyperparameters={"local_epochs": 1},
        deadline=time.time() + 60,
        payloads=("global",),
        model_message=None if model is None else model.message_id,
        **fields,
    )
    return inbox(task, round_)


def coordinator(session: DeviceSession, state: str) -> list[Action]:
    message = inbox(CoordinatorStatus(state=state))
    return session.handle(CoordinatorStatusReceived(TOPICS.coordinator_status, message))


def of(actions: list[Action], kind: type) -> list[Any]:
    return [a for a in actions if isinstance(a, kind)]


def statuses(actions: list[Action]) -> list[str]:
    return [a.state for a in of(actions, SetStatus)]


def the_job(actions: list[Action]) -> Job:
    (run,) = of(actions, RunJob)
    return run.job


def decoded(job: Job) -> Decoded:
    return Decoded(job.message.message_id, LocalTask("fedavg"), 0.01, None)


def trained(job: Job, **metrics: float) -> Trained:
    return Trained(job.message.message_id, 40, WEIGHTS, metrics, {"train_s": 0.5})


def train_to_update(session: DeviceSession, task: Message, model: Message) -> SendUpdate:
    """Model and task in, the jobs run by hand, the update sent out."""
    deliver(session, model)
    job = the_job(deliver(session, task))
    train = the_job(session.handle(JobDone(decoded(job))))
    (send,) = of(session.handle(JobDone(trained(train, loss=0.5))), SendUpdate)
    return send


def test_started_and_reconnected_announce_the_device() -> None:
    session = make_session()

    for event in (Started(), Reconnected()):
        actions = session.handle(event)

        assert statuses(actions) == ["online"]
        (hello,) = of(actions, Publish)
        assert hello.topic == TOPICS.device(DEVICE, "hello")
        body = hello.message.body
        assert isinstance(body, Hello)
        assert (body.fingerprint, body.num_samples, body.memory_bytes) == (
            "0123456789abcdef",
            40,
            2**30,
        )
        assert body.held_base is None


def test_model_then_task_gives_a_decode_then_a_train_job() -> None:
    session = make_session()
    model = model_message()
    task = task_message(model)

    assert deliver(session, model) == []
    job = the_job(deliver(session, task))

    assert isinstance(job, DecodeJob) and job.sets == {"global": WEIGHTS}
    after = session.handle(JobDone(decoded(job)))
    assert statuses(after) == ["training"]
    train = the_job(after)
    assert isinstance(train, TrainJob) and train.message == task


def test_task_before_its_model_waits_and_expires() -> None:
    session = make_session(task_timeout_s=10)
    model = model_message()

    assert deliver(session, task_message(model), now=100.0) == []
    assert session.next_expiry == 110.0
    assert the_job(deliver(session, model, now=101.0)).message.round == 0

    late = task_message(model_message(1), 1)
    deliver(session, late, now=200.0)
    assert session.handle(Tick(209.0)) == [] and session.next_expiry == 210.0
    session.handle(Tick(210.0))
    assert session.next_expiry is None


def test_a_trained_job_publishes_the_update_then_idle_and_persists() -> None:
    session = make_session()
    model = model_message()
    task = task_message(model, uplink=UploadSpec(label_counts=True))
    deliver(session, model)
    job = the_job(deliver(session, task))
    train = the_job(session.handle(JobDone(decoded(job))))

    actions = session.handle(JobDone(trained(train, loss=0.25, accuracy=float("nan"))))

    assert isinstance(actions[0], SaveModel)
    (send,) = of(actions, SendUpdate)
    (kept,) = of(actions, SaveUnacked)  # persisted before it is sent
    assert actions.index(kept) < actions.index(send) and kept.message == send.message
    assert send.topic == TOPICS.device(DEVICE, "update") and send.task_id == task.message_id
    update = send.message.body
    assert isinstance(update, Update) and update.task_message == task.message_id
    assert update.metrics == {"loss": 0.25}  # non-finite metrics are left out
    assert update.label_counts is None  # the device did not consent
    done = session.handle(UpdateSent(task.message_id, ok=True))
    assert isinstance(done[0], CommitUpload) and statuses(done) == ["idle"]
    (save,) = of(done, SaveState)
    assert save.saved.rounds_done == 1 and save.saved.handled_tasks == [task.message_id]
    assert session.rounds_done == 1


def test_a_duplicate_task_is_ignored_and_resends_the_unacked_update() -> None:
    session = make_session()
    model = model_message()
    task = task_message(model)
    send = train_to_update(session, task, model)

    session.handle(UpdateSent(task.message_id, ok=True))

    (resend,) = deliver(session, task)
    assert isinstance(resend, Publish) and resend.message == send.message


def test_an_ack_forgets_the_update_and_a_starting_coordinator_resends_until_then() -> None:
    session = make_session()
    model = model_message()
    task = task_message(model)
    send = train_to_update(session, task, model)
    session.handle(UpdateSent(task.message_id, ok=True))

    restart = coordinator(session, "starting")
    assert statuses(restart) == ["online"]
    assert [a.message for a in of(restart, Publish)][-1] == send.message  # hello, then resend
    nack = Ack(accepted=False, ref="0" * 32, reason="late")
    assert deliver(session, inbox(nack)) == []
    assert of(coordinator(session, "starting"), Publish)[-1].message == send.message

    deliver(session, inbox(Ack(accepted=True, ref=send.message.message_id)))

    (hello,) = of(coordinator(session, "starting"), Publish)
    assert isinstance(hello.message.body, Hello)
    assert deliver(session, task) == []  # handled, nothing to resend


def test_an_update_sent_but_not_acknowledged_is_sent_again_after_a_restart() -> None:
    # Prepare: the device sent its update; the coordinator was down, and the device was
    # killed before any ack came (its state dir kept the task as handled, and the update)
    session = make_session()
    model = model_message()
    task = task_message(model)
    send = train_to_update(session, task, model)
    (save,) = of(session.handle(UpdateSent(task.message_id, ok=True)), SaveState)
    # Execute: it restarts from its state dir; the resumed coordinator sends the task again
    restarted = make_session(saved=save.saved, unacked=send.message)
    at_start = restarted.handle(Started())
    again = deliver(restarted, task)
    # Assert: the very same message at its start and for the task; kept until its ack
    assert [a.message for a in of(at_start, Publish)][-1] == send.message
    assert [a.message for a in of(again, Publish)] == [send.message]
    acked = deliver(restarted, inbox(Ack(accepted=True, ref=send.message.message_id)))
    assert of(acked, SaveUnacked) == [SaveUnacked(None)]
    assert deliver(restarted, task) == []


def test_a_task_whose_deadline_passed_long_ago_is_refused_and_changes_nothing() -> None:
    # Prepare: a genuine task and model of an earlier run, replayed to the device (round
    # 7 there; this run is at round 1)
    session = make_session(stale_task_s=600)
    model = model_message(7)
    old = task_message(model, 7).model_copy()
    body = old.body.model_copy(update={"deadline": time.time() - 3600})
    old = old.model_copy(update={"body": body})
    deliver(session, model)
    # Execute
    refused = deliver(session, old)
    # Assert: nothing trained, nothing remembered: the real round-1 task still runs
    assert refused == [] and session.handled == ()
    current = model_message(1)
    late_but_close = task_message(current, 1)
    body = late_but_close.body.model_copy(update={"deadline": time.time() - 60})  # skew
    deliver(session, current)
    assert of(deliver(session, late_but_close.model_copy(update={"body": body})), RunJob)


def test_a_task_sent_before_the_newest_task_taken_is_refused_also_after_a_restart() -> None:
    # Prepare: a genuine task recorded earlier (round 9 of an earlier run, its deadline
    # still close), then the device takes this run's round-1 task and handles it
    session = make_session()
    old_model, model = model_message(9), model_message(1)
    recorded = task_message(old_model, 9)
    time.sleep(0.002)
    current = task_message(model, 1)
    deliver(session, model)
    send = train_to_update(session, current, model)
    (save,) = of(session.handle(UpdateSent(current.message_id, ok=True)), SaveState)
    deliver(session, inbox(Ack(accepted=True, ref=send.message.message_id)))
    # Execute: the recorded task replayed, to the device and to its restarted self
    deliver(session, old_model)
    refused = deliver(session, recorded)
    restarted = make_session(saved=save.saved)
    deliver(restarted, old_model)
    refused_after_restart = deliver(restarted, recorded)
    # Assert: neither trains it nor remembers it; the send time was persisted
    assert save.saved.newest_task_ms == current.sent_at_ms
    assert refused == [] and refused_after_restart == []
    assert recorded.message_id not in restarted.handled
    newer_model = model_message(2)
    deliver(restarted, newer_model)
    assert of(deliver(restarted, task_message(newer_model, 2)), RunJob)  # a newer one runs


def test_one_job_at_a_time_and_stale_tasks_are_skipped() -> None:
    session = make_session()
    first, second = model_message(0), model_message(0)
    deliver(session, first)
    deliver(session, second)
    job = the_job(deliver(session, task_message(first, 5)))
    assert deliver(session, task_message(second, 2)) == []  # queued behind the first

    train = the_job(session.handle(JobDone(decoded(job))))
    session.handle(JobDone(trained(train)))
    after = session.handle(UpdateSent(train.message.message_id, ok=True))

    assert of(after, RunJob) == []  # round 2 < round 5 done: skipped
    assert deliver(session, task_message(None, 4)) == []  # ignored at once


def test_rejected_failed_and_cancelled_jobs() -> None:
    session = make_session()
    job = the_job(deliver(session, task_message(None)))
    rejected = session.handle(JobDone(Rejected(job.message.message_id, "bad payload")))
    assert statuses(rejected) == [] and len(of(rejected, SaveState)) == 1
    assert deliver(session, job.message) == []  # handled

    job = the_job(deliver(session, task_message(None)))
    train = the_job(session.handle(JobDone(decoded(job))))
    failed = session.handle(JobDone(Failed(train.message.message_id, RuntimeError("oom"))))
    assert statuses(failed) == ["error"] and "RuntimeError: oom" in failed[-1].detail

    job = the_job(deliver(session, task_message(None)))
    train = the_job(session.handle(JobDone(decoded(job))))
    assert session.handle(JobDone(Cancelled(train.message.message_id))) == []
    assert job.message.message_id not in session.handled
    assert session.rounds_done == 0


def test_an_unknown_base_announces_the_device_again_and_the_task_can_come_back() -> None:
    session = make_session()
    job = the_job(deliver(session, task_message(None)))

    again = session.handle(
        JobDone(NeedsBase(job.message.message_id, "no base", "fedcba9876543210"))
    )

    assert statuses(again) == ["online"]
    assert of(again, Publish)[0].message.body.held_base == "fedcba9876543210"
    assert isinstance(the_job(deliver(session, job.message)), DecodeJob)  # not handled


def test_an_update_that_cannot_be_published_is_an_error() -> None:
    session = make_session()
    model = model_message()
    task = task_message(model)
    train_to_update(session, task, model)

    actions = session.handle(UpdateSent(task.message_id, ok=False))

    assert statuses(actions) == ["error"] and session.rounds_done == 0
    assert task.message_id in session.handled


def test_a_finished_coordinator_stops_the_device_only_after_it_saw_it_live() -> None:
    session = make_session(exit_when_finished=True)
    assert coordinator(session, "finished") == []  # a retained one of an earlier run
    coordinator(session, "running")
    assert coordinator(session, "stopped") == []
    assert coordinator(session, "finished") == [Stop()]
    assert coordinator(make_session(), "finished") == []  # not asked to exit


def test_foreign_and_misplaced_input_changes_nothing() -> None:
    session = make_session()
    task = task_message(None)
    foreign = task.model_copy(update={"fleet": "other"})

    assert deliver(session, foreign) == []
    assert session.handle(Received(TOPICS.device_inbox(DEVICE)[:-1] + "model", task, 0.0)) == []
    assert session.handle(Received("not/a/topic", task, 0.0)) == []
    assert session.handle(CoordinatorStatusReceived(TOPICS.coordinator_status, task)) == []
    assert isinstance(the_job(deliver(session, task)), DecodeJob)


def test_persisted_state_is_restored_for_this_device_only() -> None:
    saved = SavedState(fleet=FLEET, device_id=DEVICE, rounds_done=3, handled_tasks=["t-1"])
    session = make_session(saved)
    assert session.restored and session.rounds_done == 3 and list(session.handled) == ["t-1"]

    other = make_session(saved.model_copy(update={"device_id": "dev-002"}))
    assert not other.restored and other.rounds_done == 0 and list(other.handled) == []

    handled = task_message(None).model_copy(update={"message_id": "t-1"})
    assert deliver(session, handled) == []


# -- the resend rule -----------------------------------------------------------------------


def sent_update(**fields: Any) -> tuple[DeviceSession, Message]:
    session = make_session(**fields)
    model = model_message()
    task = task_message(model)
    send = train_to_update(session, task, model)
    session.handle(UpdateSent(task.message_id, ok=True))
    return session, send.message


def test_a_retryable_nack_sends_the_same_update_again_until_max_resends() -> None:
    session, update = sent_update(max_resends=2)
    nack = Ack(accepted=False, ref=update.message_id, reason="malformed", detail="short data")

    first = deliver(session, inbox(nack), now=1.0)
    second = deliver(session, inbox(nack), now=2.0)
    third = deliver(session, inbox(nack), now=3.0)

    assert [a.message for a in of(first, Publish)] == [update]
    assert [a.message for a in of(second, Publish)] == [update]
    assert third == []  # bounded


def test_a_nack_without_ref_names_the_unacked_update() -> None:
    session, update = sent_update()
    nack = Ack(accepted=False, reason="oversize", detail="no room for the transfer")
    (resend,) = deliver(session, inbox(nack), now=1.0)
    assert isinstance(resend, Publish) and resend.message == update


def test_a_final_nack_or_an_accepting_ack_ends_the_wait() -> None:
    for reason, accepted in (("late", False), ("not_selected", False), ("ok", True)):
        session, update = sent_update()
        ack = Ack(accepted=accepted, ref=update.message_id, reason=reason)
        assert deliver(session, inbox(ack), now=1.0) == [SaveUnacked(None)]  # forgotten
        assert session.next_expiry is None
        assert session.handle(Tick(1000.0)) == []
        again = Ack(accepted=False, ref=update.message_id, reason="malformed")
        assert deliver(session, inbox(again), now=1001.0) == []  # nothing left to resend


def test_no_ack_within_the_timeout_sends_the_update_again() -> None:
    session, update = sent_update(ack_timeout_s=10.0, max_resends=1)
    assert session.next_expiry == 0.0  # tick now: the timer starts
    assert session.handle(Tick(100.0)) == []
    assert session.next_expiry == 110.0
    assert session.handle(Tick(109.0)) == []

    (resend,) = session.handle(Tick(110.0))
    assert isinstance(resend, Publish) and resend.message == update
    assert session.next_expiry == 120.0
    assert session.handle(Tick(120.0)) == []  # max_resends reached: given up
    assert session.next_expiry is None


def test_a_nack_of_another_message_is_ignored() -> None:
    session, _ = sent_update()
    nack = Ack(accepted=False, ref="0" * 32, reason="malformed")
    assert deliver(session, inbox(nack), now=1.0) == []


def test_a_coordinator_status_older_than_the_newest_is_a_replay_and_ignored() -> None:
    # Prepare: an earlier run's genuine "finished", captured; this run is live
    session = make_session(exit_when_finished=True)
    old_finished = inbox(CoordinatorStatus(state="finished"))
    stale = old_finished.model_copy(update={"sent_at_ms": old_finished.sent_at_ms - 60_000})
    coordinator(session, "running")
    # Execute: the attacker replays it (the signature holds: it is genuine)
    actions = session.handle(CoordinatorStatusReceived(TOPICS.coordinator_status, stale))
    # Assert: the device does not stop; the real "finished" stops it
    assert actions == []
    assert of(coordinator(session, "finished"), Stop)


def test_a_flood_of_replays_leaves_one_warning_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: a live coordinator; an earlier "finished" of it, captured
    session = make_session()
    old = inbox(CoordinatorStatus(state="finished"))
    stale = old.model_copy(update={"sent_at_ms": old.sent_at_ms - 60_000})
    coordinator(session, "running")
    # Execute: replayed 500 times (anyone on the broker may)
    with caplog.at_level(logging.DEBUG, logger="edge_client.train.session"):
        for _ in range(500):
            session.handle(CoordinatorStatusReceived(TOPICS.coordinator_status, stale))
    # Assert: every replay refused and logged, one line at WARNING (a flood cannot fill
    # the device's disk at the default level)
    lines = [r for r in caplog.records if "sent before the newest one" in r.message]
    assert len(lines) == 500
    assert [r.levelno for r in lines].count(logging.WARNING) == 1


def test_the_coordinators_last_will_is_taken_though_older_than_its_statuses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare: the coordinator's will ("stopped") is signed when it connects, so it is
    # older than the "running" that follows; then the coordinator crashes
    session = make_session(exit_when_finished=True)
    will = inbox(CoordinatorStatus(state="stopped"))
    will = will.model_copy(update={"sent_at_ms": will.sent_at_ms - 5_000})
    coordinator(session, "running")
    # Execute: the broker publishes the will, then someone replays it
    with caplog.at_level(logging.DEBUG, logger="edge_client.train.session"):
        taken = session.handle(CoordinatorStatusReceived(TOPICS.coordinator_status, will))
        replayed = session.handle(CoordinatorStatusReceived(TOPICS.coordinator_status, will))
    # Assert: the crash is reported as such (no replay warning), the replay only at
    # DEBUG; neither changes what the device does next: a later "finished" stops it
    assert taken == [] and replayed == []
    assert [r.levelno for r in caplog.records if "stopped (or crashed)" in r.message] == [
        logging.INFO
    ]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert of(coordinator(session, "finished"), Stop)


def test_replayed_older_models_never_evict_the_round_s_model_from_the_buffer() -> None:
    # Prepare: model messages of earlier rounds, recorded; this round's model buffered
    session = make_session(max_buffered_models=2)
    recorded = [model_message(r).model_copy(update={"sent_at_ms": r}) for r in range(1, 6)]
    current = model_message(6)
    deliver(session, current)
    # Execute: the attacker replays every recorded model before the task arrives
    replays = [deliver(session, m) for m in recorded]
    # Assert: the round's model is still there: its task runs at once
    assert replays == [[]] * len(recorded)
    assert of(deliver(session, task_message(current, 6)), RunJob)


def test_newer_models_evict_the_one_sent_first() -> None:
    session = make_session(max_buffered_models=2)
    first, second, third = (
        model_message(r).model_copy(update={"sent_at_ms": 1_000 * r}) for r in (1, 2, 3)
    )
    for model in (second, first, third):  # the first arrives after the second
        deliver(session, model)
    assert not of(deliver(session, task_message(first, 1)), RunJob)  # evicted: it waits
    assert of(deliver(session, first), RunJob)  # ... for its model, sent again
