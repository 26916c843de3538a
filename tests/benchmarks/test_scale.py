"""benchmarks/scale.py on a tiny fleet: the sim and the engine each measured in a process
of its own, one row per transport with both figures, their ratio and peak memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.scale import TARGETS, line, main

pytestmark = pytest.mark.slow


def test_a_tiny_scale_run_writes_one_row_per_transport(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"

    args = ["--devices", "4", "--transports", "inproc", "--samples", "40"]
    code = main([*args, "--coordinator-devices", "20", "--json", str(out)])

    assert code == 0
    result = json.loads(out.read_text())
    (row,) = result["sim"]
    assert row["devices"] == 4 and row["model"] == "lenet5" and row["transport"] == "inproc"
    assert row["warm_rounds"] == 1 and row["first_round_s"] > 0 and row["warm_round_s"] > 0
    assert row["e2e_updates_per_s"] == pytest.approx(4 / row["warm_round_s"], rel=0.01)
    assert row["engine_updates_per_s"] > 0
    assert row["ratio"] == pytest.approx(
        row["e2e_updates_per_s"] / row["engine_updates_per_s"], abs=0.001
    )
    assert row["peak_rss_bytes"] > 0 and row["peak_gpu_bytes"] >= 0
    assert row["device"].startswith(("cpu: ", "cuda: "))
    # each device's model down and its update up every round (compressed fp32 LeNet-5s,
    # 61,706 floats each): more than two bytes a float
    assert row["bytes_down_per_round"] > 4 * 2 * 61_706
    assert row["bytes_up_per_round"] > 4 * 2 * 61_706
    (coordinator,) = result["coordinator"]
    assert coordinator["devices"] == 20 and coordinator["us_per_update"] > 0
    assert f"{TARGETS['inproc']}x target" in line(row)
