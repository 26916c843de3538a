"""The sim provisions a message key per emulated device (sim.run.fleet_keyring)."""

from __future__ import annotations

from sim.run import SimConfig, fleet_keyring


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
