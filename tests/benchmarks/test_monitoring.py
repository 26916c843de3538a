"""benchmarks/monitoring.py: it measures a real engine through the real servers."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.monitoring import main, measure


def test_what_the_fleet_sees_does_not_grow_with_it() -> None:
    small, large = measure(20, repeat=1), measure(300, repeat=1)
    assert small["devices"] == 20 and large["devices"] == 300
    assert small["series"] == large["series"] > 20  # no series per device
    assert abs(small["event_bytes"] - large["event_bytes"]) < 200  # no fleet in an event
    assert large["snapshot_s"] > 0 and large["page_s"] > 0 and large["hello_us"] > 0


def test_the_json_rows(tmp_path: Path, capsys: object) -> None:
    out = tmp_path / "rows.json"
    assert main(["--devices", "10", "--repeat", "1", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert set(row) >= {"devices", "snapshot_s", "interval_s", "scrape_s", "series", "page_s"}
