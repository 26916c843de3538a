"""The worked examples (edgefl_examples): their data as the packages ship it, written as
npz datasets by their command lines, and their models trained through the sim with
FedAvg, FedKF and FedDF to well past chance on the real test split."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coordinator.config import TrainingSettings
from edgefl_examples import tabular, wearable
from edgefl_examples._data import integer_labels, standardise
from sim.datasets import load_dataset
from sim.run import SimConfig, run_simulation

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {
    # name: (module, model, devices, batch size, chance in percent)
    "wearable": ("edgefl_examples.wearable", "edgefl_examples.wearable:build_cnn", 4, 8, 25.0),
    "tabular": ("edgefl_examples.tabular", "edgefl_examples.tabular:build_mlp", 5, 16, 63.0),
}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each example's dataset, written by its command line."""
    out = tmp_path_factory.mktemp("examples")
    paths = {}
    for name, (module, *_rest) in EXAMPLES.items():
        path = out / f"{name}.npz"
        done = subprocess.run(
            [sys.executable, "-m", module, "--out", str(path)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"wrote {path}" in done.stdout
        paths[name] = path
    return paths


def test_basic_motions_is_standardised_per_channel_with_the_training_statistics() -> None:
    data = wearable.load()
    assert data["x"].shape == (40, 6, 100) and data["x_test"].shape == (40, 6, 100)
    assert data["x"].dtype == np.float32 and int(data["num_classes"]) == 4
    np.testing.assert_allclose(data["x"].mean(axis=(0, 2)), 0, atol=1e-5)
    np.testing.assert_allclose(data["x"].std(axis=(0, 2)), 1, atol=1e-4)
    assert np.bincount(data["y"]).tolist() == [10, 10, 10, 10]  # 4 activities, 10 each
    assert np.bincount(data["y_test"]).tolist() == [10, 10, 10, 10]
    assert abs(float(data["x_test"].mean())) > 1e-4  # the test split was not its own yardstick


def test_breast_cancer_keeps_a_stratified_seeded_test_fifth() -> None:
    data = tabular.load()
    assert data["x"].shape == (456, 30) and data["x_test"].shape == (113, 30)
    train, test = np.bincount(data["y"]), np.bincount(data["y_test"])
    assert (train + test).tolist() == [212, 357]  # malignant, benign
    assert test.tolist() == [round(0.2 * 212), round(0.2 * 357)]
    np.testing.assert_allclose(data["x"].mean(axis=0), 0, atol=1e-5)
    again, other = tabular.load(), tabular.load(seed=1)
    np.testing.assert_array_equal(again["x_test"], data["x_test"])
    assert not np.array_equal(other["x_test"], data["x_test"])


def test_the_shared_helpers() -> None:
    a, b = standardise(np.array([[1.0, 5.0], [3.0, 5.0]]), np.array([[2.0, 6.0]]), axes=(0,))
    np.testing.assert_allclose(a, [[-1, 0], [1, 0]])  # a constant feature is only centred
    np.testing.assert_allclose(b, [[0, 1]])
    y, y_test, names = integer_labels(np.array(["walk", "run", "walk"]), np.array(["run"]))
    assert (y.tolist(), y_test.tolist(), names) == ([1, 0, 1], [0], ("run", "walk"))
    with pytest.raises(ValueError, match="test labels the training split lacks"):
        integer_labels(np.array(["walk"]), np.array(["swim"]))


def test_the_cnn_takes_only_channels_by_steps() -> None:
    with pytest.raises(ValueError, match=r"takes samples \(channels, steps\)"):
        wearable.build_cnn(num_classes=4, input_shape=(600,))


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_npz_dataset_reads_as_the_sim_takes_it(name: str, datasets: dict[str, Path]) -> None:
    splits = load_dataset("npz", datasets[name])
    source = {"wearable": wearable.load, "tabular": tabular.load}[name]()
    np.testing.assert_array_equal(splits.train.x, source["x"])
    assert splits.test is not None
    np.testing.assert_array_equal(splits.test.y, source["y_test"])


@pytest.mark.parametrize("strategy", ["fedavg", "fedkf", "feddf"])
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_example_learns_through_the_sim(
    name: str, strategy: str, datasets: dict[str, Path]
) -> None:
    _module, model, devices, batch, chance = EXAMPLES[name]
    settings: dict[str, object] = {
        "dataset": "npz",
        "data_dir": datasets[name],
        "model": model,
        "strategy": strategy,
        "devices": devices,
        "rounds": 5,
        "participation": 1.0,
        "transport": "inproc",
        "training": TrainingSettings(local_epochs=2, batch_size=batch, lr=0.05),
    }
    if strategy == "feddf":  # no proxy data: it distils on samples it generates
        settings |= {"distill_data": "generator", "distill_steps": 20}
    report = run_simulation(SimConfig.model_validate(settings))
    accuracy = report.rounds[-1].models[report.final["final_model"]].global_acc
    assert accuracy is not None and accuracy > chance + 15, accuracy  # percent, test split


def test_the_batched_engine_trains_the_wearable_cnn_as_the_loop_does(
    datasets: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Conv1d, MaxPool1d and AdaptiveAvgPool1d all have stacked forms: the CNN trains
    batched, not on the per-device path, to the loop's accuracy."""
    settings: dict[str, object] = {
        "dataset": "npz",
        "data_dir": datasets["wearable"],
        "model": EXAMPLES["wearable"][1],
        "devices": 4,
        "rounds": 3,
        "participation": 1.0,
        "transport": "inproc",
        "training": TrainingSettings(local_epochs=2, batch_size=8, lr=0.05),
    }
    with caplog.at_level(logging.INFO, logger="sim.cohort.trainer"):
        batched = run_simulation(SimConfig.model_validate(settings | {"engine": "batched"}))
    assert not [r for r in caplog.records if "per-device path" in r.getMessage()]
    loop = run_simulation(SimConfig.model_validate(settings | {"engine": "loop"}))
    for a, b in zip(batched.rounds, loop.rounds, strict=True):
        assert a.models["aca"].global_acc == pytest.approx(b.models["aca"].global_acc, abs=2.6)
