"""FedProx's device side: the proximal term and its effect on the update."""

from __future__ import annotations

import pytest
import torch

from edge_client.train.data import DeviceData
from edge_client.train.local_update import local_update
from edge_client.train.strategies.fedprox import FedProx, ProximalHook
from edge_client.train.task import LocalTask
from edge_client.train.training import TrainConfig
from tests.edge_client.train.helpers import distance, global_arrays, model, small_data


@pytest.fixture(scope="module")
def device_data() -> DeviceData:
    return small_data()


def test_fedprox_with_a_large_mu_stays_near_the_global_weights(device_data: DeviceData) -> None:
    received = global_arrays()
    hp = {"local_epochs": 3, "batch_size": 8, "lr": 0.05, "seed": 0}

    free = local_update(
        model(), device_data, LocalTask("fedprox", {**hp, "mu": 0.0}, {"global": received})
    )
    held = local_update(
        model(), device_data, LocalTask("fedprox", {**hp, "mu": 10.0}, {"global": received})
    )

    moved_free = distance(free.sets["weights"], received)
    moved_held = distance(held.sets["weights"], received)
    assert moved_held < 0.5 * moved_free


def test_proximal_term_is_mu_half_squared_distance() -> None:
    net = model()
    hook = ProximalHook(4.0)
    hook.before_training(net)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.5)
    count = sum(p.numel() for p in net.parameters())

    extra = hook.extra_loss(net, torch.zeros(1), torch.zeros(1), torch.zeros(1))

    assert extra is not None
    assert extra.item() == pytest.approx(0.5 * 4.0 * count * 0.25, rel=1e-5)
    assert ProximalHook(0.0).extra_loss(net, torch.zeros(1), torch.zeros(1), torch.zeros(1)) is None
    with pytest.raises(ValueError, match="mu"):
        ProximalHook(-1.0)
    assert FedProx().hooks(net, TrainConfig(mu=0.3), {})[0].mu == 0.3  # type: ignore[attr-defined]
