"""FedDF's distillation images from a generator: data-free FedDF, pure.

FedDF (:mod:`coordinator.feddf`) distils the ensemble of a round's models into each
group's student on unlabeled images. Without proxy images (``distill_data generator``)
the server makes its own: an image generator ``G(z)`` trained against the round's
ensemble with DENSE's generator phase (:func:`coordinator.dense.generator_phase`: the
ensemble's cross entropy to sampled labels, BatchNorm statistic matching, and the
boundary-support term against the students as they start, the groups' averages).
:func:`generate_images` runs ``batches`` such phases, each on its own noise and labels,
and keeps each phase's lowest-loss batch; FedDF then treats the images as it treats
proxy images: teachers' logits, a held-out part for early stopping and drop-worst,
:func:`coordinator.feddf.distill`.

The generator is new each round (its initial weights drawn from the round's seeded
RNG), not carried across rounds: the ensemble it serves is another each round, a
round's aggregation stays a function of that round's updates and seed (a re-run after a
crash gives the same models, with nothing more to persist), and the server state stays
the groups' models. The cost is the generator steps of every round.

Tensors and modules in, tensors and modules out; no I/O, no global state, the device a
parameter, every random draw from the caller's CPU generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from coordinator.dense import DenseSettings, GeneratorPhase, frozen, generator_phase
from models import ImageGenerator

__all__ = ["GeneratedImages", "GeneratedSettings", "generate_images"]


@dataclass(frozen=True)
class GeneratedSettings:
    """How FedDF generates its distillation images."""

    batches: int = 8
    """Generated batches per round, each from its own generator phase (1,024 images of
    DENSE's batch of 128)."""
    dense: DenseSettings = field(default_factory=DenseSettings)
    """The generator phase's settings: ``generator_steps`` per batch, ``batch_size``,
    noise and generator widths, learning rate and loss weights (DENSE's defaults)."""


@dataclass(frozen=True)
class GeneratedImages:
    """What :func:`generate_images` made."""

    images: torch.Tensor
    """``(batches * batch_size, C, H, W)`` generated images, on the generator's device."""
    last: GeneratorPhase
    """The last generator phase (its mean loss parts say how far the generator got)."""


def generate_images(
    generator: ImageGenerator,
    teachers: Sequence[nn.Module],
    students: Sequence[nn.Module],
    *,
    classes: int,
    settings: GeneratedSettings,
    rng: torch.Generator,
) -> GeneratedImages:
    """Train ``generator`` (in place) against the ensemble of ``teachers`` for
    ``settings.batches`` generator phases and return the lowest-loss batch of each.

    Every module must be on the generator's device. The teachers are left in eval mode
    with their parameters frozen; the students (the boundary-support term's, not
    trained here) in eval mode, their parameters trainable. ``classes`` is the width of
    the models' logits.

    Raises:
        ValueError: no teacher, no student, or a setting below 1.
    """
    if not teachers or not students:
        raise ValueError("generating images needs at least one teacher and one student")
    if min(settings.batches, settings.dense.generator_steps) < 1:
        raise ValueError(f"batches and generator steps must be positive: {settings}")
    for teacher in teachers:
        teacher.eval().requires_grad_(False)
    kept = []
    for _ in range(settings.batches):
        with frozen(students):
            phase = generator_phase(
                generator,
                teachers,
                students,
                classes=classes,
                settings=settings.dense,
                rng=rng,
            )
        kept.append(phase.best)
    return GeneratedImages(images=torch.cat(kept), last=phase)
