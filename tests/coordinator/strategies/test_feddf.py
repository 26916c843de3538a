"""FedDF: ensemble distillation on proxy data, the pure step and the strategy."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from coordinator.context import ServerContext
from coordinator.runtime import build_models
from coordinator.strategies.base import Aggregated, Contribution, NothingToAggregate
from coordinator.strategies.ensemble import kl_to_ensemble, teacher_logits
from coordinator.strategies.feddf import chance_teachers, distill, holdout_split
from coordinator.strategies.feddf_settings import DistillSettings
from coordinator.strategies.registry import build_strategy
from models import build_classifier, load_state_arrays, state_arrays
from models.weight_formats import binarize, fake_quantize_int8, run_weights_
from tests.coordinator.helpers import config

CPU = torch.device("cpu")


def seeded(name: str, seed: int):
    torch.manual_seed(seed)
    return build_classifier(name, num_classes=10)


def proxy(count: int = 256) -> torch.Tensor:
    return torch.rand((count, 1, 28, 28), generator=torch.Generator().manual_seed(3))


def test_distillation_lowers_the_kl_to_the_ensemble_on_held_out_proxy_data() -> None:
    images = proxy()
    teachers = [seeded("lenet5", 1), seeded("mlp", 2), seeded("lenet5", 3)]
    ensemble = torch.stack([teacher_logits(t, images) for t in teachers]).mean(0)
    rng = torch.Generator().manual_seed(0)
    train, held_out = holdout_split(len(images), 0.25, rng)
    student = seeded("mlp", 4)
    settings = DistillSettings(max_steps=150, eval_every=10, lr=3e-3)

    result = distill(
        student, images, ensemble, train=train, held_out=held_out, settings=settings, rng=rng
    )

    after = float(kl_to_ensemble(teacher_logits(student, images[held_out]), ensemble[held_out]))
    assert after == result.kl_after < 0.5 * result.kl_before
    assert 0 < result.steps <= 150
    assert set(train.tolist()).isdisjoint(held_out.tolist()) and len(held_out) == 64


def test_a_student_distilled_at_the_binary_format_too_binarizes_closer_to_the_ensemble() -> None:
    images = proxy()
    teachers = [seeded("lenet5", 1), seeded("lenet5", 3)]
    ensemble = torch.stack([teacher_logits(t, images) for t in teachers]).mean(0)
    settings = DistillSettings(max_steps=120, eval_every=10, lr=3e-3)

    def binarized_kl(formats: tuple[str, ...]) -> tuple[float, float]:
        rng = torch.Generator().manual_seed(0)
        train, held_out = holdout_split(len(images), 0.25, rng)
        student = seeded("lenet5", 4)
        result = distill(
            student,
            images,
            ensemble,
            train=train,
            held_out=held_out,
            settings=settings,
            rng=rng,
            formats=formats,
        )
        as_run = run_weights_(copy.deepcopy(student), "binary")
        logits = teacher_logits(as_run, images[held_out])
        return float(kl_to_ensemble(logits, ensemble[held_out])), result.kl_after

    float_only, _ = binarized_kl(("float",))
    both, mean_kl = binarized_kl(("binary", "float"))

    assert both < 0.8 * float_only  # the binary devices' model is distilled too
    assert both < 2 * mean_kl  # the held-out KL measured the binary student among others
    with pytest.raises(ValueError, match="at least one weight format"):
        binarized_kl(())


def test_early_stopping_keeps_the_best_student_measured() -> None:
    images = proxy(64)
    teacher = seeded("mlp", 1)
    ensemble = teacher_logits(teacher, images)
    rng = torch.Generator().manual_seed(0)
    train, held_out = holdout_split(len(images), 0.5, rng)
    student = seeded("mlp", 1)  # the teacher itself: no step can improve on it
    settings = DistillSettings(max_steps=100, eval_every=5, patience=2)

    result = distill(
        student, images, ensemble, train=train, held_out=held_out, settings=settings, rng=rng
    )

    assert result.steps == 10  # two measurements without improvement
    assert result.kl_after == result.kl_before
    for name, tensor in teacher.state_dict().items():
        assert torch.equal(student.state_dict()[name], tensor), name


def test_drop_worst_names_the_teachers_no_better_than_chance() -> None:
    held_out = torch.arange(8)
    agree = torch.nn.functional.one_hot(torch.arange(8) % 4, 4).float() * 5
    contrary = torch.nn.functional.one_hot((torch.arange(8) + 1) % 4, 4).float()

    assert chance_teachers([agree, agree, contrary], held_out) == [2]
    assert chance_teachers([agree, agree], held_out) == []


def contributions(templates) -> list[Contribution]:
    out = []
    for index, (group, seed) in enumerate([("mlp", 1), ("lenet5", 2), ("mlp", 3)]):
        weights = state_arrays(seeded(group, seed))
        assert weights.keys() == state_arrays(templates[group]).keys()
        out.append(Contribution(f"dev-{index}", group, weights, num_samples=10 * (index + 1)))
    return out


def test_feddf_distils_each_group_from_every_architecture_and_keeps_its_shapes() -> None:
    cfg = config(strategy="feddf", model="mlp,lenet5", seed=5)
    templates = build_models(cfg)
    strategy = build_strategy(cfg, templates)
    current = {name: {"aca": state_arrays(t)} for name, t in templates.items()}
    context = ServerContext.for_round(CPU, cfg.seed, 1, proxy_data=proxy(128))
    updates = contributions(templates)
    strategy.distillation = DistillSettings(max_steps=40, eval_every=10)

    result = strategy.aggregate(current, iter(updates), 1, context)

    assert isinstance(result, Aggregated) and set(result.models) == {"mlp", "lenet5"}
    mean_mlp = {
        k: (10 * updates[0].weights[k] + 30 * updates[2].weights[k]) / 40
        for k in updates[0].weights
    }
    for group, models in result.models.items():
        shapes = {k: v.shape for k, v in state_arrays(templates[group]).items()}
        assert {k: v.shape for k, v in models["aca"].items()} == shapes
    moved = [not np.allclose(result.models["mlp"]["aca"][k], v) for k, v in mean_mlp.items()]
    assert any(moved)  # distilled away from the group's average
    assert isinstance(strategy.aggregate(current, iter(()), 2, context), NothingToAggregate)


def test_the_run_settings_drive_the_distillation() -> None:
    cfg = config(
        strategy="feddf",
        distill_steps=7,
        distill_batch_size=16,
        distill_lr=0.01,
        distill_temperature=2.0,
        distill_patience=2,
    )

    strategy = build_strategy(cfg, build_models(cfg))

    assert strategy.distillation == DistillSettings(
        max_steps=7, batch_size=16, lr=0.01, temperature=2.0, patience=2
    )


@pytest.mark.parametrize(
    ("weight_format", "run"), [("binary", binarize), ("int8", fake_quantize_int8)]
)
def test_a_feddf_teacher_runs_the_weights_its_device_runs(weight_format, run) -> None:
    cfg = config(strategy="feddf", model="lenet5", seed=5)
    strategy = build_strategy(cfg, build_models(cfg))
    images = proxy(32)
    trained = seeded("lenet5", 2)
    latent = state_arrays(trained)
    deployed = {  # what the device runs: its kernels in its format, the rest float
        k: run(torch.from_numpy(v)).numpy() if v.ndim >= 2 else v for k, v in latent.items()
    }
    reference = seeded("lenet5", 0)
    load_state_arrays(reference, deployed)

    teacher = strategy.teacher(
        Contribution("dev-0", "lenet5", latent, 10, weight_format=weight_format), images, CPU
    )
    float_teacher = strategy.teacher(Contribution("dev-0", "lenet5", latent, 10), images, CPU)

    torch.testing.assert_close(teacher, teacher_logits(reference, images))
    torch.testing.assert_close(float_teacher, teacher_logits(trained, images))
    assert (teacher - float_teacher).abs().max() > 1e-5  # int8 moves logits little


def test_feddf_distils_from_the_binarized_teacher_into_a_float_student() -> None:
    cfg = config(strategy="feddf", model="mlp", seed=5)
    templates = build_models(cfg)
    strategy = build_strategy(cfg, templates)
    strategy.distillation = DistillSettings(max_steps=40, eval_every=10)
    latent = state_arrays(seeded("mlp", 1))
    current = {"mlp": {"aca": state_arrays(templates["mlp"])}}

    def fused(weight_format: str) -> dict[str, np.ndarray]:
        context = ServerContext.for_round(CPU, cfg.seed, 1, proxy_data=proxy(128))
        update = Contribution("dev-0", "mlp", latent, 10, weight_format=weight_format)
        result = strategy.aggregate(current, iter([update]), 1, context)
        assert isinstance(result, Aggregated)
        return result.models["mlp"]["aca"]

    as_float, as_binary = fused("float"), fused("binary")

    # a float teacher is its own average: nothing to distil, the student stays the average
    assert all(np.array_equal(as_float[k], v) for k, v in latent.items())
    # a binary teacher differs from the latent average the student starts from: it moves
    assert any(not np.allclose(as_binary[k], v) for k, v in latent.items())
    kernel = torch.from_numpy(as_binary["features.fc1.weight"])
    assert not torch.equal(binarize(kernel), kernel)  # the student stays float
