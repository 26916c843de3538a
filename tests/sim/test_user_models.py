"""A user's classifier, defined in a test module and named by its import path, through
the sim with every strategy that accepts it; the ones that need what it lacks refuse it
at start with one line."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coordinator.config import TrainingSettings
from sim.errors import SimError
from sim.run import SimConfig, run_simulation

SPLIT = "tests.models.user_models:build_split"
FLAT = "tests.models.user_models:build_flat"
QUICK = TrainingSettings(local_epochs=1, local_steps=2, batch_size=16)
ROOT = Path(__file__).resolve().parents[2]

SERVER_STEPS = {  # the distilling strategies' server work, kept small
    "feddf": {"distill_data": "generator", "distill_steps": 4, "distill_generator_batches": 2},
    "dense": {"rounds": 1, "participation": 1.0, "dense_epochs": 1},
}


def sim_cli(*flags: str) -> subprocess.CompletedProcess[str]:
    """``python -m sim`` with two devices for one round in process, and ``flags``."""
    command = ["--devices", "2", "--rounds", "1", "--transport", "inproc", *flags]
    return subprocess.run(
        [sys.executable, "-m", "sim", *command],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def config(model: str, strategy: str, **overrides: object) -> SimConfig:
    settings: dict[str, object] = {
        "devices": 4,
        "rounds": 2,
        "participation": 0.5,
        "training": QUICK,
        "model": model,
        "strategy": strategy,
        "transport": "inproc",
        **SERVER_STEPS.get(strategy, {}),
        **overrides,
    }
    return SimConfig(**settings)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("model", "strategy"),
    [
        (SPLIT, "fedavg"),
        (SPLIT, "fedgen"),
        (SPLIT, "fedkf"),
        (FLAT, "fedprox"),
        (FLAT, "fedavg_oca"),
        (FLAT, "fedkf"),
        (FLAT, "feddf"),
        (FLAT, "dense"),
    ],
)
def test_a_user_model_trains_through_the_sim(model: str, strategy: str) -> None:
    report = run_simulation(config(model, strategy))
    assert report.rounds
    for record in report.rounds:
        assert record.bytes_up > 0 and record.bytes_down > 0
        assert all(0 <= m.amp <= 100 for m in record.models.values())
    assert report.to_json_dict()["config"]["model"] == model


def test_the_batched_engine_trains_a_user_model_as_the_loop_does(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its layers all have stacked forms: it trains batched, not on the per-device path,
    to the loop's accuracy."""
    with caplog.at_level(logging.WARNING, logger="sim.cohort.trainer"):
        batched = run_simulation(config(SPLIT, "fedavg", engine="batched"))
    assert not [r for r in caplog.records if "per-device path" in r.getMessage()]
    loop = run_simulation(config(SPLIT, "fedavg", engine="loop"))
    for a, b in zip(batched.rounds, loop.rounds, strict=True):
        assert a.active_devices == b.active_devices == 2
        assert a.models["aca"].amp == pytest.approx(b.models["aca"].amp, abs=0.5)


@pytest.mark.parametrize(
    ("strategy", "sharing", "reason"),
    [
        ("fedgen", "full", "strategy 'fedgen' needs a model that declares its features"),
        ("fedavg", "head", "sharing 'head' needs a model that declares its features"),
    ],
)
def test_a_mode_that_needs_the_split_refuses_a_model_without_one(
    strategy: str, sharing: str, reason: str
) -> None:
    with pytest.raises(SimError, match=reason):
        run_simulation(config(FLAT, strategy, sharing=sharing))
    result = sim_cli("--model", FLAT, "--strategy", strategy, "--sharing", sharing)
    assert result.returncode == 2
    assert reason in result.stderr.strip().splitlines()[-1]  # after the run's banner


def test_a_model_path_that_does_not_import_is_refused_at_start() -> None:
    result = sim_cli("--model", "tests.models.user_models:no_such_factory")
    assert result.returncode == 2
    assert "has no no_such_factory" in result.stderr


SERIES = "tests.models.user_models:build_series"
LEARNS = {"rounds": 3, "participation": 1.0}
"""Enough for the series model to learn the level shift well past chance."""


