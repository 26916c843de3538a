"""A sample generator trained against a round's ensemble: DENSE's generator phase, pure.

DENSE (:mod:`coordinator.strategies.dense`) and FedDF with ``distill_data generator``
(:mod:`coordinator.strategies.feddf`) make the samples they distil on with a generator
``G(z)`` of the models' input shape (:func:`run_generator`: images for square images,
the MLP sample generator for series and feature vectors) trained against the ensemble
of the round's models. The code below calls them images; they are samples of any
shape. A **generator
phase** (:func:`generator_phase`) takes Adam steps on the generator's loss
(:func:`generator_loss`) of the generator and of one batch of noise ``z``, learnt with
it, for labels ``y`` sampled at the start of the phase:

- ``ce``: cross entropy of the ensemble's logits (the mean of the teachers') on ``G(z)``
  to ``y``, so that the ensemble confidently recognises each class;
- ``bn``: batch-norm statistic matching, for every BatchNorm layer of every teacher that
  has one, ``||batch mean - running_mean|| + ||batch var - running_var||`` of the
  layer's input (:class:`BatchNormMatching`), so that the images look like the devices'
  data to the layers that remember it;
- ``adv``: the boundary-support term (:func:`adversarial_loss`), minus the KL between the
  ensemble and the student, counted on the samples where both predict the same class:
  images the student has not learnt yet, on the ensemble's side of its decision
  boundary;
- ``tv``: the smoothness prior (:func:`total_variation`), weighted by
  ``smoothness_weight`` (0 for DENSE and FedDF; oneshot sets it), for teachers without
  BatchNorm, whose ``bn`` term is empty;

and keeps its lowest-loss batch (as DENSE does); its settings are DENSE's
(:class:`~coordinator.strategies.dense_settings.DenseSettings`). The adversarial mask
follows the paper (samples where ensemble and student agree; the authors' code masks
the opposite ones).

Tensors and modules in, tensors and modules out; no I/O, no global state, the device a
parameter, every random draw from the caller's CPU generator (then moved).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from coordinator.config import CoordinatorConfig
from coordinator.strategies.dense_settings import DenseSettings
from coordinator.strategies.ensemble import ensemble_logits
from models import (
    ImageGenerator,
    ImageGeneratorConfig,
    SampleGenerator,
    SampleGeneratorConfig,
    build_sample_generator,
    sample_generator_config,
    seeded,
)
from models.optim import Adam

__all__ = [
    "BatchNormMatching",
    "GeneratorLoss",
    "GeneratorPhase",
    "adversarial_loss",
    "batch_norm_loss",
    "frozen",
    "generator_loss",
    "generator_phase",
    "new_generator",
    "run_generator",
    "total_variation",
]

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


@dataclass(frozen=True)
class GeneratorLoss:
    """The parts of the generator's loss on one batch (scalar tensors)."""

    ce: torch.Tensor
    bn: torch.Tensor
    adv: torch.Tensor
    tv: torch.Tensor

    def total(self, settings: DenseSettings) -> torch.Tensor:
        """The weighted sum the generator minimises."""
        return (
            settings.ce_weight * self.ce
            + settings.bn_weight * self.bn
            + settings.adv_weight * self.adv
            + settings.smoothness_weight * self.tv
        )


