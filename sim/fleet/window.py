"""How many of the fleet's messages may wait for the coordinator's answer at once.

The coordinator answers each hello and each update with an ack, on one connection that
receives the whole fleet's traffic. Emulated devices act in step where real ones would
not — N devices start together, a cohort of devices finishes training together — and
K connections can publish faster than one client reads: a broker queues only so many
messages for a client (Mosquitto: ``max_queued_messages``, 1000 by default) and drops
the rest. A device whose hello is dropped never joins; an update whose chunk is dropped
never arrives. An :class:`AnswerWindow` holds a device's start (its hello) or its update
back while ``size`` of them wait for their answer; one unanswered for ``timeout_s`` (lost,
say) frees its place. It also keeps the coordinator's backlog short, so that the arrival
times it stamps on events (round starts, deadlines) stay close to the time it handles
them.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["DEFAULT_ANSWER_TIMEOUT_S", "DEFAULT_WINDOW", "AnswerWindow"]

DEFAULT_WINDOW = 128
"""Hellos and updates waiting for the coordinator's answer at once, at most."""
DEFAULT_ANSWER_TIMEOUT_S = 300.0
"""Seconds after which an unanswered message no longer holds a place in the window.
Long: a coordinator registering thousands of devices answers late, and every place
freed early lets its backlog grow."""

T = TypeVar("T")


class AnswerWindow(Generic[T]):
    """Items waiting to send a message the coordinator answers, and the messages sent
    and not yet answered (used from one thread).

    Args:
        size: messages waiting for an answer at once, at most (>= 1).
        timeout_s: seconds after which an unanswered message frees its place.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        size: int = DEFAULT_WINDOW,
        timeout_s: float = DEFAULT_ANSWER_TIMEOUT_S,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if size < 1 or timeout_s <= 0:
            raise ValueError(f"need size >= 1 and timeout_s > 0, got {size}, {timeout_s}")
        self.size = size
        self.timeout_s = timeout_s
        self._clock = clock
        self._waiting: deque[T] = deque()
        self._unanswered: OrderedDict[str, float] = OrderedDict()  # message id -> sent at

    def __len__(self) -> int:
        """Items still waiting."""
        return len(self._waiting)

    def queue(self, item: T) -> None:
        """``item`` will send a message the coordinator answers once admitted."""
        self._waiting.append(item)

    def sent(self, message_id: str) -> None:
        """A message the coordinator answers went out (admitted or not: a device that
        announces itself again when asked is not held back)."""
        self._unanswered[message_id] = self._clock()

    def answered(self, message_id: str | None) -> None:
        """The coordinator answered a message (an ack whose ``ref`` is its id)."""
        if message_id is not None:
            self._unanswered.pop(message_id, None)

    def admit(self) -> list[T]:
        """The items that may send their message now, in the order they queued; the
        caller reports each message with :meth:`sent`."""
        expired = self._clock() - self.timeout_s
        while self._unanswered and next(iter(self._unanswered.values())) <= expired:
            self._unanswered.popitem(last=False)
        admitted: list[T] = []
        while self._waiting and len(self._unanswered) + len(admitted) < self.size:
            admitted.append(self._waiting.popleft())
        return admitted

    def next_expiry(self) -> float | None:
        """When the oldest unanswered message frees its place (monotonic seconds), while
        items wait; None otherwise."""
        if not self._waiting or not self._unanswered:
            return None
        return next(iter(self._unanswered.values())) + self.timeout_s
