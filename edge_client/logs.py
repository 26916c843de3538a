"""Logging set-up for the edge client: journald under systemd, plain text on a terminal.

Under systemd, a service's stderr usually goes to the journal, which timestamps every
line itself and reads a ``<N>`` syslog priority prefix (``SyslogLevelPrefix=``, on by
default) as the entry's priority. One line is one journal entry, so tracebacks are folded
into the record's line. systemd tells a service where its stderr goes through the
``JOURNAL_STREAM`` environment variable (``"<device>:<inode>"`` of that stream), which
:func:`configure_logging` compares with the stream it logs to.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import IO, Literal

from edge_client.errors import ConfigError

__all__ = [
    "JOURNALD_PRIORITIES",
    "JournaldFormatter",
    "LogFormat",
    "TEXT_FORMAT",
    "configure_logging",
    "journal_priority",
    "stream_is_journal",
]

LogFormat = Literal["auto", "text", "journald"]

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""The ``text`` format: timestamp, level, logger name and message."""

JOURNALD_PRIORITIES = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}
"""Syslog priority of each standard level (``<2>`` crit ... ``<7>`` debug)."""

FOLD = " | "
"""What replaces each line break inside one journald record."""


def journal_priority(levelno: int) -> int:
    """Syslog priority for a logging level; levels in between take the lower one's."""
    for level, priority in sorted(JOURNALD_PRIORITIES.items(), reverse=True):
        if levelno >= level:
            return priority
    return JOURNALD_PRIORITIES[logging.DEBUG]


class JournaldFormatter(logging.Formatter):
    """``<N>name: message`` on one line: no timestamp, tracebacks folded with `` | ``."""

    def __init__(self) -> None:
        super().__init__("%(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)  # appends exc_info / stack_info on new lines
        folded = FOLD.join(line for line in text.splitlines() if line.strip())
        return f"<{journal_priority(record.levelno)}>{folded}"


def stream_is_journal(stream: IO[str], environ: dict[str, str] | None = None) -> bool:
    """Whether ``JOURNAL_STREAM`` names ``stream``'s file (same device and inode).

    False when the variable is unset or malformed, or the stream has no file descriptor.
    """
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    device, sep, inode = value.strip().partition(":")
    if not sep:
        return False
    try:
        expected = (int(device), int(inode))
        stat = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):  # io.UnsupportedOperation is both
        return False
    return (stat.st_dev, stat.st_ino) == expected


def configure_logging(level: int, *, fmt: LogFormat = "auto", stream: IO[str] | None = None) -> str:
    """Send the root logger's records at ``level`` and above to ``stream``.

    Replaces (and closes) every handler on the root logger, so calling it again just
    changes the set-up.

    Args:
        level: the root logger's level, e.g. ``logging.INFO``.
        fmt: ``"text"`` (:data:`TEXT_FORMAT`), ``"journald"`` (:class:`JournaldFormatter`)
            or ``"auto"``: journald when ``JOURNAL_STREAM`` names ``stream``'s file,
            else text.
        stream: where to write; ``sys.stderr`` (as it is at the call) when None.

    Returns:
        The format chosen, ``"text"`` or ``"journald"``.

    Raises:
        ConfigError: ``fmt`` is none of the three.
    """
    if fmt not in ("auto", "text", "journald"):
        raise ConfigError(f"unknown log format {fmt!r}; known: auto, text, journald")
    out = sys.stderr if stream is None else stream
    chosen = fmt if fmt != "auto" else ("journald" if stream_is_journal(out) else "text")
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        JournaldFormatter() if chosen == "journald" else logging.Formatter(TEXT_FORMAT)
    )
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level)
    return chosen
