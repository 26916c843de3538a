"""Progress output of the sim's long work: the emulation's rounds and the budget's steps.

The core (:func:`sim.run.run_simulation`, :func:`sim.budget.estimate`) reports what it
does through a :class:`Progress` it is given and never prints; the command lines give it
a :class:`TerminalProgress`:

- on a terminal, a live tqdm bar for the step under way (``round 3/10: devices trained
  4/10``, ``connecting devices 640/1000``), with each finished round printed above it
  as a permanent line;
- elsewhere (a file, a pipe, CI logs) only the permanent lines: one line per round, no
  bar, no carriage returns; a step that runs long (10,000 devices connecting, a round
  whose devices train for minutes) adds a line such as ``connecting devices: 6400/10000
  (60 s)`` or ``round 3/10: devices trained: 2/10, local step 40/94 (20 s)`` every 10 s.

A heartbeat thread keeps both alive while nothing is reported (a batched cohort trains
for a whole round before its devices count as trained): it redraws the bar once a
second, so its clock ticks, and writes the plain line when it is due. Work that knows
more than its unit counts says so with :meth:`TerminalProgress.detail` (the local steps
of the cohort training now), shown after the count.

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
from typing import TYPE_CHECKING, Protocol, TextIO, runtime_checkable

from tqdm import tqdm

from coordinator.report import human_bytes

if TYPE_CHECKING:
    from typing import Never  # Python 3.11+; annotations only

    from coordinator.report import RoundRecord

__all__ = ["Detailed", "Progress", "TerminalProgress", "round_line"]


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


@runtime_checkable
class Detailed(Protocol):
    """A :class:`Progress` that also shows what is under way within the current step."""

    def detail(self, text: str) -> None:
        """``text`` (``local step 40/94``) says how far the current unit of the step
        is; shown until the next step or detail."""


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
        every_s: without a live bar, seconds between two lines of a step under way.
        clock: monotonic seconds.
        heartbeat_s: seconds between two :meth:`tick` calls of the heartbeat thread
            (started with the first step); None: no thread (call :meth:`tick`).
    """

    def __init__(
        self,
        total_rounds: int,
        stream: TextIO | None = None,
        *,
        live: bool | None = None,
        refresh_s: float = 0.1,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        heartbeat_s: float | None = 1.0,
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
        self._detail = ""
        self._heartbeat_s = heartbeat_s
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self, text: str, total: int | None = None) -> None:
        with self._lock:
            self._end_bar()
            self._text, self._total, self._done, self._detail = text, total, 0, ""
            self._started = self._last_line = self._clock()
            self._start_heartbeat()
            if self._live:
                self._bar = tqdm(
                    total=total,
                    desc=text,
                    file=self._stream,
                    unit="" if total is None else " devices",
                    leave=False,
                    mininterval=self._refresh_s,
                    dynamic_ncols=True,
                    bar_format="{desc}: {n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining}{postfix}"
                    if total is not None
                    else "{desc} ({elapsed}){postfix}",
                )

    def advance(self, units: int = 1) -> None:
        with self._lock:
            self._done += units
            if self._bar is not None:
                self._bar.update(units)
            elif not self._live and self._total is not None:
                self._line_if_due()

    def detail(self, text: str) -> None:
        """What is under way within the step (``local step 40/94``): the bar's postfix on
        a terminal (drawn at the next redraw), part of the next plain line elsewhere."""
        with self._lock:
            self._detail = text
            if self._bar is not None:
                self._bar.set_postfix_str(text, refresh=False)

    def tick(self) -> None:
        """The heartbeat (see the module docstring): redraw the live bar, so that its
        clock moves, or write the plain line of the step under way when it is due."""
        with self._lock:
            if self._bar is not None:
                self._bar.refresh()
            elif not self._live and self._text:
                self._line_if_due()

    def _line_if_due(self) -> None:
        now = self._clock()
        if now - self._last_line < self._every_s:
            return
        self._last_line = now
        count = "" if self._total is None else f": {self._done}/{self._total}"
        detail = f", {self._detail}" if self._detail else ""
        self.write(f"{self._text}{count}{detail} ({now - self._started:.0f} s)")

    def _start_heartbeat(self) -> None:
        if self._heartbeat_s is None or self._thread is not None or self._stopped.is_set():
            return
        self._thread = threading.Thread(
            target=self._beat, args=(self._heartbeat_s,), name="progress-heartbeat", daemon=True
        )
        self._thread.start()

    def _beat(self, every_s: float) -> None:
        while not self._stopped.wait(every_s):
            try:
                self.tick()
            except (OSError, ValueError):  # the stream was closed under us
                return

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
        """End the live bar and the heartbeat (idempotent)."""
        self._stopped.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._lock:
            self._end_bar()
            self._text = ""

    def __enter__(self) -> TerminalProgress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
