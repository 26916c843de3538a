"""benchmarks/faults.py on a small run: the coordinator SIGKILLed three times and resumed
loses no acknowledged update, counts none twice, and ends bit-identical to a run without
kills (issue 17)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.fault_scenarios import ScenarioReport
from benchmarks.faults import FaultConfig, FaultReport, markdown, run_benchmark, summary
from tests.protocol.brokers import require_mosquitto


@pytest.mark.mosquitto
@pytest.mark.slow
def test_coordinator_killed_three_times_resumes_to_the_reference_models(tmp_path: Path) -> None:
    require_mosquitto()
    # rounds of this size take a few tenths of a second: six of them, and kills at most
    # half a second after each coordinator's first status, leave every kill a run to hit
    cfg = FaultConfig(devices=2, rounds=6, kills=3, seed=1, kill_after=(0.05, 0.5))

    report = run_benchmark(cfg, tmp_path)

    assert report.finished, report.problems
    assert report.kills == 3 and report.restarts == 3
    assert report.rounds_completed == cfg.rounds
    assert report.lost == 0 and report.twice == 0
    assert report.identical_to_reference
    assert report.updates_acknowledged == cfg.devices * cfg.rounds
    events = [json.loads(line) for line in (tmp_path / "faults" / "events.jsonl").open()]
    assert sum(1 for e in events if e["accepted"] and e["update_round"] is not None) >= 12
    table = markdown(report).splitlines()
    row = dict(zip(cells(table[0]), cells(table[2]), strict=True))
    assert row["faults injected"] == "coordinator_kill 3"
    assert row["lost"] == row["twice"] == row["delayed"] == "0"


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def test_the_table_adds_up_the_scenarios() -> None:
    kills = FaultReport(devices=2, rounds=4, kills=3, broker_restarts=1, rounds_completed=4)
    kills.updates_tried, kills.lost, kills.finished = 9, 1, True
    cut = ScenarioReport("cut_upload", faults={"cut_upload": 1}, rounds_completed=2, delayed=2)
    churn = ScenarioReport("churn", faults={"silent": 8, "join": 1}, updates_tried=20)
    churn.twice, churn.finished, cut.finished = 1, True, True

    totals = summary(kills, [cut, churn])
    table = markdown(kills, [cut, churn]).splitlines()

    assert totals["faults"] == {
        "coordinator_kill": 3, "broker_restart": 1, "cut_upload": 1, "silent": 8, "join": 1,
    }  # fmt: skip
    assert (totals["rounds_completed"], totals["updates_tried"]) == (6, 29)
    assert (totals["lost"], totals["twice"], totals["delayed"]) == (1, 1, 2)
    assert totals["all_finished"]
    rows = [dict(zip(cells(table[0]), cells(line), strict=True)) for line in table[2:]]
    assert [r["run"] for r in rows] == ["coordinator_kill", "cut_upload", "churn", "total"]
    assert rows[-1]["updates_tried"] == "29" and rows[-1]["delayed"] == "2"
    assert rows[2]["faults injected"] == "silent 8, join 1"
