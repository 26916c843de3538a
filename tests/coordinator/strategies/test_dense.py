"""DENSE: the generator's loss terms, its phases and the one-shot strategy."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from coordinator.config import CoordinatorConfig
from coordinator.context import ServerContext
from coordinator.errors import ConfigError
from coordinator.runtime import build_models
from coordinator.strategies.base import Aggregated, Contribution, NothingToAggregate
from coordinator.strategies.dense import Dense, dense_distill, draw_batches
from coordinator.strategies.dense_settings import DenseSettings
from coordinator.strategies.ensemble import ensemble_logits
from coordinator.strategies.registry import build_strategy
from coordinator.strategies.sample_generation import (
    BatchNormMatching,
    GeneratorPhase,
    adversarial_loss,
    batch_norm_loss,
    generator_phase,
    total_variation,
)
from models import ImageGenerator, ImageGeneratorConfig, build_classifier, seeded, state_arrays
from models.optim import Adam
from sim.synthetic import make_synthetic
from tests.coordinator.helpers import config

CPU = torch.device("cpu")
TINY = DenseSettings(
    epochs=3,
    generator_steps=3,
    student_steps=10,
    batch_size=32,
    noise_dim=16,
    generator_width=4,
    memory_batches=2,
    eval_size=64,
)

TINY_FLAGS = {"dense_epochs": 3, "dense_generator_steps": 3, "dense_student_steps": 10}
"""TINY's settings that are flags (the rest are ``Dense.defaults``)."""


def model(name: str, seed: int) -> nn.Module:
    with seeded(seed):
        return build_classifier(name, num_classes=10)


class BatchNormNet(nn.Module):
    """A small classifier with BatchNorm, whose running statistics come from the
    brighter images it was "trained" on (LeNet-5, MLP and the rest have none)."""

    def __init__(self) -> None:
        super().__init__()
        with seeded(7):
            self.conv = nn.Conv2d(1, 4, 3, padding=1)
            self.norm = nn.BatchNorm2d(4)
            self.head = nn.Linear(4, 10)
        self.train()
        with torch.no_grad():
            for _ in range(20):
                self(0.5 + 0.5 * torch.rand((16, 1, 28, 28), generator=torch.Generator()))
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.conv(x)))  # (B, 4, 28, 28)
        return self.head(h.mean((2, 3)))  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def trained() -> list[nn.Module]:
    """Two teachers (LeNet-5, MLP) trained a little on the synthetic dataset: untrained
    ones are nearly indifferent to their input, so no image could move their logits."""
    data = make_synthetic(train_samples=1000, test_samples=10)
    x, y = torch.from_numpy(data.train.x), torch.from_numpy(data.train.y)
    rng = torch.Generator().manual_seed(0)
    teachers = []
    for seed, name in enumerate(["lenet5", "mlp"]):
        net = model(name, seed)
        optimizer = Adam(net.parameters(), lr=3e-3)
        for _ in range(60):
            pick = torch.randint(len(x), (64,), generator=rng)
            loss = F.cross_entropy(net(x[pick]), y[pick])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        teachers.append(net.eval())
    return teachers


def generator(seed: int = 0, settings: DenseSettings = TINY) -> ImageGenerator:
    with seeded(seed):
        return ImageGenerator(
            ImageGeneratorConfig(
                noise_dim=settings.noise_dim, base_channels=settings.generator_width
            )
        )


def test_batch_norm_term_is_zero_at_the_running_statistics_and_positive_elsewhere() -> None:
    x = torch.rand((8, 3, 5, 5), generator=torch.Generator().manual_seed(0))
    layer = nn.BatchNorm2d(3).eval()
    layer.running_mean.copy_(x.mean((0, 2, 3)))
    layer.running_var.copy_(x.var((0, 2, 3), correction=0))
    net = nn.Sequential(nn.Identity(), layer)

    with BatchNormMatching([net, model("lenet5", 0)]) as matching:
        net(x)
        same = matching.take(CPU)
        net(2 * x + 1)
        other = matching.take(CPU)
        nothing = matching.take(CPU)

    assert matching.layers == [layer]  # LeNet-5 has no BatchNorm: it adds nothing
    assert float(same) == pytest.approx(0.0, abs=1e-6)
    assert float(other) > 1.0
    assert float(nothing) == 0.0
    assert float(other) == pytest.approx(float(batch_norm_loss(2 * x + 1, layer)))


