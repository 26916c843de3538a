"""sim.progress's heartbeat: plain lines while a long step runs, a live bar whose clock
ticks, and the budget command's progress in a pipe."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from pathlib import Path

from sim.progress import Detailed, TerminalProgress


class TTYStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_pipe_gets_a_line_every_so_often_while_nothing_is_reported() -> None:
    stream = io.StringIO()
    now = [0.0]

    with TerminalProgress(
        10, stream=stream, every_s=10, clock=lambda: now[0], heartbeat_s=None
    ) as progress:
        progress.step("round 3/10: devices trained", total=3)
        now[0] = 5.0
        progress.tick()  # not due yet
        now[0] = 10.0
        progress.tick()
        progress.detail("local step 40/94")
        progress.advance()
        now[0] = 20.0
        progress.tick()
        progress.step("loading synthetic")  # a step without a count
        now[0] = 31.0
        progress.tick()

    assert stream.getvalue().splitlines() == [
        "round 3/10: devices trained: 0/3 (10 s)",
        "round 3/10: devices trained: 1/3, local step 40/94 (20 s)",
        "loading synthetic (11 s)",
    ]


def test_the_heartbeat_thread_writes_the_lines_and_stops_with_close() -> None:
    stream = io.StringIO()

    with TerminalProgress(1, stream=stream, every_s=0, heartbeat_s=0.01) as progress:
        progress.step("round 1/1: devices trained", total=2)
        deadline = time.monotonic() + 5
        while "devices trained: 0/2" not in stream.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
    written = stream.getvalue()
    time.sleep(0.05)

    assert "round 1/1: devices trained: 0/2 (" in written
    assert stream.getvalue().count("\n") <= written.count("\n") + 1  # stopped (one in flight)
    assert "\r" not in written


def test_the_live_bar_is_redrawn_by_the_heartbeat_with_the_detail() -> None:
    stream = TTYStream()

    with TerminalProgress(1, stream=stream, refresh_s=0, heartbeat_s=None) as progress:
        assert isinstance(progress, Detailed)
        progress.step("round 1/1: devices trained", total=4)
        before = stream.getvalue()
        progress.detail("local step 7/20")  # drawn at the next redraw
        assert stream.getvalue() == before
        progress.tick()
        drawn = stream.getvalue()

    assert len(drawn) > len(before)
    assert "round 1/1: devices trained: 0/4" in drawn and "local step 7/20" in drawn


def test_the_budget_reports_its_progress_in_a_pipe() -> None:
    command = [
        sys.executable,
        *("-m", "sim", "budget", "--devices", "2", "--rounds", "2", "--participation", "1"),
        *("--local-steps", "2", "--batch-size", "8", "--progress-every", "0"),
    ]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )

    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert "\r" not in done.stderr
    assert any(line.startswith("budget: building the devices: ") for line in lines)
    round_2 = [line for line in lines if line.startswith("budget: round 2/2 (2/4 device-rounds")]
    assert round_2 and any("devices trained: 2/2" in line for line in round_2), lines
    assert "whole run" in done.stdout