def series_file(path: Path, samples: int = 240, classes: int = 3) -> Path:
    """Windows of 9 time steps x 6 channels whose class shifts one channel's level."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, classes, samples)
    x = rng.standard_normal((samples, 9, 6)).astype(np.float32)
    x[:, :, 0] += 2.0 * y[:, None]
    np.savez(path, x=x[:200], y=y[:200], x_test=x[200:], y_test=y[200:])
    return path


@pytest.mark.parametrize("strategy", ["fedavg", "fedprox", "fedavg_oca", "fedgen"])
def test_a_user_model_trains_on_series_from_an_npz_dataset(strategy: str, tmp_path: Path) -> None:
    path = series_file(tmp_path / "watch.npz")
    training = TrainingSettings(local_epochs=2, batch_size=16, lr=0.05)
    report = run_simulation(
        config(SERIES, strategy, dataset="npz", data_dir=path, training=training, **LEARNS)
    )
    assert report.final["num_classes"] == 3
    last = report.rounds[-1].models["aca"]
    assert last.global_acc is not None and last.global_acc > 60  # percent; chance: 1/3


@pytest.mark.parametrize("strategy", ["fedkf", "feddf", "dense"])
def test_the_generating_strategies_train_on_series(strategy: str, tmp_path: Path) -> None:
    """FedKF's device generator and DENSE's and FedDF's server generators make series
    of the model's input shape (the MLP sample generator), and the model learns."""
    path = series_file(tmp_path / "watch.npz")
    training = TrainingSettings(local_epochs=2, batch_size=16, lr=0.05)
    overrides: dict[str, object] = dict(LEARNS)
    if strategy == "dense":  # one shot: its ensemble is distilled once
        overrides |= {"rounds": 1, "dense_epochs": 4}
    report = run_simulation(
        config(SERIES, strategy, dataset="npz", data_dir=path, training=training, **overrides)
    )
    last = report.rounds[-1].models["aca"]
    # percent; chance: 1/3. DENSE's student starts untrained and learns from generated
    # series alone, in one shot (one-shot FedAvg gets 62.5 here, a centralised run 80-90)
    assert last.global_acc is not None and last.global_acc > (50 if strategy == "dense" else 60)


def test_a_built_in_classifier_refuses_series_with_the_reason(tmp_path: Path) -> None:
    path = series_file(tmp_path / "watch.npz")
    with pytest.raises(SimError, match=r"takes square images \(C, H, W\), not samples of shape"):
        run_simulation(config("mlp", "fedavg", dataset="npz", data_dir=path))


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_a_user_model_on_series_travels_quantized_with_deltas(
    precision: str, tmp_path: Path
) -> None:
    """Quantized transfers both ways, lossy uplink deltas with error feedback and
    downlink deltas against the held model: fewer bytes than fp32, and it still learns."""
    path = series_file(tmp_path / "watch.npz")
    training = TrainingSettings(local_epochs=2, batch_size=16, lr=0.05)
    runs = {
        p: run_simulation(
            config(
                SERIES,
                "fedavg",
                dataset="npz",
                data_dir=path,
                training=training,
                downlink_precision=p,
                uplink_precision=p,
                **LEARNS,
            )
        )
        for p in ("fp32", precision)
    }
    fp32, quantized = runs["fp32"], runs[precision]
    assert quantized.final["bytes_up"] < 0.5 * fp32.final["bytes_up"]
    assert quantized.final["bytes_down"] < 0.6 * fp32.final["bytes_down"]
    last = quantized.rounds[-1].models["aca"]
    assert last.global_acc is not None and last.global_acc > 60


def test_feddf_distils_a_user_model_on_proxy_series(tmp_path: Path) -> None:
    """Proxy data of the model's own shape, a plain .npy of unlabeled windows."""
    path = series_file(tmp_path / "watch.npz")
    proxy = tmp_path / "proxy.npy"
    with np.load(path) as data:
        np.save(proxy, data["x_test"])  # unlabeled windows of the same shape
    training = TrainingSettings(local_epochs=2, batch_size=16, lr=0.05)
    report = run_simulation(
        config(
            SERIES,
            "feddf",
            dataset="npz",
            data_dir=path,
            training=training,
            proxy_data=proxy,
            distill_data="proxy",
            distill_steps=20,
            **LEARNS,
        )
    )
    last = report.rounds[-1].models["aca"]
    assert last.global_acc is not None and last.global_acc > 60


def test_the_budget_tool_and_the_int8_template_take_a_user_model(tmp_path: Path) -> None:
    path = series_file(tmp_path / "watch.npz")
    budget = subprocess.run(
        [sys.executable, "-m", "sim", "budget", "--model", SERIES, "--dataset", "npz",
         "--data-dir", str(path), "--devices", "4", "--rounds", "1", "--json"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert budget.returncode == 0, budget.stderr[-2000:]
    figures = json.loads(budget.stdout)
    assert figures["config"]["model"] == SERIES
    assert json.dumps(figures).count('"update"') >= 1
    template = tmp_path / "series-int8.onnx"
    made = subprocess.run(
        [sys.executable, "-m", "edge_client", "template", "--model", SERIES,
         "--num-classes", "3", "--input-shape", "9,6", "--precision", "int8",
         "--out", str(template)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    assert template.stat().st_size > 0 and "int8 template" in made.stdout
