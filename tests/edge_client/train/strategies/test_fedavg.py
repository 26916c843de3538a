"""FedAvg's device side (and FedAvg (OCA)'s, which trains alike): full and head-only sharing."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.train.data import DeviceData
from edge_client.train.local_update import local_update
from edge_client.train.task import LocalTask
from models import load_state_arrays, state_arrays, state_shapes
from tests.edge_client.train.helpers import HP, distance, global_arrays, model, small_data


@pytest.fixture(scope="module")
def device_data() -> DeviceData:
    return small_data()


def test_fedavg_starts_from_the_global_weights_and_returns_the_new_ones(
    device_data: DeviceData,
) -> None:
    received = global_arrays()
    a, b = model(1), model(2)  # different local weights before the round

    result_a = local_update(a, device_data, LocalTask("fedavg", HP, {"global": received}))
    result_b = local_update(b, device_data, LocalTask("fedavg_oca", HP, {"global": received}))

    weights = result_a.sets["weights"]
    assert {k: v.shape for k, v in weights.items()} == state_shapes(a)
    assert all(np.array_equal(weights[k], result_b.sets["weights"][k]) for k in weights)
    assert distance(weights, received) > 0
    assert result_a.num_samples == 64 and result_a.steps == 8
    assert set(result_a.metrics) == {"loss", "accuracy"}
    assert set(result_a.timings) == {"load_s", "train_s"}


def test_fedavg_head_sharing_keeps_the_devices_features(device_data: DeviceData) -> None:
    received = global_arrays()
    head = {k: v for k, v in received.items() if k.startswith("head.")}
    net = model()
    own = state_arrays(net, "features")

    result = local_update(net, device_data, LocalTask("fedavg", HP, {"head": head}, upload="head"))

    assert sorted(result.sets["weights"]) == sorted(head)
    reference = model()
    load_state_arrays(reference, {**own, **head})
    expected = local_update(reference, device_data, LocalTask("fedavg", HP, {}))
    for name, value in result.sets["weights"].items():
        np.testing.assert_array_equal(value, expected.sets["weights"][name])
