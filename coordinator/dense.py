"""DENSE's server step: a generator trained against the ensemble, then distillation, pure.

DENSE (Zhang et al., 2022, "DENSE: Data-Free One-Shot Federated Learning") needs one
upload per device and no data on the server: it trains an image generator ``G(z)``
against the ensemble of the received models and distils the ensemble into a fresh
global model on the generated images. Epochs alternate two phases:

* **generator phase** (:func:`generator_phase`): Adam steps on the generator's loss
  (:func:`generator_loss`) of the generator and of one batch of noise ``z``, learnt
  with it, for labels ``y`` sampled at the start of the phase:

  - ``ce``: cross entropy of the ensemble's logits (the mean of the teachers') on
    ``G(z)`` to ``y``, so that the ensemble confidently recognises each class;
  - ``bn``: batch-norm statistic matching, for every BatchNorm layer of every teacher
    that has one, ``||batch mean - running_mean|| + ||batch var - running_var||`` of
    the layer's input (:class:`BatchNormMatching`), so that the images look like the
    devices' data to the layers that remember it;
  - ``adv``: the boundary-support term (:func:`adversarial_loss`), minus the KL between
    the ensemble and the student, counted on the samples where both predict the same
    class: images the student has not learnt yet, on the ensemble's side of its
    decision boundary;

  the phase keeps its lowest-loss batch (as DENSE does) in a bounded memory
  (:class:`GeneratedMemory`) with the ensemble's logits over it;
* **student phase** (:func:`student_phase`): Adam steps on
  ``T^2 * KL(softmax(ensemble / T) || softmax(student / T))``
  (:func:`coordinator.feddf.kl_to_ensemble`) over random samples of the memory.

:func:`dense_distill` runs the epochs and measures each student's KL to the ensemble on
a held-out generated batch, before (the student as given) and after. Several students
(one per architecture group of a mixed fleet) share one generator and memory; the
adversarial term is their mean. Differences from the authors' code, for a small CPU
server: the generator keeps training across epochs (theirs is re-initialised each
epoch), a 10x larger generator learning rate for the few steps, no augmentation of the
generated images, Adam for the student (theirs: SGD with momentum), and a bounded
memory (theirs keeps every batch). The adversarial mask follows the paper (samples
where ensemble and student agree; the authors' code masks the opposite ones).

Tensors and modules in, tensors and modules out; no I/O, no global state, the device a
parameter, every random draw from the caller's CPU generator (then moved), so a seed
gives the same result on every re-run.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from coordinator.feddf import kl_to_ensemble, teacher_logits
from models import ImageGenerator, ImageGeneratorConfig
from models.optim import Adam

__all__ = [
    "BatchNormMatching",
    "DenseResult",
    "DenseSettings",
    "GeneratedMemory",
    "GeneratorLoss",
    "GeneratorPhase",
    "adversarial_loss",
    "batch_norm_loss",
    "dense_distill",
    "ensemble_logits",
    "frozen",
    "generator_loss",
    "generator_phase",
    "image_generator_config",
    "student_phase",
]

log = logging.getLogger(__name__)

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


@dataclass(frozen=True)
class DenseSettings:
    """How the server generates and distils: DENSE's loss weights (1 each); far fewer
    steps and a narrower generator than the paper's 200 epochs on a GPU, sized for a
    2-core CPU server. Measured there on one core (five LeNet-5 teachers of non-IID
    synthetic data, one LeNet-5 student): about 90 s, each generator step about 0.3 s
    and each student step 0.03 s; the student reached 67% test accuracy where the
    ensemble had 71% (the generator learning rate is 10x the authors', for the few
    steps)."""

    epochs: int = 20
    """Alternations of a generator phase and a student phase."""
    generator_steps: int = 10
    """Generator Adam steps per epoch."""
    student_steps: int = 20
    """Student Adam steps per epoch (each student)."""
    batch_size: int = 128
    """Generated images per step, both phases."""
    noise_dim: int = 100
    """Width of the generator's noise z."""
    generator_width: int = 16
    """The image generator's ``base_channels`` (its last stage; earlier ones 2x)."""
    generator_lr: float = 1e-2
    """Adam learning rate of the generator and its noise (betas 0.5, 0.999 as DENSE's)."""
    student_lr: float = 1e-3
    """Student Adam learning rate."""
    ce_weight: float = 1.0
    """Weight of the ensemble's cross entropy to the sampled labels."""
    bn_weight: float = 1.0
    """Weight of the BatchNorm statistic matching (zero without BatchNorm teachers)."""
    adv_weight: float = 1.0
    """Weight of the boundary-support (adversarial) term."""
    temperature: float = 1.0
    """Softmax temperature of the student's distillation loss."""
    memory_batches: int = 10
    """Generated batches kept for the student (the oldest goes first)."""
    eval_size: int = 256
    """Held-out generated images on which the result's KL is measured."""


