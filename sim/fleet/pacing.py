"""A token bucket: how fast the fleet's devices may publish, all connections together.

Every message a device publishes goes to the coordinator's one connection. Emulated
devices act in step where real ones would not (a cohort of decoded tasks reports
``training`` at once), and K connections publish faster than one client reads: beyond
what the broker queues for that client (Mosquitto: ``max_queued_messages``, 1000 by
default) messages are dropped. :class:`RateLimit` lets bursts of up to ``burst``
messages through and spreads longer ones at ``rate`` messages per second.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["DEFAULT_BURST", "DEFAULT_RATE", "RateLimit"]

DEFAULT_RATE = 500.0
"""Messages per second the fleet publishes at most, over a burst (a coordinator on this
project's 2-core machine reads about 1,000 a second)."""
DEFAULT_BURST = 200
"""Messages that may go at once before the rate applies."""


class RateLimit:
    """A token bucket shared by threads.

    Args:
        rate: tokens per second (> 0).
        burst: most tokens saved up (>= 1).
        clock: monotonic seconds.
        sleep: waits that many seconds.
    """

    def __init__(
        self,
        rate: float = DEFAULT_RATE,
        burst: int = DEFAULT_BURST,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] = time.sleep,
    ) -> None:
        if not rate > 0 or burst < 1:
            raise ValueError(f"need rate > 0 and burst >= 1, got {rate}, {burst}")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._sleep = sleep
        self._tokens = float(burst)
        self._last = clock()
        self._lock = threading.Lock()

    def acquire(self) -> float:
        """Take a token, waiting for it if need be; returns the seconds waited.

        A caller that finds the bucket empty takes its token on credit and sleeps until
        the bucket has paid it back, so callers are served in the order they came and
        no one spins.
        """
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= 1
            wait = max(0.0, -self._tokens / self.rate)
        if wait:
            self._sleep(wait)
        return wait
