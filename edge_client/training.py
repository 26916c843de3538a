"""The one local training loop, with hooks for what each algorithm adds.

:func:`train_local` runs mini-batch SGD on cross-entropy. Algorithms change it only
through :class:`TrainHook` objects: FedProx adds a proximal term with
:meth:`TrainHook.extra_loss`, FedKF trains its generator in
:meth:`TrainHook.before_batch` and adds a distillation loss, FedGen adds a loss on
generated latents, and quantization-aware training (``TrainConfig.qat``) swaps in
fake-quantized weights in :meth:`TrainHook.before_batch` and restores the float ones in
:meth:`TrainHook.before_step`. There is no second copy of this loop anywhere (STYLE
principle 8).

Pure: tensors and a :class:`TrainConfig` in, a trained model and a :class:`TrainResult`
out; no I/O, no global RNG (shuffling uses its own ``torch.Generator`` seeded from
``TrainConfig.seed``), no thread settings. Same model, data, config and thread count
give bit-identical weights.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F  # noqa: N812
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import nn

from edge_client.errors import TaskError

__all__ = ["TrainConfig", "TrainHook", "TrainResult", "train_local"]

MAX_SEED = 2**64 - 1
_NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class TrainConfig(BaseModel):
    """Local training hyperparameters, as a round task's ``hyperparameters`` carry them.

    Types are strict: an integer field rejects ``1.0`` and ``True``; a float field
    accepts integers. Unknown keys are rejected.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    local_epochs: int = Field(default=1, ge=0)
    """Passes over the local train set (used when ``local_steps`` is 0)."""
    local_steps: int = Field(default=0, ge=0)
    """When > 0: exactly this many mini-batches, cycling through reshuffled epochs,
    instead of ``local_epochs``."""
    batch_size: int = Field(default=32, ge=1)
    """Samples per mini-batch (the last batch of an epoch may be smaller)."""
    lr: float = Field(default=0.01, gt=0, allow_inf_nan=False)
    """SGD learning rate."""
    momentum: _NonNegFloat = 0.0
    """SGD momentum (0: none)."""
    weight_decay: _NonNegFloat = 0.0
    """L2 penalty added by SGD to the gradient of every trainable parameter."""
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    """Seed of the shuffling generator; same seed, same batches."""
    mu: _NonNegFloat = 0.0
    """FedProx proximal weight; only the ``fedprox`` strategy uses it."""

    # FedKF (strategy "fedkf") and the generators of FedKF / FedGen.
    gamma: _NonNegFloat = 1.0
    """FedKF: weight of the distillation term ``gamma * KL(teacher || student)`` on
    generated samples (0: no generator work, plain SGD on the student)."""
    lambda1: _NonNegFloat = 0.1
    """FedKF: weight of the one-hot loss in the generator objective L_G."""
    lambda2: _NonNegFloat = 0.1
    """FedKF: weight of the activation loss in the generator objective L_G."""
    generator_lr: float = Field(default=1e-3, gt=0, allow_inf_nan=False)
    """FedKF: Adam learning rate of the local image generator."""
    generator_width: int = Field(default=16, ge=1)
    """FedKF: ``base_channels`` of the local image generator (64 is the DCGAN size)."""
    generator_noise_dim: int = Field(default=0, ge=0)
    """Noise width of the generator; 0: the strategy's default (100 for FedKF's image
    generator, 32 for FedGen's latent generator)."""
    generator_hidden: int = Field(default=256, ge=1)
    """FedGen: hidden width of the latent generator (must match the coordinator's)."""
    generative_alpha: _NonNegFloat = 0.0
    """FedGen: this round's weight alpha_t of ``CE(head(G(eps, y)), y)`` (the coordinator
    applies the decay schedule and sends the round's value; 0: plain cross-entropy)."""
    generator_batch_size: int = Field(default=0, ge=0)
    """FedGen: generated latents per step; 0: ``batch_size``."""
    qat: bool = False
    """int8 quantization-aware training: weights of rank >= 2 are fake-quantized per
    output channel (symmetric, 127 levels each side) in every forward pass; gradients
    pass straight through to the float weights (:mod:`edge_client.qat`)."""

    @classmethod
    def from_hyperparameters(cls, hyperparameters: Mapping[str, object]) -> TrainConfig:
        """Validate a task's hyperparameters; absent keys take the defaults above.

        Raises:
            TaskError: an unknown key, a value of the wrong type, or out of range; the
                message names every offending key.
        """
        try:
            return cls.model_validate(dict(hyperparameters))
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(part) for part in err['loc']) or '(config)'}: {err['msg']}"
                for err in exc.errors()
            )
            known = ", ".join(cls.model_fields)
            raise TaskError(f"invalid hyperparameters: {problems} (known keys: {known})") from None

    def total_steps(self, num_samples: int) -> int:
        """Optimizer steps this config makes on ``num_samples`` samples (0 if none)."""
        if num_samples == 0:
            return 0
        if self.local_steps > 0:
            return self.local_steps
        return self.local_epochs * math.ceil(num_samples / self.batch_size)


