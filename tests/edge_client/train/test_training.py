"""The one training loop: determinism, step counts, hooks, and hyperparameter validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from edge_client.errors import TaskError
from edge_client.train.training import TrainConfig, TrainHook, train_local
from models import Classifier, build_classifier


def model(seed: int = 0) -> Classifier:
    torch.manual_seed(seed)
    return build_classifier("mlp", num_classes=4, in_channels=1, image_size=8)


def data(n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    y = (np.arange(n) % 4).astype(np.int64)
    x = rng.random((n, 1, 8, 8), dtype=np.float32) * 0.3
    x[np.arange(n), 0, y, y] += 1.0  # a learnable signal
    return x, y


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return float(sum(((a[k] - b[k]) ** 2).sum() for k in a) ** 0.5)


class Counter(TrainHook):
    def __init__(self) -> None:
        self.before = 0
        self.steps = 0
        self.extra_calls = 0

    def before_training(self, model: nn.Module) -> None:
        self.before += 1

    def extra_loss(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor
    ) -> torch.Tensor | None:
        self.extra_calls += 1
        assert logits.shape == (x.shape[0], 4)
        return None

    def after_step(self, model: nn.Module) -> None:
        self.steps += 1


def test_same_seed_gives_identical_weights_and_another_seed_differs() -> None:
    x, y = data()
    config = TrainConfig(local_epochs=2, batch_size=16, lr=0.1, momentum=0.9, seed=7)
    a, b, c = model(), model(), model()

    result_a = train_local(a, x, y, config)
    result_b = train_local(b, torch.from_numpy(x), torch.from_numpy(y), config)
    train_local(c, x, y, config.model_copy(update={"seed": 8}))

    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert result_a.loss == result_b.loss and result_a.accuracy == result_b.accuracy
    assert distance(weights(a), weights(c)) > 0


def test_epochs_and_local_steps_give_exact_step_counts() -> None:
    x, y = data(64)
    by_epochs, by_steps = Counter(), Counter()

    epochs = train_local(model(), x, y, TrainConfig(local_epochs=2, batch_size=20), [by_epochs])
    steps = train_local(
        model(), x, y, TrainConfig(local_epochs=5, local_steps=7, batch_size=16), [by_steps]
    )

    assert epochs.steps == 2 * 4 == by_epochs.steps == by_epochs.extra_calls  # ceil(64/20)=4
    assert steps.steps == 7 == by_steps.steps  # local_steps wins over local_epochs
    assert by_epochs.before == by_steps.before == 1
    assert steps.num_samples == 64
    assert np.isfinite(steps.loss) and 0.0 <= steps.accuracy <= 1.0 and steps.seconds >= 0


def test_training_lowers_the_loss_and_zero_steps_change_nothing() -> None:
    x, y = data(64)
    trained = model()
    untouched = model()
    before = weights(untouched)

    first = train_local(trained, x, y, TrainConfig(local_epochs=1, batch_size=8, lr=0.2))
    later = train_local(trained, x, y, TrainConfig(local_epochs=5, batch_size=8, lr=0.2))
    none = train_local(untouched, x, y, TrainConfig(local_epochs=0))
    empty = train_local(model(), x[:0], y[:0], TrainConfig())

    assert later.loss < first.loss
    assert none.steps == 0 and none.loss == 0.0 and distance(weights(untouched), before) == 0
    assert empty.steps == 0 and empty.num_samples == 0


def test_an_extra_loss_changes_the_gradient() -> None:
    class Pull(TrainHook):
        def extra_loss(
            self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor
        ) -> torch.Tensor | None:
            return 10.0 * logits.pow(2).mean()

    x, y = data()
    plain, pulled = model(), model()
    config = TrainConfig(local_steps=3, batch_size=16, lr=0.05)

    train_local(plain, x, y, config)
    train_local(pulled, x, y, config, [Pull()])

    assert distance(weights(plain), weights(pulled)) > 1e-3


def test_before_batch_runs_first_and_its_gradients_are_discarded() -> None:
    class Meddle(TrainHook):
        def __init__(self) -> None:
            self.seen: list[tuple[str, list[int]]] = []

        def before_batch(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
            self.seen.append(("before", y.tolist()))
            for p in model.parameters():
                p.grad = torch.full_like(p, 1000.0)  # must not reach the step

        def extra_loss(
            self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor
        ) -> torch.Tensor | None:
            self.seen.append(("extra", y.tolist()))
            return None

    x, y = data()
    plain, meddled = model(), model()
    config = TrainConfig(local_steps=3, batch_size=16, lr=0.05, seed=4)
    hook = Meddle()

    train_local(plain, x, y, config)
    train_local(meddled, x, y, config, [hook])

    assert distance(weights(plain), weights(meddled)) == 0
    assert [kind for kind, _ in hook.seen] == ["before", "extra"] * 3
    assert all(hook.seen[i][1] == hook.seen[i + 1][1] for i in range(0, 6, 2))
    assert TrainHook().metrics() == {}


def test_bad_inputs_are_task_errors() -> None:
    x, y = data(8)
    with pytest.raises(TaskError, match="inputs but"):
        train_local(model(), x, y[:4], TrainConfig())
    with pytest.raises(TaskError, match="float32"):
        train_local(model(), x.astype(np.float64), y, TrainConfig())


def test_defaults_and_valid_hyperparameters() -> None:
    config = TrainConfig.from_hyperparameters(
        {"local_epochs": 2, "batch_size": 8, "lr": 1, "momentum": 0.5, "seed": 3, "mu": 0.01}
    )

    assert config.lr == 1.0 and isinstance(config.lr, float)
    assert config.local_steps == 0 and config.weight_decay == 0.0
    assert TrainConfig.from_hyperparameters({}) == TrainConfig()
    defaults = TrainConfig()
    assert (defaults.gamma, defaults.lambda1, defaults.lambda2) == (1.0, 0.1, 0.1)
    assert (defaults.generator_lr, defaults.generator_width) == (1e-3, 16)
    assert (defaults.generator_noise_dim, defaults.generator_hidden) == (0, 256)
    assert (defaults.generative_alpha, defaults.generator_batch_size) == (0.0, 0)
    assert (defaults.momentum, defaults.mu) == (0.9, 0.01)  # protocol.hyperparams' defaults
    assert TrainConfig.from_hyperparameters({"gamma": 2, "generative_alpha": 1}).gamma == 2.0
    assert config.total_steps(17) == 2 * 3 and config.total_steps(0) == 0


@pytest.mark.parametrize(
    ("hyperparameters", "message"),
    [
        ({"epochs": 1}, "epochs: Extra inputs are not permitted"),
        ({"lr": 0.0}, "lr: Input should be greater than 0"),
        ({"lr": float("nan")}, "lr"),
        ({"batch_size": 0}, "batch_size"),
        ({"local_epochs": -1}, "local_epochs"),
        ({"local_steps": 1.5}, "local_steps"),
        ({"local_epochs": 1.0}, "local_epochs: Input should be a valid integer"),
        ({"batch_size": True}, "batch_size"),
        ({"seed": "3"}, "seed"),
        ({"seed": -1}, "seed"),
        ({"mu": -0.1}, "mu"),
        ({"momentum": -0.5}, "momentum"),
        ({"momentum": 1.0}, "momentum: Input should be less than 1"),
        ({"weight_decay": "0"}, "weight_decay"),
        ({"gamma": -1.0}, "gamma"),
        ({"lambda1": -0.1}, "lambda1"),
        ({"lambda2": float("inf")}, "lambda2"),
        ({"generator_lr": 0.0}, "generator_lr"),
        ({"generator_width": 0}, "generator_width"),
        ({"generator_width": 16.0}, "generator_width: Input should be a valid integer"),
        ({"generator_noise_dim": -1}, "generator_noise_dim"),
        ({"generator_hidden": 0}, "generator_hidden"),
        ({"generative_alpha": -0.5}, "generative_alpha"),
        ({"generator_batch_size": True}, "generator_batch_size"),
    ],
)
def test_invalid_hyperparameters_raise_task_error(
    hyperparameters: dict[str, object], message: str
) -> None:
    with pytest.raises(TaskError, match=message) as caught:
        TrainConfig.from_hyperparameters(hyperparameters)

    known = str(caught.value).split("known keys: ")[1]
    assert "local_epochs" in known and "momentum" in known and "seed" in known
    assert isinstance(caught.value, ValueError)
