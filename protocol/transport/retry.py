"""Connecting to a broker that may not be up yet: the first connection, retried.

The coordinator and the edge clients start as services beside their broker, which may
come up after them: :func:`connect_retrying` tries again with a doubling delay until a
time budget is spent. (Reconnects after a lost session are the transport's own.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from protocol.errors import TransportError
from protocol.transport.base import Transport, Will

__all__ = ["RetryWait", "connect_retrying"]

RetryWait = Callable[[int, TransportError, float, float], None]
"""Told of each failed attempt before the wait: (attempt, error, wait s, budget left s)."""


def connect_retrying(
    transport: Transport,
    will: Will | None,
    stop: threading.Event,
    *,
    retry_s: float,
    first_delay_s: float,
    max_delay_s: float,
    timeout_s: float,
    on_wait: RetryWait,
) -> int | None:
    """Connect, trying again after ``first_delay_s`` doubling up to ``max_delay_s`` until
    ``retry_s`` is spent (0: one attempt); returns the attempts it took, None when
    ``stop`` was set first. Each attempt waits at most ``timeout_s`` for the session, and
    no longer than the budget left (at least 1 s).

    Raises:
        TransportError: no session within ``retry_s`` (the message counts the attempts
            and ends with the last error).
    """
    deadline = time.monotonic() + retry_s
    delay, attempt = first_delay_s, 0
    while not stop.is_set():
        attempt += 1
        remaining = deadline - time.monotonic()
        timeout = timeout_s if retry_s == 0 else max(1.0, min(timeout_s, remaining))
        try:
            transport.connect(will=will, timeout=timeout)
            return attempt
        except TransportError as exc:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportError(
                    f"no connection to the broker after {attempt} attempt(s) in "
                    f"{retry_s:.0f} s: {exc}"
                ) from exc
            wait = min(delay, remaining)
            on_wait(attempt, exc, wait, remaining)
            if stop.wait(wait):
                return None
            delay = min(delay * 2, max_delay_s)
    return None
