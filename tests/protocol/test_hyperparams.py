"""The task's hyperparameters: one schema, one set of defaults, both ends."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from coordinator.config import CoordinatorConfig, TrainingSettings
from coordinator.strategies.registry import build_strategy
from edge_client.train.training import TrainConfig
from models import build_classifier
from protocol.hyperparams import Hyperparameters, LocalTraining


def test_the_shared_settings_have_one_default_on_both_ends() -> None:
    shared = LocalTraining.model_fields

    run, task = TrainingSettings(), TrainConfig()

    for name in shared:
        assert getattr(run, name) == getattr(task, name) == shared[name].default, name
    assert run.momentum == 0.9  # what docs/results.md was measured with


def test_to_wire_keeps_only_the_keys_set() -> None:
    hyper = Hyperparameters(local_epochs=2, lr=0.05)

    assert hyper.to_wire() == {"local_epochs": 2, "lr": 0.05}


def test_schema_is_strict_and_closed() -> None:
    with pytest.raises(ValidationError, match="epochs"):
        Hyperparameters.model_validate({"epochs": 1})
    with pytest.raises(ValidationError, match="local_steps"):
        Hyperparameters.model_validate({"local_steps": 1.0})
    with pytest.raises(ValidationError, match="momentum"):
        Hyperparameters.model_validate({"momentum": 1.0})


@pytest.mark.parametrize("strategy", ["fedavg", "fedprox", "fedavg_oca", "fedkf", "fedgen"])
def test_every_strategy_sends_hyperparameters_the_device_accepts(strategy: str) -> None:
    config = CoordinatorConfig(strategy=strategy, training=TrainingSettings(momentum=0.5))
    template = build_classifier("lenet5", num_classes=10, in_channels=1, image_size=28)

    sent = build_strategy(config, {template.architecture: template}).hyperparameters(2)
    received = TrainConfig.from_hyperparameters(sent)

    assert received.momentum == 0.5 and received.total_steps(100) > 0
    assert set(sent) <= set(Hyperparameters.model_fields)


def test_the_protocol_document_lists_every_hyperparameter() -> None:
    """docs/protocol.md's table of the task's hyperparameters names each key of the
    schema, and no other (an independent device is written from that table)."""
    text = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text()
    section = text[text.index("hyperparameters:\n\n   | key |") :]
    table = section[section.index("| key |") :].split("\n\n")[0]
    documented = {
        key for line in table.splitlines()[2:] for key in re.findall(r"`(\w+)`", line.split("|")[1])
    }

    assert documented == set(Hyperparameters.model_fields)


def test_fedkf_sends_its_cost_settings_and_the_paper_s_stay_selectable() -> None:
    template = build_classifier("lenet5", num_classes=10, in_channels=1, image_size=28)
    models = {template.architecture: template}

    default = build_strategy(CoordinatorConfig(strategy="fedkf"), models).hyperparameters(1)
    paper = TrainingSettings(generator_every=1, sample_reuse=1, generator_batch_size=0)
    published = build_strategy(
        CoordinatorConfig(strategy="fedkf", training=paper), models
    ).hyperparameters(1)

    wanted = ("generator_every", "sample_reuse", "generator_batch_size")
    assert [default[k] for k in wanted] == [2, 4, 16]
    assert [published[k] for k in wanted] == [1, 1, 0]
    received = TrainConfig.from_hyperparameters(published)
    assert (received.generator_batch_size or received.batch_size) == 64  # B, as the paper