def total_variation(samples: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference of neighbours along each axis of ``samples`` after the
    channel axis (``(B, C, H, W)`` images: both image axes, summed; ``(B, C, T)``
    series: time): 0 for constant samples, large for noise. Feature vectors ``(B, F)``
    have no neighbours: 0."""
    terms = [samples.diff(dim=axis).abs().mean() for axis in range(2, samples.dim())]
    return torch.stack(terms).sum() if terms else samples.new_zeros(())


def batch_norm_loss(inputs: torch.Tensor, layer: nn.modules.batchnorm._BatchNorm) -> torch.Tensor:
    """``||mean - running_mean||_2 + ||var - running_var||_2`` of ``inputs`` ``(B, C,
    ...)``, the input of BatchNorm ``layer``: mean and biased variance per channel over
    every other axis, against the statistics ``layer`` keeps (from its training data)."""
    axes = [d for d in range(inputs.dim()) if d != 1]
    mean = inputs.mean(axes)
    var = inputs.var(axes, correction=0)
    running_mean, running_var = layer.running_mean, layer.running_var
    assert running_mean is not None and running_var is not None
    mean_gap: torch.Tensor = torch.linalg.vector_norm(mean - running_mean)
    var_gap: torch.Tensor = torch.linalg.vector_norm(var - running_var)
    return mean_gap + var_gap


class BatchNormMatching:
    """Forward hooks on every BatchNorm layer (with running statistics) of ``models``
    that add :func:`batch_norm_loss` of each forward's input to a running sum.

    Use as a context manager (the hooks live inside it); :meth:`take` returns the sum
    since the last take and starts a new one. Models without BatchNorm add nothing.
    """

    def __init__(self, models: Sequence[nn.Module]) -> None:
        self.layers = [
            m
            for model in models
            for m in model.modules()
            if isinstance(m, _BATCH_NORMS) and m.track_running_stats
        ]
        self._terms: list[torch.Tensor] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> BatchNormMatching:
        self._handles = [layer.register_forward_hook(self._hook) for layer in self.layers]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._terms = []

    def _hook(
        self, layer: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor
    ) -> None:
        assert isinstance(layer, nn.modules.batchnorm._BatchNorm)
        self._terms.append(batch_norm_loss(inputs[0], layer))

    def take(self, device: torch.device) -> torch.Tensor:
        """The sum of the terms since the last take (0 on ``device`` without any)."""
        terms, self._terms = self._terms, []
        return torch.stack(terms).sum() if terms else torch.zeros((), device=device)


def adversarial_loss(
    student_logits: torch.Tensor, ensemble: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """DENSE's boundary-support term: minus the mean over the batch of
    ``T^2 * KL(softmax(ensemble / T) || softmax(student / T))`` per sample, where a
    sample counts only if student and ensemble predict the same class (others add 0).

    Minimising it pushes the generator towards samples both still classify alike but
    on which the student's distribution is furthest from the ensemble's.
    """
    t = temperature
    log_target = F.log_softmax(ensemble / t, dim=1)
    log_student = F.log_softmax(student_logits / t, dim=1)
    per_sample = F.kl_div(log_student, log_target, reduction="none", log_target=True).sum(1)
    agree = (student_logits.argmax(1) == ensemble.argmax(1)).to(per_sample.dtype)
    return -(per_sample * agree).mean() * t * t


def generator_loss(
    images: torch.Tensor,
    labels: torch.Tensor,
    teachers: Sequence[nn.Module],
    students: Sequence[nn.Module],
    matching: BatchNormMatching,
) -> GeneratorLoss:
    """The parts of the generator's loss for generated ``images`` ``(B, *shape)`` and
    their sampled ``labels`` ``(B,)``; ``matching`` must hook the ``teachers`` (the
    BatchNorm terms of this forward are taken from it). The adversarial term is the
    mean over the ``students``."""
    ensemble = ensemble_logits(teachers, images)
    bn = matching.take(images.device)
    ce = F.cross_entropy(ensemble, labels)
    adv = torch.stack([adversarial_loss(s(images), ensemble) for s in students]).mean()
    return GeneratorLoss(ce=ce, bn=bn, adv=adv, tv=total_variation(images))


def run_generator(
    settings: DenseSettings, config: CoordinatorConfig
) -> ImageGeneratorConfig | SampleGeneratorConfig:
    """The generator of ``settings`` (noise and width) for the run's samples: an image
    generator for square images, the MLP sample generator for any other shape
    (:func:`~models.generators.sample_generator_config`)."""
    return sample_generator_config(
        config.sample_shape, noise_dim=settings.noise_dim, width=settings.generator_width
    )


def new_generator(
    config: ImageGeneratorConfig | SampleGeneratorConfig, rng: torch.Generator
) -> ImageGenerator | SampleGenerator:
    """A new generator, its initial weights seeded by a draw of ``rng``."""
    with seeded(int(torch.randint(2**62, (), generator=rng))):
        return build_sample_generator(config)


def _draw(
    settings: DenseSettings, classes: int, rng: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise ``(B, noise_dim)`` and labels ``(B,)``, drawn on the CPU, moved to ``device``."""
    z = torch.randn((settings.batch_size, settings.noise_dim), generator=rng)
    y = torch.randint(classes, (settings.batch_size,), generator=rng)
    return z.to(device), y.to(device)


@dataclass(frozen=True)
class GeneratorPhase:
    """What one generator phase did: its lowest-loss batch and the mean loss parts."""

    best: torch.Tensor
    """The generated samples ``(B, *sample_shape)`` of the step with the lowest total
    loss."""
    labels: torch.Tensor
    """The labels ``(B,)`` the phase's images were generated for."""
    ce: float
    bn: float
    adv: float
    tv: float


def generator_phase(
    generator: ImageGenerator | SampleGenerator,
    teachers: Sequence[nn.Module],
    students: Sequence[nn.Module],
    *,
    classes: int,
    settings: DenseSettings,
    rng: torch.Generator,
) -> GeneratorPhase:
    """``settings.generator_steps`` Adam steps on :func:`generator_loss` of ``generator``
    (in place, in train mode) and of one batch of noise with its labels, drawn at the
    start. The noise is learnt with the generator, as DENSE does: the generator takes
    no label, so only noise that moves towards its label's region can lower the cross
    entropy (with fresh noise every step the best it could do is an image every class
    claims equally). Teachers and students should be in eval mode with their parameters
    frozen (no gradient is kept for them)."""
    device = next(generator.parameters()).device
    generator.train()
    z, y = _draw(settings, classes, rng, device)
    z.requires_grad_(True)
    optimizer = Adam([*generator.parameters(), z], lr=settings.generator_lr, betas=(0.5, 0.999))
    sums = torch.zeros(4)
    best, best_loss = None, float("inf")
    with BatchNormMatching(teachers) as matching:
        for _ in range(settings.generator_steps):
            images = generator(z)
            parts = generator_loss(images, y, teachers, students, matching)
            loss = parts.total(settings)
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            sums += torch.stack([parts.ce, parts.bn, parts.adv, parts.tv]).detach().cpu()
            if loss.item() < best_loss or best is None:
                best, best_loss = images.detach(), loss.item()
    assert best is not None, "generator_steps must be positive"
    ce, bn, adv, tv = (sums / settings.generator_steps).tolist()
    return GeneratorPhase(best=best, labels=y, ce=ce, bn=bn, adv=adv, tv=tv)


@contextlib.contextmanager
def frozen(students: Iterable[nn.Module]) -> Iterator[None]:
    """Inside: the students in eval mode with frozen parameters, so that the generator
    phase backpropagates through them to the images without keeping their gradients or
    moving their statistics; afterwards their parameters are trainable again."""
    frozen = [s.eval().requires_grad_(False) for s in students]
    try:
        yield
    finally:
        for s in frozen:
            s.requires_grad_(True)
