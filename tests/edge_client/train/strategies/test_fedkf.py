"""FedKF's device side: the local generator, the frozen teacher and the distillation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from edge_client.errors import TaskError
from edge_client.train.data import DeviceData
from edge_client.train.local_update import local_update
from edge_client.train.strategies.fedkf import (
    GENERATOR_STATE_KEY,
    FedKF,
    FedKFHook,
    LocalGenerator,
    frozen_teacher,
    local_generator,
)
from edge_client.train.task import LocalTask
from edge_client.train.training import TrainConfig, TrainHook, train_local
from models import Classifier, build_classifier, state_arrays
from models.losses import fedkf_generator_loss

CPU = torch.device("cpu")
HP: dict[str, object] = {
    "local_steps": 4,
    "batch_size": 16,
    "lr": 0.05,
    "seed": 3,
    "generator_width": 4,
    "generator_lr": 0.01,
    "generator_every": 1,  # the paper's: a generator step and a fresh sample every batch
    "sample_reuse": 1,
}


def lenet(seed: int) -> Classifier:
    torch.manual_seed(seed)
    return build_classifier("lenet5")


def patterned(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Ten classes, each a bright 7x7 block at its own place on faint noise."""
    rng = np.random.default_rng(0)
    y = (np.arange(n) % 10).astype(np.int64)
    x = rng.random((n, 1, 28, 28), dtype=np.float32) * 0.2
    for i, label in enumerate(y):
        row, col = divmod(int(label), 4)
        x[i, 0, row * 7 : row * 7 + 7, col * 7 : col * 7 + 7] += 0.8
    return x, y


@pytest.fixture(scope="module")
def device_data() -> DeviceData:
    x, y = patterned(64)
    return DeviceData("dev-000", x, y, x[:0], y[:0], 10)


def distance(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in a)))


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


class BatchRecorder(TrainHook):
    def __init__(self) -> None:
        self.labels: list[list[int]] = []

    def before_batch(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        self.labels.append(y.tolist())


def mean_generator_loss(local: LocalGenerator, teacher: Classifier) -> float:
    noise = torch.Generator().manual_seed(123)
    total = 0.0
    with torch.no_grad():
        for _ in range(4):
            images = local.module(local.noise(32, noise))
            features = teacher.features(images)
            loss, _ = fedkf_generator_loss(teacher.head(features), features, 0.1, 0.1)
            total += float(loss)
    return total / 4


def test_the_generator_lowers_its_loss_against_a_trained_teacher() -> None:
    x, y = patterned(128)
    net = lenet(0)
    train_local(net, x, y, TrainConfig(local_steps=40, batch_size=32, lr=0.1, momentum=0.9))
    teacher = frozen_teacher(net)
    config = TrainConfig(generator_width=16, generator_lr=1e-3, seed=0)
    local = local_generator({}, teacher, config, CPU)
    noise = torch.Generator().manual_seed(0)
    before = mean_generator_loss(local, teacher)

    losses = [local.step(teacher, 32, 0.1, 0.1, noise)[0] for _ in range(30)]

    after = mean_generator_loss(local, teacher)
    assert after < before - 0.25  # from about -1.6 to -2.1 (the floor is near -ln 10)
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
    assert all(p.grad is None for p in teacher.parameters())


def test_the_generator_step_touches_neither_student_nor_teacher() -> None:
    student, teacher = lenet(1), frozen_teacher(lenet(2))
    teacher_before = state_arrays(teacher)
    hook = FedKFHook(teacher, {}, TrainConfig.from_hyperparameters(HP))
    x = torch.rand(8, 1, 28, 28)

    hook.before_training(student)
    hook.before_batch(student, x, torch.zeros(8, dtype=torch.int64))

    assert hook.generator is not None
    assert all(p.grad is None for p in student.parameters())
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())
    assert all(p.grad is not None for p in hook.generator.module.parameters())
    assert same(state_arrays(teacher), teacher_before)
    extra = hook.extra_loss(student, x, torch.zeros(8, dtype=torch.int64), student(x))
    assert extra is not None and extra.item() >= 0
    extra.backward()  # type: ignore[no-untyped-call]
    assert all(p.grad is not None for p in student.parameters())  # KD reaches the student
    assert all(p.grad is None for p in teacher.parameters())


