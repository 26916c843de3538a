"""Why a device is not let in, told at the device (issue 27): the session's hello rules
driven by hand, the coordinator's refusal detail, and the settings behind them. The
processes, end to end: test_refusal_e2e.py."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from coordinator.admission import fingerprint_refusal, guess_classes, tensor_difference
from coordinator.config import CoordinatorConfig
from coordinator.groups import ArchitectureGroup
from edge_client.config import ClientConfig, DeviceSettings
from edge_client.train.exchange import (
    Action,
    CoordinatorStatusReceived,
    Publish,
    Received,
    Reconnected,
    Started,
    Stop,
    Tick,
)
from edge_client.train.hello import ModelDescription, device_hello
from edge_client.train.session import DeviceSession
from edge_client.train.trainer import describe_model
from models import Classifier, build_classifier
from protocol.messages import Ack, CoordinatorStatus, Hello, Message, ReasonCode, RoundTask
from protocol.tensors import Precision
from protocol.topics import Topics

FLEET = "lab"
DEVICE = "dev-7"
TOPICS = Topics(FLEET)
SUMMARY = "lenet5, 26 classes, input 1x28x28"
LOGGER = "edge_client.train.session"


def make_session(**fields: Any) -> DeviceSession:
    config = ClientConfig(device_id=DEVICE, fleet=FLEET, insecure_no_auth=True, **fields)
    return DeviceSession(
        config,
        fingerprint="0123456789abcdef",
        num_samples=40,
        label_counts=(10,) * 26,
        memory_bytes=2**30,
        model=ModelDescription((1, 28, 28), 26, None),
    )


def hellos(actions: list[Action]) -> list[Message]:
    return [a.message for a in actions if isinstance(a, Publish) and a.message.kind == "hello"]


def started(session: DeviceSession) -> Message:
    """Start the session; its hello."""
    (hello,) = hellos(session.handle(Started()))
    return hello


def answer(session: DeviceSession, hello: Message, now: float = 0.0, **ack: Any) -> list[Action]:
    body = Ack(ref=hello.message_id, **ack)
    message = Message(fleet=FLEET, sender="coordinator", body=body)
    return session.handle(Received(TOPICS.to_device(DEVICE, "ack"), message, now))


def coordinator(session: DeviceSession, state: str) -> list[Action]:
    message = Message(fleet=FLEET, sender="coordinator", body=CoordinatorStatus(state=state))
    return session.handle(CoordinatorStatusReceived(TOPICS.coordinator_status, message))


MISMATCH: dict[str, Any] = {
    "accepted": False,
    "reason": ReasonCode.FINGERPRINT_MISMATCH,
    "detail": "fleet runs lenet5 (10 classes, input 1x28x28, fingerprint 182886740282db9a)",
}


# -- a refused hello ---------------------------------------------------------------------------


def test_a_refused_hello_stops_a_device_that_exits_when_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    session = make_session(exit_when_refused=True, hello_timeout_s=5)
    hello = started(session)

    with caplog.at_level(logging.INFO, LOGGER):
        actions = answer(session, hello, **MISMATCH)
        again = answer(session, hello, **MISMATCH)

    assert actions == [Stop()] and again == []
    assert session.refusal is not None and session.refusal.kind == "refused"
    (error,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    text = error.getMessage()
    assert "the coordinator of fleet lab refused this device (fingerprint_mismatch)" in text
    assert "10 classes" in text and f"this device: {SUMMARY}" in text
    assert "--model" in text and text.endswith("the device stops")
    assert session.refusal.message in text
    assert session.next_expiry is None  # answered: no hint will follow


def test_a_refused_hello_keeps_a_device_up_and_says_why_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    session = make_session(hello_timeout_s=5)
    hello = started(session)

    with caplog.at_level(logging.DEBUG, LOGGER):
        first = answer(session, hello, 0.0, **MISMATCH)
        again = answer(session, hello, 30.0, **MISMATCH)
        consent = answer(
            session, hello, 31.0, accepted=False, reason=ReasonCode.CONSENT_REQUIRED, detail="x"
        )
        later = answer(session, hello, 61.0, **MISMATCH)

    assert first == again == consent == later == [] and session.refusal is None
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 3  # the mismatch at 0 s and 61 s, the consent at 31 s
    assert "--share-label-counts" in errors[1]
    assert all("stays up and says hello again" in e for e in errors)
    assert "(fingerprint_mismatch)" in errors[2]
    # the refused device says hello again as before: on a coordinator's "starting"
    assert hellos(coordinator(session, "starting"))


def test_an_accepted_hello_and_a_task_end_the_wait() -> None:
    session = make_session(exit_when_refused=True, hello_timeout_s=5)
    hello = started(session)
    assert session.next_expiry == 0.0  # the wait starts at the next tick
    session.handle(Tick(100.0))
    assert session.next_expiry == 105.0

    answer(session, hello, accepted=True)

    assert session.next_expiry is None and session.handle(Tick(1000.0)) == []
    # a reconnect says hello again and waits again; a task ends that wait too
    session.handle(Reconnected())
    session.handle(Tick(1000.0))
    task = RoundTask(strategy="fedavg", deadline=1e12, payloads=("global",))
    message = Message(fleet=FLEET, sender="coordinator", body=task, round=1)
    session.handle(Received(TOPICS.to_device(DEVICE, "task"), message, 1001.0))
    assert session.handle(Tick(2000.0)) == [] and session.refusal is None


def test_an_update_nack_is_not_taken_for_a_hello_refusal() -> None:
    session = make_session(exit_when_refused=True, hello_timeout_s=5)
    started(session)
    body = Ack(accepted=False, reason=ReasonCode.FINGERPRINT_MISMATCH, ref="ab" * 16)
    message = Message(fleet=FLEET, sender="coordinator", body=body, round=3)

    actions = session.handle(Received(TOPICS.to_device(DEVICE, "ack"), message, 0.0))

    assert actions == [] and session.refusal is None


# -- an unanswered hello -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "hint"),
    [
        (None, "no coordinator status on fleet lab either, so the fleet name (--fleet lab)"),
        ("waiting", "is up (status waiting) but silent: it cannot authenticate device dev-7"),
        ("running", "so the device key is likely wrong or not registered"),
    ],
)
def test_an_unanswered_hello_stops_a_device_that_exits_when_refused(
    status: str | None, hint: str, caplog: pytest.LogCaptureFixture
) -> None:
    session = make_session(exit_when_refused=True, hello_timeout_s=5)
    started(session)
    if status is not None:
        coordinator(session, status)

    with caplog.at_level(logging.INFO, LOGGER):
        assert session.handle(Tick(10.0)) == []  # arms the wait
        assert session.handle(Tick(14.9)) == []
        actions = session.handle(Tick(15.0))

    assert actions == [Stop()]
    assert session.refusal is not None and session.refusal.kind == "unanswered"
    (error,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert error.startswith(
        "no answer from a coordinator of fleet lab in 5 s: check --fleet, the broker and the "
        "device key; "
    )
    assert hint in error and error.endswith("the device stops")
    assert session.handle(Tick(100.0)) == []  # stopping: said once


def test_an_unanswered_hello_is_said_again_at_a_bounded_rate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    session = make_session(hello_timeout_s=100)
    first = started(session)
    session.handle(Tick(0.0))
    sent = [first]

    with caplog.at_level(logging.INFO, LOGGER):
        hints = []
        for now in (100.0, 300.0, 700.0, 1300.0, 1900.0):
            assert session.handle(Tick(now - 0.5)) == []
            actions = session.handle(Tick(now))
            sent += hellos(actions)
            hints.append(session.next_expiry)

    assert hints == [300.0, 700.0, 1300.0, 1900.0, 2500.0]  # 200, 400, then 600 s apart
    assert len({m.message_id for m in sent}) == 6 and session.refusal is None
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 5 and "in 1900 s" in errors[-1]
    assert "saying hello again (next hint in 600 s)" in errors[-1]
    # the answer of a hello said again ends the wait
    answer(session, sent[-1], accepted=True)
    assert session.next_expiry is None


def test_a_device_let_in_before_never_stops_for_want_of_an_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    session = make_session(exit_when_refused=True, hello_timeout_s=5)
    answer(session, started(session), accepted=True)
    coordinator(session, "running")
    session.handle(Reconnected())  # a broker restart: the new hello may be lost

    with caplog.at_level(logging.INFO, LOGGER):
        session.handle(Tick(0.0))
        actions = session.handle(Tick(5.0))

    assert len(hellos(actions)) == 1 and Stop() not in actions and session.refusal is None
    (warning,) = [r for r in caplog.records if "no answer" in r.getMessage()]
    assert warning.levelno == logging.WARNING and "let this device in before" in warning.message


def test_a_stopped_coordinator_is_waited_for(caplog: pytest.LogCaptureFixture) -> None:
    session = make_session(exit_when_refused=True, hello_timeout_s=5)
    started(session)
    coordinator(session, "running")
    coordinator(session, "stopped")  # its last will: it crashed

    with caplog.at_level(logging.INFO, LOGGER):
        session.handle(Tick(0.0))
        assert session.handle(Tick(5.0)) == []

    assert session.refusal is None and session.next_expiry is None
    assert any("is stopped: waiting for it" in r.getMessage() for r in caplog.records)
    # its "starting" brings a new hello, and a new wait
    assert hellos(coordinator(session, "starting")) and session.next_expiry == 0.0


def test_a_device_without_the_coordinators_key_cannot_tell_why() -> None:
    config = ClientConfig(device_id=DEVICE, fleet=FLEET, hello_timeout_s=5, auth_key="00" * 32)
    session = DeviceSession(
        config, fingerprint="0123456789abcdef", num_samples=1, label_counts=(1,), memory_bytes=0
    )
    hint, hopeless = session.no_answer_hint(5.0)
    assert hopeless and "reads no coordinator status (no --coordinator-key-file)" in hint


def test_without_a_hello_timeout_nothing_is_watched() -> None:
    session = make_session(exit_when_refused=True)  # the emulator's devices
    started(session)
    assert session.next_expiry is None and session.handle(Tick(1e6)) == []


# -- the settings ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "timeout", "exits"),
    [
        ({}, 60.0, False),
        ({"exit_when_finished": True}, 60.0, True),
        ({"hello_timeout": 2.5, "exit_when_finished": True}, 2.5, True),
        ({"hello_timeout": 0}, None, False),
    ],
)
def test_the_command_line_sets_the_hello_timeout_and_exit_when_refused(
    given: dict[str, Any], timeout: float | None, exits: bool
) -> None:
    settings = DeviceSettings(insecure_no_auth=True, **given)
    config = settings.client_config("dev-1")
    assert config.hello_timeout_s == timeout and config.exit_when_refused is exits


def test_a_negative_hello_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="hello_timeout"):
        DeviceSettings(hello_timeout=-1)


# -- the coordinator's refusal detail ----------------------------------------------------------


def hello_of(architecture: str, fingerprint: str) -> Hello:
    return Hello(
        device_id=DEVICE,
        architecture=architecture,
        fingerprint=fingerprint,
        precisions=(Precision.FP32,),
        memory_bytes=0,
        threads=1,
        software_version="test",
        num_samples=10,
    )


@pytest.fixture(scope="module")
def groups() -> dict[str, ArchitectureGroup]:
    return {name: ArchitectureGroup.of(build_classifier(name)) for name in ("lenet5", "mlp")}


def test_the_refusal_names_the_classes_of_the_fleet_and_of_the_device(
    groups: dict[str, ArchitectureGroup],
) -> None:
    wide = build_classifier("lenet5", num_classes=26).fingerprint()
    detail = fingerprint_refusal(hello_of("lenet5", wide), groups, CoordinatorConfig())

    assert detail.startswith(
        "fleet runs lenet5 (10 classes, input 1x28x28, fingerprint "
        f"{groups['lenet5'].fingerprint}), mlp (10 classes"
    )
    assert f"device announced lenet5 (fingerprint {wide})" in detail
    assert detail.endswith(
        "that is lenet5 with 26 classes: the device's data have 26 classes, the fleet's model 10"
    )
    assert len(detail) <= 512
    assert guess_classes(groups["mlp"], build_classifier("mlp", num_classes=2).fingerprint()) == 2


def test_the_refusal_of_another_architecture_or_input_says_so(
    groups: dict[str, ArchitectureGroup],
) -> None:
    config = CoordinatorConfig()
    resnet = build_classifier("resnet8").fingerprint()
    other = fingerprint_refusal(hello_of("resnet8", resnet), groups, config)
    assert other.endswith("this fleet runs no resnet8: start the device with --model lenet5, mlp")

    colour = build_classifier("lenet5", in_channels=3).fingerprint()
    assert guess_classes(groups["lenet5"], colour) is None
    detail = fingerprint_refusal(hello_of("lenet5", colour), groups, config)
    assert detail.endswith(
        "its lenet5 differs from the fleet's: other data (classes, channels or image size) "
        "or other model options"
    )


def test_the_refusal_of_a_users_model_names_its_classes_or_a_code_difference() -> None:
    path = "tests.models.user_models:build_split"
    groups = {path: ArchitectureGroup.of(build_classifier(path))}
    config = CoordinatorConfig(model=path)
    wide = build_classifier(path, num_classes=26).fingerprint()
    detail = fingerprint_refusal(hello_of(path, wide), groups, config)
    assert detail.endswith(
        f"that is {path} with 26 classes: the device's data have 26 classes, the fleet's model 10"
    )
    colour = build_classifier(path, in_channels=3).fingerprint()
    detail = fingerprint_refusal(hello_of(path, colour), groups, config)
    assert detail.endswith("or another version of that factory's code on one side")
    assert len(detail) <= 512


def described_hello(architecture: str, model: Classifier) -> Hello:
    """The hello a device of this build announces: its model described."""
    config = ClientConfig(device_id=DEVICE, fleet=FLEET, insecure_no_auth=True, model=architecture)
    return device_hello(
        config,
        fingerprint=model.fingerprint(),
        num_samples=10,
        held_base=None,
        memory_bytes=0,
        model=describe_model(model),
    )


SERIES = "tests.models.user_models:build_series"


def test_a_described_model_of_other_samples_or_classes_is_named_so() -> None:
    groups = {SERIES: ArchitectureGroup.of(build_classifier(SERIES, input_shape=(9, 6)))}
    config = CoordinatorConfig(model=SERIES, input_shape=(9, 6))

    transposed = build_classifier(SERIES, input_shape=(6, 9))  # same tensors: no guess could tell
    assert transposed.fingerprint() == groups[SERIES].fingerprint
    detail = fingerprint_refusal(described_hello(SERIES, transposed), groups, config)
    assert detail.endswith("the device's samples are 6x9, the fleet's 9x6"), detail

    both = build_classifier(SERIES, input_shape=(12, 6), num_classes=3)
    detail = fingerprint_refusal(described_hello(SERIES, both), groups, config)
    assert detail.endswith(
        "the device's samples are 12x6, the fleet's 9x6; the device's data have 3 classes, "
        "the fleet's model 10"
    ), detail
    assert len(detail) <= 512


def test_a_described_model_with_other_tensors_names_them() -> None:
    """Same name, samples and classes, other code (another version of the factory on
    one side): the tensors that differ are named, the rest counted."""
    split = "tests.models.user_models:build_split"
    groups = {split: ArchitectureGroup.of(build_classifier(split))}
    config = CoordinatorConfig(model=split)
    other = build_classifier("tests.models.user_models:build_flat")  # another version
    detail = fingerprint_refusal(described_hello(split, other), groups, config)
    assert detail.endswith(
        "same samples and classes, other tensors (other model options or another version "
        "of that factory's code on one side): tensors only the device's model has: "
        "features.1.bias, features.1.weight, features.3.bias (+1 more); tensors only the "
        "fleet's has: features.0.bias, features.0.weight, head.bias (+1 more)"
    ), detail
    assert len(detail) <= 512

    wider = {name: (shape[0] * 2, *shape[1:]) for name, shape in groups[split].shapes.items()}
    text = tensor_difference(wider, groups[split].shapes)
    assert text.startswith("tensors shaped otherwise: features.0.bias 8 (fleet 4), ")
    assert text.endswith("(+1 more)")
