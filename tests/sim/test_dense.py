"""DENSE end to end through the in-process sim: one round, one upload per device, a
global model per architecture group distilled on the coordinator."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from coordinator.config import TrainingSettings
from coordinator.strategies.dense import Dense
from models import build_classifier, seeded, state_arrays
from sim.run import SimConfig, run_simulation
from tests.coordinator.strategies.test_dense import TINY, TINY_FLAGS


def test_a_dense_run_is_one_round_of_one_upload_per_device_and_a_model_per_group(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(Dense, "defaults", TINY)
    config = SimConfig(
        strategy="dense",
        devices=4,
        model="lenet5,mlp",
        transport="inproc",
        training=TrainingSettings(local_steps=2, batch_size=16),
        **TINY_FLAGS,
    )

    report = run_simulation(config, final_models_dir=tmp_path / "models")

    assert (config.rounds, config.participation) == (1, 1.0)  # dense's own defaults
    (record,) = report.rounds
    assert record.active_devices == 4
    assert set(record.models) == {"lenet5/aca", "mlp/aca"}
    # the devices published their four updates (two of each model, fp32) and little else
    model_bytes = {
        name: sum(a.nbytes for a in state_arrays(build_classifier(name)).values())
        for name in ("lenet5", "mlp")
    }
    updates = 2 * sum(model_bytes.values())
    assert updates * 0.8 < record.bytes_up < updates * 1.2
    for name in ("lenet5", "mlp"):
        saved = torch.load(tmp_path / "models" / name / "model.pt", weights_only=True)
        with seeded(config.seed):  # the untrained model the devices and the student began as
            template = state_arrays(build_classifier(name))
        assert {k: tuple(v.shape) for k, v in saved.items()} == {
            k: v.shape for k, v in template.items()
        }
        assert any(not np.array_equal(saved[k].numpy(), template[k]) for k in template)


def test_the_cli_refuses_a_dense_run_of_more_than_one_round_with_a_clear_error() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sim",
            "--devices",
            "2",
            "--rounds",
            "2",
            "--transport",
            "inproc",
            "--strategy",
            "dense",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        "python -m sim run: error: dense is one-shot: run it with --rounds 1 "
        "(the default for dense), not 2"
    )