def test_fedkf_trains_the_student_and_keeps_the_received_teacher(
    device_data: DeviceData,
) -> None:
    student, teacher = state_arrays(lenet(5)), state_arrays(lenet(6))
    teacher_copy = {k: v.copy() for k, v in teacher.items()}
    model = lenet(7)
    sets = {"student": student, "teacher": teacher}
    config = TrainConfig.from_hyperparameters(HP)

    hooks = FedKF().prepare(model, sets, config, {})
    assert same(state_arrays(model), student)  # the student was loaded
    (hook,) = hooks
    assert isinstance(hook, FedKFHook)
    result = train_local(model, device_data.x, device_data.y, config, hooks)

    assert result.steps == 4
    assert distance(state_arrays(model), student) > 0
    assert same(state_arrays(hook.teacher), teacher_copy)
    assert same(teacher, teacher_copy)  # the received arrays are untouched
    assert not hook.teacher.training
    assert set(hook.metrics()) == {"kd_loss", "generator_loss"}


def test_local_update_reports_the_distillation_metrics(device_data: DeviceData) -> None:
    sets = {"student": state_arrays(lenet(5)), "teacher": state_arrays(lenet(6))}

    result = local_update(lenet(7), device_data, LocalTask("fedkf", HP, sets), {})

    assert set(result.metrics) == {"loss", "accuracy", "kd_loss", "generator_loss"}
    assert result.metrics["kd_loss"] > 0 and np.isfinite(result.metrics["generator_loss"])
    assert set(result.sets["weights"]) == set(state_arrays(lenet(0)))


def test_the_generator_persists_across_rounds_with_its_optimizer(
    device_data: DeviceData,
) -> None:
    state: dict[str, object] = {}
    model = lenet(0)
    task = LocalTask("fedkf", HP, {"student": state_arrays(lenet(5))})

    local_update(model, device_data, task, state)
    first = state[GENERATOR_STATE_KEY]
    assert isinstance(first, LocalGenerator)
    after_one = state_arrays(first.module)
    steps_one = list(first.optimizer.steps)
    local_update(model, device_data, task, state)
    second = state[GENERATOR_STATE_KEY]

    assert second is first
    assert distance(state_arrays(first.module), after_one) > 0
    assert first.optimizer.steps == [s + 4 for s in steps_one]
    wider = LocalTask("fedkf", {**HP, "generator_width": 8}, task.sets)
    local_update(model, device_data, wider, state)
    rebuilt = state[GENERATOR_STATE_KEY]
    assert isinstance(rebuilt, LocalGenerator) and rebuilt is not first
    assert rebuilt.module.config.base_channels == 8


def test_the_generator_is_seeded_without_touching_the_global_rng() -> None:
    teacher = frozen_teacher(lenet(0))
    config = TrainConfig(generator_width=4, seed=11)
    rng_before = torch.get_rng_state()

    a = local_generator({}, teacher, config, CPU)
    b = local_generator({}, teacher, config, CPU)

    assert torch.equal(torch.get_rng_state(), rng_before)
    assert same(state_arrays(a.module), state_arrays(b.module))
    assert a.module.noise_dim == 100
    c = local_generator({}, teacher, TrainConfig(generator_noise_dim=7), CPU)
    assert c.module.noise_dim == 7


def test_single_downlink_uses_the_received_student_as_teacher(device_data: DeviceData) -> None:
    received = state_arrays(lenet(5))
    model = lenet(7)
    config = TrainConfig.from_hyperparameters(HP)

    (hook,) = FedKF().prepare(model, {"student": received}, config, {})
    train_local(model, device_data.x, device_data.y, config, [hook])

    assert isinstance(hook, FedKFHook)
    assert same(state_arrays(hook.teacher), received)
    assert distance(state_arrays(model), received) > 0


