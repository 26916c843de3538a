"""The paper studies' table: a run is measured against FedAvg's final AMP of its own seed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks.paper_studies import report_path, table


def _report(seed: int, curve: list[float]) -> dict[str, object]:
    rounds = [
        {
            "models": {m: {"amp": amp, "fm": 0.0, "wlp": amp} for m in ("aca", "oca")},
            "device_train_s": 1.0,
        }
        for amp in curve
    ]
    final = {"rounds": len(curve), "bytes_up": 1e6, "bytes_down": 1e6, "wall_s": 1.0}
    return {"config": {"seed": seed}, "rounds": rounds, "final": final}


def test_a_run_with_fewer_seeds_is_compared_with_its_own_seed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fedavg = {0: [10.0, 20.0, 30.0], 2: [10.0, 20.0, 50.0]}
    for seed, curve in fedavg.items():
        report_path(tmp_path, "emnist-fedavg", seed).write_text(json.dumps(_report(seed, curve)))
    # only seed 2 of the published run: it reaches seed 0's 30 at round 1, seed 2's 50 at 3
    published = _report(2, [40.0, 45.0, 55.0])
    report_path(tmp_path, "emnist-fedkf-paper-dual", 2).write_text(json.dumps(published))

    table(argparse.Namespace(out=tmp_path, plots=None))

    row = next(line for line in capsys.readouterr().out.splitlines() if "published (ACA)" in line)
    assert row.split("|")[6].strip() == "3"
