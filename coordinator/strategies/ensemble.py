"""A round's ensemble, as the server-side distillations read it (FedDF, DENSE), pure.

The ensemble of a round's models is the mean of their logits. :func:`teacher_logits`
computes one model's logits over a set of images in eval mode, :func:`ensemble_logits`
the ensemble's with gradients to the images (for a generator learning against it), and
:func:`kl_to_ensemble` is the distillation loss of a student against the ensemble.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

__all__ = ["ensemble_logits", "evaluating", "kl_to_ensemble", "teacher_logits"]


@torch.no_grad()
def teacher_logits(
    model: nn.Module, images: torch.Tensor, *, batch_size: int = 256
) -> torch.Tensor:
    """``model``'s logits ``(N, classes)`` over ``images`` ``(N, C, H, W)``, in eval mode,
    on the device of ``images``; the module's training flags are restored afterwards."""
    with evaluating(model):
        return torch.cat(
            [model(images[i : i + batch_size]) for i in range(0, len(images), batch_size)]
        )


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
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


def ensemble_logits(teachers: Sequence[nn.Module], images: torch.Tensor) -> torch.Tensor:
    """The mean of the teachers' logits ``(B, classes)`` over ``images``, with gradients
    to the images (the teachers run as they are: put them in eval mode)."""
    return torch.stack([teacher(images) for teacher in teachers]).mean(0)