@dataclass(frozen=True)
class GeneratorLoss:
    """The parts of the generator's loss on one batch (scalar tensors)."""

    ce: torch.Tensor
    bn: torch.Tensor
    adv: torch.Tensor

    def total(self, settings: DenseSettings) -> torch.Tensor:
        """The weighted sum the generator minimises."""
        return (
            settings.ce_weight * self.ce
            + settings.bn_weight * self.bn
            + settings.adv_weight * self.adv
        )


@dataclass(frozen=True)
class DenseResult:
    """What one :func:`dense_distill` did."""

    generator_steps: int
    """Generator Adam steps taken."""
    student_steps: int
    """Adam steps each student took."""
    kl_before: dict[str, float]
    """Student name -> its KL to the ensemble on the held-out batch as it came in."""
    kl_after: dict[str, float]
    """Student name -> the same after distillation."""
    ce: float
    """The ensemble's cross entropy to the sampled labels, mean of the last phase."""
    bn: float
    """BatchNorm statistic matching, mean of the last generator phase."""
    adv: float
    """The adversarial term, mean of the last generator phase."""


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


def ensemble_logits(teachers: Sequence[nn.Module], images: torch.Tensor) -> torch.Tensor:
    """The mean of the teachers' logits ``(B, classes)`` over ``images``, with gradients
    to the images (the teachers run as they are: put them in eval mode)."""
    return torch.stack([teacher(images) for teacher in teachers]).mean(0)


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
    """The parts of the generator's loss for generated ``images`` ``(B, C, H, W)`` and
    their sampled ``labels`` ``(B,)``; ``matching`` must hook the ``teachers`` (the
    BatchNorm terms of this forward are taken from it). The adversarial term is the
    mean over the ``students``."""
    ensemble = ensemble_logits(teachers, images)
    bn = matching.take(images.device)
    ce = F.cross_entropy(ensemble, labels)
    adv = torch.stack([adversarial_loss(s(images), ensemble) for s in students]).mean()
    return GeneratorLoss(ce=ce, bn=bn, adv=adv)


def image_generator_config(
    settings: DenseSettings, *, channels: int, image_size: int
) -> ImageGeneratorConfig:
    """The image generator of ``settings`` (noise and width) for the models' images.

    Raises:
        ValueError: images it cannot make (a side that is no multiple of 4).
    """
    return ImageGeneratorConfig(
        noise_dim=settings.noise_dim,
        image_size=image_size,
        channels=channels,
        base_channels=settings.generator_width,
    )


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
    """The generated images ``(B, C, H, W)`` of the step with the lowest total loss."""
    labels: torch.Tensor
    """The labels ``(B,)`` the phase's images were generated for."""
    ce: float
    bn: float
    adv: float


