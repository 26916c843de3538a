"""TopicTree against topic_matches: the same answers on every pair of a generated set."""

from __future__ import annotations

import itertools
import random

from protocol.transport.base import topic_matches
from protocol.transport.topictree import TopicTree

LEVELS = ["a", "b", "$SYS", ""]


def _topics() -> list[str]:
    out = []
    for depth in (1, 2, 3):
        out += ["/".join(p) for p in itertools.product(LEVELS, repeat=depth)]
    return out


def _filters() -> list[str]:
    out = []
    for depth in (1, 2, 3):
        for parts in itertools.product([*LEVELS, "+", "#"], repeat=depth):
            if "#" in parts[:-1]:
                continue  # '#' only last
            out.append("/".join(parts))
    return out


TOPICS, FILTERS = _topics(), _filters()


def test_match_finds_exactly_the_filters_a_topic_matches() -> None:
    tree: TopicTree[int] = TopicTree()
    for index, topic_filter in enumerate(FILTERS):
        tree[topic_filter] = index

    for topic in TOPICS:
        want = {f for f in FILTERS if topic_matches(f, topic)}
        got = tree.match(topic)
        assert {f for f, _ in got} == want, topic
        assert all(tree[f] == v for f, v in got)


def test_matching_finds_exactly_the_topics_a_filter_matches() -> None:
    tree: TopicTree[str] = TopicTree()
    for topic in TOPICS:
        tree[topic] = topic.upper()

    for topic_filter in FILTERS:
        want = {t for t in TOPICS if topic_matches(topic_filter, t)}
        got = tree.matching(topic_filter)
        assert {t for t, _ in got} == want, topic_filter
        assert all(v == t.upper() for t, v in got)


def test_deleting_keys_prunes_the_tree_and_keeps_the_rest() -> None:
    rng = random.Random(0)
    tree: TopicTree[int] = TopicTree()
    keys = list(FILTERS)
    for index, key in enumerate(keys):
        tree[key] = index
    rng.shuffle(keys)
    gone, kept = keys[: len(keys) // 2], keys[len(keys) // 2 :]

    for key in gone:
        del tree[key]

    assert len(tree) == len(kept) and set(tree) == set(kept)
    for topic in TOPICS:
        assert {f for f, _ in tree.match(topic)} == {f for f in kept if topic_matches(f, topic)}
    tree.clear()
    assert len(tree) == 0 and tree.match("a/b") == [] and not tree._root.children
