"""benchmarks/abuse.py on a short run: a hostile client fuzzing every topic the
coordinator reads, in every category, gets every message refused (each leaves a log
line), while the honest devices lose no update and end bit-identical to a run without
abuse (issue 17)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.abuse import (
    CATEGORIES,
    DEVICE_SIDE,
    AbuseConfig,
    DeviceLogs,
    markdown,
    run_benchmark,
)
from tests.protocol.brokers import require_mosquitto

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow]


ROUNDS = 60


def test_every_bad_input_is_refused_and_the_honest_run_is_unchanged(tmp_path: Path) -> None:
    require_mosquitto()
    # the attack lasts as long as the honest run: 60 rounds leave room for every
    # category even when the hostile client is slow to get ready (a cold first test)
    cfg = AbuseConfig(devices=2, rounds=ROUNDS, burst=4, seed=3)

    report = run_benchmark(cfg, tmp_path)

    assert report.coordinator_exit == 0, report.problems
    assert report.rounds_completed == report.reference_rounds_completed == ROUNDS
    assert report.lost == 0 and report.honest_accepted == 2 * ROUNDS
    assert report.identical_to_reference
    assert report.honest_transfers_dropped == 0
    assert set(report.categories) == set(CATEGORIES), report.problems
    for name, c in report.categories.items():
        assert c.tried > 0, name
        if name == "chunk_flood":  # at most 4 unfinished transfers held per honest topic
            assert c.rejected + report.held_at_end == c.tried
            assert report.held_at_end <= 4 * cfg.devices
        else:
            assert c.rejected == c.tried, (name, c)
    assert 0 < report.logged < report.rejected  # the first of a kind per source, not all
    bursts = [json.loads(line) for line in (tmp_path / "abuse" / "bursts.jsonl").open()]
    assert {b["category"] for b in bursts} == set(CATEGORIES)
    assert "| lost | 0 |" in markdown(report)


def test_device_side_bursts_count_only_the_lines_written_since_they_began(tmp_path: Path) -> None:
    """A burst the devices refuse is credited with the lines their logs gained since it
    began (a burst cut off by the run's end, counted nowhere, adds none to the next)."""
    logs = DeviceLogs(tmp_path, ["dev-0", "dev-1"])
    needle, combine = DEVICE_SIDE["forged_fleet"]
    line = f"2026-01-01 00:00:00 WARNING edge_client.train.runtime: {needle}: forged\n"
    for device in ("dev-0", "dev-1"):  # an earlier, uncounted burst of 3
        (tmp_path / f"{device}.log").write_text(line * 3)
    before = logs.refusals(needle)
    (tmp_path / "dev-0.log").write_text(line * 5)
    (tmp_path / "dev-1.log").write_text(line * 6 + line.replace("WARNING", "DEBUG"))
    assert logs.wait_for((needle, combine), before, sent=2, timeout_s=5.0) == (2, 2)
    # fewer lines than messages: the wait ends at its timeout with what it saw
    assert logs.wait_for((needle, combine), before, sent=4, timeout_s=0.3) == (2, 2)
    assert logs.wait_for((needle, sum), before, sent=6, timeout_s=5.0) == (6, 5)
