"""A stacked module gives each of N models its own output and its own gradient."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn

from models import (
    LatentGenerator,
    LatentGeneratorConfig,
    build_classifier,
    build_generator,
)
from models.stacked import StackedModule

ROWS, BATCH = 3, 5


def _state(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    first = modules[0]
    trainable = {n for n, p in first.named_parameters() if p.requires_grad}
    out = {}
    for name, _ in list(first.named_parameters()) + list(first.named_buffers()):
        rows = [dict(list(m.named_parameters()) + list(m.named_buffers()))[name] for m in modules]
        out[name] = torch.stack([r.detach().clone() for r in rows]).requires_grad_(
            name in trainable
        )
    return out


def _distinct(module: nn.Module, rows: int) -> list[nn.Module]:
    """``rows`` copies of ``module`` with different weights and running statistics."""
    out = []
    for row in range(rows):
        copy_ = copy.deepcopy(module)
        with torch.no_grad():
            for tensor in list(copy_.parameters()) + list(copy_.buffers()):
                if tensor.is_floating_point():
                    tensor.add_(0.05 * (row + 1) * torch.randn_like(tensor))
                    if tensor.min() >= 0:  # running variances stay positive
                        tensor.abs_()
        out.append(copy_)
    return out


def _check(modules: list[nn.Module], inputs: list[torch.Tensor], train: bool) -> None:
    stacked = StackedModule(modules[0]).train(train)
    assert stacked.unstackable == ""
    state = _state(modules)
    out = stacked(state, *inputs)
    names = [n for n, p in modules[0].named_parameters() if p.requires_grad]
    grads = torch.autograd.grad((out**2).sum(), [state[n] for n in names])
    for row, module in enumerate(modules):
        module.train(train)
        expected = module(*[x[row] for x in inputs])
        torch.testing.assert_close(out[row], expected, rtol=1e-5, atol=1e-5)
        own = torch.autograd.grad((expected**2).sum(), [p for _, p in module.named_parameters()])
        # relative to the row's largest gradient: a bias just before a training-mode
        # BatchNorm has a gradient of exactly 0, which each summation order rounds apart
        scale = max(1.0, *(float(value.abs().max()) for value in own))
        for name, value, got in zip(names, own, grads, strict=True):
            assert float((value - got[row]).abs().max()) <= 1e-4 * scale, name
        for name, buffer in module.named_buffers():  # BatchNorm's running statistics
            torch.testing.assert_close(state[name][row], buffer, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("name", "side", "channels"),
    [("lenet5", 28, 1), ("resnet8", 16, 3), ("fedgen_cnn", 28, 1), ("mlp", 28, 1)],
)
def test_each_row_is_its_own_classifier(name: str, side: int, channels: int) -> None:
    torch.manual_seed(0)
    model = build_classifier(name, num_classes=10, in_channels=channels, image_size=side)
    _check(_distinct(model, ROWS), [torch.randn(ROWS, BATCH, channels, side, side)], True)


@pytest.mark.parametrize("train", [True, False])
def test_each_row_is_its_own_image_generator_with_its_own_batch_statistics(train: bool) -> None:
    torch.manual_seed(1)
    generator = build_generator("image", noise_dim=8, image_size=28, channels=1, base_channels=4)
    _check(_distinct(generator, ROWS), [torch.randn(ROWS, BATCH, 8)], train)


def test_each_row_is_its_own_latent_generator() -> None:
    torch.manual_seed(2)
    generator = LatentGenerator(LatentGeneratorConfig(hidden_dim=16, num_classes=4, latent_dim=8))
    labels = torch.randint(0, 4, (ROWS, BATCH))
    _check(_distinct(generator, ROWS), [torch.randn(ROWS, BATCH, 32), labels], True)


def test_a_chain_hands_grouped_tensors_only_to_layers_that_act_on_each_plane() -> None:
    # Prepare: convolutions with plane-wise layers between them, and layers that need the
    # flat layout in the middle (BatchNorm, GroupNorm) and at the end (Flatten, Linear)
    torch.manual_seed(3)
    chain = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3, stride=2),
        nn.BatchNorm2d(6),
        nn.Tanh(),
        nn.Conv2d(6, 4, 1),
        nn.GroupNorm(2, 4),
        nn.AvgPool2d(2),
        nn.Conv2d(4, 5, 3, padding=1),
        nn.Flatten(),
        nn.Linear(5, 3),
    )

    # Execute / Assert: row by row as each model alone, in training and in evaluation
    for train in (True, False):
        _check(_distinct(chain, ROWS), [torch.randn(ROWS, BATCH, 2, 12, 12)], train)
    twin = StackedModule(chain).twin
    assert type(twin).__name__ == "_GroupedSequential"
    assert [n for n, _ in twin.named_parameters()] == [n for n, _ in chain.named_parameters()]


def _run_order(chain: nn.Sequential) -> list[str]:
    """The kinds of the steps the stacked twin of ``chain`` runs, in order."""
    steps: list[object] = vars(StackedModule(chain).twin)["_order"]
    return [type(step).__name__ for step in steps]


def test_a_relu_before_a_max_pooling_runs_after_it_with_the_same_values() -> None:
    # Prepare: ReLU then max pooling (LeNet-5's stages), once with padding and ceil mode
    torch.manual_seed(5)
    chain = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 4, 3),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 3),
    )

    # Execute / Assert: each row is its own model, and the pooling runs first
    for train in (True, False):
        _check(_distinct(chain, ROWS), [torch.randn(ROWS, BATCH, 2, 12, 12)], train)
    order = _run_order(chain)
    assert order[:6] == ["_Conv2d", "MaxPool2d", "ReLU", "_Conv2d", "MaxPool2d", "ReLU"]


@pytest.mark.parametrize(("groups", "bias"), [(1, True), (2, False)])
def test_an_upsampling_before_a_3x3_convolution_runs_as_one_transposed_convolution(
    groups: int, bias: bool
) -> None:
    # Prepare: nearest x2 upsamplings each before a 3x3 convolution (an image generator's
    # blocks), on images that are not square; then one that is not fused (x3)
    torch.manual_seed(6)
    chain = nn.Sequential(
        nn.Upsample(scale_factor=2),
        nn.Conv2d(4, 6, 3, padding=1, groups=groups, bias=bias),
        nn.BatchNorm2d(6),
        nn.LeakyReLU(0.2),
        nn.Upsample(scale_factor=(2, 2)),
        nn.Conv2d(6, 2, 3, padding=1),
        nn.Upsample(scale_factor=3),
        nn.Conv2d(2, 2, 3, padding=1),
    )

    # Execute / Assert
    for train in (True, False):
        _check(_distinct(chain, ROWS), [torch.randn(ROWS, BATCH, 4, 3, 5)], train)
    order = _run_order(chain)
    assert order == [
        "_UpsampledConv",
        "_BatchNorm",
        "LeakyReLU",
        "_UpsampledConv",
        "Upsample",
        "_Conv2d",
    ]


class _TwoChains(nn.Module):
    """Two chains one after the other in ``forward``, the first one's output changed in
    place or not in between."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.in_place = in_place
        self.first = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1))
        self.second = nn.Sequential(nn.Upsample(scale_factor=2), nn.Conv2d(4, 3, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        if self.in_place:
            x.mul_(3.0)
        return self.second(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("in_place", [False, True])
def test_a_chain_takes_the_grouped_output_of_the_chain_before_unless_it_was_changed(
    in_place: bool,
) -> None:
    torch.manual_seed(7)
    model = _TwoChains(in_place)
    _check(_distinct(model, ROWS), [torch.randn(ROWS, BATCH, 2, 6, 6)], True)


def test_each_row_is_its_own_1d_convolutional_network() -> None:
    """Series models (the wearable example's kind): Conv1d with padding, stride,
    dilation and groups, BatchNorm1d and the 1-D pooling between them."""
    torch.manual_seed(4)
    chain = nn.Sequential(
        nn.Conv1d(6, 8, 5, padding=2),
        nn.BatchNorm1d(8),
        nn.ReLU(),
        nn.MaxPool1d(2),
        nn.Conv1d(8, 8, 3, stride=2, dilation=2, groups=2, bias=False),
        nn.ReLU(),
        nn.AdaptiveMaxPool1d(3),
        nn.Conv1d(8, 4, 1),
        nn.AdaptiveAvgPool1d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )
    for train in (True, False):
        _check(_distinct(chain, ROWS), [torch.randn(ROWS, BATCH, 6, 20)], train)


def test_a_layer_without_a_stacked_form_is_named() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    stacked = StackedModule(model)
    assert stacked.unstackable == "layer 1 (LayerNorm) has no stacked form"
    with pytest.raises(ValueError, match="LayerNorm"):
        stacked({}, torch.zeros(2, 3, 4))


def test_an_unknown_layer_without_weights_is_not_assumed_per_sample() -> None:
    class BatchMean(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x - x.mean(dim=0)

    stacked = StackedModule(nn.Sequential(nn.Linear(4, 4), BatchMean()))
    assert "BatchMean" in stacked.unstackable


def test_the_stacked_weights_are_not_copied_from_the_architecture() -> None:
    model = build_classifier("lenet5", num_classes=10, in_channels=1, image_size=28)
    stacked = StackedModule(model)
    assert all(p.device.type == "meta" for p in stacked.twin.parameters())
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_the_cohort_engine_does_not_import_torchs_compiler() -> None:
    """torch.func.vmap imports torch._dynamo on first use (seconds): the engine must not,
    for any strategy with a batched form."""
    code = """
import sys, copy
import numpy as np, torch
from edge_client.train.data import DeviceData
from edge_client.train.task import LocalTask
from models import build_classifier, state_arrays
from sim.cohort.engine import Member, train_cohort
model = build_classifier("lenet5", num_classes=4, in_channels=1, image_size=28)
rng = np.random.default_rng(0)
x = rng.random((12, 1, 28, 28), dtype=np.float32)
y = (np.arange(12) % 4).astype(np.int64)
data = DeviceData("d", x, y, x[:0], y[:0], 4)
weights = state_arrays(model)
kf = {"generator_width": 4, "generator_noise_dim": 8}
tasks = [
    LocalTask("fedavg", {"seed": 1, "batch_size": 8, "qat": True}, {"global": weights}),
    LocalTask("fedprox", {"seed": 1, "batch_size": 8, "mu": 0.1}, {"global": weights}),
    LocalTask("fedkf", {"seed": 1, "batch_size": 8, **kf}, {"student": weights}),
]
members = [Member(copy.deepcopy(model), data, t) for t in tasks for _ in range(2)]
outcomes = train_cohort(members)
assert all(o.batched and o.result is not None for o in outcomes), outcomes
print("torch._dynamo" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
