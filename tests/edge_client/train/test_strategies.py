"""The strategy registry and local_update, the device step shared with the sim."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_client.errors import TaskError
from edge_client.train.data import DeviceData
from edge_client.train.strategies import (
    FedProx,
    LocalTask,
    ProximalHook,
    device_strategy,
    local_update,
    strategy_names,
)
from edge_client.train.training import TrainConfig
from models import Classifier, build_classifier, load_state_arrays, state_arrays, state_shapes


def model(seed: int = 0) -> Classifier:
    torch.manual_seed(seed)
    return build_classifier("mlp", num_classes=4, in_channels=1, image_size=8)


@pytest.fixture(scope="module")
def device_data() -> DeviceData:
    rng = np.random.default_rng(2)
    y = (np.arange(64) % 4).astype(np.int64)
    x = rng.random((64, 1, 8, 8), dtype=np.float32)
    return DeviceData("dev-000", x, y, x[:0], y[:0], 4)


def global_arrays(seed: int = 5) -> dict[str, np.ndarray]:
    return state_arrays(model(seed))


def distance(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in a)))


HP = {"local_epochs": 2, "batch_size": 16, "lr": 0.1, "seed": 1}


def test_registry_names_and_unknown_strategy() -> None:
    assert strategy_names() == (
        "dense",
        "fedavg",
        "fedavg_oca",
        "feddf",
        "fedgen",
        "fedkf",
        "fedprox",
    )
    assert isinstance(device_strategy("fedprox"), FedProx)
    with pytest.raises(
        TaskError, match="unknown strategy 'fedsgd'; known: dense, fedavg, fedavg_oca"
    ):
        device_strategy("fedsgd")


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


def test_a_task_without_sets_trains_the_current_model(device_data: DeviceData) -> None:
    net = model()
    before = state_arrays(net)

    result = local_update(net, device_data, LocalTask("fedavg", HP), state={})

    assert distance(result.sets["weights"], before) > 0


@pytest.mark.parametrize(
    ("task", "message"),
    [
        (LocalTask("nope", HP, {}), "unknown strategy"),
        (LocalTask("fedavg", {"lr": -1.0}, {}), "invalid hyperparameters"),
        (LocalTask("fedprox", HP, {"teacher": {}}), "needs the set 'global'"),
        (LocalTask("fedavg", HP, {"teacher": {}}), r"takes \['global', 'head'\]"),
        (
            LocalTask("fedavg", HP, {"global": {"head.weight": np.zeros((4, 200), np.float32)}}),
            "missing",
        ),
    ],
)
def test_invalid_tasks_raise_before_touching_the_model(
    device_data: DeviceData, task: LocalTask, message: str
) -> None:
    net = model()
    before = state_arrays(net)

    with pytest.raises(TaskError, match=message):
        local_update(net, device_data, task)

    assert distance(state_arrays(net), before) == 0


def test_mismatched_shapes_are_task_errors(device_data: DeviceData) -> None:
    received = global_arrays()
    received["head.bias"] = np.zeros(7, np.float32)
    net = model()
    before = state_arrays(net)

    with pytest.raises(TaskError, match=r"wrong shape \['head.bias'\]"):
        local_update(net, device_data, LocalTask("fedavg", HP, {"global": received}))

    assert distance(state_arrays(net), before) == 0


def test_unknown_sets_and_unsupported_uploads_are_task_errors(device_data: DeviceData) -> None:
    received = global_arrays()
    net = model()
    before = state_arrays(net)

    with pytest.raises(
        TaskError, match=r"does not use the set\(s\) \['teacher'\]; it takes \['global'\]"
    ):
        local_update(
            net, device_data, LocalTask("fedprox", HP, {"global": received, "teacher": received})
        )
    with pytest.raises(TaskError, match=r"uploads \['all'\], not 'head'"):
        local_update(
            net, device_data, LocalTask("fedprox", HP, {"global": received}, upload="head")
        )

    assert distance(state_arrays(net), before) == 0


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
        "fedprox": ("all",),
        "fedkf": ("all",),
        "fedgen": ("all", "head"),
    }


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
