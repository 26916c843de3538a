"""benchmarks/load.py on a tiny fleet: a coordinator process and ``python -m sim devices``
against a private Mosquitto lose no acknowledged update, complete every round, and report
positive memory and throughput figures as JSON numbers (issue 17)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.load import LoadConfig, ok, run_benchmark, table
from tests.protocol.brokers import require_mosquitto

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow]


def _numbers(record: dict[str, object], names: list[str]) -> None:
    for name in names:
        value = record[name]
        assert isinstance(value, (int, float)) and not isinstance(value, bool), name


def test_tiny_load_run_loses_nothing_and_reports_numbers(tmp_path: Path) -> None:
    require_mosquitto()
    a = LoadConfig(devices=10, per_round=3, rounds=2, local_steps=1, connections=4)
    b = LoadConfig(
        per_round=3, rounds=1, model="fedgen_cnn", precision="fp32", local_steps=1,
        image_size=8, samples_per_device=20, connections=4,
    )  # fmt: skip

    result = json.loads(json.dumps(run_benchmark(a, [12], b, tmp_path)))

    assert ok(result), result
    run = result["a"]
    assert run["finished"] and run["problems"] == []
    assert run["rounds_completed"] == 2
    assert run["lost"] == 0 and run["twice"] == 0
    assert run["updates_acknowledged"] == run["updates_aggregated"] == 2 * 3
    rounds = run["per_round_figures"]
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(r["selected"] == r["aggregated"] == r["acknowledged"] == 3 for r in rounds)
    assert all(r["wall_s"] > 0 and r["devices_s"] > 0 for r in rounds)
    assert all(r["overhead_s"] == pytest.approx(r["wall_s"] - r["devices_s"]) for r in rounds)
    _numbers(run, ["coordinator_peak_rss_mb", "devices_peak_rss_mb", "broker_messages_per_s",
                   "broker_mb_per_s", "overhead_s_mean", "lost", "twice"])  # fmt: skip
    assert run["coordinator_peak_rss_mb"] > 0 and run["devices_peak_rss_mb"] > 0
    # per round at least each selected device's task, model, update and ack
    assert run["broker_messages"] >= 2 * 3 * 4 and run["broker_mb_per_s"] > 0
    point = result["b"]["points"][0]
    assert point["devices"] == 12 and point["rounds_completed"] == 1
    assert point["lost"] == 0 and point["twice"] == 0
    _numbers(point, ["coordinator_peak_rss_mb"])
    assert point["coordinator_peak_rss_mb"] > 0
    assert result["b"]["model_parameters"] == 3350
    assert "| A lost | 0 |" in table(result)
