"""FedGen's server step: diversity loss, label weights, and training the latent generator."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from coordinator.strategies.fedgen import (
    GeneratorTraining,
    diversity_loss,
    ensemble_accuracy,
    label_prior,
    label_weights,
    train_latent_generator,
)
from models import LatentGenerator, LatentGeneratorConfig, build_classifier, state_arrays

LATENT_DIM = 16
NUM_CLASSES = 4
# Skewed per device: label 3 lives almost only on device 2, label 0 mostly on device 0.
COUNTS = [[50, 30, 5, 0], [0, 40, 40, 5], [10, 0, 20, 60]]

Head = dict[str, npt.NDArray[Any]]


def make_generator(init_seed: int = 0, hidden_dim: int = 64) -> LatentGenerator:
    config = LatentGeneratorConfig(
        noise_dim=8, hidden_dim=hidden_dim, num_classes=NUM_CLASSES, latent_dim=LATENT_DIM
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        return LatentGenerator(config)


def make_heads(n: int = 3, seed: int = 0) -> list[Head]:
    rng = np.random.default_rng(seed)
    return [
        {
            "head.weight": rng.normal(size=(NUM_CLASSES, LATENT_DIM)).astype(np.float32),
            "head.bias": (0.1 * rng.normal(size=NUM_CLASSES)).astype(np.float32),
        }
        for _ in range(n)
    ]


def generator_state(generator: LatentGenerator) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in generator.state_dict().items()}


FAST = GeneratorTraining(steps=200, batch_size=32, lr=1e-3)


# --- diversity loss -------------------------------------------------------------------


def test_diversity_loss_of_two_samples_matches_hand_computation() -> None:
    noise = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    outputs = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 3.0]])
    # d_noise(0,1) = (1 + 4) / 2 = 2.5; d_out(0,1) = (1 + 2 + 3) / 3 = 2; the diagonal
    # is 0, so the mean over the 4 ordered pairs is 2 * (2.5 * 2) / 4.
    expected = math.exp(-(2 * 2.5 * 2.0) / 4)

    loss = diversity_loss(noise, outputs)

    assert loss.shape == ()
    assert float(loss) == pytest.approx(expected, rel=1e-6)


def test_diversity_loss_of_three_samples_matches_hand_computation() -> None:
    noise = torch.tensor([[0.0], [1.0], [3.0]])
    outputs = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 4.0]])
    d_noise = {(0, 1): 1.0, (0, 2): 9.0, (1, 2): 4.0}
    d_out = {(0, 1): (2 + 0) / 2, (0, 2): (0 + 4) / 2, (1, 2): (2 + 4) / 2}
    expected = math.exp(-2 * sum(d_noise[p] * d_out[p] for p in d_noise) / 9)

    assert float(diversity_loss(noise, outputs)) == pytest.approx(expected, rel=1e-6)


def test_diversity_loss_is_one_for_collapsed_outputs_and_has_gradients() -> None:
    noise = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    outputs = torch.ones(5, 4, requires_grad=True)

    loss = diversity_loss(noise, outputs)
    loss.backward()  # type: ignore[no-untyped-call]

    assert loss.item() == pytest.approx(1.0)
    assert outputs.grad is not None


def test_diversity_loss_rejects_mismatched_batches() -> None:
    with pytest.raises(ValueError, match="expected noise"):
        diversity_loss(torch.zeros(3, 2), torch.zeros(4, 2))


# --- label weights and prior ----------------------------------------------------------


def test_label_weights_are_each_devices_share_of_a_label() -> None:
    counts = np.array([[2, 0, 1], [6, 0, 4]])  # 2 devices, 3 labels; label 1 held by none

    weights = label_weights(counts)

    assert weights.dtype == np.float32
    np.testing.assert_allclose(weights, [[0.25, 0.75], [0.0, 0.0], [0.2, 0.8]], rtol=1e-6)


def test_label_prior_normalises_the_aggregated_counts() -> None:
    prior = label_prior([[2, 0, 1], [6, 0, 4]])

    assert prior.dtype == np.float32
    np.testing.assert_allclose(prior, [8 / 13, 0.0, 5 / 13], rtol=1e-6)


@pytest.mark.parametrize("counts", [[[0, 0], [0, 0]], [[1, -1]], [1, 2, 3], [[1.0, float("nan")]]])
def test_label_prior_rejects_invalid_counts(counts: Any) -> None:
    with pytest.raises(ValueError):
        label_prior(counts)


# --- training ---------------------------------------------------------------------------


def test_training_teaches_the_generator_to_fool_the_weighted_ensemble() -> None:
    generator, heads = make_generator(), make_heads()
    before = ensemble_accuracy(generator, heads, COUNTS, samples=2000, seed=1)

    stats = train_latent_generator(
        generator, heads, COUNTS, FAST, rng=torch.Generator().manual_seed(0)
    )
    after = ensemble_accuracy(generator, heads, COUNTS, samples=2000, seed=1)

    assert before < 0.5
    assert after > 0.9
    assert stats["steps"] == 200
    assert stats["ensemble_loss_last"] < 0.5 * stats["ensemble_loss_first"]
    assert 0 < stats["diversity_loss_last"] <= 1


def test_default_settings_also_learn() -> None:
    generator, heads = make_generator(hidden_dim=256), make_heads()

    stats = train_latent_generator(
        generator, heads, COUNTS, GeneratorTraining(steps=200), rng=torch.Generator().manual_seed(0)
    )

    assert stats["ensemble_loss_last"] < stats["ensemble_loss_first"]
    assert ensemble_accuracy(generator, heads, COUNTS, samples=2000, seed=1) > 0.9


def test_same_seed_gives_the_same_generator_and_another_seed_does_not() -> None:
    heads = make_heads()
    a, b, c = make_generator(), make_generator(), make_generator()
    settings = GeneratorTraining(steps=20, lr=1e-3)

    stats_a = train_latent_generator(
        a, heads, COUNTS, settings, rng=torch.Generator().manual_seed(7)
    )
    stats_b = train_latent_generator(
        b, heads, COUNTS, settings, rng=torch.Generator().manual_seed(7)
    )
    train_latent_generator(c, heads, COUNTS, settings, rng=torch.Generator().manual_seed(8))

    assert stats_a == stats_b
    state_a, state_b, state_c = generator_state(a), generator_state(b), generator_state(c)
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert not all(torch.equal(state_a[k], state_c[k]) for k in state_a)


def test_only_the_generator_changes() -> None:
    generator, heads = make_generator(), make_heads()
    heads_before = [{k: v.copy() for k, v in head.items()} for head in heads]
    counts = np.array(COUNTS)
    counts_before = counts.copy()
    state_before = generator_state(generator)
    generator.eval()

    train_latent_generator(
        generator, heads, counts, GeneratorTraining(steps=5), rng=torch.Generator().manual_seed(0)
    )

    for head, before in zip(heads, heads_before, strict=True):
        assert head.keys() == before.keys()
        for name in head:
            np.testing.assert_array_equal(head[name], before[name])
    np.testing.assert_array_equal(counts, counts_before)
    state_after = generator_state(generator)
    assert not torch.equal(state_after["fc1.weight"], state_before["fc1.weight"])
    assert not generator.training  # mode restored


def test_heads_from_a_classifier_state_are_accepted() -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_classifier("mlp", num_classes=NUM_CLASSES, hidden=(LATENT_DIM,))
    heads = [state_arrays(model, "head")] * 2

    stats = train_latent_generator(
        make_generator(),
        heads,
        [[3, 1, 0, 2], [0, 5, 5, 0]],
        GeneratorTraining(steps=3),
        rng=torch.Generator().manual_seed(0),
    )

    assert stats["steps"] == 3


def test_ensemble_votes_are_weighted_by_label_share() -> None:
    # Head 0 always says label 0, head 1 always says label 1, whatever the latent.
    def constant_head(label: int) -> Head:
        bias = np.zeros(NUM_CLASSES, np.float32)
        bias[label] = 100.0
        return {"head.weight": np.zeros((NUM_CLASSES, LATENT_DIM), np.float32), "head.bias": bias}

    heads = [constant_head(0), constant_head(1)]
    generator = make_generator()

    # Each device holds only the label its head predicts: every vote is right.
    assert ensemble_accuracy(generator, heads, [[10, 0, 0, 0], [0, 10, 0, 0]], samples=200) == 1.0
    # Swapped: the only head allowed to vote on a label predicts the other one.
    assert ensemble_accuracy(generator, heads, [[0, 10, 0, 0], [10, 0, 0, 0]], samples=200) == 0.0


# --- validation -----------------------------------------------------------------------


def _bad_heads_and_counts() -> list[tuple[list[Head], Any, str]]:
    good = make_heads(2)
    counts = [[1, 2, 3, 4], [4, 3, 2, 1]]
    no_bias = [good[0], {"head.weight": good[1]["head.weight"]}]
    extra = [good[0], {**good[1], "features.fc.weight": np.zeros((2, 2), np.float32)}]
    wrong_latent = [good[0], {**good[1], "head.weight": np.zeros((NUM_CLASSES, 8), np.float32)}]
    wrong_classes = [good[0], {"head.weight": np.zeros((3, LATENT_DIM)), "head.bias": np.zeros(3)}]
    nan_head = [good[0], {**good[1], "head.bias": np.full(NUM_CLASSES, np.nan, np.float32)}]
    return [
        ([], [], "at least one head"),
        (good, [[1, 2, 3, 4]], "label counts must be"),
        (good, [[1, 2, 3], [3, 2, 1]], "label counts must be"),
        (good, [[1, 2, 3, -4], [4, 3, 2, 1]], "non-negative"),
        (good, [[0, 0, 0, 0], [0, 0, 0, 0]], "all zero"),
        (no_bias, counts, "head 1: expected exactly"),
        (extra, counts, "head 1: expected exactly"),
        (wrong_latent, counts, "head 1: expected"),
        (wrong_classes, counts, "head 1: expected"),
        (nan_head, counts, "non-finite"),
    ]


@pytest.mark.parametrize(("heads", "counts", "message"), _bad_heads_and_counts())
def test_invalid_inputs_raise_value_error_and_leave_the_generator_alone(
    heads: list[Head], counts: Any, message: str
) -> None:
    generator = make_generator()
    before = generator_state(generator)

    with pytest.raises(ValueError, match=message):
        train_latent_generator(
            generator,
            heads,
            counts,
            GeneratorTraining(steps=2),
            rng=torch.Generator().manual_seed(0),
        )
    with pytest.raises(ValueError, match=message):
        ensemble_accuracy(generator, heads, counts, samples=10)

    after = generator_state(generator)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize(
    "options",
    [
        {"steps": 0},
        {"batch_size": 1},
        {"lr": 0.0},
        {"lr": float("inf")},
        {"diversity_weight": -1.0},
        {"ensemble_weight": float("nan")},
        {"ensemble_weight": 0.0, "diversity_weight": 0.0},
    ],
)
def test_generator_training_rejects_out_of_range_settings(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        GeneratorTraining(**options)


def test_generator_training_defaults() -> None:
    settings = GeneratorTraining()

    assert (settings.steps, settings.batch_size, settings.lr) == (50, 32, 3e-4)
    assert (settings.diversity_weight, settings.ensemble_weight) == (1.0, 1.0)


def test_ensemble_accuracy_rejects_no_samples() -> None:
    with pytest.raises(ValueError, match="samples"):
        ensemble_accuracy(make_generator(), make_heads(), COUNTS, samples=0)
