"""Accuracy, AMP / FM / WLP and the per-round evaluation of named global models."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from coordinator.errors import CoordinatorError
from coordinator.evaluation import (
    Fairness,
    MetricsError,
    ModelMetrics,
    evaluate_accuracy,
    evaluate_models,
    evaluate_personal,
    fairness,
)
from models import StateMismatchError, build_classifier, load_state_arrays, state_arrays

# ------------------------------------------------------------------------ fairness


def test_fairness_weighted_amp_differs_from_plain_mean() -> None:
    # Prepare: device 0 has 1 test sample at 50 %, device 1 has 3 at 100 %
    accuracies, weights = [0.5, 1.0], [1, 3]

    # Execute
    result = fairness(accuracies, weights)

    # Assert: AMP = (1 * 50 + 3 * 100) / 4; plain mean would be 75
    assert result.amp == pytest.approx(87.5)
    assert result.amp != pytest.approx(75.0)
    assert result.fm == pytest.approx(625.0)  # population variance of [50, 100], percent^2
    assert result.wlp == pytest.approx(50.0)


def test_fairness_three_devices_by_hand() -> None:
    result = fairness(np.array([0.9, 0.6, 0.75]), np.array([10, 20, 30]))

    assert result.amp == pytest.approx((10 * 90 + 20 * 60 + 30 * 75) / 60)  # 72.5
    mean = (90 + 60 + 75) / 3
    assert result.fm == pytest.approx(((90 - mean) ** 2 + (60 - mean) ** 2 + (75 - mean) ** 2) / 3)
    assert result.wlp == pytest.approx(60.0)
    assert isinstance(result, Fairness)


def test_fairness_equal_accuracies_have_zero_variance() -> None:
    result = fairness([0.8, 0.8, 0.8], [1, 5, 9])

    assert result == Fairness(amp=pytest.approx(80.0), fm=pytest.approx(0.0), wlp=80.0, best=80.0)


def test_fairness_skips_devices_with_empty_splits() -> None:
    # the empty device's accuracy is undefined (NaN) and would otherwise be the worst
    with_empty = fairness([0.5, math.nan, 1.0, 0.0], [1, 0, 3, 0])

    assert with_empty == fairness([0.5, 1.0], [1, 3])


@pytest.mark.parametrize(
    ("accuracies", "weights", "message"),
    [
        ([0.5, 0.5], [0, 0], "no device"),
        ([], [], "no device"),
        ([0.5], [1, 2], "equal length"),
        ([[0.5]], [[1]], "1-D"),
        ([0.5, 1.5], [1, 1], r"\[0, 1\]"),
        ([0.5, math.nan], [1, 1], r"\[0, 1\]"),
        ([0.5, 0.7], [1, -1], ">= 0"),
        ([0.5, 0.7], [1, math.inf], "finite"),
    ],
)
def test_fairness_rejects_bad_input(accuracies: object, weights: object, message: str) -> None:
    with pytest.raises(MetricsError, match=message) as caught:
        fairness(accuracies, weights)  # type: ignore[arg-type]
    assert isinstance(caught.value, ValueError)
    assert isinstance(caught.value, CoordinatorError)


# --------------------------------------------------------------- evaluate_accuracy


def identity_classifier() -> nn.Module:
    """Logits = the two input features, so the predicted class is the larger one."""
    linear = nn.Linear(2, 2)
    with torch.no_grad():
        linear.weight.copy_(torch.eye(2))
        linear.bias.zero_()
    return nn.Sequential(nn.Flatten(), linear)


def crafted_inputs() -> tuple[np.ndarray, np.ndarray]:
    x = np.array([[3, 1], [0, 2], [5, 4], [1, 7], [2, 9]], dtype=np.float32).reshape(5, 1, 1, 2)
    # predicted classes: 0, 1, 0, 1, 1; labels make samples 0, 1 and 3 correct
    y = np.array([0, 1, 1, 1, 0], dtype=np.int64)
    return x, y


@pytest.mark.parametrize("batch_size", [1, 2, 5, 1024])
def test_evaluate_accuracy_known_answer(batch_size: int) -> None:
    model = identity_classifier()
    x, y = crafted_inputs()

    accuracy = evaluate_accuracy(model, x, y, batch_size=batch_size)

    assert accuracy == pytest.approx(3 / 5)


def test_evaluate_accuracy_accepts_float64_inputs() -> None:
    x, y = crafted_inputs()

    assert evaluate_accuracy(identity_classifier(), x.astype(np.float64), y) == pytest.approx(0.6)


@pytest.mark.parametrize("training", [True, False])
def test_evaluate_accuracy_restores_mode(training: bool) -> None:
    model = identity_classifier().train(training)
    x, y = crafted_inputs()

    evaluate_accuracy(model, x, y)

    assert all(module.training is training for module in model.modules())


def test_evaluate_accuracy_restores_mixed_submodule_modes() -> None:
    model = identity_classifier().train()
    model[1].eval()
    x, y = crafted_inputs()

    evaluate_accuracy(model, x, y)

    assert model.training and model[0].training and not model[1].training


def test_evaluate_accuracy_runs_in_eval_mode_without_grad() -> None:
    seen: list[tuple[bool, bool]] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((self.training, torch.is_grad_enabled()))
            return x.flatten(1)

    x, y = crafted_inputs()
    evaluate_accuracy(Probe().train(), x, y)

    assert seen == [(False, False)]


def test_evaluate_accuracy_empty_input_raises() -> None:
    x = np.zeros((0, 1, 1, 2), np.float32)
    y = np.zeros(0, np.int64)

    with pytest.raises(ValueError, match="empty test set"):
        evaluate_accuracy(identity_classifier(), x, y)


def test_evaluate_accuracy_rejects_mismatched_lengths_and_bad_batch_size() -> None:
    x, y = crafted_inputs()

    with pytest.raises(MetricsError, match="same N"):
        evaluate_accuracy(identity_classifier(), x, y[:3])
    with pytest.raises(MetricsError, match="batch_size"):
        evaluate_accuracy(identity_classifier(), x, y, batch_size=0)


# ----------------------------------------------------------------- evaluate_models

NUM_CLASSES = 4


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return build_classifier(
        "mlp", num_classes=NUM_CLASSES, in_channels=1, image_size=6, hidden=(16,)
    )


def device_split(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    x = rng.random((n, 1, 6, 6), dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES, n).astype(np.int64)
    return x, y


def reference_metrics(
    model: nn.Module,
    device_tests: list[tuple[np.ndarray, np.ndarray]],
    global_test: tuple[np.ndarray, np.ndarray] | None,
) -> ModelMetrics:
    """Each device evaluated on its own, then combined by fairness()."""
    accuracies = [evaluate_accuracy(model, x, y) if len(y) else math.nan for x, y in device_tests]
    fair = fairness(accuracies, [len(y) for _, y in device_tests])
    global_acc = None if global_test is None else 100 * evaluate_accuracy(model, *global_test)
    return ModelMetrics(fair.amp, fair.fm, fair.wlp, global_acc)


def assert_metrics_close(actual: ModelMetrics, expected: ModelMetrics) -> None:
    assert actual.amp == pytest.approx(expected.amp)
    assert actual.fm == pytest.approx(expected.fm)
    assert actual.wlp == pytest.approx(expected.wlp)
    if expected.global_acc is None:
        assert actual.global_acc is None
    else:
        assert actual.global_acc == pytest.approx(expected.global_acc)


@pytest.mark.parametrize("batch_size", [4, 1024])
def test_evaluate_models_matches_per_device_evaluation(batch_size: int) -> None:
    # Prepare: two global models, four devices (one with an empty split), a global set
    rng = np.random.default_rng(0)
    aca, oca = mlp(1), mlp(2)
    states = {"aca": state_arrays(aca), "oca": state_arrays(oca)}
    device_tests = [device_split(rng, n) for n in (7, 0, 13, 3)]
    global_test = device_split(rng, 11)
    scratch = mlp(3).train()

    # Execute
    results = evaluate_models(states, scratch, device_tests, global_test, batch_size=batch_size)

    # Assert
    assert list(results) == ["aca", "oca"]
    assert_metrics_close(results["aca"], reference_metrics(aca, device_tests, global_test))
    assert_metrics_close(results["oca"], reference_metrics(oca, device_tests, global_test))
    assert scratch.training  # mode restored
    for name, tensor in scratch.state_dict().items():  # holds the last state loaded
        np.testing.assert_array_equal(tensor.numpy(), states["oca"][name])


def test_evaluate_models_amp_is_accuracy_over_the_union() -> None:
    rng = np.random.default_rng(1)
    model = mlp(4)
    device_tests = [device_split(rng, n) for n in (2, 9, 20)]
    union_x = np.concatenate([x for x, _ in device_tests])
    union_y = np.concatenate([y for _, y in device_tests])

    result = evaluate_models({"aca": state_arrays(model)}, mlp(5), device_tests, None)["aca"]

    assert result.amp == pytest.approx(100 * evaluate_accuracy(model, union_x, union_y))
    assert result.global_acc is None
    assert result.to_dict() == {
        "amp": result.amp,
        "fm": result.fm,
        "wlp": result.wlp,
        "best": result.best,
        "global_acc": None,
    }


def test_evaluate_models_perfect_model_scores_100() -> None:
    # labels are the model's own predictions
    rng = np.random.default_rng(2)
    model = mlp(6)
    device_tests = []
    for n in (5, 8):
        x, _ = device_split(rng, n)
        with torch.no_grad():
            y = model(torch.from_numpy(x)).argmax(1).numpy().astype(np.int64)
        device_tests.append((x, y))

    result = evaluate_models({"aca": state_arrays(model)}, mlp(7), device_tests, device_tests[0])

    assert result["aca"] == ModelMetrics(amp=100.0, fm=0.0, wlp=100.0, global_acc=100.0, best=100.0)


def test_evaluate_models_errors() -> None:
    rng = np.random.default_rng(3)
    states = {"aca": state_arrays(mlp(8))}
    empty = (np.zeros((0, 1, 6, 6), np.float32), np.zeros(0, np.int64))
    good = [device_split(rng, 4)]

    with pytest.raises(MetricsError, match="every device test split is empty"):
        evaluate_models(states, mlp(9), [empty, empty], None)
    with pytest.raises(MetricsError, match="global test set is empty"):
        evaluate_models(states, mlp(9), good, empty)
    with pytest.raises(MetricsError, match="sample shape"):
        odd = (np.zeros((2, 1, 5, 5), np.float32), np.zeros(2, np.int64))
        evaluate_models(states, mlp(9), [*good, odd], None)
    with pytest.raises(StateMismatchError):
        evaluate_models({"aca": {"head.bias": np.zeros(3, np.float32)}}, mlp(9), good, None)


def test_evaluate_models_lenet5_smoke() -> None:
    torch.manual_seed(0)
    lenet = build_classifier("lenet5", num_classes=10, in_channels=1, image_size=28)
    rng = np.random.default_rng(4)
    device_tests = [
        (rng.random((n, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, n).astype(np.int64))
        for n in (3, 5)
    ]
    scratch = build_classifier("lenet5", num_classes=10, in_channels=1, image_size=28)
    load_state_arrays(scratch, state_arrays(lenet))

    results = evaluate_models({"aca": state_arrays(lenet)}, scratch, device_tests, None)

    assert_metrics_close(results["aca"], reference_metrics(lenet, device_tests, None))


@pytest.mark.parametrize(("name", "channels"), [("lenet5", 1), ("resnet8", 3)])
def test_evaluation_gives_the_plain_forward_s_classes_and_leaves_the_layout(
    name: str, channels: int
) -> None:
    # Prepare
    torch.manual_seed(1)
    model = build_classifier(name, num_classes=10, in_channels=channels, image_size=32)
    x = np.random.default_rng(2).random((300, channels, 32, 32), dtype=np.float32)
    with torch.no_grad():
        expected = model.eval()(torch.from_numpy(x)).argmax(1).numpy()
    model.train()

    # Execute
    accuracy = evaluate_accuracy(model, x, expected, batch_size=128)

    # Assert: the classes of the plain forward, and the weights as they lay before
    assert accuracy == 1.0
    assert all(p.is_contiguous() for p in model.parameters()) and model.training


# --------------------------------------------------------------- evaluate_personal


def test_evaluate_personal_uses_each_devices_own_model() -> None:
    rng = np.random.default_rng(7)
    models = [mlp(10), mlp(11), mlp(12)]
    device_tests = [device_split(rng, n) for n in (9, 0, 14)]
    # labels of device 2 are its own model's predictions: 100 % with its model only
    x2 = device_tests[2][0]
    with torch.no_grad():
        y2 = models[2](torch.from_numpy(x2)).argmax(1).numpy()
    device_tests[2] = (x2, y2)

    result = evaluate_personal([state_arrays(m) for m in models], mlp(13), device_tests)

    acc0 = evaluate_accuracy(models[0], *device_tests[0])
    expected = fairness([acc0, math.nan, 1.0], [9, 0, 14])
    assert result.amp == pytest.approx(expected.amp) and result.wlp == pytest.approx(expected.wlp)
    assert result.global_acc is None
    with pytest.raises(MetricsError, match="2 states for 3 device splits"):
        evaluate_personal([state_arrays(m) for m in models[:2]], mlp(13), device_tests)
