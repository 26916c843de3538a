"""DENSE: the strategy, and its server step, a generator trained against the ensemble,
then distillation.

DENSE (Zhang et al., 2022, "DENSE: Data-Free One-Shot Federated Learning") needs one
upload per device and no data on the server: it trains an image generator ``G(z)``
against the ensemble of the received models and distils the ensemble into a fresh
global model on the generated images. Epochs alternate two phases:

* **generator phase** (:func:`~coordinator.strategies.sample_generation.generator_phase`,
  shared with FedDF's generated images): Adam steps on the generator and one batch of
  noise against the ensemble's cross entropy to sampled labels, BatchNorm statistic
  matching and the boundary-support term; the phase's lowest-loss batch is kept in a
  bounded memory (:class:`GeneratedMemory`) with the ensemble's logits over it;
* **student phase** (:func:`student_phase`): Adam steps on
  ``T^2 * KL(softmax(ensemble / T) || softmax(student / T))``
  (:func:`~coordinator.strategies.ensemble.kl_to_ensemble`) over random samples of the
  memory.

:func:`dense_distill` runs the epochs and measures each student's KL to the ensemble on
a held-out generated batch, before (the student as given) and after. Several students
(one per architecture group of a mixed fleet) share one generator and memory; the
adversarial term is their mean. Differences from the authors' code, for a small CPU
server: the generator keeps training across epochs (theirs is re-initialised each
epoch), a 10x larger generator learning rate for the few steps, no augmentation of the
generated images, Adam for the student (theirs: SGD with momentum), and a bounded
memory (theirs keeps every batch). The settings, and DENSE's defaults for the fleet
(one round of every device): :mod:`coordinator.strategies.dense_settings`.

The server step's functions take tensors and modules and return tensors and modules; no
I/O, no global state, the device a parameter, every random draw from the caller's CPU
generator (then moved), so a seed gives the same result on every re-run.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import nn

from coordinator.averaging import WeightedSum
from coordinator.config import CoordinatorConfig
from coordinator.context import ServerContext
from coordinator.errors import ConfigError
from coordinator.groups import GroupModels
from coordinator.strategies.base import (
    Aggregated,
    AggregateResult,
    Contribution,
    NothingToAggregate,
    Strategy,
)
from coordinator.strategies.dense_settings import DenseSettings
from coordinator.strategies.ensemble import ensemble_logits, kl_to_ensemble, teacher_logits
from coordinator.strategies.sample_generation import (
    frozen,
    generator_phase,
    new_generator,
    run_generator,
)
from models import Classifier, ImageGenerator, SampleGenerator, state_arrays
from models import load_state_arrays as load_arrays
from models.optim import Adam
from models.weight_formats import run_weights_

__all__ = [
    "Dense",
    "DenseResult",
    "GeneratedMemory",
    "dense_distill",
    "hard_samples",
    "student_phase",
]

log = logging.getLogger(__name__)


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
        self._joined: tuple[torch.Tensor, torch.Tensor] | None = None  # until the next add

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
        self._joined = None

    def sample(self, count: int, rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` (image, logits) pairs drawn uniformly with replacement from all held."""
        if self._joined is None:  # joined once per change, not once per student step
            self._joined = (
                torch.cat([b for b, _ in self._batches]),
                torch.cat([t for _, t in self._batches]),
            )
        images, logits = self._joined
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


def hard_samples(
    samples: torch.Tensor,
    teachers: Sequence[nn.Module],
    students: Sequence[nn.Module],
    *,
    steps: int,
    epsilon: float,
    images: bool,
) -> torch.Tensor:
    """``samples`` moved by ``steps`` sign-gradient steps of ``epsilon / steps`` up the
    students' summed KL to the ensemble of ``teachers``: samples the students do not yet
    get right, near the ensemble's decision boundaries (images kept in [0, 1]). The
    students are read in eval mode and left as they were (no gradient kept)."""
    modes = [student.training for student in students]
    hard = samples.detach()
    with frozen(students):
        for _ in range(steps):
            with torch.no_grad():
                target = ensemble_logits(teachers, hard)
            hard = hard.requires_grad_(True)
            kl = torch.stack([kl_to_ensemble(s(hard), target) for s in students]).sum()
            (grad,) = torch.autograd.grad(kl, hard)
            hard = hard.detach() + (epsilon / steps) * grad.sign()
            if images:
                hard = hard.clamp(0.0, 1.0)
    for student, mode in zip(students, modes, strict=True):
        student.train(mode)
    return hard.detach()


