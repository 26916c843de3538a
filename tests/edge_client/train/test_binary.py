"""Binarized-weights training: the binarizer, the BinaryConnect hook, clipping, the task."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from edge_client.errors import TaskError
from edge_client.train.binary import LATENT_CLIP, BinarizeHook, binarize, clip_latent_
from edge_client.train.data import DeviceData
from edge_client.train.local_update import local_update
from edge_client.train.task import LocalTask
from edge_client.train.training import TrainConfig, TrainHook, train_local
from models import Classifier, build_classifier
from models.weight_formats import run_weights_


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """These models are tiny: one thread, or thread overhead dominates on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def separable(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """4 classes on 8x8 images: each class lights its own quadrant (plus noise)."""
    rng = np.random.default_rng(seed)
    y = (np.arange(n) % 4).astype(np.int64)
    x = 0.1 * rng.standard_normal((n, 1, 8, 8)).astype(np.float32)
    for c in range(4):
        r, k = divmod(c, 2)
        x[y == c, 0, 4 * r : 4 * r + 4, 4 * k : 4 * k + 4] += 1.0
    return x, y


def mlp(seed: int = 0) -> Classifier:
    torch.manual_seed(seed)
    return build_classifier("mlp", num_classes=4, in_channels=1, image_size=8, hidden=(32,))


def is_binary(p: torch.Tensor) -> bool:
    """Every output channel holds one magnitude, with either sign."""
    magnitudes = p.detach().flatten(1).abs()  # (C, fan_in)
    return bool((magnitudes == magnitudes[:, :1]).all())


def loss(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    with torch.no_grad():
        return float(F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)))


# --- binarize ------------------------------------------------------------------------


def test_binarize_takes_the_sign_times_each_output_channels_mean_magnitude() -> None:
    weight = torch.tensor([[-1.0, 0.5, 0.0, 2.5], [0.25, -0.25, 0.25, -0.25], [0.0, 0.0, 0.0, 0.0]])

    result = binarize(weight)

    # channel 0: mean|w| = 1.0, the zero maps to +scale; channel 1: 0.25; channel 2 stays 0
    expected = torch.tensor(
        [[-1.0, 1.0, 1.0, 1.0], [0.25, -0.25, 0.25, -0.25], [0.0, 0.0, 0.0, 0.0]]
    )
    assert torch.equal(result, expected)
    assert result.dtype == weight.dtype and not result.requires_grad


def test_binarize_works_on_convolution_kernels_per_output_channel() -> None:
    torch.manual_seed(0)
    weight = torch.randn(6, 3, 5, 5)

    result = binarize(weight)

    for c in range(6):
        scale = weight[c].abs().mean()
        assert torch.allclose(result[c].abs(), scale.expand(3, 5, 5))
        assert torch.equal(torch.sign(result[c]), torch.sign(weight[c]))
    assert is_binary(result)  # binarizing twice changes nothing


def test_binarize_refuses_scalars_and_integers() -> None:
    with pytest.raises(ValueError, match="rank >= 1"):
        binarize(torch.tensor(1.0))
    with pytest.raises(ValueError, match="floating-point"):
        binarize(torch.ones(2, 2, dtype=torch.int64))


def test_clip_latent_bounds_each_weight_in_place() -> None:
    weight = torch.tensor([[-3.0, -0.5], [0.75, 1.5]])

    clip_latent_(weight)

    assert LATENT_CLIP == 1.0
    assert torch.equal(weight, torch.tensor([[-1.0, -0.5], [0.75, 1.0]]))


# --- the hook ------------------------------------------------------------------------


def test_the_hook_trains_a_binarized_model_and_keeps_float_latent_weights() -> None:
    x, y = separable(256, 1)
    x_test, y_test = separable(128, 2)
    model = mlp()
    before = loss(run_weights_(copy.deepcopy(model), "binary"), x_test, y_test)

    result = train_local(
        model,
        x,
        y,
        TrainConfig(local_steps=60, batch_size=32, lr=0.05, binarize=True),
        [BinarizeHook()],
    )

    deployed = run_weights_(copy.deepcopy(model), "binary")
    assert loss(deployed, x_test, y_test) < 0.5 * before  # the binarized model learned
    with torch.no_grad():
        accuracy = (deployed(torch.from_numpy(x_test)).argmax(1).numpy() == y_test).mean()
    assert accuracy >= 0.95
    weights = [p for p in model.parameters() if p.ndim >= 2]
    assert not any(is_binary(p) for p in weights)  # latent floats were restored
    assert all(float(p.detach().abs().max()) <= LATENT_CLIP for p in weights)
    assert np.isfinite(result.loss) and result.steps == 60


def test_the_step_applies_the_gradient_at_the_binarized_weights_and_then_clips() -> None:
    x, y = separable(64, 1)
    model = mlp()
    with torch.no_grad():  # one latent weight the step will push past the clip
        dict(model.named_parameters())["head.weight"][0, 0] = 0.999
    start = {k: v.clone() for k, v in model.state_dict().items()}
    reference = run_weights_(copy.deepcopy(model), "binary")
    reference_loss = F.cross_entropy(reference(torch.from_numpy(x)), torch.from_numpy(y))
    reference_loss.backward()  # type: ignore[no-untyped-call]
    grads = {k: p.grad for k, p in reference.named_parameters() if p.grad is not None}
    lr = 0.5

    result = train_local(
        model,
        x,
        y,
        TrainConfig(local_steps=1, batch_size=64, lr=lr, binarize=True),
        [BinarizeHook()],
    )

    after = model.state_dict()
    assert set(grads) == set(after)
    for name, grad in grads.items():
        expected = start[name] - lr * grad  # from the latent weights, not the binary ones
        if start[name].ndim >= 2:
            expected = expected.clamp(-LATENT_CLIP, LATENT_CLIP)
        assert torch.allclose(after[name], expected, atol=1e-6), name
    assert result.loss == pytest.approx(
        float(reference_loss.detach()), abs=1e-6
    )  # the binary model's


def test_local_update_with_binarize_binarizes_in_the_batch_and_restores_at_the_step() -> None:
    x, y = separable(64, 1)
    device_data = DeviceData("dev-000", x, y, x[:0], y[:0], 4)
    seen: list[tuple[bool, bool]] = []

    class Caller(TrainHook):
        def __init__(self) -> None:
            self.at_batch = False

        def before_batch(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
            self.at_batch = is_binary(dict(model.named_parameters())["features.fc1.weight"])

        def before_step(self, model: nn.Module) -> None:
            fc1 = dict(model.named_parameters())["features.fc1.weight"]
            seen.append((self.at_batch, is_binary(fc1)))

    hp = {"local_steps": 3, "batch_size": 16, "lr": 0.1}

    plain = local_update(mlp(), device_data, LocalTask("fedavg", hp))
    binary = local_update(
        mlp(), device_data, LocalTask("fedavg", {**hp, "binarize": True}), hooks=[Caller()]
    )

    assert seen == [(True, False)] * 3
    name = "features.fc1.weight"
    assert not np.array_equal(plain.sets["weights"][name], binary.sets["weights"][name])


def test_binarize_is_a_hyperparameter_off_by_default_and_excludes_qat() -> None:
    assert TrainConfig().binarize is False
    assert TrainConfig.from_hyperparameters({"binarize": True}).binarize is True
    with pytest.raises(TaskError, match="qat and binarize exclude each other"):
        TrainConfig.from_hyperparameters({"binarize": True, "qat": True})
