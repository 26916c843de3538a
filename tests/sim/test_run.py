"""The lab emulation end to end: real coordinator, real edge clients, all through a broker."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from coordinator.config import TrainingSettings
from models import build_classifier
from sim.errors import SimError
from sim.run import SimConfig, run_simulation
from tests.protocol.brokers import Mosquitto
from tests.sim.test_datasets import write_mnist_like

QUICK = TrainingSettings(local_epochs=1, local_steps=2, batch_size=16)


def quick(**overrides) -> SimConfig:
    base = {"devices": 6, "rounds": 2, "participation": 0.5, "training": QUICK, "model": "mlp"}
    base.update(overrides)
    return SimConfig(**base)


def test_inproc_run_reports_every_round_with_bytes_and_both_models() -> None:
    report = run_simulation(quick(strategy="fedavg_oca", transport="inproc"))

    assert [r.round for r in report.rounds] == [1, 2]
    for record in report.rounds:
        assert record.active_devices == 3
        assert record.device_train_s is not None and record.device_train_s > 0
        assert record.bytes_up > 0 and record.bytes_down > 0
        assert record.wire_bytes_up > record.bytes_up and record.wire_bytes_down > record.bytes_down
        assert set(record.models) == {"aca", "oca"}
        for metrics in record.models.values():
            assert 0 <= metrics.wlp <= metrics.amp <= 100
            assert metrics.global_acc is not None
    data = report.to_json_dict()
    assert data["config"]["devices"] == 6
    assert data["final"]["rounds"] == 2 and data["final"]["peak_rss_bytes"] > 0
    assert data["final"]["peak_gpu_bytes"] == 0  # trained on the CPU


@pytest.mark.parametrize("broker", ["inproc", "embedded", "mosquitto"])
def test_a_fleet_of_several_architectures_trains_and_reports_each_group(
    broker: str, tmp_path: Path
) -> None:
    config = quick(model="mlp,lenet5", participation=1.0, transport="inproc")
    with contextlib.ExitStack() as stack:
        if broker != "inproc":
            config = config.model_copy(update={"transport": "mqtt"})
        if broker == "mosquitto":
            (tmp_path / "mosquitto").mkdir()
            mosquitto = stack.enter_context(Mosquitto(tmp_path / "mosquitto"))
            config = config.model_copy(update={"broker_url": mosquitto.url})

        report = run_simulation(config, final_models_dir=tmp_path / "models")

    for record in report.rounds:
        assert record.active_devices == 6  # three devices of each architecture
        assert set(record.models) == {"mlp/aca", "lenet5/aca"}
        assert all(m.global_acc is not None for m in record.models.values())
    assert report.to_json_dict()["config"]["model"] == "mlp,lenet5"
    for name in ("mlp", "lenet5"):
        saved = torch.load(tmp_path / "models" / name / "model.pt", weights_only=True)
        template = build_classifier(name, num_classes=report.final["num_classes"])
        assert {k: v.shape for k, v in saved.items()} == {
            k: v.shape for k, v in template.state_dict().items()
        }


def test_feddf_fuses_a_fleet_of_several_architectures_on_proxy_data(tmp_path: Path) -> None:
    write_mnist_like(tmp_path / "proxy", n_train=200, n_test=1)
    config = quick(
        strategy="feddf",
        model="mlp,lenet5",
        participation=1.0,
        transport="inproc",
        proxy_data=tmp_path / "proxy",
        drop_worst=True,
    )

    report = run_simulation(config)

    assert [r.round for r in report.rounds] == [1, 2]
    for record in report.rounds:
        assert record.active_devices == 6
        assert set(record.models) == {"mlp/aca", "lenet5/aca"}
        assert 0 < record.aggregate_s < record.wall_s  # the distillation, timed
    with pytest.raises(SimError, match="proxy-data"):
        run_simulation(quick(strategy="feddf", transport="inproc"))


def test_proxy_data_is_refused_by_a_strategy_that_would_not_read_it(tmp_path: Path) -> None:
    write_mnist_like(tmp_path / "proxy", n_train=20, n_test=1)
    config = quick(strategy="fedavg", transport="inproc", proxy_data=tmp_path / "proxy")

    with pytest.raises(SimError, match=r"would not read the proxy data: .*\(feddf, with"):
        run_simulation(config)


def test_feddf_distils_on_generated_images_end_to_end_without_proxy_data(
    tmp_path: Path,
) -> None:
    config = quick(
        strategy="feddf",
        distill_data="generator",
        distill_generator_batches=2,
        distill_generator_steps=2,
        distill_steps=20,
        drop_worst=True,
        devices=4,
        rounds=1,
        model="mlp,lenet5",
        participation=1.0,
        transport="inproc",
    )

    report = run_simulation(config, final_models_dir=tmp_path / "first")
    again = run_simulation(config, final_models_dir=tmp_path / "again")

    assert config.proxy_data is None
    assert [r.round for r in report.rounds] == [1]
    for record in report.rounds:
        assert record.active_devices == 4
        assert set(record.models) == {"mlp/aca", "lenet5/aca"}
        assert 0 < record.aggregate_s < record.wall_s  # the generator and distillation, timed
    for name in ("mlp", "lenet5"):  # same seed, same models
        first = torch.load(tmp_path / "first" / name / "model.pt", weights_only=True)
        second = torch.load(tmp_path / "again" / name / "model.pt", weights_only=True)
        template = build_classifier(name, num_classes=report.final["num_classes"])
        assert {k: v.shape for k, v in first.items()} == {
            k: v.shape for k, v in template.state_dict().items()
        }
        assert all(torch.equal(first[k], second[k]) for k in first), name
    assert report.rounds[-1].models["mlp/aca"].amp == again.rounds[-1].models["mlp/aca"].amp
    write_mnist_like(tmp_path / "proxy", n_train=20, n_test=1)
    with pytest.raises(SimError, match="leave out --proxy-data"):
        run_simulation(config.model_copy(update={"proxy_data": tmp_path / "proxy"}))


def test_embedded_broker_counts_the_same_bytes_as_the_inproc_twin() -> None:
    inproc = run_simulation(quick(transport="inproc"))
    mqtt = run_simulation(quick(transport="mqtt"))

    for a, b in zip(inproc.rounds, mqtt.rounds, strict=True):
        assert a.active_devices == b.active_devices
        for field in ("bytes_up", "bytes_down", "wire_bytes_up", "wire_bytes_down"):
            # same messages; only random message ids compress differently
            assert getattr(a, field) == pytest.approx(getattr(b, field), rel=0.01), field
        assert a.models["aca"].amp == pytest.approx(b.models["aca"].amp)


@pytest.mark.parametrize("strategy", ["fedavg", "fedkf"])
def test_the_batched_engine_runs_the_fleet_as_the_loop_does(strategy: str) -> None:
    settings = {"strategy": strategy, "transport": "inproc", "model": "lenet5"}
    batched = run_simulation(quick(engine="batched", **settings))
    loop = run_simulation(quick(engine="loop", **settings))

    for a, b in zip(batched.rounds, loop.rounds, strict=True):
        assert a.active_devices == b.active_devices == 3
        for field in ("bytes_up", "bytes_down"):
            assert getattr(a, field) == pytest.approx(getattr(b, field), rel=0.01), field
        assert a.models["aca"].amp == pytest.approx(b.models["aca"].amp, abs=0.5)


def test_cli_default_command_writes_json_and_report(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sim",
            "--devices",
            "4",
            "--rounds",
            "2",
            "--participation",
            "0.5",
            "--model",
            "mlp",
            "--local-steps",
            "2",
            "--transport",
            "inproc",
            "--json-out",
            str(out),
            "--report-dir",
            str(tmp_path / "report"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )

    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert set(data) == {"config", "rounds", "final"}
    assert [r["round"] for r in data["rounds"]] == [1, 2]
    assert data["final"]["interrupted"] is False
    assert set(data["rounds"][0]) == {
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
    assert set(data["rounds"][0]["models"]["aca"]) == {"amp", "fm", "wlp", "best", "global_acc"}
    assert (tmp_path / "report" / "rounds.csv").exists()
    assert (tmp_path / "report" / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "round 2/2" in result.stderr


def test_cli_bad_flags_exit_2_with_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sim", "--devices", "0", "--transport", "inproc"],
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "devices" in result.stderr


def test_cli_refuses_options_the_strategy_cannot_honour() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sim",
            "--devices",
            "2",
            "--rounds",
            "1",
            "--transport",
            "inproc",
            "--strategy",
            "fedprox",
            "--sharing",
            "head",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert result.returncode == 2
    assert "strategy 'fedprox' does not support sharing 'head'" in result.stderr


def test_class_fraction_keeps_that_share_of_every_class() -> None:
    from sim.datasets import load_dataset
    from sim.run import _subsample

    train = load_dataset("synthetic", seed=0).train
    kept = _subsample(train, 0.1, seed=3)

    full = np.bincount(train.y, minlength=train.num_classes)
    part = np.bincount(kept.y, minlength=train.num_classes)
    assert np.all(np.abs(part - 0.1 * full) <= 0.5)
    assert len(np.unique(kept.x.reshape(len(kept.y), -1), axis=0)) == len(kept.y)  # no repeats
    again = _subsample(train, 0.1, seed=3)
    np.testing.assert_array_equal(again.y, kept.y)


@pytest.mark.parametrize("transport", ["inproc", "mqtt"])
def test_per_round_bytes_do_not_depend_on_the_pool_size(transport: str) -> None:
    one = run_simulation(quick(transport=transport, connections=1))
    each = run_simulation(quick(transport=transport, connections=6))

    for a, b in zip(one.rounds, each.rounds, strict=True):
        assert a.active_devices == b.active_devices == 3
        for field in ("bytes_up", "bytes_down", "wire_bytes_up", "wire_bytes_down"):
            # the same messages; only random message ids compress differently
            assert getattr(a, field) == pytest.approx(getattr(b, field), rel=0.002), field
    for field in ("bytes_up", "bytes_down", "wire_bytes_up", "wire_bytes_down"):
        assert one.final[field] == pytest.approx(each.final[field], rel=0.002), field


def test_a_broker_that_does_not_stop_in_time_loses_nothing_of_the_finished_run(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """amqtt still routing a 10,000-device backlog did not stop within its 10 s; the
    run had finished and its report was lost to that error."""
    from protocol.errors import BrokerError
    from protocol.transport.broker import EmbeddedBroker

    stop = EmbeddedBroker.stop

    def slow_stop(self: EmbeddedBroker, timeout: float = 10.0) -> None:
        stop(self, timeout)
        raise BrokerError(f"embedded broker thread did not stop within {timeout} s")

    monkeypatch.setattr(EmbeddedBroker, "stop", slow_stop)

    report = run_simulation(quick(transport="mqtt"))

    assert [r.round for r in report.rounds] == [1, 2]
    assert "did not stop within 10.0 s; its thread ends with the process" in caplog.text