def draw_batches(
    generator: ImageGenerator | SampleGenerator,
    settings: DenseSettings,
    rng: torch.Generator,
    device: torch.device,
) -> list[torch.Tensor]:
    """``settings.extra_batches`` batches of the generator as it stands, each from fresh
    noise drawn from ``rng`` (in eval mode, no gradient; left in train mode)."""
    batches = []
    generator.eval()
    with torch.no_grad():
        for _ in range(settings.extra_batches):
            z = torch.randn((settings.batch_size, settings.noise_dim), generator=rng)
            batches.append(generator(z.to(device)))
    generator.train()
    return batches


def dense_distill(
    students: Mapping[str, nn.Module],
    teachers: Sequence[nn.Module],
    generator: ImageGenerator | SampleGenerator,
    *,
    classes: int,
    settings: DenseSettings,
    rng: torch.Generator,
    device: torch.device,
    observe: Callable[[torch.Tensor], None] | None = None,
) -> DenseResult:
    """Distil the ensemble of ``teachers`` into each of ``students`` (name -> model,
    trained in place, left in eval mode) on images of ``generator`` (trained in place),
    alternating generator and student phases for ``settings.epochs`` epochs.

    Every module is moved to ``device``; the teachers are left in eval mode with their
    parameters frozen (they are only read). ``classes`` is the width of every model's
    logits; ``generator`` must make images of the models' input shape. Each epoch is
    logged at INFO (the loss parts and each student's KL), as the whole takes minutes.
    ``observe``, when given, is called with each epoch's optimised batch (its labels were
    drawn uniformly) before the teachers label it.

    Raises:
        ValueError: no teacher, no student, a setting below 1 (``extra_batches``:
            below 0), or a memory too small for one epoch's batches.
    """
    if not teachers or not students:
        raise ValueError("DENSE needs at least one teacher and one student")
    if min(settings.epochs, settings.generator_steps, settings.student_steps) < 1:
        raise ValueError(f"epochs and steps must be positive: {settings}")
    if settings.extra_batches < 0:
        raise ValueError(f"extra_batches must be 0 or more: {settings}")
    per_epoch = 1 + settings.extra_batches + (settings.hard_steps > 0)
    if settings.memory_batches < per_epoch:
        raise ValueError(
            f"the memory ({settings.memory_batches} batches) must hold an epoch's "
            f"{per_epoch} (1 optimised, {settings.extra_batches} extra, hard samples "
            f"{'1' if settings.hard_steps else '0'}): {settings}"
        )
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
        if observe is not None:
            observe(phase.best)
        with torch.no_grad():
            memory.add(phase.best, ensemble_logits(teachers, phase.best))
            for batch in draw_batches(generator, settings, rng, device):
                memory.add(batch, ensemble_logits(teachers, batch))
        if settings.hard_steps:
            hard = hard_samples(
                phase.best,
                teachers,
                list(students.values()),
                steps=settings.hard_steps,
                epsilon=settings.hard_epsilon,
                images=isinstance(generator, ImageGenerator),
            )
            with torch.no_grad():
                memory.add(hard, ensemble_logits(teachers, hard))
        kls = {
            name: student_phase(student, s_opts[name], memory, settings=settings, rng=rng)
            for name, student in students.items()
        }
        log.info(
            "dense epoch %d/%d: generator CE %.4f BN %.4f adv %.4f TV %.4f; student KL %s",
            epoch,
            settings.epochs,
            phase.ce,
            phase.bn,
            phase.adv,
            phase.tv,
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


class Dense(Strategy):
    """DENSE (data-free one-shot federated learning): see the module docstring.

    Exactly one round: every device trains once, as with FedAvg but for more local
    epochs (its one chance), and uploads once. The server then builds a fresh model per
    architecture group (the run seed's initial weights, untrained; or the average of the
    group's uploads, ``DenseSettings.start_from_average``), trains an image
    generator against the ensemble of every upload, whatever its group, and distils
    the ensemble into each group's model on the generated images: no proxy data, no
    data of the devices. Left out of the configuration, ``rounds`` is 1 and
    ``participation`` 1.0 (:class:`~coordinator.strategies.dense_settings.DenseOptions`);
    a run configured with more rounds is refused. The server
    keeps every upload as a model at once (the ensemble needs them all): memory is
    O(devices x model).
    """

    name = "dense"
    robust_aggregation = False
    training_defaults: ClassVar[Mapping[str, int]] = {"local_epochs": 10, "batch_size": 32}
    defaults: ClassVar[DenseSettings] = DenseSettings()
    """The server step's settings that are no flags (batch, generator width, learning
    rates, loss weights)."""

    def __init__(self, config: CoordinatorConfig, templates: Mapping[str, Classifier]) -> None:
        super().__init__(config, templates)
        self.settings = replace(
            self.defaults,
            epochs=config.dense_epochs,
            generator_steps=config.dense_generator_steps,
            student_steps=config.dense_student_steps,
        )
        """The server step's generator and distillation settings (``--dense-*``)."""
        if config.rounds != 1:
            raise ConfigError(
                f"{self.name} is one-shot: run it with --rounds 1 (the default for "
                f"{self.name}), not {config.rounds}"
            )
        self._generator_config = run_generator(self.settings, config)
        self._templates = {name: copy.deepcopy(t) for name, t in templates.items()}

    def aggregate(
        self,
        current: GroupModels,
        updates: Iterable[Contribution],
        round_number: int,
        context: ServerContext,
    ) -> AggregateResult:
        received = list(updates)
        teachers = [self._teacher(update) for update in received]
        if not teachers:
            return NothingToAggregate(f"no on-time update in round {round_number}")
        students = self._students(current, received)
        generator = new_generator(self._generator_config, context.rng)
        log.info(
            "round %d: DENSE distils %d teacher(s) into %s over %d epochs",
            round_number,
            len(teachers),
            ", ".join(students),
            self.settings.epochs,
        )
        result = dense_distill(
            students,
            teachers,
            generator,
            classes=self.config.num_classes,
            settings=self.settings,
            rng=context.rng,
            device=context.device,
        )
        for group in students:
            log.info(
                "round %d: %s distilled in %d generator and %d student steps, KL to the "
                "ensemble on held-out generated images %.4f -> %.4f",
                round_number,
                group,
                result.generator_steps,
                result.student_steps,
                result.kl_before[group],
                result.kl_after[group],
            )
        return Aggregated({group: {"aca": state_arrays(s)} for group, s in students.items()})

    def _teacher(self, update: Contribution) -> Classifier:
        """The model ``update``'s device runs (its group's architecture with the
        uploaded weights, at the device's weight format), in eval mode."""
        teacher = copy.deepcopy(self._templates[update.group])
        load_arrays(teacher, update.weights)
        return run_weights_(teacher, update.weight_format).eval()

    def _students(
        self, current: GroupModels, updates: Sequence[Contribution]
    ) -> dict[str, Classifier]:
        """Each group's student as distillation starts: an untrained copy of its template
        (the run seed's initial weights every device of the group started from; as
        DENSE, the global model owes nothing to averaging the uploads), or with
        ``start_from_average`` the sample-weighted average of the group's uploads (a
        group without one: untrained)."""
        sums: dict[str, WeightedSum] = {}
        if self.settings.start_from_average:
            for update in updates:
                sums.setdefault(update.group, WeightedSum()).add(update.weights, update.num_samples)
        students = {group: copy.deepcopy(self._templates[group]) for group in current}
        for group, weighted in sums.items():
            if group in students:
                load_arrays(students[group], weighted.mean())
        return students