def generator_phase(
    generator: ImageGenerator,
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
    sums = torch.zeros(3)
    best, best_loss = None, float("inf")
    with BatchNormMatching(teachers) as matching:
        for _ in range(settings.generator_steps):
            images = generator(z)
            parts = generator_loss(images, y, teachers, students, matching)
            loss = parts.total(settings)
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            sums += torch.stack([parts.ce, parts.bn, parts.adv]).detach().cpu()
            if loss.item() < best_loss or best is None:
                best, best_loss = images.detach(), loss.item()
    assert best is not None, "generator_steps must be positive"
    ce, bn, adv = (sums / settings.generator_steps).tolist()
    return GeneratorPhase(best=best, labels=y, ce=ce, bn=bn, adv=adv)


class GeneratedMemory:
    """The last ``capacity`` generated batches with the ensemble's logits over them, as
    one ring buffer: the student samples images from all of them (DENSE keeps every
    batch it generated; here the oldest goes so that memory stays bounded)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"memory needs room for a batch, got capacity {capacity}")
        self.capacity = capacity
        self._batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._next = 0

    def __len__(self) -> int:
        """Images held."""
        return sum(len(images) for images, _ in self._batches)

    def add(self, images: torch.Tensor, logits: torch.Tensor) -> None:
        """Keep ``images`` ``(B, C, H, W)`` and the ensemble's ``logits`` ``(B, classes)``
        over them, replacing the oldest batch when full."""
        if len(self._batches) < self.capacity:
            self._batches.append((images, logits))
        else:
            self._batches[self._next] = (images, logits)
        self._next = (self._next + 1) % self.capacity

    def sample(self, count: int, rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` (image, logits) pairs drawn uniformly with replacement from all held."""
        images = torch.cat([b for b, _ in self._batches])
        logits = torch.cat([t for _, t in self._batches])
        pick = torch.randint(len(images), (count,), generator=rng).to(images.device)
        return images[pick], logits[pick]


def student_phase(
    student: nn.Module,
    optimizer: Adam,
    memory: GeneratedMemory,
    *,
    settings: DenseSettings,
    rng: torch.Generator,
) -> float:
    """``settings.student_steps`` Adam steps of ``student`` (in train mode, in place) on
    the KL to the ensemble over samples of ``memory``; returns the mean loss."""
    student.train()
    total = 0.0
    for _ in range(settings.student_steps):
        images, target = memory.sample(settings.batch_size, rng)
        loss = kl_to_ensemble(student(images), target, settings.temperature)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        total += loss.item()
    return total / max(1, settings.student_steps)


def dense_distill(
    students: Mapping[str, nn.Module],
    teachers: Sequence[nn.Module],
    generator: ImageGenerator,
    *,
    classes: int,
    settings: DenseSettings,
    rng: torch.Generator,
    device: torch.device,
) -> DenseResult:
    """Distil the ensemble of ``teachers`` into each of ``students`` (name -> model,
    trained in place, left in eval mode) on images of ``generator`` (trained in place),
    alternating generator and student phases for ``settings.epochs`` epochs.

    Every module is moved to ``device``; the teachers are left in eval mode with their
    parameters frozen (they are only read). ``classes`` is the width of every model's
    logits; ``generator`` must make images of the models' input shape. Each epoch is
    logged at INFO (the loss parts and each student's KL), as the whole takes minutes.

    Raises:
        ValueError: no teacher, no student, or a setting below 1.
    """
    if not teachers or not students:
        raise ValueError("DENSE needs at least one teacher and one student")
    if min(settings.epochs, settings.generator_steps, settings.student_steps) < 1:
        raise ValueError(f"epochs and steps must be positive: {settings}")
    generator.to(device)
    for model in (*teachers, *students.values()):
        model.to(device)
    for teacher in teachers:
        teacher.eval().requires_grad_(False)
    eval_z = torch.randn((settings.eval_size, settings.noise_dim), generator=rng).to(device)
    fresh = {name: copy.deepcopy(s).eval() for name, s in students.items()}
    s_opts = {name: Adam(s.parameters(), lr=settings.student_lr) for name, s in students.items()}
    memory = GeneratedMemory(settings.memory_batches)
    phase = None
    for epoch in range(1, settings.epochs + 1):
        with frozen(students.values()):
            phase = generator_phase(
                generator,
                teachers,
                list(students.values()),
                classes=classes,
                settings=settings,
                rng=rng,
            )
        with torch.no_grad():
            memory.add(phase.best, ensemble_logits(teachers, phase.best))
        kls = {
            name: student_phase(student, s_opts[name], memory, settings=settings, rng=rng)
            for name, student in students.items()
        }
        log.info(
            "dense epoch %d/%d: generator CE %.4f BN %.4f adv %.4f; student KL %s",
            epoch,
            settings.epochs,
            phase.ce,
            phase.bn,
            phase.adv,
            ", ".join(f"{name} {kl:.4f}" for name, kl in kls.items()),
        )
    assert phase is not None
    for student in students.values():
        student.eval()
    with torch.no_grad():
        images = generator(eval_z)
        target = ensemble_logits(teachers, images)

    def held_out_kl(model: nn.Module) -> float:
        return float(kl_to_ensemble(teacher_logits(model, images), target, settings.temperature))

    return DenseResult(
        generator_steps=settings.epochs * settings.generator_steps,
        student_steps=settings.epochs * settings.student_steps,
        kl_before={name: held_out_kl(model) for name, model in fresh.items()},
        kl_after={name: held_out_kl(model) for name, model in students.items()},
        ce=phase.ce,
        bn=phase.bn,
        adv=phase.adv,
    )


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