def test_adversarial_term_counts_only_samples_where_student_and_ensemble_agree() -> None:
    ensemble = torch.tensor([[3.0, 0.0, 0.0], [0.0, 3.0, 0.0]])
    disagree = torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 2.0]])
    agree = torch.tensor([[1.0, 0.5, 0.0], [0.0, 3.0, 0.0]])

    assert float(adversarial_loss(disagree, ensemble)) == 0.0
    loss = adversarial_loss(agree, ensemble)
    kl_first = F.kl_div(
        F.log_softmax(agree[:1], 1),
        F.log_softmax(ensemble[:1], 1),
        log_target=True,
        reduction="sum",
    )
    assert float(loss) == pytest.approx(-float(kl_first) / 2)  # the second sample: KL 0
    assert float(loss) < 0


def one_phase(trained: list[nn.Module], **settings: Any) -> tuple[list[nn.Module], GeneratorPhase]:
    """The frozen ``trained`` teachers, and a generator phase of a fresh generator against
    them (an MLP student) at TINY with ``settings`` changed."""
    teachers = [t.requires_grad_(False) for t in trained]
    student = model("mlp", 3).eval().requires_grad_(False)
    phase = generator_phase(
        generator(),
        teachers,
        [student],
        classes=10,
        settings=dataclasses.replace(TINY, **settings),
        rng=torch.Generator().manual_seed(5),
    )
    return teachers, phase


def test_a_generator_phase_lowers_the_ensembles_cross_entropy_to_the_sampled_labels(
    trained: list[nn.Module],
) -> None:
    def best_ce(steps: int) -> float:
        teachers, phase = one_phase(trained, generator_steps=steps)
        with torch.no_grad():
            return float(F.cross_entropy(ensemble_logits(teachers, phase.best), phase.labels))

    before, after = best_ce(1), best_ce(30)  # one step: the untrained generator's images

    assert after < before - 0.5


def test_total_variation_is_zero_for_constant_samples_and_counts_each_neighbour_axis() -> None:
    flat = torch.full((2, 1, 4, 4), 0.3)
    stripes = torch.zeros((2, 1, 4, 4))
    stripes[..., 1::2, :] = 1.0  # rows alternate: every vertical neighbour differs by 1
    series = torch.tensor([[[0.0, 1.0, 0.0, 1.0]]])  # (B, C, T)

    assert float(total_variation(flat)) == 0.0
    assert float(total_variation(stripes)) == pytest.approx(1.0)  # columns are constant
    assert float(total_variation(stripes.transpose(-1, -2) + stripes)) == pytest.approx(2.0)
    assert float(total_variation(series)) == pytest.approx(1.0)
    assert float(total_variation(torch.rand(3, 7))) == 0.0  # feature vectors: no neighbours


def test_the_smoothness_prior_makes_a_generator_phase_keep_smoother_images(
    trained: list[nn.Module],
) -> None:
    def phase(weight: float) -> tuple[float, float]:
        _, result = one_phase(trained, generator_steps=20, smoothness_weight=weight)
        return float(total_variation(result.best)), result.tv

    without, reported = phase(0.0)
    smoothed, _ = phase(10.0)

    assert reported == pytest.approx(without, rel=0.5)  # the phase reports its mean TV
    assert smoothed < 0.7 * without


def test_distillation_lowers_the_students_kl_to_the_ensemble_and_shows_each_epochs_batch() -> None:
    teachers = [model("lenet5", 1), model("lenet5", 2), model("mlp", 3)]
    student = model("lenet5", 4)
    observed: list[torch.Tensor] = []

    result = dense_distill(
        {"lenet5": student},
        teachers,
        generator(),
        classes=10,
        settings=TINY,
        rng=torch.Generator().manual_seed(0),
        device=CPU,
        observe=observed.append,
    )

    assert result.kl_after["lenet5"] < 0.5 * result.kl_before["lenet5"]
    assert [b.shape for b in observed] == [(32, 1, 28, 28)] * 3  # each epoch's optimised batch
    assert not any(b.requires_grad for b in observed)
    assert result.generator_steps == 9 and result.student_steps == 30
    assert result.bn == 0.0  # no teacher has BatchNorm
    assert not student.training


