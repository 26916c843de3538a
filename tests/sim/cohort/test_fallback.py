"""The cohort engine asks each hook for its batched form; a hook without one trains on
the per-device path, with the same result as the loop."""

from __future__ import annotations

import copy
from collections.abc import MutableMapping
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from edge_client.train.data import DeviceData
from edge_client.train.local_update import local_update
from edge_client.train.strategies.fedprox import FedProx
from edge_client.train.task import LocalTask
from edge_client.train.training import TrainConfig, TrainHook
from models import build_classifier, state_arrays
from sim.cohort.engine import Member, train_cohort


class _L2Hook(TrainHook):
    """An extra loss term with no batched form."""

    def extra_loss(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor
    ) -> torch.Tensor | None:
        return 0.01 * torch.stack([p.pow(2).sum() for p in model.parameters()]).sum()


def test_a_hook_without_a_batched_form_trains_on_the_per_device_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def hooks(
        self: FedProx, model: nn.Module, config: TrainConfig, state: MutableMapping[str, Any]
    ) -> tuple[TrainHook, ...]:
        return (_L2Hook(),)

    monkeypatch.setattr(FedProx, "hooks", hooks)
    torch.manual_seed(0)
    start = build_classifier("mlp", num_classes=4, in_channels=1, image_size=8)
    rng = np.random.default_rng(3)
    x = rng.random((20, 1, 8, 8), dtype=np.float32)
    y = (np.arange(20) % 4).astype(np.int64)
    data = DeviceData("dev-0", x, y, x[:0], y[:0], 4)
    task = LocalTask("fedprox", {"seed": 1, "batch_size": 8}, {"global": state_arrays(start)})

    (outcome,) = train_cohort([Member(copy.deepcopy(start), data, task)])
    reference = local_update(copy.deepcopy(start), data, task)

    assert not outcome.batched
    assert outcome.fallback_reason == "the strategy's hook _L2Hook has no batched form"
    assert outcome.result is not None
    for name, value in reference.sets["weights"].items():
        np.testing.assert_array_equal(outcome.result.sets["weights"][name], value)


def test_a_model_with_a_layer_without_a_stacked_form_trains_on_the_per_device_path() -> None:
    """An ``nn.LayerNorm`` (weights, no stacked form here) in the classifier's features:
    the engine trains the device on the loop and says which layer."""
    torch.manual_seed(0)
    start = build_classifier("mlp", num_classes=4, in_channels=1, image_size=8)
    start.features.add_module("extra_norm", nn.LayerNorm(start.latent_dim))
    rng = np.random.default_rng(3)
    x = rng.random((20, 1, 8, 8), dtype=np.float32)
    y = (np.arange(20) % 4).astype(np.int64)
    data = DeviceData("dev-0", x, y, x[:0], y[:0], 4)
    task = LocalTask("fedavg", {"seed": 1, "batch_size": 8}, {"global": state_arrays(start)})

    (outcome,) = train_cohort([Member(copy.deepcopy(start), data, task)])
    reference = local_update(copy.deepcopy(start), data, task)

    assert not outcome.batched
    assert "features.extra_norm (LayerNorm) has no stacked form" in outcome.fallback_reason
    assert outcome.result is not None
    for name, value in reference.sets["weights"].items():
        np.testing.assert_array_equal(outcome.result.sets["weights"][name], value)
