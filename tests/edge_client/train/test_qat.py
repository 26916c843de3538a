"""int8 quantization-aware training: the fake quantizer, the STE hook, and what it buys."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from onnx import numpy_helper
from torch import nn

from edge_client.errors import TaskError
from edge_client.train.data import DeviceData
from edge_client.train.local_update import local_update
from edge_client.train.qat import FakeQuantHook, fake_quantize_int8
from edge_client.train.task import LocalTask
from edge_client.train.training import TrainConfig, TrainHook, train_local
from models import Classifier, build_classifier
from models.onnx_export import INPUT_NAME, export_onnx, quantize_onnx_int8


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """These models are tiny: one thread, or thread overhead dominates on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# A learnable 4-class task on 8x8 images: a faint class pattern over every pixel plus
# noise, so the classifier needs many small weights. Pixel (0, 0) is always 0.
_PATTERNS = np.random.default_rng(0).standard_normal((4, 1, 8, 8)).astype(np.float32)


def data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = (np.arange(n) % 4).astype(np.int64)
    x = 0.5 + 0.1 * _PATTERNS[y] + 0.1 * rng.standard_normal((n, 1, 8, 8), dtype=np.float32)
    x[:, 0, 0, 0] = 0.0  # a dead pixel
    return x.astype(np.float32), y


def fc1(model: nn.Module) -> torch.Tensor:
    return dict(model.named_parameters())["features.fc1.weight"]


def mlp(seed: int = 0, *, outlier: float | None = None) -> Classifier:
    """A one-hidden-layer MLP; ``outlier``: the first layer's weight on the dead pixel.

    That weight never gets a gradient (its input is always 0), so it pins every hidden
    unit's int8 scale at ``outlier / 127``: the grid is coarse for the other weights.
    """
    torch.manual_seed(seed)
    model = build_classifier("mlp", num_classes=4, in_channels=1, image_size=8, hidden=(32,))
    if outlier is not None:
        with torch.no_grad():
            fc1(model)[:, 0] = outlier
    return model


