"""Classifiers: parameter counts, shapes, the features/head split, fingerprints, registry."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import models
from models import (
    MLP,
    Classifier,
    ModelConfigError,
    ModelError,
    UnknownModelError,
    build_classifier,
    classifier_names,
)

# (name, in_channels, image_size, options) -> exact parameter count with 10 classes.
PARAM_COUNTS = [
    ("lenet5", 1, 28, {}, 61_706),
    ("lenet5", 3, 32, {}, 62_006),
    ("resnet8", 1, 28, {}, 77_754),
    ("resnet8", 3, 32, {}, 78_042),
    ("resnet8", 3, 32, {"widths": (64, 128, 256)}, 1_227_594),
    ("fedgen_cnn", 1, 28, {}, 26_390),
    ("fedgen_cnn", 3, 32, {}, 34_178),
    ("mlp", 1, 28, {}, 199_210),
    ("mlp", 3, 32, {}, 656_810),
]
LATENT_DIMS = {"lenet5": 84, "resnet8": 64, "fedgen_cnn": 32, "mlp": 200}
INPUTS = [(1, 28), (3, 32)]


def n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_registry_lists_every_architecture() -> None:
    assert classifier_names() == ("fedgen_cnn", "lenet5", "mlp", "resnet8")


@pytest.mark.parametrize(("name", "channels", "size", "options", "expected"), PARAM_COUNTS)
def test_parameter_count(
    name: str, channels: int, size: int, options: dict[str, Any], expected: int
) -> None:
    model = build_classifier(name, in_channels=channels, image_size=size, **options)

    assert n_params(model) == expected


@pytest.mark.parametrize("name", sorted(LATENT_DIMS))
@pytest.mark.parametrize(("channels", "size"), INPUTS)
def test_shapes_and_forward_is_head_of_features(name: str, channels: int, size: int) -> None:
    torch.manual_seed(0)
    model = build_classifier(name, num_classes=7, in_channels=channels, image_size=size)
    x = torch.randn(3, channels, size, size)

    latent = model.features(x)
    logits = model(x)

    assert isinstance(model, Classifier)
    assert model.architecture == name
    assert model.input_shape == (channels, size, size)
    assert model.num_classes == 7
    assert model.latent_dim == LATENT_DIMS[name]
    assert latent.shape == (3, LATENT_DIMS[name])
    assert logits.shape == (3, 7)
    torch.testing.assert_close(logits, model.head(latent))


@pytest.mark.parametrize("name", sorted(LATENT_DIMS))
def test_head_param_names_are_the_head_keys(name: str) -> None:
    model = build_classifier(name)

    names = model.head_param_names

    assert names == ("head.weight", "head.bias")
    assert tuple(model.head.weight.shape) == (10, model.latent_dim)
    assert all(k.startswith(("features.", "head.")) for k in model.state_dict())


@pytest.mark.parametrize("name", sorted(LATENT_DIMS))
def test_fingerprint_depends_on_shapes_not_weights(name: str) -> None:
    torch.manual_seed(1)
    first = build_classifier(name)
    torch.manual_seed(2)
    second = build_classifier(name)
    other_classes = build_classifier(name, num_classes=5)

    assert not torch.equal(first.head.weight, second.head.weight)
    assert first.fingerprint() == second.fingerprint()
    assert len(first.fingerprint()) == 16
    assert first.fingerprint() != other_classes.fingerprint()


def test_fingerprint_differs_between_architectures_and_widths() -> None:
    fingerprints = {build_classifier(name).fingerprint() for name in classifier_names()}
    small = build_classifier("resnet8", in_channels=3, image_size=32)
    wide = build_classifier("resnet8", in_channels=3, image_size=32, widths=(64, 128, 256))

    assert len(fingerprints) == len(classifier_names())
    assert small.fingerprint() != wide.fingerprint()


def test_fingerprint_is_stable_across_rebuilds() -> None:
    # Pinned so that an accidental change of names or shapes is noticed: devices
    # announce this value and the coordinator compares it.
    model = build_classifier("lenet5")

    assert model.fingerprint() == build_classifier("lenet5").fingerprint()
    assert model.fingerprint() == "182886740282db9a"


@pytest.mark.parametrize("name", sorted(LATENT_DIMS))
def test_manual_seed_gives_identical_weights(name: str) -> None:
    torch.manual_seed(123)
    first = build_classifier(name, device=torch.device("cpu"))
    torch.manual_seed(123)
    second = build_classifier(name, device="cpu")

    for (key_a, a), (key_b, b) in zip(
        first.state_dict().items(), second.state_dict().items(), strict=True
    ):
        assert key_a == key_b
        assert torch.equal(a, b)


def test_device_parameter_places_the_module() -> None:
    model = build_classifier("fedgen_cnn", device=torch.device("cpu"))

    assert {p.device for p in model.parameters()} == {torch.device("cpu")}


def test_resnet8_uses_groupnorm_without_buffers() -> None:
    model = build_classifier("resnet8", in_channels=3, image_size=32)

    norms = [m for m in model.modules() if isinstance(m, torch.nn.GroupNorm)]

    assert list(model.buffers()) == []
    assert norms and all(m.num_groups == m.num_channels for m in norms)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def test_unknown_name_lists_known_names() -> None:
    with pytest.raises(UnknownModelError) as info:
        build_classifier("vgg16")

    assert isinstance(info.value, KeyError)
    assert "vgg16" in str(info.value)
    assert "lenet5" in str(info.value) and "resnet8" in str(info.value)


@pytest.mark.parametrize(
    ("name", "options", "mentions"),
    [
        ("mlp", {"hiden": (10,)}, "hiden"),
        ("resnet8", {"widths": (16, 32)}, "widths"),
        ("resnet8", {"widths": (16, 0, 64)}, "widths"),
        ("lenet5", {"image_size": 64}, "image_size"),
        ("fedgen_cnn", {"kernel_size": 4}, "kernel_size"),
        ("mlp", {"num_classes": 1}, "num_classes"),
        ("mlp", {"hidden": ()}, "hidden"),
    ],
)
def test_bad_option_raises_model_config_error(
    name: str, options: dict[str, Any], mentions: str
) -> None:
    with pytest.raises(ModelConfigError) as info:
        build_classifier(name, **options)

    assert isinstance(info.value, ModelError)
    assert isinstance(info.value, ValueError)
    assert mentions in str(info.value)


def test_options_reach_the_config() -> None:
    model = build_classifier("mlp", hidden=(32, 16), num_classes=3)

    assert isinstance(model, MLP)
    assert model.latent_dim == 16
    assert model.config.hidden == (32, 16)
    assert n_params(model) == 784 * 32 + 32 + 32 * 16 + 16 + 16 * 3 + 3


def test_public_surface_resolves() -> None:
    exported = set(models.__all__)

    assert len(exported) == len(models.__all__)
    assert all(hasattr(models, name) for name in exported)
    assert {"build_classifier", "state_arrays", "load_state_arrays", "ModelError"} <= exported
