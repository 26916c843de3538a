"""FedDF's server step: ensemble distillation on unlabeled proxy data, pure.

FedDF (Lin et al., 2020, "Ensemble Distillation for Robust Model Fusion in Federated
Learning") fuses the models a round received by distillation rather than (only) by
averaging: each group's student starts from the average of its group's models and is
trained on unlabeled proxy images to match the ensemble of *all* received models (their
averaged logits), whatever their architectures. Here:

* the teachers' logits over the proxy images are computed once per round
  (:func:`teacher_logits`, one teacher at a time, so memory is one model plus
  ``teachers * N * classes`` floats);
* the proxy images are split into a distillation part and a held-out part
  (:func:`holdout_split`); :func:`distill` takes Adam steps on
  ``T^2 * KL(softmax(ensemble / T) || softmax(student / T))`` over random batches of the
  distillation part, measures the same KL on the held-out part every ``eval_every``
  steps, and stops after ``patience`` measurements without improvement, keeping the
  student of the best one (early stopping);
* a group whose devices run int8 or binarized weights (``formats``) gets one student
  for all of them: each step's loss is the mean of the KL at every format (the student
  run as a device of that format runs it, :func:`models.weight_formats.weights_at`,
  gradients straight through to the float weights), and so is the held-out KL; a
  float student distilled alone would lose most of what it learned when a binary device
  binarizes it;
* drop-worst (:func:`chance_teachers`): with no labels, a teacher whose predictions on the
  held-out part agree with the ensemble's no more often than chance (1 / classes) is
  left out of the ensemble.

Tensors and modules in, tensors and modules out; no I/O, no global state, the device a
parameter, every random draw from the caller's generator.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.func import functional_call

from models.optim import Adam
from models.weight_formats import weights_at
from protocol.messages import WeightFormat

__all__ = [
    "DistillResult",
    "DistillSettings",
    "chance_teachers",
    "distill",
    "holdout_split",
    "kl_to_ensemble",
    "teacher_logits",
]


@dataclass(frozen=True)
class DistillSettings:
    """How a student is distilled from the ensemble (defaults after the FedDF paper's
    Adam with learning rate 1e-3, scaled down in steps for small servers)."""

    max_steps: int = 500
    """Most Adam steps per student and round."""
    batch_size: int = 64
    """Proxy images per step."""
    lr: float = 1e-3
    """Adam learning rate."""
    temperature: float = 1.0
    """Softmax temperature of teacher and student."""
    eval_every: int = 25
    """Steps between measurements of the held-out KL."""
    patience: int = 4
    """Measurements without improvement before stopping."""
    holdout: float = 0.2
    """Share of the proxy images held out for early stopping (and drop-worst)."""


@dataclass(frozen=True)
class DistillResult:
    """What one distillation did."""

    steps: int
    """Adam steps taken."""
    kl_before: float
    """Held-out KL of the starting student to the ensemble."""
    kl_after: float
    """Held-out KL of the student kept (the best measured)."""


def holdout_split(
    count: int, fraction: float, rng: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random split of ``count`` indices: (distillation, held-out); the held-out part
    holds ``round(fraction * count)`` of them, at least one, and so does the other.

    Raises:
        ValueError: fewer than two indices.
    """
    if count < 2:
        raise ValueError(f"distillation needs at least 2 proxy images, got {count}")
    held = min(count - 1, max(1, round(fraction * count)))
    order = torch.randperm(count, generator=rng)
    return order[held:], order[:held]


