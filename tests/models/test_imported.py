"""A user's classifier by import path: built, checked, and refused with reasons."""

from __future__ import annotations

import numpy as np
import pytest
from torch import nn

from edge_client.config import ClientConfig
from edge_client.train.data import DeviceData
from edge_client.train.local_update import local_update
from edge_client.train.task import LocalTask
from edge_client.train.trainer import build_device_model
from models import (
    ImportedClassifier,
    ModelConfigError,
    UnknownModelError,
    build_classifier,
    lacks_split,
    seeded,
    state_arrays,
)

HERE = "tests.models.user_models"


def build(name: str, **kwargs: object) -> ImportedClassifier:
    with seeded(0):
        model = build_classifier(f"{HERE}:{name}", num_classes=5, **kwargs)  # type: ignore[arg-type]
    assert isinstance(model, ImportedClassifier)
    return model


def test_a_model_that_declares_its_split_is_a_classifier_of_features_and_head() -> None:
    model = build("build_split")
    assert model.architecture == f"{HERE}:build_split"
    assert model.split and not lacks_split(model)
    assert model.latent_dim == 4 * 4 * 4
    assert isinstance(model.head, nn.Linear)
    keys = list(model.state_dict())
    assert keys and all(k.startswith(("features.", "head.")) for k in keys)
    assert model.head_param_names == ("head.weight", "head.bias")
    again = build("build_split")  # the same seed: the same weights and fingerprint
    assert again.fingerprint() == model.fingerprint()
    for key, value in state_arrays(model).items():
        np.testing.assert_array_equal(value, state_arrays(again)[key])
    wider = build("build_split", image_size=35)  # another input: another fingerprint
    assert wider.fingerprint() != model.fingerprint()


def test_a_model_without_a_split_is_all_features() -> None:
    model = build("build_flat")
    assert not model.split and lacks_split(model)
    assert isinstance(model.head, nn.Identity)
    assert all(k.startswith("features.") for k in model.state_dict())
    assert model.head_param_names == ()


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("build_wrong_output", r"to \(2, 6\), not logits \(2, 5\)"),
        ("build_not_a_module", "returned an object of type dict, not a torch.nn.Module"),
        ("build_scaled_split", r"forward is not head\(features\(x\)\)"),
        ("build_stray", "parameters outside them: temperature"),
        ("NOT_CALLABLE", "not a callable factory: it is of type int"),
        ("no_such_factory", "has no no_such_factory"),
    ],
)
def test_a_factory_that_breaks_the_contract_is_refused_with_the_reason(
    name: str, match: str
) -> None:
    with pytest.raises(ModelConfigError, match=match):
        build(name)


def test_an_import_path_that_does_not_import_is_refused() -> None:
    with pytest.raises(ModelConfigError, match=r"cannot import tests\.models\.nowhere"):
        build_classifier("tests.models.nowhere:build")
    with pytest.raises(ModelConfigError, match="at most 64"):
        build_classifier("a" * 60 + ".b:build")
    with pytest.raises(ModelConfigError, match="not a registered name nor an import path"):
        build_classifier("tests.models:")
    with pytest.raises(UnknownModelError, match="or a factory's import path"):
        build_classifier("lenet7")


def test_a_users_model_takes_samples_of_any_shape_and_a_device_trains_it() -> None:
    """Series (T, C) on a model of the user's; the built-in classifiers take square
    images only and say so."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((24, 9, 6)).astype(np.float32)
    y = (x.mean(axis=(1, 2)) > 0).astype(np.int64)
    data = DeviceData("watch-1", x, y, x[:4], y[:4], 2)
    config = ClientConfig(device_id="watch-1", model=f"{HERE}:build_flat")
    model = build_device_model(config, data)
    assert model.input_shape == (9, 6)
    assert model.features[1].in_features == 54  # type: ignore[index]
    task = LocalTask("fedavg", {"batch_size": 8, "local_epochs": 2}, {})
    result = local_update(model, data, task)
    assert result.steps == 6 and result.num_samples == 24
    assert all(np.isfinite(v).all() for v in result.sets["weights"].values())
    with pytest.raises(ModelConfigError, match=r"takes square images \(C, H, W\), not samples"):
        build_classifier("lenet5", num_classes=2, input_shape=(9, 6))
    with pytest.raises(ModelConfigError, match="every dimension of a sample must be >= 1"):
        build_classifier(f"{HERE}:build_flat", num_classes=2, input_shape=(9, 0))