def quantized(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every weight of rank >= 2 fake-quantized."""
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for p in copied.parameters():
            if p.ndim >= 2:
                p.copy_(fake_quantize_int8(p))
    return copied


def loss(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    with torch.no_grad():
        return float(F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)))


def on_grid(p: torch.Tensor) -> bool:
    return torch.equal(fake_quantize_int8(p), p.detach())


# --- fake_quantize_int8 --------------------------------------------------------------------


def test_fake_quantize_puts_each_channel_on_its_symmetric_int8_grid() -> None:
    torch.manual_seed(3)
    weight = torch.randn(8, 3, 5, 5) * torch.logspace(-3, 1, 8).view(8, 1, 1, 1)
    weight[2] = 0.0  # a dead channel

    result = fake_quantize_int8(weight)

    assert result.shape == weight.shape and result.dtype == weight.dtype
    assert not torch.isnan(result).any()
    assert torch.equal(result[2], torch.zeros_like(result[2]))
    live = [c for c in range(8) if c != 2]
    scale = weight[live].abs().amax(dim=(1, 2, 3), keepdim=True) / 127  # (7, 1, 1, 1)
    q = result[live] / scale
    assert torch.allclose(q, q.round(), atol=1e-3)  # integers...
    assert q.round().abs().max() == 127  # ...in [-127, 127], the extremes reached
    assert torch.all(q.round().abs().amax(dim=(1, 2, 3)) == 127)  # in every channel
    assert torch.all((result[live] - weight[live]).abs() <= scale / 2 * (1 + 1e-5))


def test_fake_quantize_rounds_half_to_even_per_row_of_a_linear_weight() -> None:
    weight = torch.tensor(
        [
            [31.75, 1.0, 0.125, 0.375, -0.3],  # scale 0.25
            [0.0, 0.0, 0.0, 0.0, 0.0],
            [-127.0, 2.5, -3.5, 0.4, 0.0],  # scale 1
        ],
        requires_grad=True,
    )

    result = fake_quantize_int8(weight)

    assert not result.requires_grad
    expected = torch.tensor(
        [[31.75, 1.0, 0.0, 0.5, -0.25], [0.0] * 5, [-127.0, 2.0, -4.0, 0.0, 0.0]]
    )
    assert torch.equal(result, expected)  # halves to even, as numpy and onnxruntime do


def test_fake_quantize_rejects_scalars_and_integer_tensors() -> None:
    with pytest.raises(ValueError, match="rank >= 1"):
        fake_quantize_int8(torch.tensor(1.0))
    with pytest.raises(ValueError, match="floating-point"):
        fake_quantize_int8(torch.ones(2, 2, dtype=torch.int64))


def test_fake_quantize_equals_the_weights_onnxruntime_stores_in_the_int8_model() -> None:
    torch.manual_seed(0)
    lenet = build_classifier("lenet5", num_classes=10)  # convolutions and linear layers
    calibration = np.random.default_rng(0).random((16, 1, 28, 28), dtype=np.float32)

    int8 = onnx.load_from_string(
        quantize_onnx_int8(export_onnx(lenet, lenet.input_shape), calibration)
    )

    arrays = {i.name: numpy_helper.to_array(i) for i in int8.graph.initializer}
    state = lenet.state_dict()
    checked = []
    for name, value in state.items():
        if value.ndim < 2:
            continue
        q = arrays[f"{name}_quantized"]
        assert q.dtype == np.int8 and not arrays[f"{name}_zero_point"].any()  # symmetric
        scale = arrays[f"{name}_scale"].reshape((-1,) + (1,) * (q.ndim - 1))  # per channel
        expected = fake_quantize_int8(value).numpy()
        assert np.array_equal(q.astype(np.float32) * scale, expected), name
        checked.append(name)
    assert len(checked) == 5  # conv1..3, fc, head


# --- FakeQuantHook in train_local ----------------------------------------------------------


def test_before_step_runs_after_backward_in_hook_order() -> None:
    calls: list[str] = []

    class Probe(TrainHook):
        def __init__(self, tag: str) -> None:
            self.tag = tag

        def before_step(self, model: nn.Module) -> None:
            assert all(p.grad is not None for p in model.parameters())
            calls.append(self.tag)

    x, y = data(32, 1)

    result = train_local(
        mlp(), x, y, TrainConfig(local_steps=3, batch_size=8), [Probe("a"), Probe("b")]
    )

    assert result.steps == 3
    assert calls == ["a", "b"] * 3


def test_the_step_applies_the_gradient_at_the_quantized_weights_to_the_float_weights() -> None:
    x, y = data(64, 1)
    model = mlp(outlier=12.7)  # scale 0.1: quantization moves the weights visibly
    start = {k: v.clone() for k, v in model.state_dict().items()}
    # the reference, by hand: the gradient of the full-batch loss at the quantized point
    reference = quantized(model)
    reference_loss = F.cross_entropy(reference(torch.from_numpy(x)), torch.from_numpy(y))
    reference_loss.backward()  # type: ignore[no-untyped-call]
    grads = {k: p.grad for k, p in reference.named_parameters() if p.grad is not None}
    lr = 0.5

    train_local(
        model, x, y, TrainConfig(local_steps=1, batch_size=64, lr=lr, qat=True), [FakeQuantHook()]
    )

    after = model.state_dict()
    assert set(grads) == set(after)  # every parameter got a gradient; no buffers
    for name, grad in grads.items():
        expected = start[name] - lr * grad  # from the float weights, not the quantized ones
        assert torch.allclose(after[name], expected, atol=1e-6), name
    name = "features.fc1.weight"
    from_quantized = fake_quantize_int8(start[name]) - lr * grads[name]  # what no restore does
    assert (after[name] - from_quantized).abs().max() > 1e-2


def test_qat_keeps_float_master_weights() -> None:
    x, y = data(128, 1)
    model = mlp(outlier=25.4)  # scale 0.2 in fc1

    result = train_local(
        model, x, y, TrainConfig(local_steps=20, batch_size=32, lr=0.1, qat=True), [FakeQuantHook()]
    )

    weights = [p for p in model.parameters() if p.ndim >= 2]
    assert not any(on_grid(p) for p in weights)  # trained floats, not int8 values
    assert (fake_quantize_int8(fc1(model)) - fc1(model)).abs().max() > 0.05
    assert result.steps == 20 and np.isfinite(result.loss)


def test_a_qat_model_loses_less_to_int8_than_a_float_trained_one() -> None:
    """The dead-pixel weight makes int8 coarse (scale 0.2, hidden weights ~0.1 at init):
    a float-trained model's cross-entropy rises when its weights are rounded, a
    QAT-trained one was trained on the rounded weights. Both in torch and in
    onnxruntime's int8 model. (With natural weights int8 costs too little for any
    comparison between two training runs to see.)"""
    x, y = data(256, 1)
    x_test, y_test = data(512, 2)
    plain, qat = mlp(outlier=25.4), mlp(outlier=25.4)
    config = TrainConfig(local_steps=300, batch_size=32, lr=0.1, momentum=0.0)  # plain SGD

    train_local(plain, x, y, config)
    train_local(qat, x, y, config.model_copy(update={"qat": True}), [FakeQuantHook()])

    plain_gap = loss(quantized(plain), x, y) - loss(plain, x, y)
    qat_gap = loss(quantized(qat), x, y) - loss(qat, x, y)
    assert plain_gap > 0.002  # rounding hurts the float-trained model
    assert qat_gap < 0.0 < plain_gap  # the QAT model was trained at the rounded weights
    plain_int8, qat_int8 = (
        ort.InferenceSession(
            quantize_onnx_int8(export_onnx(m, m.input_shape), x[:128]),
            providers=["CPUExecutionProvider"],
        ).run(None, {INPUT_NAME: x_test})[0]
        for m in (plain, qat)
    )
    targets = torch.from_numpy(y_test)
    plain_int8_loss = float(F.cross_entropy(torch.from_numpy(plain_int8), targets))
    qat_int8_loss = float(F.cross_entropy(torch.from_numpy(qat_int8), targets))
    assert qat_int8_loss < plain_int8_loss - 0.002
    # the deployed int8 model behaves like the fake-quantized one QAT trained
    assert abs(qat_int8_loss - loss(quantized(qat), x_test, y_test)) < 2e-3
    assert (qat_int8.argmax(axis=1) == y_test).mean() >= 0.95


# --- configuration and strategies --------------------------------------------------------


def test_qat_is_a_hyperparameter_off_by_default() -> None:
    assert TrainConfig().qat is False
    assert TrainConfig.from_hyperparameters({"qat": True}).qat is True
    with pytest.raises(TaskError, match="qat"):
        TrainConfig.from_hyperparameters({"qat": 1})


def test_local_update_with_qat_runs_the_hook_after_the_strategys_and_before_the_callers() -> None:
    x, y = data(64, 1)
    device_data = DeviceData("dev-000", x, y, x[:0], y[:0], 4)
    seen: list[tuple[bool, bool]] = []

    class Caller(TrainHook):
        def __init__(self) -> None:
            self.at_batch = False

        def before_batch(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
            self.at_batch = on_grid(fc1(model))

        def before_step(self, model: nn.Module) -> None:
            seen.append((self.at_batch, on_grid(fc1(model))))

    hp = {"local_steps": 3, "batch_size": 16, "lr": 0.1}

    plain = local_update(mlp(outlier=25.4), device_data, LocalTask("fedprox", {**hp, "mu": 0.1}))
    qat = local_update(
        mlp(outlier=25.4),
        device_data,
        LocalTask("fedprox", {**hp, "mu": 0.1, "qat": True}),
        hooks=[Caller()],
    )

    assert seen == [(True, False)] * 3  # quantized in the batch, float again at the step
    weights = "features.fc1.weight"
    assert not np.array_equal(plain.sets["weights"][weights], qat.sets["weights"][weights])
