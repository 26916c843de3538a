"""benchmarks/faults.py on a small run: the coordinator SIGKILLed three times and resumed
loses no acknowledged update, counts none twice, and ends bit-identical to a run without
kills (issue 17)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.faults import FaultConfig, markdown, run_benchmark
from tests.protocol.brokers import require_mosquitto

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow]


def test_coordinator_killed_three_times_resumes_to_the_reference_models(tmp_path: Path) -> None:
    require_mosquitto()
    cfg = FaultConfig(devices=2, rounds=4, kills=3, seed=1)

    report = run_benchmark(cfg, tmp_path)

    assert report.finished, report.problems
    assert report.kills == 3 and report.restarts == 3
    assert report.rounds_completed == 4
    assert report.lost == 0 and report.twice == 0
    assert report.identical_to_reference
    assert report.updates_acknowledged == 2 * 4
    events = [json.loads(line) for line in (tmp_path / "faults" / "events.jsonl").open()]
    assert sum(1 for e in events if e["accepted"] and e["update_round"] is not None) >= 8
    assert "| lost | 0 |" in markdown(report)
