"""FedGen's device side: full and head-only sharing, the generator term, the sets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_client.errors import TaskError
from edge_client.train.data import DeviceData
from edge_client.train.local_update import local_update, validate_task
from edge_client.train.strategies.fedgen import (
    FedGen,
    FedGenHook,
    label_prior,
    latent_generator_shapes,
)
from edge_client.train.task import LocalTask
from edge_client.train.training import TrainConfig, train_local
from models import (
    Classifier,
    LatentGenerator,
    LatentGeneratorConfig,
    build_classifier,
    state_arrays,
    state_shapes,
)

NUM_CLASSES = 4
HP: dict[str, object] = {"local_steps": 4, "batch_size": 16, "lr": 0.1, "seed": 2}


def model(seed: int = 0) -> Classifier:
    torch.manual_seed(seed)
    return build_classifier("mlp", num_classes=NUM_CLASSES, in_channels=1, image_size=8)


def generator_arrays(seed: int = 9, hidden: int = 256) -> dict[str, np.ndarray]:
    """A coordinator-side generator for the MLP's 200-d latents, with non-trivial
    BatchNorm statistics (as after training)."""
    torch.manual_seed(seed)
    generator = LatentGenerator(
        LatentGeneratorConfig(hidden_dim=hidden, num_classes=NUM_CLASSES, latent_dim=200)
    )
    generator.train()
    with torch.no_grad():
        for _ in range(3):
            generator(torch.randn(16, 32), torch.arange(16) % NUM_CLASSES)
    return state_arrays(generator)


def prior(values: list[float]) -> dict[str, np.ndarray]:
    return {"label_prior": np.asarray(values, dtype=np.float32)}


@pytest.fixture(scope="module")
def device_data() -> DeviceData:
    rng = np.random.default_rng(4)
    y = (np.arange(64) % NUM_CLASSES).astype(np.int64)
    x = rng.random((64, 1, 8, 8), dtype=np.float32)
    return DeviceData("dev-000", x, y, x[:0], y[:0], NUM_CLASSES)


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def part(arrays: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {k: v for k, v in arrays.items() if k.startswith(prefix)}


def test_head_sharing_loads_only_the_head_and_uploads_only_the_head(
    device_data: DeviceData,
) -> None:
    device_model = model(1)
    own_features = part(state_arrays(device_model), "features.")
    received_head = state_arrays(model(5), "head")
    no_training = {**HP, "local_steps": 0, "local_epochs": 0}

    result = local_update(
        device_model,
        device_data,
        LocalTask("fedgen", no_training, {"head": received_head}, upload="head"),
    )

    uploaded = result.sets["weights"]
    assert tuple(uploaded) == device_model.head_param_names
    assert not any(name.startswith("features.") for name in uploaded)
    assert same(uploaded, received_head)
    assert same(part(state_arrays(device_model), "features."), own_features)


def test_head_sharing_trains_from_the_own_features_and_the_received_head(
    device_data: DeviceData,
) -> None:
    own = state_arrays(model(1))
    received = state_arrays(model(5))
    generator = generator_arrays()
    hp = {**HP, "generative_alpha": 1.0}
    combined = {**part(own, "features."), **part(received, "head.")}

    head_mode = local_update(
        model(1),
        device_data,
        LocalTask("fedgen", hp, {"head": part(received, "head."), "generator": generator}),
    )
    as_if_global = local_update(
        model(7), device_data, LocalTask("fedgen", hp, {"global": combined, "generator": generator})
    )
    full_mode = local_update(
        model(1), device_data, LocalTask("fedgen", hp, {"global": received, "generator": generator})
    )

    trained = head_mode.sets["weights"]
    assert same(trained, as_if_global.sets["weights"])
    assert not same(part(trained, "features."), part(own, "features."))  # trained locally
    assert not same(part(trained, "features."), part(full_mode.sets["weights"], "features."))


def test_full_sharing_loads_the_whole_model(device_data: DeviceData) -> None:
    received = state_arrays(model(5))
    no_training = {**HP, "local_steps": 0, "local_epochs": 0}

    result = local_update(
        model(1), device_data, LocalTask("fedgen", no_training, {"global": received})
    )

    assert same(result.sets["weights"], received)


def test_without_the_generator_term_fedgen_is_fedavg(device_data: DeviceData) -> None:
    received = state_arrays(model(5))
    generator = generator_arrays()

    fedavg = local_update(model(1), device_data, LocalTask("fedavg", HP, {"global": received}))
    first_round = local_update(model(1), device_data, LocalTask("fedgen", HP, {"global": received}))
    alpha_zero = local_update(
        model(1),
        device_data,
        LocalTask("fedgen", HP, {"global": received, "generator": generator}),
    )

    assert same(first_round.sets["weights"], fedavg.sets["weights"])
    assert same(alpha_zero.sets["weights"], fedavg.sets["weights"])
    assert set(alpha_zero.metrics) == {"loss", "accuracy"}


def test_the_generator_term_changes_the_update_and_is_deterministic(
    device_data: DeviceData,
) -> None:
    sets = {"global": state_arrays(model(5)), "generator": generator_arrays()}
    with_term = {**HP, "generative_alpha": 1.0}

    plain = local_update(model(1), device_data, LocalTask("fedgen", HP, sets))
    a = local_update(model(1), device_data, LocalTask("fedgen", with_term, sets))
    b = local_update(model(2), device_data, LocalTask("fedgen", with_term, sets))

    assert not same(a.sets["weights"], plain.sets["weights"])
    assert same(a.sets["weights"], b.sets["weights"])
    assert set(a.metrics) == {"loss", "accuracy", "generator_ce"}
    assert a.metrics["generator_ce"] > 0


def test_the_generator_stays_frozen(device_data: DeviceData) -> None:
    received = generator_arrays()
    net = model(1)
    config = TrainConfig.from_hyperparameters({**HP, "generative_alpha": 2.0})

    (hook,) = FedGen().prepare(
        net, {"global": state_arrays(model(5)), "generator": received}, config, {}
    )
    train_local(net, device_data.x, device_data.y, config, [hook])

    assert isinstance(hook, FedGenHook)
    assert same(state_arrays(hook.generator), received)  # BatchNorm statistics included
    assert not hook.generator.training
    assert all(p.grad is None for p in hook.generator.parameters())


def test_generated_labels_follow_the_prior(device_data: DeviceData) -> None:
    # All generated labels are class 2, so the term pushes the head's bias of class 2 up.
    sets = {
        "global": state_arrays(model(5)),
        "generator": generator_arrays(),
        "prior": prior([0.0, 0.0, 1.0, 0.0]),
    }
    bias_of = {}
    for alpha in (0.0, 5.0):
        result = local_update(
            model(1), device_data, LocalTask("fedgen", {**HP, "generative_alpha": alpha}, sets)
        )
        bias_of[alpha] = result.sets["weights"]["head.bias"]

    shift = bias_of[5.0] - bias_of[0.0]
    assert shift[2] > 0 and all(shift[k] < 0 for k in (0, 1, 3))


def test_generator_hyperparameters_set_the_expected_shapes() -> None:
    config = TrainConfig(generator_hidden=64, generator_noise_dim=8)

    shapes = latent_generator_shapes(model(), config)

    assert shapes["fc1.weight"] == (64, 8 + NUM_CLASSES)
    assert shapes["out.weight"] == (200, 64)
    assert shapes["norm1.num_batches_tracked"] == ()
    assert latent_generator_shapes(model(), TrainConfig())["fc1.weight"] == (256, 32 + NUM_CLASSES)


def test_label_prior_checks_and_normalises() -> None:
    assert label_prior(None, 4).tolist() == [0.25] * 4
    assert label_prior(np.array([0.5, 0.5, 0.0, 0.004]), 4).sum().item() == pytest.approx(1.0)
    for bad, message in [
        (np.array([0.5, 0.5, 0.5, -0.5]), "non-negative"),
        (np.array([0.5, 0.5, np.nan, 0.0]), "finite"),
        (np.array([0.5, 0.6, 0.0, 0.0]), "sum to 1"),
        (np.array([1, 0, 0, 0]), "float vector"),
        (np.array([0.5, 0.5]), "shape"),
    ]:
        with pytest.raises(TaskError, match=message):
            label_prior(bad, 4)


@pytest.mark.parametrize(
    ("sets", "upload", "message"),
    [
        ({"generator": "G"}, "all", "exactly one of the sets 'global'"),
        ({"global": "M", "head": "H"}, "all", "exactly one of the sets 'global'"),
        ({"global": "M", "teacher": "M"}, "all", r"does not use the set\(s\) \['teacher'\]"),
        ({"head": "H", "generator": "G64"}, "all", r"set 'generator' does not fit.*wrong shape"),
        ({"head": "M"}, "head", r"set 'head' does not fit.*unexpected \['features"),
        ({"global": "M", "prior": "P+"}, "all", "sum to 1"),
        ({"global": "M", "prior": "P3"}, "all", r"set 'prior' does not fit.*wrong shape"),
        ({"global": "M"}, "features", "not 'features'"),
    ],
)
def test_invalid_fedgen_tasks_are_task_errors(
    device_data: DeviceData, sets: dict[str, str], upload: str, message: str
) -> None:
    arrays = {
        "M": state_arrays(model(5)),
        "H": state_arrays(model(5), "head"),
        "G": generator_arrays(),
        "G64": generator_arrays(hidden=64),
        "P+": prior([0.5, 0.5, 0.5, 0.0]),
        "P3": prior([0.5, 0.5, 0.0]),
    }
    task = LocalTask("fedgen", HP, {name: arrays[key] for name, key in sets.items()}, upload)  # type: ignore[arg-type]
    net = model(1)
    before = state_arrays(net)

    with pytest.raises(TaskError, match=message):
        local_update(net, device_data, task)

    assert same(state_arrays(net), before)


def test_head_upload_is_fedavg_and_fedgen_only() -> None:
    net = model()
    head_task = LocalTask("fedprox", HP, {"global": state_arrays(net)}, upload="head")

    with pytest.raises(TaskError, match=r"strategy 'fedprox' uploads \['all'\], not 'head'"):
        validate_task(net, head_task)
    config = validate_task(
        net, LocalTask("fedgen", HP, {"head": state_arrays(net, "head")}, "head")
    )
    assert isinstance(config, TrainConfig)
    assert state_shapes(net, "head") == {"head.weight": (4, 200), "head.bias": (4,)}
