"""The strategies' registry, and the configuration's independence of it."""

from __future__ import annotations

import subprocess
import sys

from coordinator.config import FleetSettings
from coordinator.strategies.options import StrategyOptions
from coordinator.strategies.registry import STRATEGIES, strategy_names


def test_every_strategy_is_registered_under_its_own_name() -> None:
    assert strategy_names() == (
        "fedavg",
        "fedprox",
        "fedavg_oca",
        "fedkf",
        "fedgen",
        "feddf",
        "dense",
        "oneshot",
    )
    assert all(cls.name == name for name, cls in STRATEGIES.items())


def test_each_strategys_options_are_mixed_into_the_fleet_settings_and_name_it() -> None:
    options = [c for c in FleetSettings.__mro__ if issubclass(c, StrategyOptions)]
    mixed = [c for c in options if c is not StrategyOptions]

    assert {c.strategy_name for c in mixed} == {"fedkf", "feddf", "dense", "oneshot"}
    assert all(c.strategy_name in STRATEGIES for c in mixed)
    for cls in mixed:  # flat keys of the fleet's settings
        assert set(cls.model_fields) <= set(FleetSettings.model_fields)


def test_the_configuration_loads_no_strategy_and_no_server_step() -> None:
    """coordinator.config imports the strategies' light settings modules only: no
    strategy class, no registry, no server-side training (config used to import the
    strategies, which import it back)."""
    code = (
        "import sys, coordinator.config; "
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('coordinator'))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()

    assert set(loaded) == {
        "coordinator",
        "coordinator.config",
        "coordinator.errors",
        "coordinator.strategies",
        "coordinator.strategies.options",
        "coordinator.strategies.fedkf_settings",
        "coordinator.strategies.feddf_settings",
        "coordinator.strategies.dense_settings",
        "coordinator.strategies.oneshot_settings",
    }
