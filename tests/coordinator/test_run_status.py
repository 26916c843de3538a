"""The status file: what ``python -m coordinator`` writes to ``STATE_DIR/status.json`` at
each round transition (the benchmarks read it instead of the log)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, cast

from coordinator.actions import AggregateRequested, Finished, RoundClosed, RoundStarted
from coordinator.runtime import RunStatus
from tests.coordinator.helpers import config


def closed(round_number: int, on_time: int, duration_s: float = 1.5) -> RoundClosed:
    return RoundClosed(
        round=round_number, selected=3, on_time=on_time, late=1, rejected=0,
        duration_s=duration_s, models={}, aggregate_s=0.25,
    )  # fmt: skip


def read(path: Path) -> dict[str, Any]:
    return cast(dict[str, Any], json.loads(path.read_text()))


def test_each_round_transition_rewrites_the_file(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    status = RunStatus(path, config(rounds=2), resume=False)
    starting = read(path)

    status(RoundStarted(1, ("dev-0", "dev-1", "dev-2")))
    training = read(path)
    status(AggregateRequested(job=cast(Any, None)))
    aggregating = read(path)
    status(closed(1, on_time=2))
    status(Finished(models={}))
    status.exited(123.4)
    done = read(path)

    assert starting["phase"] == "starting" and starting["pid"] == os.getpid()
    assert (starting["rounds"], starting["started"], starting["closed"]) == (2, {}, {})
    assert training["phase"] == "training" and training["round"] == 1
    assert training["started"]["1"]["selected"] == 3
    assert aggregating["phase"] == "aggregating"
    assert done["phase"] == "finished" and done["peak_rss_mb"] == 123.4
    assert done["closed"] == {
        "1": {"duration_s": 1.5, "on_time": 2, "selected": 3, "late": 1, "rejected": 0,
              "server_step_s": 0.25},
    }  # fmt: skip
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]  # no temporary left


def test_a_resumed_run_keeps_the_earlier_rounds_and_a_round_closed_again_replaces_its_entry(
    tmp_path: Path,
) -> None:
    path = tmp_path / "status.json"
    first = RunStatus(path, config(rounds=3), resume=False)
    first(RoundStarted(1, ("dev-0",)))
    first(closed(1, on_time=1))
    first(RoundStarted(2, ("dev-0",)))
    first(closed(2, on_time=0))  # killed after the close, before its commit

    second = RunStatus(path, config(rounds=3), resume=True)
    resumed = read(path)
    second(closed(2, on_time=1, duration_s=2.0))
    second.exited(50.0)
    stopped = read(path)

    assert resumed["phase"] == "starting" and resumed["round"] == 2
    assert set(resumed["started"]) == set(resumed["closed"]) == {"1", "2"}
    assert stopped["closed"]["2"]["on_time"] == 1 and stopped["closed"]["2"]["duration_s"] == 2.0
    assert stopped["phase"] == "stopped"  # exited before the end


def test_a_fresh_run_starts_a_fresh_file(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    RunStatus(path, config(), resume=False)(RoundStarted(1, ("dev-0",)))

    RunStatus(path, config(), resume=False)

    assert read(path)["started"] == {} and read(path)["round"] == 0
