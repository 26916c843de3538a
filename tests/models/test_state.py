"""State <-> dict of numpy arrays: round trips, subsets, buffers, all-or-nothing loads."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from models import (
    ModelInputError,
    StateMismatchError,
    build_classifier,
    build_generator,
    load_state_arrays,
    state_arrays,
    state_shapes,
    subset_names,
)

CPU = torch.device("cpu")
Arrays = dict[str, npt.NDArray[Any]]


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def assert_state_equal(module: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = module.state_dict()
    assert list(state) == list(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


@pytest.mark.parametrize("name", ["lenet5", "resnet8", "fedgen_cnn", "mlp"])
def test_round_trip_gives_equal_outputs(name: str) -> None:
    torch.manual_seed(0)
    source = build_classifier(name, device=CPU)
    target = build_classifier(name, device=CPU)
    x = torch.randn(2, 1, 28, 28)

    load_state_arrays(target, state_arrays(source))

    torch.testing.assert_close(target(x), source(x), rtol=0, atol=0)


def test_arrays_are_contiguous_float32_copies_in_state_dict_order() -> None:
    model = build_classifier("lenet5")

    arrays = state_arrays(model)
    arrays["head.bias"][:] = 42.0

    assert list(arrays) == list(model.state_dict())
    assert all(a.dtype == np.float32 and a.flags.c_contiguous for a in arrays.values())
    assert all(a.shape == tuple(model.state_dict()[k].shape) for k, a in arrays.items())
    assert not torch.any(model.head.bias == 42.0)


def test_half_precision_module_exports_float32() -> None:
    model = build_classifier("mlp", hidden=(8,)).to(torch.bfloat16)

    arrays = state_arrays(model, "head")

    assert {a.dtype for a in arrays.values()} == {np.dtype(np.float32)}
    np.testing.assert_array_equal(arrays["head.bias"], model.head.bias.float().detach().numpy())


def test_head_and_features_partition_the_state() -> None:
    model = build_classifier("resnet8")

    head = subset_names(model, "head")
    features = subset_names(model, "features")
    everything = subset_names(model, "all")

    assert head == model.head_param_names == ("head.weight", "head.bias")
    assert set(head).isdisjoint(features)
    assert set(head) | set(features) == set(everything)
    assert len(head) + len(features) == len(everything)


def test_shapes_match_arrays() -> None:
    model = build_classifier("fedgen_cnn")

    shapes = state_shapes(model, "head")

    assert shapes == {"head.weight": (10, 32), "head.bias": (10,)}
    assert shapes == {k: a.shape for k, a in state_arrays(model, "head").items()}


def test_head_only_load_leaves_features_alone() -> None:
    torch.manual_seed(0)
    source = build_classifier("fedgen_cnn")
    target = build_classifier("fedgen_cnn")
    features_before = {k: v.clone() for k, v in target.features.state_dict().items()}

    load_state_arrays(target, state_arrays(source, "head"), subset="head")

    assert torch.equal(target.head.weight, source.head.weight)
    assert_state_equal(target.features, features_before)


def test_buffers_flag_includes_or_excludes_batchnorm_statistics() -> None:
    generator = build_generator("latent")
    generator(torch.randn(4, 32), torch.tensor([0, 1, 2, 3]))  # updates running stats

    with_buffers = state_arrays(generator, "generator")
    without = state_arrays(generator, "generator", buffers=False)

    buffer_names = {"norm1.running_mean", "norm1.running_var", "norm1.num_batches_tracked"}
    assert buffer_names <= set(with_buffers)
    assert set(with_buffers) - set(without) == buffer_names
    assert set(without) == {n for n, _ in generator.named_parameters()}
    assert with_buffers["norm1.num_batches_tracked"].dtype == np.int64
    assert with_buffers["norm1.num_batches_tracked"].shape == ()
    assert int(with_buffers["norm1.num_batches_tracked"]) == 1


def test_generator_round_trip_with_buffers() -> None:
    torch.manual_seed(0)
    source = build_generator("image", noise_dim=8, base_channels=4)
    source(torch.randn(3, 8))  # move the running statistics away from their defaults
    target = build_generator("image", noise_dim=8, base_channels=4)
    z = torch.randn(2, 8)

    load_state_arrays(target, state_arrays(source, "generator"), subset="generator")

    torch.testing.assert_close(target.eval()(z), source.eval()(z), rtol=0, atol=0)
    count = target.state_dict()["norm0.num_batches_tracked"]
    assert count.dtype == torch.int64
    assert int(count) == 1


def test_parameters_only_load_keeps_buffers() -> None:
    source = build_generator("latent")
    source(torch.randn(4, 32), torch.tensor([0, 1, 2, 3]))
    target = build_generator("latent")

    load_state_arrays(target, state_arrays(source, buffers=False), buffers=False)

    assert torch.equal(target.fc1.weight, source.fc1.weight)
    assert int(target.state_dict()["norm1.num_batches_tracked"]) == 0
    assert torch.equal(target.state_dict()["norm1.running_mean"], torch.zeros(256))


def _corrupt_shape(arrays: Arrays) -> None:
    arrays["head.weight"] = np.zeros((3, 84), dtype=np.float32)


def _drop(arrays: Arrays) -> None:
    del arrays["features.conv2.bias"]


def _extra(arrays: Arrays) -> None:
    arrays["features.conv9.weight"] = np.zeros(3, dtype=np.float32)


def _nan(arrays: Arrays) -> None:
    arrays["features.fc.bias"][5] = np.nan


def _inf(arrays: Arrays) -> None:
    arrays["head.bias"][0] = -np.inf


def _strings(arrays: Arrays) -> None:
    arrays["head.bias"] = np.array(["x"] * 10)


@pytest.mark.parametrize(
    ("corrupt", "named"),
    [
        (_corrupt_shape, "head.weight"),
        (_drop, "features.conv2.bias"),
        (_extra, "features.conv9.weight"),
        (_nan, "features.fc.bias"),
        (_inf, "head.bias"),
        (_strings, "head.bias"),
    ],
)
def test_bad_arrays_are_rejected_and_module_unchanged(
    corrupt: Callable[[Arrays], None], named: str
) -> None:
    torch.manual_seed(0)
    source = build_classifier("lenet5", device=CPU)
    target = build_classifier("lenet5", device=CPU)
    arrays = state_arrays(source)
    corrupt(arrays)
    before = snapshot(target)

    with pytest.raises(StateMismatchError) as info:
        load_state_arrays(target, arrays)

    assert named in str(info.value)
    assert isinstance(info.value, ValueError)
    assert_state_equal(target, before)


def test_error_names_every_problem_at_once() -> None:
    model = build_classifier("lenet5")
    arrays = state_arrays(model)
    _corrupt_shape(arrays)
    _drop(arrays)
    _nan(arrays)

    with pytest.raises(StateMismatchError) as info:
        load_state_arrays(model, arrays)

    message = str(info.value)
    assert "missing: features.conv2.bias" in message
    assert "head.weight (3, 84) != (10, 84)" in message
    assert "non-finite values: features.fc.bias" in message


def test_non_strict_load_allows_missing_and_unexpected_names() -> None:
    torch.manual_seed(0)
    source = build_classifier("mlp", hidden=(8,))
    target = build_classifier("mlp", hidden=(8,))
    kept = target.state_dict()["features.fc1.weight"].clone()
    arrays = {"head.bias": state_arrays(source)["head.bias"], "other": np.zeros(1)}

    load_state_arrays(target, arrays, strict=False)

    assert torch.equal(target.head.bias, source.head.bias)
    assert torch.equal(target.state_dict()["features.fc1.weight"], kept)


def test_non_strict_load_still_checks_shapes() -> None:
    model = build_classifier("mlp", hidden=(8,))
    before = snapshot(model)

    with pytest.raises(StateMismatchError, match=r"head\.bias"):
        load_state_arrays(model, {"head.bias": np.zeros(3, np.float32)}, strict=False)

    assert_state_equal(model, before)


def test_load_converts_dtype_and_byte_order_to_the_module() -> None:
    model = build_classifier("mlp", hidden=(4,), num_classes=3).to(torch.float64)
    bias = np.array([1.5, -2.0, 0.25], dtype=">f4")  # big-endian float32

    load_state_arrays(model, {"head.bias": bias}, subset="head", strict=False)

    assert model.head.bias.dtype == torch.float64
    assert model.head.bias.tolist() == [1.5, -2.0, 0.25]


def test_subset_must_fit_the_module() -> None:
    classifier = build_classifier("mlp")
    generator = build_generator("latent")

    with pytest.raises(ModelInputError):
        state_arrays(generator, "head")
    with pytest.raises(ModelInputError):
        subset_names(classifier, "generator")
    with pytest.raises(ModelInputError):
        state_shapes(classifier, "everything")  # type: ignore[arg-type]
