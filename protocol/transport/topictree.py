"""Topics or topic filters indexed by level, so matching costs O(levels), not O(keys).

Checking a topic against every filter in turn (:func:`topic_matches` on each) costs
O(filters) per message. A fleet of N devices has N inbox filters, so each message cost
O(N) and a round O(N^2): with 3,000 emulated devices that matching was a fifth of the
run; and each new subscription was checked against all N retained statuses. A
:class:`TopicTree` keeps its keys in a tree of their levels and walks only the branches
that can match, with the MQTT rules of :func:`protocol.transport.base.topic_matches`
(which the tests compare it with):

- keys are filters (``+`` and ``#`` are levels of their own): :meth:`TopicTree.match`
  finds those a topic matches (routing a message);
- keys are topics: :meth:`TopicTree.matching` finds those a filter matches (the retained
  messages a new subscription receives).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Generic, TypeVar

__all__ = ["TopicTree"]

V = TypeVar("V")


class _Node:
    __slots__ = ("children", "key")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.key: str | None = None  # the key that ends here, if any


class TopicTree(MutableMapping[str, V], Generic[V]):
    """A mapping from topics or topic filters (assumed valid) to values, searchable by
    :meth:`match` (keys are filters) or :meth:`matching` (keys are topics)."""

    def __init__(self) -> None:
        self._values: dict[str, V] = {}
        self._root = _Node()

    def __getitem__(self, topic_filter: str) -> V:
        return self._values[topic_filter]

    def __setitem__(self, topic_filter: str, value: V) -> None:
        if topic_filter not in self._values:
            node = self._root
            for level in topic_filter.split("/"):
                node = node.children.setdefault(level, _Node())
            node.key = topic_filter
        self._values[topic_filter] = value

    def __delitem__(self, topic_filter: str) -> None:
        del self._values[topic_filter]
        path = [self._root]
        levels = topic_filter.split("/")
        for level in levels:
            path.append(path[-1].children[level])
        path[-1].key = None
        for depth in range(len(levels), 0, -1):  # prune branches left empty
            node = path[depth]
            if node.key is not None or node.children:
                break
            del path[depth - 1].children[levels[depth - 1]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def match(self, topic: str) -> list[tuple[str, V]]:
        """The (filter, value) pairs whose filter matches ``topic`` (a valid topic)."""
        levels = topic.split("/")
        found: list[str] = []
        self._walk(self._root, levels, 0, topic.startswith("$"), found)
        return [(f, self._values[f]) for f in found]

    def matching(self, topic_filter: str) -> list[tuple[str, V]]:
        """The (topic, value) pairs whose topic ``topic_filter`` (a valid filter) matches."""
        found: list[str] = []
        self._search(self._root, topic_filter.split("/"), 0, found)
        return [(t, self._values[t]) for t in found]

    def _search(self, node: _Node, levels: list[str], index: int, found: list[str]) -> None:
        if index == len(levels):
            if node.key is not None:
                found.append(node.key)
            return
        level = levels[index]
        if level == "#":  # this level and everything below it
            if index > 0 and node.key is not None:
                found.append(node.key)
            self._everything(node, index == 0, found)
        elif level == "+":
            for name, child in node.children.items():
                if not (index == 0 and name.startswith("$")):
                    self._search(child, levels, index + 1, found)
        elif (exact := node.children.get(level)) is not None:
            self._search(exact, levels, index + 1, found)

    def _everything(self, node: _Node, top: bool, found: list[str]) -> None:
        """Every key below ``node`` (``top``: skip '$' topics at the first level)."""
        stack = [child for name, child in node.children.items() if not (top and name[:1] == "$")]
        while stack:
            current = stack.pop()
            if current.key is not None:
                found.append(current.key)
            stack.extend(current.children.values())

    def _walk(
        self, node: _Node, levels: list[str], index: int, system: bool, found: list[str]
    ) -> None:
        wildcards = not (system and index == 0)  # '$' topics: no wildcard first level
        if wildcards and (multi := node.children.get("#")) is not None and multi.key:
            found.append(multi.key)  # '#' matches the parent level and all below
        if index == len(levels):
            if node.key is not None:
                found.append(node.key)
            return
        exact = node.children.get(levels[index])
        if exact is not None:
            self._walk(exact, levels, index + 1, system, found)
        if wildcards and (single := node.children.get("+")) is not None:
            self._walk(single, levels, index + 1, system, found)