def test_fedkf_is_deterministic_for_a_seed(device_data: DeviceData) -> None:
    sets = {"student": state_arrays(lenet(5)), "teacher": state_arrays(lenet(6))}

    a = local_update(lenet(0), device_data, LocalTask("fedkf", HP, sets), {})
    b = local_update(lenet(1), device_data, LocalTask("fedkf", HP, sets), {})
    c = local_update(lenet(0), device_data, LocalTask("fedkf", {**HP, "seed": 4}, sets), {})

    assert same(a.sets["weights"], b.sets["weights"])
    assert a.metrics == b.metrics
    assert not same(a.sets["weights"], c.sets["weights"])
    other_teacher = {**sets, "teacher": state_arrays(lenet(8))}
    d = local_update(lenet(0), device_data, LocalTask("fedkf", HP, other_teacher), {})
    assert not same(a.sets["weights"], d.sets["weights"])  # the teacher matters


def test_gamma_zero_is_fedavg_and_the_noise_leaves_the_batches_alone(
    device_data: DeviceData,
) -> None:
    received = state_arrays(lenet(5))
    teacher = state_arrays(lenet(6))
    plain_batches, kd_batches = BatchRecorder(), BatchRecorder()

    fedavg = local_update(
        lenet(0), device_data, LocalTask("fedavg", HP, {"global": received}), hooks=[plain_batches]
    )
    off = local_update(
        lenet(0),
        device_data,
        LocalTask("fedkf", {**HP, "gamma": 0.0}, {"student": received, "teacher": teacher}),
    )
    on = local_update(
        lenet(0),
        device_data,
        LocalTask("fedkf", {**HP, "gamma": 1.0}, {"student": received, "teacher": teacher}),
        hooks=[kd_batches],
    )

    assert same(off.sets["weights"], fedavg.sets["weights"])
    assert set(off.metrics) == {"loss", "accuracy"}
    assert not same(on.sets["weights"], fedavg.sets["weights"])
    assert kd_batches.labels == plain_batches.labels and len(kd_batches.labels) == 4


def test_invalid_fedkf_tasks_are_task_errors(device_data: DeviceData) -> None:
    student = state_arrays(lenet(5))
    bad_teacher = {k: np.full_like(v, np.nan) for k, v in student.items()}
    model = lenet(0)
    before = state_arrays(model)
    cases = [
        (LocalTask("fedkf", HP, {"teacher": student}), "needs the set 'student'"),
        (LocalTask("fedkf", HP, {"student": student, "global": student}), "does not use"),
        (LocalTask("fedkf", HP, {"student": student}, upload="head"), "not 'head'"),
        (LocalTask("fedkf", {**HP, "generator_width": 0}, {}), "generator_width"),
        (LocalTask("fedkf", HP, {"student": student, "teacher": bad_teacher}), "non-finite"),
    ]

    for task, message in cases:
        with pytest.raises(TaskError, match=message):
            local_update(model, device_data, task, {})

    assert same(state_arrays(model), before)
    with pytest.raises(TaskError, match="needs a classifier"):
        local_update(nn.Linear(2, 2), device_data, LocalTask("fedkf", HP))


@pytest.mark.parametrize(("every", "reuse", "generated"), [(1, 1, 0), (3, 2, 5), (4, 10, 7)])
def test_the_generator_steps_and_samples_as_often_as_asked(
    device_data: DeviceData, every: int, reuse: int, generated: int
) -> None:
    """``generator_every`` batches per generator step, ``sample_reuse`` batches per
    generated batch, ``generator_batch_size`` samples in each (0: the local batch)."""
    hp = {**HP, "local_steps": 10, "generator_every": every, "sample_reuse": reuse}
    config = TrainConfig.from_hyperparameters({**hp, "generator_batch_size": generated})
    hook = FedKFHook(frozen_teacher(lenet(2)), {}, config)
    model = lenet(1)
    hook.before_training(model)
    assert hook.generator is not None
    sizes: list[int] = []  # the batch of every forward pass of G
    hook.generator.module.register_forward_hook(lambda m, args, out: sizes.append(len(out)))

    train_local(model, device_data.x, device_data.y, config, (hook,))

    steps, samples = -(-10 // every), -(-10 // reuse)
    assert hook.generator.optimizer.steps == [steps] * len(hook.generator.optimizer.steps)
    assert sizes == [generated or 16] * (steps + samples)
    assert set(hook.metrics()) == {"kd_loss", "generator_loss"}
