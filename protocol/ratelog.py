"""Warnings about bad input from the network, logged at a bounded rate.

Anyone on the broker may publish anything, as often as they like: a peer that logged a
WARNING line per forged, replayed or undecodable frame would let a flood fill its disk
(a Raspberry Pi's SD card) and bury the lines that matter. :class:`RateLimitedLog` logs
the first warning of a key (a kind of refusal and its source) in each interval at
WARNING and the others at DEBUG (``-v`` shows every one). The coordinator and the edge
client both use it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """Logs a warning at most once per key per ``interval_s`` (bounded memory), so bad
    input from one source is logged once, and a flood of it does not flood the log; the
    others are logged at DEBUG (``-v`` shows every refusal)."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval_s: float = 60.0,
        max_keys: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._interval = interval_s
        self._max_keys = max_keys
        self._clock = clock
        self._last: OrderedDict[str, float] = OrderedDict()
        self.suppressed = 0
        """Warnings logged at DEBUG only because their key was logged recently."""
        self._listeners: list[Callable[[str, str], None]] = []

    def listen(self, listener: Callable[[str, str], None]) -> None:
        """Call ``listener(key, text)`` for every warning, rate-limited or not (the
        coordinator's telemetry counts refusals by the key's first field)."""
        self._listeners.append(listener)

    def warning(self, key: str, msg: str, *args: object) -> None:
        for listener in self._listeners:
            listener(key, msg % args if args else msg)
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._interval:
            self.suppressed += 1
            self._log.debug(msg, *args)
            return
        self._last[key] = now
        self._last.move_to_end(key)
        while len(self._last) > self._max_keys:
            self._last.popitem(last=False)
        self._log.warning(msg, *args)
