"""The coordinator's run report (coordinator/recording.py): records from its transport's
counters, the held-out evaluation off the engine thread, what a stopped run writes, and
the checks made before a run starts; the held-out file's reader."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.actions import Finished, RoundClosed, RoundStarted
from coordinator.config import CoordinatorConfig
from coordinator.errors import ConfigError
from coordinator.evaluation import evaluate_accuracy, read_eval_data
from coordinator.recording import HeldOut, RunRecorder, check_outputs
from coordinator.runtime import build_models
from models import load_state_arrays, state_arrays
from protocol.transport import TrafficStats
from tests.coordinator.helpers import GROUP, config


def held_out(samples: int = 64) -> HeldOut:
    rng = np.random.default_rng(0)
    return rng.random((samples, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, samples)


def closed(round_number: int, models: dict[str, Any], on_time: int = 2) -> RoundClosed:
    return RoundClosed(
        round=round_number,
        selected=on_time,
        on_time=on_time,
        late=0,
        rejected=0,
        duration_s=0.5,
        models={GROUP: models},
        device_train_s=0.25,
        aggregate_s=0.125,
    )


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_round_is_recorded_with_its_bytes_and_held_out_accuracy() -> None:
    cfg = config()
    traffic, clock, data = TrafficStats(), Clock(), held_out()
    told: list[tuple[int, dict[str, dict[str, float]], str]] = []
    recorder = RunRecorder(
        cfg,
        traffic,
        scratch=build_models(cfg),
        held_out=data,
        evaluated=lambda r, m: told.append((r, m, threading.current_thread().name)),
        clock=clock,
    )
    model = build_models(cfg)[GROUP]
    traffic.record("in", "fl/t/from/dev-0/hello", 100, 120)  # start-up: counted in round 1
    for round_number in (1, 2):
        clock.now += 1.0
        recorder(RoundStarted(round_number, ("dev-0", "dev-1")))
        traffic.record("in", "fl/t/from/dev-0/update", 1000, 1010)
        traffic.record("out", "fl/t/to/dev-0/model", 2000, 2020)
        clock.now += 2.0
        recorder(closed(round_number, {"aca": state_arrays(model)}))
    recorder(Finished({GROUP: {"aca": state_arrays(model)}}))
    traffic.record("out", "fl/t/coordinator/status", 10, 30)  # shutdown: in the totals only

    recorder.finish()
    report = recorder.report(interrupted=False)

    assert recorder.finished
    first, second = report.rounds
    assert (first.bytes_up, first.wire_bytes_up, first.bytes_down) == (1100, 1130, 2000)
    assert (second.bytes_up, second.bytes_down, second.wire_bytes_down) == (1000, 2000, 2020)
    assert (second.wall_s, second.active_devices, second.closed_s) == (2.0, 2, 6.0)
    assert (second.device_train_s, second.aggregate_s) == (0.25, 0.125)
    expected = 100 * evaluate_accuracy(model, *data)
    metrics = second.models["aca"]
    assert metrics.global_acc == pytest.approx(expected)
    assert metrics.amp == metrics.wlp == metrics.best == metrics.global_acc and metrics.fm == 0
    assert [(r, sorted(m["aca"])) for r, m, _ in told] == [
        (1, ["amp", "best", "fm", "global_acc", "wlp"]),
        (2, ["amp", "best", "fm", "global_acc", "wlp"]),
    ]
    assert all(thread.startswith("coordinator-eval") for _, _, thread in told)
    final = report.final
    assert (final["bytes_up"], final["bytes_down"], final["wire_bytes_down"]) == (2100, 4010, 4070)
    assert final["rounds"] == 2 and final["interrupted"] is False
    assert final["models"]["aca"]["global_acc"] == pytest.approx(expected)


def test_the_report_leaves_the_broker_password_out() -> None:
    cfg = config(broker={"url": "mqtt://localhost:1883", "password": "hunter2"})

    report = RunRecorder(cfg, TrafficStats()).report(interrupted=False)

    assert report.config["broker"]["url"] == "mqtt://localhost:1883"
    assert "password" not in report.config["broker"] and "hunter2" not in json.dumps(report.config)


def test_without_held_out_data_the_rounds_have_no_models() -> None:
    recorder = RunRecorder(config(), TrafficStats())

    recorder(closed(1, {"aca": {}}))
    recorder.finish()

    (record,) = recorder.records
    assert record.models == {} and record.round == 1


def test_a_failed_evaluation_is_logged_and_the_round_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = config()
    recorder = RunRecorder(cfg, TrafficStats(), scratch=build_models(cfg), held_out=held_out())
    caplog.set_level(logging.WARNING, logger="coordinator.recording")

    recorder(closed(1, {"aca": {"nonsense": np.zeros(3, np.float32)}}))
    recorder.finish()

    (record,) = recorder.records
    assert record.models == {}
    assert any("round 1: evaluation failed" in r.getMessage() for r in caplog.records)


def test_a_stopped_run_writes_its_finished_rounds_with_their_byte_sums(tmp_path: Path) -> None:
    cfg = config(json_out=tmp_path / "run.json", report_dir=tmp_path / "report")
    traffic = TrafficStats()
    recorder = RunRecorder(cfg, traffic)
    traffic.record("in", "fl/t/from/dev-0/update", 500, 520)
    recorder(closed(1, {}))
    traffic.record("in", "fl/t/from/dev-0/update", 999, 1000)  # a round that never closed

    recorder.finish()
    paths = recorder.write(interrupted=True)

    assert tmp_path / "run.json" in paths and tmp_path / "report" / "rounds.csv" in paths
    data = json.loads((tmp_path / "run.json").read_text())
    assert data["final"]["interrupted"] is True and data["final"]["bytes_up"] == 500
    assert len(data["rounds"]) == 1 and data["config"]["json_out"] == str(tmp_path / "run.json")


def test_a_run_stopped_before_its_first_round_writes_nothing(tmp_path: Path) -> None:
    cfg = config(json_out=tmp_path / "run.json")
    recorder = RunRecorder(cfg, TrafficStats())
    recorder.finish()

    assert recorder.write(interrupted=True) == [] and not (tmp_path / "run.json").exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"json_out": "afile/run.json"}, "afile is a file, not a folder"),
        ({"report_dir": "afile"}, "--report-dir afile: is a file, not a folder"),
        ({"json_out": "state", "state_dir": "state"}, "--json-out and --state-dir name the same"),
        ({"eval_data": "missing.npz"}, "--eval-data missing.npz: no such file"),
        ({"eval_data": "afile", "sharing": "head"}, "--eval-data needs sharing full"),
    ],
)
def test_check_outputs_refuses_what_the_run_could_not_do(
    overrides: dict[str, Any], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    cfg = CoordinatorConfig.model_validate({**config().model_dump(), **overrides})

    with pytest.raises(ConfigError, match=message):
        check_outputs(cfg)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing created


def test_check_outputs_reads_the_held_out_data(tmp_path: Path) -> None:
    path = tmp_path / "held-out.npz"
    x, y = held_out(8)
    np.savez(path, x=x, y=y)

    data = check_outputs(config(eval_data=path))

    assert data is not None and np.array_equal(data[0], x) and data[1].dtype == np.int64


# ----------------------------------------------------------------------- read_eval_data


def test_uint8_images_without_a_channel_axis_are_scaled(tmp_path: Path) -> None:
    path = tmp_path / "data.npz"
    np.savez(path, x=np.full((3, 28, 28), 255, np.uint8), y=np.array([0, 1, 9], np.uint8))

    x, y = read_eval_data(path, shape=(1, 28, 28), num_classes=10)

    assert x.shape == (3, 1, 28, 28) and x.dtype == np.float32 and float(x.max()) == 1.0
    assert y.tolist() == [0, 1, 9] and y.dtype == np.int64


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"x": np.zeros((2, 1, 28, 28), np.float32)}, r"missing key\(s\) \['y'\]"),
        ({"x": np.zeros((2, 3, 28, 28), np.float32), "y": np.zeros(2, np.int64)}, "take"),
        ({"x": np.zeros((2, 28, 28), np.float32), "y": np.zeros(3, np.int64)}, "shape \\(2,\\)"),
        ({"x": np.zeros((2, 28, 28), np.float32), "y": np.array([0, 10])}, r"\[0, 10\)"),
        ({"x": np.zeros((2, 28, 28), np.float32), "y": np.zeros(2, np.float32)}, "integer"),
        ({"x": np.zeros((2, 28, 28), np.int16), "y": np.zeros(2, np.int64)}, "uint8 or float"),
        ({"x": np.full((2, 28, 28), np.nan, np.float32), "y": np.zeros(2)}, "not finite"),
    ],
)
def test_bad_held_out_files_are_refused(
    arrays: dict[str, np.ndarray], message: str, tmp_path: Path
) -> None:
    path = tmp_path / "data.npz"
    np.savez(path, **arrays)

    with pytest.raises(ConfigError, match=message):
        read_eval_data(path, shape=(1, 28, 28), num_classes=10)


def test_a_file_that_is_no_npz_is_refused(tmp_path: Path) -> None:
    single, text = tmp_path / "x.npy", tmp_path / "x.txt"
    np.save(single, np.zeros(3))
    text.write_text("hello")

    with pytest.raises(ConfigError, match=r"a single \.npy array"):
        read_eval_data(single, shape=(1, 28, 28), num_classes=10)
    with pytest.raises(ConfigError, match=r"not a readable \.npz"):
        read_eval_data(text, shape=(1, 28, 28), num_classes=10)


def test_the_scratch_models_are_not_the_coordinators() -> None:
    cfg = config()
    scratch = build_models(cfg)
    recorder = RunRecorder(cfg, TrafficStats(), scratch=scratch, held_out=held_out())
    other = build_models(cfg)[GROUP]
    state = {k: v + 1 for k, v in state_arrays(other).items()}

    recorder(closed(1, {"aca": state}))
    recorder.finish()

    load_state_arrays(other, state)
    assert recorder.records[0].models["aca"].global_acc == pytest.approx(
        100 * evaluate_accuracy(other, *held_out())
    )
