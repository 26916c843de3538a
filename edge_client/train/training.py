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

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F  # noqa: N812
from pydantic import ValidationError
from torch import nn

from edge_client.errors import TaskError
from models.optim import SGD
from protocol.hyperparams import Hyperparameters

__all__ = ["TrainConfig", "TrainHook", "TrainResult", "as_tensor", "batch_indices", "train_local"]


class TrainConfig(Hyperparameters):
    """Local training hyperparameters: a round task's ``hyperparameters`` validated.

    The fields and their defaults are those of :class:`protocol.hyperparams.Hyperparameters`
    (the schema the coordinator fills the task from); this class adds the device's error
    path. Types are strict: an integer field rejects ``1.0`` and ``True``; a float field
    accepts integers. Unknown keys are rejected.
    """

    @classmethod
    def from_hyperparameters(cls, hyperparameters: Mapping[str, object]) -> TrainConfig:
        """Validate a task's hyperparameters; absent keys take the defaults.

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
            known = ", ".join(sorted(cls.model_fields))
            raise TaskError(f"invalid hyperparameters: {problems} (known keys: {known})") from None


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


def batch_indices(n: int, config: TrainConfig, total: int) -> Iterator[torch.Tensor]:
    """The sample indices of each of ``total`` batches over ``n`` samples: reshuffled
    epochs from a ``torch.Generator`` seeded by ``config.seed`` (the last batch of an
    epoch may be smaller). Every trainer takes its batches from here, so the same seed
    gives the same batches in the per-device loop and in the sim's batched engine."""
    generator = torch.Generator().manual_seed(config.seed)
    done = 0
    while done < total:
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, config.batch_size):
            yield order[start : start + config.batch_size]
            done += 1
            if done == total:
                return


def as_tensor(value: torch.Tensor | npt.NDArray[np.generic], dtype: torch.dtype) -> torch.Tensor:
    """``value`` as a tensor (numpy arrays are wrapped, not copied).

    Raises:
        TaskError: it is not of ``dtype``.
    """
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
    xs = as_tensor(x, torch.float32)
    ys = as_tensor(y, torch.int64)
    n = int(ys.shape[0])
    if int(xs.shape[0]) != n:
        raise TaskError(f"{int(xs.shape[0])} inputs but {n} labels")
    total = config.total_steps(n)
    model.to(device)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = SGD(
        trainable, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )
    for hook in hooks:
        hook.before_training(model)
    start = time.perf_counter()
    loss_sum = torch.zeros((), dtype=torch.float64)
    correct = torch.zeros((), dtype=torch.int64)
    seen = 0
    steps = 0
    for index in batch_indices(n, config, total):
        xb = xs[index].to(device)  # (B, C, H, W)
        yb = ys[index].to(device)  # (B,)
        for hook in hooks:
            hook.before_batch(model, xb, yb)
        optimizer.zero_grad()
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
