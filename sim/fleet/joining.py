"""How the fleet's devices join: a window at a time, not all at once.

Every device announces itself when it starts (a retained ``online`` status and a hello),
and the coordinator answers each hello. N devices starting together would put 2N
messages in front of the coordinator's one connection at once; a broker queues only so
many for a client that reads slowly (Mosquitto: ``max_queued_messages``, 1000 by
default) and drops the rest, and a device whose hello is dropped never joins. A
:class:`JoinWindow` lets a device start once fewer than ``size`` hellos wait for their
answer; a hello unanswered for ``timeout_s`` (300 s) frees its place.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable

__all__ = ["DEFAULT_JOIN_WINDOW", "JoinWindow"]

DEFAULT_JOIN_WINDOW = 256
"""Hellos waiting for the coordinator's answer at once, at most."""
DEFAULT_HELLO_TIMEOUT_S = 300.0
"""Seconds after which an unanswered hello (lost, say) no longer holds a place in the
window. Long: a coordinator registering thousands of devices answers late, and every
place freed early lets its backlog grow."""


class JoinWindow:
    """Devices waiting to start, and the hellos waiting for an answer (one thread).

    Args:
        size: hellos waiting for an answer at once, at most (>= 1).
        timeout_s: seconds after which an unanswered hello frees its place.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        size: int = DEFAULT_JOIN_WINDOW,
        timeout_s: float = DEFAULT_HELLO_TIMEOUT_S,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if size < 1 or timeout_s <= 0:
            raise ValueError(f"need size >= 1 and timeout_s > 0, got {size}, {timeout_s}")
        self.size = size
        self.timeout_s = timeout_s
        self._clock = clock
        self._waiting: deque[str] = deque()
        self._unanswered: OrderedDict[str, float] = OrderedDict()  # hello id -> sent at

    def __len__(self) -> int:
        """Devices still waiting to start."""
        return len(self._waiting)

    def queue(self, device_id: str) -> None:
        """``device_id`` is ready to start."""
        self._waiting.append(device_id)

    def announced(self, hello_id: str) -> None:
        """A hello went out (a device started, reconnected or was asked to announce)."""
        self._unanswered[hello_id] = self._clock()

    def answered(self, hello_id: str | None) -> None:
        """The coordinator answered a message (an ack whose ``ref`` is its id); if it was
        a hello, its place in the window is free."""
        if hello_id is not None:
            self._unanswered.pop(hello_id, None)

    def admit(self) -> list[str]:
        """The devices that may start now, in the order they queued."""
        expired = self._clock() - self.timeout_s
        while self._unanswered and next(iter(self._unanswered.values())) <= expired:
            self._unanswered.popitem(last=False)
        admitted: list[str] = []
        while self._waiting and len(self._unanswered) + len(admitted) < self.size:
            admitted.append(self._waiting.popleft())
        return admitted

    def next_expiry(self) -> float | None:
        """When the oldest unanswered hello frees its place (monotonic seconds), while
        devices wait to start; None otherwise."""
        if not self._waiting or not self._unanswered:
            return None
        return next(iter(self._unanswered.values())) + self.timeout_s