def test_extra_batches_are_fresh_draws_of_the_generator_without_a_step() -> None:
    gen = generator()
    before = state_arrays(gen)
    settings = dataclasses.replace(TINY, extra_batches=3)

    batches = draw_batches(gen, settings, torch.Generator().manual_seed(0), CPU)

    assert len(batches) == 3 and all(b.shape == (32, 1, 28, 28) for b in batches)
    assert not any(b.requires_grad for b in batches)
    assert not torch.allclose(batches[0], batches[1])  # each its own noise
    after = state_arrays(gen)
    assert all(np.array_equal(before[k], after[k]) for k in before)  # no step taken
    assert gen.training
    assert draw_batches(gen, TINY, torch.Generator(), CPU) == []


def test_a_memory_smaller_than_one_epochs_batches_is_refused() -> None:
    settings = dataclasses.replace(TINY, extra_batches=2, hard_steps=1, memory_batches=3)
    with pytest.raises(ValueError, match=r"must hold an epoch's 4"):
        dense_distill(
            {"mlp": model("mlp", 4)},
            [model("mlp", 2)],
            generator(),
            classes=10,
            settings=settings,
            rng=torch.Generator(),
            device=CPU,
        )


def test_the_same_seed_gives_the_same_students() -> None:
    def run() -> tuple[dict[str, np.ndarray], float]:
        student = model("mlp", 4)
        result = dense_distill(
            {"mlp": student},
            [model("lenet5", 1), model("mlp", 2)],
            generator(),
            classes=10,
            settings=TINY,
            rng=torch.Generator().manual_seed(3),
            device=CPU,
        )
        return state_arrays(student), result.kl_after["mlp"]

    (first, kl_first), (second, kl_second) = run(), run()

    assert kl_first == kl_second
    assert all(np.array_equal(first[k], second[k]) for k in first)


def test_teachers_with_and_without_batch_norm_teach_students_of_two_architectures() -> None:
    students = {"lenet5": model("lenet5", 4), "mlp": model("mlp", 5)}
    shapes = {
        name: {k: v.shape for k, v in state_arrays(s).items()} for name, s in students.items()
    }

    result = dense_distill(
        students,
        [BatchNormNet(), model("lenet5", 1)],
        generator(),
        classes=10,
        settings=TINY,
        rng=torch.Generator().manual_seed(0),
        device=CPU,
    )

    assert result.bn > 0  # the BatchNorm teacher's statistics are matched
    for name, student in students.items():
        assert result.kl_after[name] < result.kl_before[name]
        assert {k: v.shape for k, v in state_arrays(student).items()} == shapes[name]


def dense_config(**overrides: object) -> CoordinatorConfig:
    return CoordinatorConfig.model_validate(
        {
            "fleet": "test",
            "model": "lenet5,mlp",
            "seed": 1,
            "strategy": "dense",
            **TINY_FLAGS,
            **overrides,
        }
    )


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Dense, "defaults", TINY)


def updates(cfg: CoordinatorConfig) -> list[Contribution]:
    out = []
    for i, group in enumerate(["lenet5", "mlp", "lenet5"]):
        weights = state_arrays(model(group, 10 + i))
        out.append(Contribution(f"dev-{i}", group, weights, num_samples=20))
    return out


@pytest.mark.usefixtures("tiny")
def test_the_strategy_distils_a_fresh_model_per_group_and_again_the_same() -> None:
    cfg = dense_config()
    templates = build_models(cfg)
    strategy = build_strategy(cfg, templates)
    current = {name: {"aca": state_arrays(t)} for name, t in templates.items()}

    first = strategy.aggregate(current, updates(cfg), 1, ServerContext.for_round(CPU, 1, 1))
    again = strategy.aggregate(current, updates(cfg), 1, ServerContext.for_round(CPU, 1, 1))
    nothing = strategy.aggregate(current, [], 1, ServerContext.for_round(CPU, 1, 1))

    assert isinstance(first, Aggregated) and isinstance(again, Aggregated)
    assert set(first.models) == {"lenet5", "mlp"}
    for group, template in templates.items():
        aca, repeat = first.models[group]["aca"], again.models[group]["aca"]
        assert {k: v.shape for k, v in aca.items()} == {
            k: tuple(v.shape) for k, v in template.state_dict().items()
        }
        assert all(np.array_equal(aca[k], repeat[k]) for k in aca)
        assert any(not np.array_equal(aca[k], current[group]["aca"][k]) for k in aca)
    assert isinstance(nothing, NothingToAggregate)


