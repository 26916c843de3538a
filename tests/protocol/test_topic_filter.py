"""MQTT topic names, filters and wildcard matching."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.errors import TransportError
from protocol.transport import topic_matches, validate_filter, validate_topic

# A topic level: any text without '/', wildcards or NUL (may be empty, as MQTT allows).
level = st.text(st.characters(exclude_characters="/+#\x00", exclude_categories=["Cs"]), max_size=8)
topics = st.lists(level, min_size=1, max_size=6).map("/".join).filter(bool)
plain_topics = topics.filter(lambda t: not t.startswith("$"))


@pytest.mark.parametrize(
    ("topic_filter", "topic", "expected"),
    [
        ("a/b", "a/b", True),
        ("a/b", "a/c", False),
        ("a/+", "a/b", True),
        ("a/+", "a/b/c", False),
        ("a/+", "a", False),
        ("a/+", "a/", True),
        ("+/+", "/x", True),
        ("+", "/x", False),
        ("a/#", "a", True),
        ("a/#", "a/b/c", True),
        ("a/#", "ab", False),
        ("#", "a/b", True),
        ("#", "/", True),
        ("+/b/#", "x/b", True),
        ("+/b/#", "x/c/b", False),
        ("#", "$SYS/broker", False),
        ("+/broker", "$SYS/broker", False),
        ("$SYS/#", "$SYS/broker", True),
        ("$SYS/+", "$SYS/broker", True),
        ("fl/+/devices/+/up", "fl/f1/devices/d7/up", True),
        ("A/b", "a/b", False),
    ],
)
def test_topic_matches_examples(topic_filter: str, topic: str, expected: bool) -> None:
    assert topic_matches(topic_filter, topic) is expected


@given(plain_topics)
def test_every_plain_topic_matches_hash(topic: str) -> None:
    assert topic_matches("#", topic)


@given(topics)
def test_a_topic_matches_itself_as_a_filter(topic: str) -> None:
    validate_topic(topic)
    validate_filter(topic)
    assert topic_matches(topic, topic)


@given(plain_topics, st.data())
def test_replacing_a_level_with_plus_still_matches(topic: str, data: st.DataObject) -> None:
    levels = topic.split("/")
    index = data.draw(st.integers(0, len(levels) - 1))
    levels[index] = "+"
    topic_filter = "/".join(levels)

    validate_filter(topic_filter)
    assert topic_matches(topic_filter, topic)
    assert topic_matches(topic_filter + "/#", topic)


@given(plain_topics, level)
def test_an_extra_level_breaks_an_exact_match(topic: str, extra: str) -> None:
    assert not topic_matches(topic, f"{topic}/{extra}")
    assert not topic_matches(f"{topic}/{extra}", topic)


@pytest.mark.parametrize("topic", ["", "a/+", "+", "a/#", "#", "a+b", "nul\x00", "é" * 32_768, 42])
def test_validate_topic_rejects(topic: str) -> None:
    with pytest.raises(TransportError):
        validate_topic(topic)


@pytest.mark.parametrize("topic", ["a", "/", "a//b", "$SYS/x", "é" * 32_767, "x" * 65_535])
def test_validate_topic_accepts(topic: str) -> None:
    validate_topic(topic)


@pytest.mark.parametrize(
    "topic_filter", ["", "a/#/b", "#/a", "a#", "a/b#", "a+", "a/+b", "nul\x00", "x" * 65_536]
)
def test_validate_filter_rejects(topic_filter: str) -> None:
    with pytest.raises(TransportError):
        validate_filter(topic_filter)


@pytest.mark.parametrize("topic_filter", ["#", "+", "a/#", "+/+/#", "a/+/c", "/", "$SYS/#"])
def test_validate_filter_accepts(topic_filter: str) -> None:
    validate_filter(topic_filter)


def test_transport_error_is_also_an_os_error() -> None:
    with pytest.raises(OSError):
        validate_topic("a/#")
