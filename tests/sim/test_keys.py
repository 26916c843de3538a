"""The sim provisions a message key per emulated device (sim.run.fleet_keyring), given to
the coordinator or, with ``enrol``, enrolled by it from the fleet token."""

from __future__ import annotations

import logging

import pytest

from coordinator.config import TrainingSettings
from protocol.auth import derive_device_key, new_key
from sim.run import SimConfig, fleet_keyring, run_simulation


def test_every_device_gets_its_own_key_and_every_run_new_ones() -> None:
    # Prepare
    ids = [f"dev-{i:03d}" for i in range(20)]
    # Execute
    first, second = fleet_keyring(ids), fleet_keyring(ids)
    config = SimConfig(devices=2).device_config(0, "dev-000", first["dev-000"])
    # Assert
    assert sorted(first) == ids and len(set(first.values())) == len(ids)
    assert all(len(k) == 32 for k in first.values())
    assert all(first[d] != second[d] for d in ids)
    keyring = config.keyring()
    assert keyring is not None and dict(keyring) == {"dev-000": first["dev-000"]}
    token = new_key()
    assert fleet_keyring(ids, token=token)["dev-003"] == derive_device_key(token, "dev-003")


def test_with_enrol_the_coordinator_enrols_every_device_from_the_token(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare
    training = TrainingSettings(local_epochs=1, local_steps=2, batch_size=16)
    config = SimConfig(
        devices=3, rounds=1, participation=1.0, training=training, model="mlp", transport="inproc"
    )
    # Execute
    with caplog.at_level(logging.INFO, logger="coordinator.enrolment"):
        report = run_simulation(config.model_copy(update={"enrol": True}))
    # Assert: each device enrolled once, and all three took part in the round
    enrolled = [r.getMessage() for r in caplog.records if "with the fleet token" in r.getMessage()]
    assert sorted(m.split()[1] for m in enrolled) == ["dev-000", "dev-001", "dev-002"]
    assert [r.active_devices for r in report.rounds] == [3]
