"""Progress output of the sim's long work: the emulation's rounds and the budget's steps.

The core (:func:`sim.run.run_simulation`, :func:`sim.budget.estimate`) reports what it
does through a :class:`Progress` it is given and never prints; the command lines give it
a :class:`TerminalProgress`:

- on a terminal, a live tqdm bar for the step under way (``round 3/10: devices trained
  4/10``, ``connecting devices 640/1000``), with each finished round printed above it
  as a permanent line;
- elsewhere (a file, a pipe, CI logs) only the permanent lines: one line per round, no
  bar, no carriage returns; a counted step that runs long (10,000 devices connecting)
  adds a line such as ``connecting devices: 6400/10000 (60 s)`` every 30 s.

A round's line reads ``round 5/10 | AMP aca 81.2% oca 80.9% | up 1.2 MB down 3.4 MB |
2.31 s/round``: AMP per global model after the round, payload bytes sent so far in each
direction, and the mean wall time per round so far.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, TextIO

from tqdm import tqdm

from sim.report import human_bytes

if TYPE_CHECKING:
    from typing import Never  # Python 3.11+; annotations only

    from sim.report import RoundRecord

__all__ = ["Progress", "TerminalProgress", "round_line"]


class Progress(Protocol):
    """What long-running sim work reports as it goes (see the module docstring).

    It is told things from several threads (the coordinator's, the fleet's, the round
    evaluator's): an implementation is thread-safe."""

    def step(self, text: str, total: int | None = None) -> None:
        """A new step begins: ``text`` says what it does, ``total`` counts its units
        (devices, rounds) where it has any."""

    def advance(self, units: int = 1) -> None:
        """``units`` more units of the current step are done."""

    def round_closed(self, record: RoundRecord) -> None:
        """A round of the emulation closed and was measured."""


def round_line(record: RoundRecord, total_rounds: int, up: int, down: int, wall_s: float) -> str:
    """One round's permanent line; ``up`` / ``down``: payload bytes so far, ``wall_s``:
    the mean seconds per round so far."""
    parts = [f"round {record.round}/{total_rounds}"]
    if record.models:
        amps = " ".join(f"{name} {m.amp:.1f}%" for name, m in record.models.items())
        parts.append(f"AMP {amps}")
    parts.append(f"up {human_bytes(up)} down {human_bytes(down)}")
    if record.aggregate_s >= 0.1:  # a server step worth naming (distillation, generator)
        parts.append(f"server step {record.aggregate_s:.1f} s")
    parts.append(f"{wall_s:.2f} s/round")
    return " | ".join(parts)


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class TerminalProgress:
    """:class:`Progress` on ``stream`` (stderr by default): tqdm bars on a terminal, one
    line per round elsewhere. A context manager; :meth:`close` ends the live bar.

    Args:
        total_rounds: rounds the run will do (for the round lines).
        stream: where to write; ``sys.stderr`` (looked up now) when None.
        live: draw live bars; None: only when ``stream`` is a terminal.
        refresh_s: least seconds between two redraws of a live bar.
        every_s: without a live bar, seconds between two lines of a counted step.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        total_rounds: int,
        stream: TextIO | None = None,
        *,
        live: bool | None = None,
        refresh_s: float = 0.1,
        every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._refresh_s = refresh_s
        self._every_s = every_s
        self._clock = clock
        self._text = ""
        self._total: int | None = None
        self._done = 0
        self._started = self._last_line = 0.0
        self._total_rounds = total_rounds
        self._stream = stream if stream is not None else sys.stderr
        self._live = _isatty(self._stream) if live is None else live
        self._bar: tqdm[Never] | None = None
        self._up = self._down = 0
        self._rounds = 0
        self._wall_s = 0.0
        self._lock = threading.RLock()

    def step(self, text: str, total: int | None = None) -> None:
        with self._lock:
            self._end_bar()
            self._text, self._total, self._done = text, total, 0
            self._started = self._last_line = self._clock()
            if self._live:
                self._bar = tqdm(
                    total=total,
                    desc=text,
                    file=self._stream,
                    unit="" if total is None else " devices",
                    leave=False,
                    mininterval=self._refresh_s,
                    dynamic_ncols=True,
                    bar_format="{desc}: {n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining}"
                    if total is not None
                    else "{desc} ({elapsed})",
                )

    def advance(self, units: int = 1) -> None:
        with self._lock:
            self._done += units
            if self._bar is not None:
                self._bar.update(units)
            elif not self._live and self._total is not None:
                now = self._clock()
                if now - self._last_line >= self._every_s:
                    self._last_line = now
                    elapsed = now - self._started
                    self.write(f"{self._text}: {self._done}/{self._total} ({elapsed:.0f} s)")

    def round_closed(self, record: RoundRecord) -> None:
        with self._lock:
            self._up += record.bytes_up
            self._down += record.bytes_down
            self._rounds += 1
            self._wall_s += record.wall_s
            mean = self._wall_s / self._rounds
            self.write(round_line(record, self._total_rounds, self._up, self._down, mean))

    @property
    def rounds_closed(self) -> int:
        """Rounds reported so far through :meth:`round_closed`."""
        with self._lock:
            return self._rounds

    def write(self, line: str) -> None:
        """A permanent line (above the live bar on a terminal)."""
        with self._lock:
            if self._live:
                tqdm.write(line, file=self._stream)
            else:
                self._stream.write(line + "\n")
            self._stream.flush()

    def _end_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        """End the live bar (idempotent)."""
        with self._lock:
            self._end_bar()

    def __enter__(self) -> TerminalProgress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
