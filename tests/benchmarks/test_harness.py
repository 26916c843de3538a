"""benchmarks/harness.py reads the status file the coordinator writes (no broker needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.harness import RoundClose, Status, wait_status
from coordinator.actions import RoundClosed, RoundStarted
from coordinator.runtime import STATUS_FILE, RunStatus
from tests.coordinator.helpers import config


def test_the_status_the_coordinator_writes_reads_back(tmp_path: Path) -> None:
    status = RunStatus(tmp_path / STATUS_FILE, config(rounds=2), resume=False)
    status(RoundStarted(1, ("dev-0", "dev-1")))
    status(RoundClosed(1, 2, 1, 1, 0, 3.5, {}, aggregate_s=0.5))
    status.exited(99.0)

    read = Status.read(tmp_path)

    assert read is not None
    assert (read.phase, read.selected, read.peak_rss_mb) == ("stopped", {1: 2}, 99.0)
    assert read.closed == {1: RoundClose(3.5, 1, 2, 1, 0, 0.5)}
    assert list(read.started_at) == [1]


def test_no_status_before_the_coordinator_wrote_one(tmp_path: Path) -> None:
    assert Status.read(tmp_path) is None


def test_a_status_of_another_process_is_not_waited_for(tmp_path: Path) -> None:
    RunStatus(tmp_path / STATUS_FILE, config(), resume=False)  # this process's pid
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()

    assert wait_status(tmp_path, child, lambda _: True, timeout=5) is None
