"""Run report: JSON shape and round trip, CSV, plots, progress bar and byte formatting."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import pytest

from coordinator.errors import CoordinatorError
from coordinator.evaluation import ModelMetrics
from coordinator.report import (
    ReportError,
    RoundRecord,
    RunReport,
    accuracy_figure,
    human_bytes,
    traffic_figure,
    write_csv,
    write_plots,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ROUND_KEYS = {
    "round",
    "wall_s",
    "active_devices",
    "bytes_up",
    "bytes_down",
    "wire_bytes_up",
    "wire_bytes_down",
    "device_train_s",
    "aggregate_s",
    "closed_s",
    "models",
    "server_metrics",
}
METRIC_KEYS = {"amp", "fm", "wlp", "best", "global_acc"}


def make_report() -> RunReport:
    """Three rounds; ``oca`` appears from round 2 and has no global accuracy."""
    rounds = [
        RoundRecord(
            1, 2.5, 10, 1000, 4000, 1100, 4200, {"aca": ModelMetrics(40.0, 90.0, 20.0, 41.5)}
        ),
        RoundRecord(
            2,
            1.5,
            8,
            2000,
            8000,
            2100,
            8300,
            {
                "aca": ModelMetrics(60.0, 50.0, 35.0, 61.0),
                "oca": ModelMetrics(58.0, 40.0, 30.0, None),
            },
        ),
        RoundRecord(
            3,
            2.0,
            9,
            1500,
            8000,
            1600,
            8300,
            {
                "aca": ModelMetrics(81.25, 12.5, 70.0, 80.5),
                "oca": ModelMetrics(80.0, 10.0, 65.0, None),
            },
        ),
    ]
    config = {"devices": 10, "strategy": "fedkf", "precision": "int8", "rounds": 3}
    return RunReport(config=config, rounds=rounds, final={"model": "oca", "amp": 80.0})


# --------------------------------------------------------------------------- JSON


def test_json_dict_has_exactly_the_required_keys() -> None:
    data = make_report().to_json_dict()

    assert set(data) == {"config", "rounds", "final"}
    assert data["config"]["strategy"] == "fedkf"
    assert data["final"] == {"model": "oca", "amp": 80.0}
    assert [r["round"] for r in data["rounds"]] == [1, 2, 3]
    for record in data["rounds"]:
        assert set(record) == ROUND_KEYS
        for metrics in record["models"].values():
            assert set(metrics) == METRIC_KEYS
    assert data["rounds"][1]["models"]["oca"] == {
        "amp": 58.0,
        "fm": 40.0,
        "wlp": 30.0,
        "best": None,
        "global_acc": None,
    }
    assert data["rounds"][0]["bytes_down"] == 4000


def test_json_round_trips() -> None:
    report = make_report()
    data = report.to_json_dict()

    text = json.dumps(data)

    assert json.loads(text) == data
    assert '"global_acc": null' in text
    assert RunReport.from_json_dict(json.loads(text)) == report


def test_write_json_is_atomic_and_creates_parents(tmp_path: Path) -> None:
    report = make_report()
    path = tmp_path / "out" / "run1" / "report.json"

    written = report.write_json(path)

    assert written == path
    assert json.loads(path.read_text("utf-8")) == report.to_json_dict()
    assert [p.name for p in path.parent.iterdir()] == ["report.json"]  # no temp file left
    report.write_json(path)  # overwrites
    assert json.loads(path.read_text("utf-8")) == report.to_json_dict()


def test_write_json_rejects_non_json_values_without_writing(tmp_path: Path) -> None:
    path = tmp_path / "report.json"

    with pytest.raises(ReportError, match="not JSON"):
        RunReport(config={}, final={"amp": math.nan}).write_json(path)
    with pytest.raises(ReportError, match="not JSON"):
        RunReport(config={"out": tmp_path}).write_json(path)
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


def test_write_json_converts_os_errors(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")

    with pytest.raises(ReportError, match="cannot write") as caught:
        make_report().write_json(blocker / "report.json")
    assert isinstance(caught.value, CoordinatorError)
    assert isinstance(caught.value.__cause__, OSError)


def test_from_json_dict_rejects_malformed_data() -> None:
    data = make_report().to_json_dict()
    del data["rounds"][0]["models"]["aca"]["fm"]

    with pytest.raises(ReportError, match="malformed"):
        RunReport.from_json_dict(data)


def test_a_report_of_an_earlier_version_reads_without_the_newer_round_fields() -> None:
    data = make_report().to_json_dict()
    for record in data["rounds"]:
        del record["device_train_s"], record["aggregate_s"], record["closed_s"]

    rounds = RunReport.from_json_dict(data).rounds

    assert [(r.device_train_s, r.aggregate_s, r.closed_s) for r in rounds] == [
        (None, 0.0, None)
    ] * 3


# ---------------------------------------------------------------------------- CSV


def test_csv_columns_and_values(tmp_path: Path) -> None:
    path = write_csv(make_report(), tmp_path / "csv")

    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        header = reader.fieldnames
        rows = list(reader)

    assert path.name == "rounds.csv"
    assert header == [
        "round",
        "wall_s",
        "active_devices",
        "bytes_up",
        "bytes_down",
        "wire_bytes_up",
        "wire_bytes_down",
        "device_train_s",
        "aggregate_s",
        "closed_s",
        "aca_amp",
        "aca_fm",
        "aca_wlp",
        "aca_best",
        "aca_global_acc",
        "oca_amp",
        "oca_fm",
        "oca_wlp",
        "oca_best",
        "oca_global_acc",
    ]
    assert len(rows) == 3
    assert [int(r["round"]) for r in rows] == [1, 2, 3]
    assert float(rows[0]["wall_s"]) == 2.5
    assert int(rows[1]["wire_bytes_down"]) == 8300
    assert float(rows[2]["aca_amp"]) == 81.25
    assert float(rows[2]["aca_global_acc"]) == 80.5
    assert float(rows[1]["oca_fm"]) == 40.0
    assert rows[0]["oca_amp"] == ""  # oca absent in round 1
    assert rows[2]["oca_global_acc"] == ""  # no global test set for oca


def test_csv_of_empty_report_has_only_round_columns(tmp_path: Path) -> None:
    path = write_csv(RunReport(config={}), tmp_path)

    assert path.read_text("utf-8") == (
        "round,wall_s,active_devices,bytes_up,bytes_down,wire_bytes_up,wire_bytes_down,"
        "device_train_s,aggregate_s,closed_s\n"
    )


# -------------------------------------------------------------------------- plots


def test_plots_are_png_files(tmp_path: Path) -> None:
    accuracy, traffic = write_plots(make_report(), tmp_path / "plots")

    assert accuracy == tmp_path / "plots" / "accuracy.png"
    assert traffic == tmp_path / "plots" / "bytes.png"
    for path in (accuracy, traffic):
        assert path.read_bytes()[:8] == PNG_SIGNATURE
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["accuracy.png", "bytes.png"]


def test_traffic_plot_shows_what_each_round_cost_up_and_down() -> None:
    report = make_report()

    figure = traffic_figure(report)

    axes = figure.axes[0]
    heights = sorted(round(p.get_height() * 1e6) for p in axes.patches)
    per_round = sorted([r.bytes_up for r in report.rounds] + [r.bytes_down for r in report.rounds])
    assert heights == per_round  # one bar per round and direction, not a running total
    wire = sorted(round(v * 1e6) for line in axes.get_lines() for v in line.get_ydata())
    assert wire == sorted(
        [r.wire_bytes_up for r in report.rounds] + [r.wire_bytes_down for r in report.rounds]
    )


def test_each_plot_names_its_run_and_keeps_its_legend_off_the_data() -> None:
    report = make_report()
    report.config |= {"model": "lenet5", "dataset": "mnist", "alpha": 0.1}
    report.config |= {"downlink_precision": "fp32", "uplink_precision": "int8"}

    for figure in (traffic_figure(report), accuracy_figure(report)):
        figure.canvas.draw()
        title = figure.get_suptitle()
        assert (
            title == "fedkf on lenet5, mnist (alpha=0.1), 10 devices, fp32 down / int8 up, 3 rounds"
        )
        axes = figure.axes[0]
        legend = axes.get_legend()
        assert legend is not None
        renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
        below = legend.get_window_extent(renderer).y1 <= axes.get_window_extent(renderer).y0
        assert below  # under the axes: it covers no bar and no line


def test_accuracy_plot_has_chance_level_and_the_device_spread() -> None:
    report = make_report()
    for record in report.rounds:
        for name, m in record.models.items():
            record.models[name] = ModelMetrics(m.amp, m.fm, m.wlp, m.global_acc, m.amp + 10)
    report.final["num_classes"] = 10

    axes = accuracy_figure(report).axes[0]

    labels = [line.get_label() for line in axes.get_lines()]
    assert "chance" in labels
    chance = axes.get_lines()[labels.index("chance")]
    assert list(chance.get_ydata()) == [10.0, 10.0]
    spreads = [c for c in axes.collections if "worst to best" in str(c.get_label())]
    assert len(spreads) == 2  # aca and oca
    aca = spreads[0].get_paths()[0].vertices[:, 1]
    assert aca.min() == 20.0 and aca.max() == 91.25  # round 1 WLP to round 3 best


def test_plots_of_a_report_without_rounds(tmp_path: Path) -> None:
    accuracy, traffic = write_plots(RunReport(config={}), tmp_path)

    assert accuracy.read_bytes()[:8] == PNG_SIGNATURE
    assert traffic.read_bytes()[:8] == PNG_SIGNATURE


def test_plots_without_matplotlib_raise_report_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (
        "matplotlib",
        "matplotlib.figure",
        "matplotlib.backends",
        "matplotlib.backends.backend_agg",
    ):
        monkeypatch.setitem(sys.modules, name, None)

    with pytest.raises(ReportError, match=r'pip install "edgefl\[report\]"'):
        write_plots(make_report(), tmp_path)
    assert list(tmp_path.iterdir()) == []


# -------------------------------------------------------------------- human_bytes


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (999, "999 B"),
        (1000, "1.0 kB"),
        (1536, "1.5 kB"),
        (999_949, "999.9 kB"),
        (999_999, "1.0 MB"),
        (12_345_678, "12.3 MB"),
        (2_000_000_000, "2.0 GB"),
        (5 * 10**12, "5.0 TB"),
        (10**18, "1000.0 PB"),
    ],
)
def test_human_bytes(n: int, text: str) -> None:
    assert human_bytes(n) == text


def test_human_bytes_rejects_negative() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        human_bytes(-1)
