"""oneshot end to end through the sim over MQTT (the embedded broker): one round (the
label counts travel with the uploads where the weighting asks for them), and the round's
record reports the ensemble's held-out accuracy beside the student's."""

from __future__ import annotations

import json

import pytest

from coordinator.config import TrainingSettings
from coordinator.report import RunReport
from sim.run import SimConfig, run_simulation
from tests.coordinator.strategies.test_dense import TINY_FLAGS


@pytest.mark.parametrize("weighting", ["energy", "counts"])
def test_a_oneshot_run_reports_its_ensemble_beside_its_student(weighting: str) -> None:
    """``counts`` raises in the server step unless every upload carried its counts."""
    config = SimConfig(
        strategy="oneshot",
        oneshot_weighting=weighting,
        devices=4,
        alpha=0.1,
        model="lenet5",
        training=TrainingSettings(local_steps=5, batch_size=16),
        **TINY_FLAGS,
    )
    assert config.transport == "mqtt"

    report = run_simulation(config)

    (record,) = report.rounds
    assert record.active_devices == 4
    metrics = record.server_metrics
    assert set(metrics) == {"ensemble_accuracy", "lenet5/student_accuracy", "lenet5/kl_after"}
    assert 0 <= metrics["ensemble_accuracy"] <= 100
    # the student's held-out accuracy is the sim's own measure of the delivered model
    assert record.models["aca"].global_acc == metrics["lenet5/student_accuracy"]
    saved = RunReport.from_json_dict(json.loads(json.dumps(report.to_json_dict())))
    assert saved.rounds[0].server_metrics == metrics
