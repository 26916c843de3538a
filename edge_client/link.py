"""What both device products do on the broker: connect with backoff, publish the retained
status, measure their memory. The training runtime (:mod:`edge_client.train.runtime`) and
the follower (:mod:`edge_client.serve.follower`) import it; it imports no torch.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Literal

from edge_client.config import ClientConfig
from edge_client.errors import ConnectError
from protocol.channel import Channel
from protocol.errors import EncodeError, TransportError
from protocol.messages import DeviceStatus, Message
from protocol.topics import Topics
from protocol.transport.base import Transport, Will
from protocol.transport.retry import connect_retrying

__all__ = [
    "DeviceState",
    "connect_with_retry",
    "peak_rss_bytes",
    "publish_status",
    "rss_bytes",
    "total_memory_bytes",
]

logger = logging.getLogger(__name__)

DeviceState = Literal["online", "offline", "idle", "training", "uploading", "error"]
_DETAIL_MAX = 512  # DeviceStatus.detail limit, characters


def rss_bytes(*, proc: Path = Path("/proc")) -> int | None:
    """Current resident set size of this process in bytes (Linux), else None."""
    try:
        pages = int((proc / "self" / "statm").read_text(encoding="ascii").split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


STATUS_RSS_MAX_AGE_S = 1.0
"""How old the resident set size a status reports may be."""


class _RecentRss:
    """:func:`rss_bytes`, read at most once every :data:`STATUS_RSS_MAX_AGE_S`."""

    def __init__(self) -> None:
        self._when = -math.inf
        self._value: int | None = None

    def __call__(self) -> int | None:
        now = time.monotonic()
        if now - self._when >= STATUS_RSS_MAX_AGE_S:
            self._value = rss_bytes()
            self._when = now
        return self._value


status_rss_bytes = _RecentRss()
"""The resident set size a status reports: the sim's devices share one process and
publish thousands of statuses a second, and each read of ``/proc`` took milliseconds in
a large process (on a GPU host, 22 thread-seconds in three rounds of 1,000 devices)."""


def total_memory_bytes() -> int:
    """Physical memory of the machine in bytes, 0 if unknown."""
    try:
        return max(0, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (OSError, ValueError, AttributeError):
        return 0


def new_session() -> str:
    """A device session id: 16 random hex digits, drawn once per start (section 7)."""
    return os.urandom(8).hex()


def publish_status(
    channel: Channel,
    config: ClientConfig,
    state: DeviceState,
    detail: str = "",
    session: str | None = None,
) -> None:
    """Publish the device's retained status (with its RSS and ``session``, its
    :func:`new_session`); failures are logged."""
    body = DeviceStatus(
        state=state, detail=detail[:_DETAIL_MAX], rss_bytes=status_rss_bytes(), session=session
    )
    message = Message(fleet=config.fleet, sender=config.device_id, body=body)
    topic = Topics(config.fleet).device(config.device_id, "status")
    try:
        channel.send(topic, message, retain=True)
    except (TransportError, EncodeError) as exc:
        logger.warning("could not publish status %r: %s", state, exc)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes: ``VmHWM`` (the high-water mark
    of this program's memory, unlike ``ru_maxrss``, which also counts the parent's memory
    at the fork before ``exec``), else ``ru_maxrss``."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def connect_with_retry(
    transport: Transport, config: ClientConfig, will: Will | None, stop: threading.Event
) -> bool:
    """Connect with exponential backoff (``connect_backoff_s`` doubling up to
    ``connect_backoff_max_s``) for up to ``connect_retry_s``; False if ``stop`` was set
    before a session.

    Raises:
        ConnectError: no session within ``connect_retry_s``.
    """

    def waiting(attempt: int, exc: TransportError, wait: float, _remaining: float) -> None:
        logger.warning("connect attempt %d failed (%s); retry in %.1f s", attempt, exc, wait)

    try:
        attempts = connect_retrying(
            transport,
            will,
            stop,
            retry_s=config.connect_retry_s,
            first_delay_s=config.connect_backoff_s,
            max_delay_s=config.connect_backoff_max_s,
            timeout_s=config.broker.connect_timeout_s,
            on_wait=waiting,
        )
    except TransportError as exc:
        raise ConnectError(str(exc)) from exc
    return attempts is not None