@torch.no_grad()
def teacher_logits(
    model: nn.Module, images: torch.Tensor, *, batch_size: int = 256
) -> torch.Tensor:
    """``model``'s logits ``(N, classes)`` over ``images`` ``(N, C, H, W)``, in eval mode,
    on the device of ``images``; the module's training flags are restored afterwards."""
    with _evaluating(model):
        return torch.cat(
            [model(images[i : i + batch_size]) for i in range(0, len(images), batch_size)]
        )


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """Inside: ``model`` in eval mode; afterwards each module's training flag as it was."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, mode in modes:
            module.train(mode)


def kl_to_ensemble(
    student_logits: torch.Tensor, ensemble_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``T^2 * KL(softmax(ensemble / T) || softmax(student / T))``, the batch mean."""
    t = temperature
    target = F.log_softmax(ensemble_logits / t, dim=1)
    log_student = F.log_softmax(student_logits / t, dim=1)
    return F.kl_div(log_student, target, reduction="batchmean", log_target=True) * t * t


def chance_teachers(logits: Sequence[torch.Tensor], held_out: torch.Tensor) -> list[int]:
    """Indices of the teachers no better than chance on ``held_out``: their predictions
    agree with the ensemble's (the argmax of the averaged logits) on at most
    ``1 / classes`` of the held-out images. Never all of them."""
    ensemble = torch.stack([t[held_out] for t in logits]).mean(0).argmax(1)
    classes = logits[0].shape[1]
    worst = [
        i
        for i, t in enumerate(logits)
        if (t[held_out].argmax(1) == ensemble).float().mean().item() <= 1 / classes
    ]
    return [] if len(worst) == len(logits) else worst


def _logits_at(model: nn.Module, weight_format: WeightFormat, images: torch.Tensor) -> torch.Tensor:
    """``model``'s logits on ``images`` as a device of ``weight_format`` runs it."""
    params = weights_at(model, weight_format)
    logits: torch.Tensor = functional_call(model, params, (images,))
    return logits


def distill(
    student: nn.Module,
    images: torch.Tensor,
    ensemble: torch.Tensor,
    *,
    train: torch.Tensor,
    held_out: torch.Tensor,
    settings: DistillSettings,
    rng: torch.Generator,
    formats: Sequence[WeightFormat] = ("float",),
) -> DistillResult:
    """Distil ``ensemble`` (logits ``(N, classes)`` over ``images`` ``(N, C, H, W)``) into
    ``student``, in place: Adam on batches of the ``train`` indices, early stopping on
    the KL over the ``held_out`` indices; ``student`` ends with the best weights
    measured (the starting ones if no step improved on them) and in eval mode.

    The KL, of a step and held out, is the mean over ``formats``: the student as a
    device of each format runs it (the float weights stay what is trained).
    ``student``, ``images`` and ``ensemble`` live on one device; ``rng`` is a CPU
    generator (batches are drawn on the CPU).

    Raises:
        ValueError: no format.
    """
    if not formats:
        raise ValueError("distill: give at least one weight format")
    t = settings.temperature

    def mean_kl(pick: torch.Tensor) -> torch.Tensor:
        """The KL on the images ``pick``, the mean over the formats."""
        batch, target = images[pick], ensemble[pick]
        losses = [kl_to_ensemble(_logits_at(student, f, batch), target, t) for f in formats]
        return torch.stack(losses).mean()

    @torch.no_grad()
    def held_out_kl() -> float:
        with _evaluating(student):
            parts = torch.split(held_out.to(images.device), 256)
            total = sum(float(mean_kl(part)) * len(part) for part in parts)
        return total / len(held_out)

    best_kl = first_kl = held_out_kl()
    best = copy.deepcopy(student.state_dict())
    optimizer = Adam(student.parameters(), lr=settings.lr)
    student.train()
    steps = stale = 0
    while steps < settings.max_steps and stale < settings.patience:
        pick = train[torch.randint(len(train), (settings.batch_size,), generator=rng)]
        pick = pick.to(images.device)
        optimizer.zero_grad()
        loss = mean_kl(pick)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        steps += 1
        if steps % settings.eval_every == 0 or steps == settings.max_steps:
            kl = held_out_kl()
            if kl < best_kl:
                best_kl, best, stale = kl, copy.deepcopy(student.state_dict()), 0
            else:
                stale += 1
    student.load_state_dict(best)
    student.eval()
    return DistillResult(steps=steps, kl_before=first_kl, kl_after=best_kl)
