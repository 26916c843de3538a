"""The topic layout and its parser."""

from __future__ import annotations

import pytest

from protocol.errors import DecodeError
from protocol.topics import TopicInfo, Topics, parse_topic


def test_every_device_topic_contains_the_device_id() -> None:
    topics = Topics("lab")
    for leaf in ("hello", "update", "status"):
        topic = topics.device("pi-07", leaf)  # type: ignore[arg-type]
        assert topic == f"fl/lab/devices/pi-07/{leaf}"
        assert parse_topic(topic) == TopicInfo("lab", "device", "pi-07", leaf)


def test_downlink_and_fleet_topics_parse_back() -> None:
    topics = Topics("lab")
    assert parse_topic(topics.to_device("pi-07", "task")) == TopicInfo("lab", "to", "pi-07", "task")
    assert parse_topic(topics.broadcast_model) == TopicInfo("lab", "broadcast", None, "model")
    assert parse_topic(topics.coordinator_status).role == "coordinator"
    assert topics.from_devices("update") == "fl/lab/devices/+/update"
    assert topics.device_inbox("pi-07") == "fl/lab/to/pi-07/#"


@pytest.mark.parametrize("bad", ["a/b", "+", "#", "", "-lead", "x" * 65, "sp ace"])
def test_identifiers_that_would_break_topics_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid"):
        Topics("lab").device(bad, "hello")
    with pytest.raises(ValueError, match="invalid"):
        Topics(bad)


@pytest.mark.parametrize(
    "topic",
    [
        "",
        "fl",
        "fl/lab",
        "x/lab/devices/d/hello",
        "fl/lab/devices/d/steal",
        "fl/lab/devices/d",
        "fl/lab/to/d/update",
        "fl/lab/devices/d/hello/extra",
        "fl/lab/broadcast/task",
    ],
)
def test_topics_outside_the_layout_are_rejected(topic: str) -> None:
    with pytest.raises(DecodeError):
        parse_topic(topic)