@pytest.mark.parametrize("from_average", [False, True])
def test_students_start_untrained_or_from_the_average_of_their_groups_uploads(
    monkeypatch: pytest.MonkeyPatch, from_average: bool
) -> None:
    """With a student learning rate of 0 the delivered models are where the students
    started: the template, or the sample-weighted mean of the group's uploads."""
    still = dataclasses.replace(TINY, student_lr=0.0, start_from_average=from_average)
    monkeypatch.setattr(Dense, "defaults", still)
    cfg = dense_config()
    templates = build_models(cfg)
    strategy = build_strategy(cfg, templates)
    current = {name: {"aca": state_arrays(t)} for name, t in templates.items()}
    received = updates(cfg)
    received[2] = dataclasses.replace(received[2], num_samples=60)  # lenet5: 20 and 60

    result = strategy.aggregate(current, received, 1, ServerContext.for_round(CPU, 1, 1))

    assert isinstance(result, Aggregated)
    lenet, mlp = result.models["lenet5"]["aca"], result.models["mlp"]["aca"]
    for name, value in lenet.items():
        first, second = received[0].weights[name], received[2].weights[name]
        expected = (
            (20 * first + 60 * second) / 80 if from_average else current["lenet5"]["aca"][name]
        )
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)
    for name, value in mlp.items():
        expected = received[1].weights[name] if from_average else current["mlp"]["aca"][name]
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("tiny")
def test_each_teacher_is_the_model_its_device_runs() -> None:
    """A binary device's upload teaches as the binarized model it runs, not as its
    latent float weights."""
    cfg = dense_config()
    templates = build_models(cfg)
    strategy = build_strategy(cfg, templates)
    current = {name: {"aca": state_arrays(t)} for name, t in templates.items()}
    as_float = updates(cfg)
    as_binary = [dataclasses.replace(u, weight_format="binary") for u in as_float]

    def fused(contributions: list[Contribution]) -> dict[str, np.ndarray]:
        result = strategy.aggregate(current, contributions, 1, ServerContext.for_round(CPU, 1, 1))
        assert isinstance(result, Aggregated)
        return result.models["lenet5"]["aca"]

    floats, binaries = fused(as_float), fused(as_binary)

    assert any(not np.array_equal(floats[k], binaries[k]) for k in floats)


def test_dense_is_one_shot_by_default_and_refuses_more_rounds() -> None:
    cfg = dense_config()
    assert (cfg.rounds, cfg.participation) == (1, 1.0)
    assert dense_config(participation=0.5).participation == 0.5
    assert config(strategy="fedavg").rounds == 3 and CoordinatorConfig().rounds == 10
    strategy = build_strategy(cfg, build_models(cfg))
    assert strategy.task_settings(1)["local_epochs"] == 10
    assert not strategy.needs_proxy_data

    with pytest.raises(ConfigError, match="dense is one-shot: run it with --rounds 1"):
        build_strategy(dense_config(rounds=2), build_models(cfg))


def test_denses_server_step_sizes_are_in_the_resume_fingerprint_where_set() -> None:
    """A resumed DENSE run with other --dense-* sizes would distil otherwise: refused.
    At their defaults they are left out, so runs persisted before they counted resume."""
    default = CoordinatorConfig(strategy="dense").fingerprint_fields()
    assert not {"dense_epochs", "dense_generator_steps", "dense_student_steps"} & set(default)
    sized = dense_config().fingerprint_fields()  # TINY_FLAGS: every size set
    assert (sized["dense_epochs"], sized["dense_generator_steps"]) == (3, 3)
    assert dense_config(dense_student_steps=11).fingerprint_fields() != sized
