"""The distillation losses against values computed by hand, and their gradients."""

from __future__ import annotations

import math

import pytest
import torch

from models.losses import (
    activation_loss,
    distillation_kl,
    fedkf_generator_loss,
    information_entropy_loss,
    one_hot_loss,
)

# Two samples, three classes, written out.
LOGITS = [[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]]
OTHER = [[0.5, 0.5, -1.0], [2.0, 1.0, 0.0]]
FEATURES = [[1.0, -2.0], [0.5, -0.5]]


def softmax(row: list[float]) -> list[float]:
    exps = [math.exp(v) for v in row]
    total = sum(exps)
    return [e / total for e in exps]


def tensor(rows: list[list[float]], grad: bool = False) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64, requires_grad=grad)


def test_information_entropy_is_the_negative_entropy_of_the_mean_prediction() -> None:
    p1, p2 = softmax(LOGITS[0]), softmax(LOGITS[1])
    mean = [(a + b) / 2 for a, b in zip(p1, p2, strict=True)]
    expected = sum(m * math.log(m) for m in mean)

    value = information_entropy_loss(tensor(LOGITS))

    assert value.item() == pytest.approx(expected, rel=1e-12)
    assert -math.log(3) < value.item() < 0


def test_information_entropy_is_smallest_when_the_mean_prediction_is_uniform() -> None:
    # Each sample is confident, but the batch covers the classes equally.
    balanced = tensor([[5.0, 0.0, 0.0], [0.0, 5.0, 0.0], [0.0, 0.0, 5.0]], grad=True)
    collapsed = tensor([[5.0, 0.0, 0.0], [5.0, 0.0, 0.0], [5.0, 0.0, 0.0]])

    value = information_entropy_loss(balanced)
    value.backward()  # type: ignore[no-untyped-call]

    assert value.item() == pytest.approx(-math.log(3), rel=1e-12)
    assert balanced.grad is not None
    assert balanced.grad.abs().max().item() < 1e-12  # a stationary point
    assert information_entropy_loss(collapsed).item() > value.item()
    # Gradient descent from a skewed batch moves towards the minimum.
    logits = tensor([[3.0, 0.0, 0.0], [2.0, 1.0, 0.0]], grad=True)
    start = information_entropy_loss(logits).item()
    optimizer = torch.optim.SGD([logits], lr=1.0)
    for _ in range(50):
        optimizer.zero_grad()
        information_entropy_loss(logits).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    end = information_entropy_loss(logits).item()
    assert end < start and end == pytest.approx(-math.log(3), abs=1e-3)


def test_information_entropy_of_a_one_hot_mean_is_zero_not_nan() -> None:
    value = information_entropy_loss(tensor([[0.0, -1e4, -1e4]]))

    assert value.item() == pytest.approx(0.0, abs=1e-9)


def test_one_hot_loss_is_the_cross_entropy_against_the_argmax() -> None:
    # argmax: class 1 for the first sample, class 2 for the second.
    expected = -(math.log(softmax(LOGITS[0])[1]) + math.log(softmax(LOGITS[1])[2])) / 2
    logits = tensor(LOGITS, grad=True)

    value = one_hot_loss(logits)
    value.backward()  # type: ignore[no-untyped-call]

    assert value.item() == pytest.approx(expected, rel=1e-12)
    assert logits.grad is not None
    # d/dz of -ln softmax(z)[k] / B is (p - onehot(k)) / B.
    p1 = softmax(LOGITS[0])
    assert logits.grad[0].tolist() == pytest.approx([p1[0] / 2, (p1[1] - 1) / 2, p1[2] / 2])


def test_activation_loss_is_the_negative_mean_absolute_value() -> None:
    assert activation_loss(tensor(FEATURES)).item() == pytest.approx(-(1 + 2 + 0.5 + 0.5) / 4)
    assert activation_loss(torch.zeros(3, 5)).item() == 0.0


def test_fedkf_generator_loss_weights_the_three_parts() -> None:
    lambda1, lambda2 = 0.3, 0.7
    p1, p2 = softmax(LOGITS[0]), softmax(LOGITS[1])
    mean = [(a + b) / 2 for a, b in zip(p1, p2, strict=True)]
    entropy = sum(m * math.log(m) for m in mean)
    one_hot = -(math.log(p1[1]) + math.log(p2[2])) / 2
    activation = -1.0

    total, parts = fedkf_generator_loss(tensor(LOGITS), tensor(FEATURES), lambda1, lambda2)

    assert total.item() == pytest.approx(
        entropy + lambda1 * one_hot + lambda2 * activation, rel=1e-12
    )
    assert parts == pytest.approx(
        {"entropy": entropy, "one_hot": one_hot, "activation": activation}, rel=1e-12
    )
    assert all(isinstance(v, float) for v in parts.values())


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_distillation_kl_is_the_batch_mean_kl_times_t_squared(temperature: float) -> None:
    expected = 0.0
    for t_row, s_row in zip(LOGITS, OTHER, strict=True):
        p = softmax([v / temperature for v in t_row])
        q = softmax([v / temperature for v in s_row])
        expected += sum(pc * (math.log(pc) - math.log(qc)) for pc, qc in zip(p, q, strict=True))
    expected = expected / 2 * temperature**2

    value = distillation_kl(tensor(LOGITS), tensor(OTHER), temperature)

    assert value.item() == pytest.approx(expected, rel=1e-12)


def test_distillation_kl_is_zero_for_equal_predictions_and_leaves_the_teacher_alone() -> None:
    teacher = tensor(LOGITS, grad=True)
    student = tensor(LOGITS, grad=True)
    shifted = tensor([[v + 4.0 for v in row] for row in LOGITS])  # same softmax

    value = distillation_kl(teacher, student)
    value.backward()  # type: ignore[no-untyped-call]

    assert value.item() == pytest.approx(0.0, abs=1e-12)
    assert distillation_kl(shifted, tensor(LOGITS)).item() == pytest.approx(0.0, abs=1e-12)
    assert teacher.grad is None  # a constant
    assert student.grad is not None and student.grad.abs().max().item() < 1e-12
    assert distillation_kl(tensor(LOGITS), tensor(OTHER)).item() > 0


def test_distillation_kl_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="temperature"):
        distillation_kl(tensor(LOGITS), tensor(OTHER), 0.0)
    with pytest.raises(ValueError, match="differ in shape"):
        distillation_kl(tensor(LOGITS), tensor([[1.0, 2.0]]))