class TrainHook:
    """What an algorithm adds to :func:`train_local`; every method is a no-op here.

    Subclass and override what you need. Hooks are called in the order given.
    """

    def before_training(self, model: nn.Module) -> None:
        """Called once, before the first step, with the model in training mode and on
        the training device."""

    def before_batch(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        """Called for every batch before the model's gradients are zeroed and before its
        forward pass (FedKF trains its generator here). Gradients the hook leaves on the
        model's parameters are discarded.

        Args:
            model: the model being trained.
            x: the batch's inputs (B, C, H, W), on the training device.
            y: the batch's labels (B,), int64.
        """

    def extra_loss(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor
    ) -> torch.Tensor | None:
        """A scalar added to the batch's cross-entropy before ``backward()`` (or None).

        Args:
            model: the model being trained.
            x: the batch's inputs (B, C, H, W), on the training device.
            y: the batch's labels (B,), int64.
            logits: ``model(x)``, (B, num_classes), part of the autograd graph.
        """
        return None

    def before_step(self, model: nn.Module) -> None:
        """Called for every batch after ``backward()``, before the optimizer step (the
        gradients are on the model's parameters; quantization-aware training restores its
        float weights here)."""

    def after_step(self, model: nn.Module) -> None:
        """Called after every optimizer step. May raise to abort training."""

    def metrics(self) -> dict[str, float]:
        """What the hook measured over the run (e.g. mean extra losses), by name; read
        once training ended. None by default."""
        return {}


@dataclass(frozen=True)
class TrainResult:
    """What one :func:`train_local` call did."""

    steps: int
    """Optimizer steps taken."""
    num_samples: int
    """Local train samples N (each step uses a batch of them)."""
    loss: float
    """Sample-weighted mean cross-entropy over all batches seen (the hooks' extra losses
    excluded), measured before each step; 0.0 when no step was taken."""
    accuracy: float
    """Fraction of the samples seen that the model classified correctly, before each
    step; 0.0 when no step was taken."""
    seconds: float
    """Wall-clock time of the loop, seconds."""


def _batches(n: int, config: TrainConfig, total: int) -> Iterator[torch.Tensor]:
    """Index batches: reshuffled epochs from a generator seeded by ``config.seed``."""
    generator = torch.Generator().manual_seed(config.seed)
    done = 0
    while done < total:
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, config.batch_size):
            yield order[start : start + config.batch_size]
            done += 1
            if done == total:
                return


def _as_tensor(value: torch.Tensor | npt.NDArray[np.generic], dtype: torch.dtype) -> torch.Tensor:
    tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
    if tensor.dtype != dtype:
        raise TaskError(f"expected a {dtype} tensor, got {tensor.dtype}")
    return tensor


def train_local(
    model: nn.Module,
    x: torch.Tensor | npt.NDArray[np.float32],
    y: torch.Tensor | npt.NDArray[np.int64],
    config: TrainConfig,
    hooks: Sequence[TrainHook] = (),
    *,
    device: torch.device = torch.device("cpu"),  # noqa: B008
) -> TrainResult:
    """Train ``model`` in place with SGD on cross-entropy plus the hooks' extra losses.

    Batches come from a ``torch.Generator`` seeded by ``config.seed`` (reshuffled every
    epoch); all batches are kept, the last one of an epoch may be smaller. The number of
    steps is ``config.total_steps(N)``. The model ends in training mode, on ``device``.

    Args:
        model: the classifier to train (moved to ``device``).
        x: float32 inputs (N, C, H, W), numpy or torch, on any device; batches are
            moved to ``device`` one at a time.
        y: int64 labels (N,).
        config: the hyperparameters.
        hooks: algorithm hooks, called in order.
        device: where to train.

    Raises:
        TaskError: ``x`` / ``y`` of the wrong dtype, or of different lengths.
        Whatever a hook raises (training stops there; the model keeps the steps taken).
    """
    xs = _as_tensor(x, torch.float32)
    ys = _as_tensor(y, torch.int64)
    n = int(ys.shape[0])
    if int(xs.shape[0]) != n:
        raise TaskError(f"{int(xs.shape[0])} inputs but {n} labels")
    total = config.total_steps(n)
    model.to(device)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(
        trainable, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )
    for hook in hooks:
        hook.before_training(model)
    start = time.perf_counter()
    loss_sum = torch.zeros((), dtype=torch.float64)
    correct = torch.zeros((), dtype=torch.int64)
    seen = 0
    steps = 0
    for index in _batches(n, config, total):
        xb = xs[index].to(device)  # (B, C, H, W)
        yb = ys[index].to(device)  # (B,)
        for hook in hooks:
            hook.before_batch(model, xb, yb)
        optimizer.zero_grad(set_to_none=True)
        logits = model(xb)  # (B, num_classes)
        data_loss = F.cross_entropy(logits, yb)
        loss = data_loss
        for hook in hooks:
            extra = hook.extra_loss(model, xb, yb, logits)
            if extra is not None:
                loss = loss + extra
        loss.backward()  # type: ignore[no-untyped-call]
        for hook in hooks:
            hook.before_step(model)
        optimizer.step()
        with torch.no_grad():
            batch = int(yb.shape[0])
            loss_sum += data_loss.detach().double().cpu() * batch
            correct += (logits.argmax(dim=1) == yb).sum().cpu()
            seen += batch
        steps += 1
        for hook in hooks:
            hook.after_step(model)
    seconds = time.perf_counter() - start
    return TrainResult(
        steps=steps,
        num_samples=n,
        loss=float(loss_sum) / seen if seen else 0.0,
        accuracy=float(correct) / seen if seen else 0.0,
        seconds=seconds,
    )
