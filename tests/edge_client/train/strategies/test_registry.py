"""The device strategies' registry: names, lookup, the sets and uploads each declares."""

from __future__ import annotations

import pytest

from edge_client.errors import TaskError
from edge_client.train.strategies import device_strategy, strategy_names
from edge_client.train.strategies.fedprox import FedProx
from edge_client.train.training import TrainConfig
from models import state_shapes
from tests.edge_client.train.helpers import model


def test_registry_names_and_unknown_strategy() -> None:
    assert strategy_names() == (
        "dense",
        "fedavg",
        "fedavg_oca",
        "feddf",
        "fedgen",
        "fedkf",
        "fedprox",
        "oneshot",
    )
    assert isinstance(device_strategy("fedprox"), FedProx)
    with pytest.raises(
        TaskError, match="unknown strategy 'fedsgd'; known: dense, fedavg, fedavg_oca"
    ):
        device_strategy("fedsgd")


def test_every_strategy_declares_its_sets() -> None:
    net = model()
    config = TrainConfig()
    full = state_shapes(net)

    declared = {
        name: {
            set_name: (spec.required, spec.shapes == full)
            for set_name, spec in device_strategy(name).expected_sets(net, config).items()
        }
        for name in strategy_names()
    }

    assert declared == {
        "fedavg": {"global": (False, True), "head": (False, False)},
        "fedavg_oca": {"global": (True, True)},
        "feddf": {"global": (True, True)},
        "dense": {"global": (True, True)},
        "oneshot": {"global": (True, True)},
        "fedprox": {"global": (True, True)},
        "fedkf": {"student": (True, True), "teacher": (False, True)},
        "fedgen": {
            "global": (False, True),
            "head": (False, False),
            "generator": (False, False),
            "prior": (False, False),
        },
    }
    assert {name: device_strategy(name).uploads for name in strategy_names()} == {
        "fedavg": ("all", "head"),
        "fedavg_oca": ("all",),
        "feddf": ("all",),
        "dense": ("all",),
        "oneshot": ("all",),
        "fedprox": ("all",),
        "fedkf": ("all",),
        "fedgen": ("all", "head"),
    }
