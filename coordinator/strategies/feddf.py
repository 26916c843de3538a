"""FedDF: the strategy, and its server step, ensemble distillation on unlabeled images.

FedDF (Lin et al., 2020, "Ensemble Distillation for Robust Model Fusion in Federated
Learning") fuses the models a round received by distillation rather than (only) by
averaging: each group's student starts from the average of its group's models and is
trained on unlabeled proxy images to match the ensemble of *all* received models (their
averaged logits), whatever their architectures. Here:

* the teachers' logits over the proxy images are computed once per round
  (:func:`~coordinator.strategies.ensemble.teacher_logits`, one teacher at a time, so
  memory is one model plus ``teachers * N * classes`` floats);
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

Without proxy images (``distill_data generator``) the server makes its own:
:func:`generate_images` runs ``batches`` of DENSE's generator phases
(:func:`coordinator.strategies.sample_generation.generator_phase`: the ensemble's cross
entropy to sampled labels, BatchNorm statistic matching, and the boundary-support term
against the students as they start, the groups' averages), each on its own noise and
labels, and keeps each phase's lowest-loss batch; FedDF then treats the images as it
treats proxy images. The generator is new each round (its initial weights drawn from
the round's seeded RNG), not carried across rounds: the ensemble it serves is another
each round, a round's aggregation stays a function of that round's updates and seed (a
re-run after a crash gives the same models, with nothing more to persist), and the
server state stays the groups' models. The cost is the generator steps of every round.

The server step's functions take tensors and modules and return tensors and modules; no
I/O, no global state, the device a parameter, every random draw from the caller's
generator. The settings: :mod:`coordinator.strategies.feddf_settings`.
"""

from __future__ import annotations

import copy
import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.func import functional_call

from coordinator.averaging import WeightedSum
from coordinator.config import CoordinatorConfig
from coordinator.context import ServerContext
from coordinator.errors import ConfigError
from coordinator.groups import GroupModels
from coordinator.strategies.base import (
    Aggregated,
    AggregateResult,
    Arrays,
    Contribution,
    NothingToAggregate,
    Strategy,
)
from coordinator.strategies.ensemble import evaluating, kl_to_ensemble, teacher_logits
from coordinator.strategies.feddf_settings import DistillSettings, GeneratedSettings
from coordinator.strategies.sample_generation import (
    GeneratorPhase,
    frozen,
    generator_phase,
    new_generator,
    run_generator,
)
from models import Classifier, ImageGenerator, SampleGenerator, state_arrays
from models import load_state_arrays as load_arrays
from models.optim import Adam
from models.weight_formats import run_weights_, weights_at
from protocol.messages import WeightFormat

__all__ = [
    "DistillResult",
    "FedDF",
    "GeneratedImages",
    "chance_teachers",
    "distill",
    "generate_images",
    "holdout_split",
]

log = logging.getLogger(__name__)


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
        with evaluating(student):
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


@dataclass(frozen=True)
class GeneratedImages:
    """What :func:`generate_images` made."""

    images: torch.Tensor
    """``(batches * batch_size, C, H, W)`` generated images, on the generator's device."""
    last: GeneratorPhase
    """The last generator phase (its mean loss parts say how far the generator got)."""


def generate_images(
    generator: ImageGenerator | SampleGenerator,
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


class FedDF(Strategy):
    """FedDF (ensemble distillation for model fusion): see the module docstring.

    One global model per architecture group. Each round a group's model starts from the
    sample-weighted average of its group's on-time updates (a group without one starts
    from its current model) and is distilled from the ensemble of every on-time update
    of the round (their averaged logits), across groups, on unlabeled images: the
    server's proxy data (``distill_data proxy``), or images of a generator trained
    against the round's ensemble (``distill_data generator``,
    :func:`generate_images`: no data at all on the server; a new generator
    each round, seeded by the round's RNG). With ``drop_worst`` the teachers no better
    than chance on the held-out images are left out (logged); with generated images
    the generator was trained against every teacher. Devices train as with FedAvg.

    A fleet may mix weight formats: each teacher's logits come from the weights its
    device runs (:func:`~models.weight_formats.run_weights_` of the contribution's
    ``weight_format``: int8 or binarized kernels), while the averages the students start
    from are of the float (latent) weights. A group's student stays float and is
    distilled at float and at every format its group's updates of the round ran at (the
    mean KL; :func:`distill`), since the group's devices of each
    format run it at theirs.

    Memory: with proxy data one teacher model at a time plus the teachers' logits; with
    generated images every teacher as a model at once (the generator trains against the
    whole ensemble), O(updates x model).
    """

    name = "feddf"
    distills_on_proxy = True
    robust_aggregation = False

    def __init__(self, config: CoordinatorConfig, templates: Mapping[str, Classifier]) -> None:
        super().__init__(config, templates)
        self._templates = {name: copy.deepcopy(t) for name, t in templates.items()}
        self.distillation = DistillSettings(
            max_steps=config.distill_steps,
            batch_size=config.distill_batch_size,
            lr=config.distill_lr,
            temperature=config.distill_temperature,
            patience=config.distill_patience,
        )
        self.generation = GeneratedSettings(
            batches=config.distill_generator_batches,
            dense=replace(
                GeneratedSettings().dense, generator_steps=config.distill_generator_steps
            ),
        )
        """How the images are generated with ``distill_data generator``."""
        self._generator_config = (
            run_generator(self.generation.dense, config)
            if config.distill_data == "generator"
            else None
        )

    def aggregate(
        self,
        current: GroupModels,
        updates: Iterable[Contribution],
        round_number: int,
        context: ServerContext,
    ) -> AggregateResult:
        images: torch.Tensor | None = None
        if self._generator_config is None:
            if context.proxy_data is None:
                raise ConfigError("feddf distils on proxy data: give the run some (--proxy-data)")
            images = context.proxy_data.to(context.device)
        sums: dict[str, WeightedSum] = {}
        teachers: list[torch.Tensor] = []
        models: list[Classifier] = []  # generated images: every teacher, as a model
        names: list[str] = []
        formats: list[str] = []
        run_formats: dict[str, set[WeightFormat]] = {}
        for update in updates:
            sums.setdefault(update.group, WeightedSum()).add(update.weights, update.num_samples)
            run_formats.setdefault(update.group, {"float"}).add(update.weight_format)
            if images is None:
                models.append(self._teacher_model(update, context.device))
            else:
                teachers.append(self.teacher(update, images, context.device))
            names.append(update.device_id)
            formats.append(update.weight_format)
        if not names:
            return NothingToAggregate(f"no on-time update in round {round_number}")
        starts = {
            group: sums[group].mean() if group in sums else models_["aca"]
            for group, models_ in current.items()
        }
        if images is None:
            images = self._generate(models, starts, round_number, context)
            teachers = [teacher_logits(model, images) for model in models]
            del models
        settings = self.distillation
        train, held_out = holdout_split(len(images), settings.holdout, context.rng)
        source = "proxy" if self._generator_config is None else "generated"
        if self.config.drop_worst:
            dropped = chance_teachers(teachers, held_out)
            if dropped:
                log.warning(
                    "round %d: drop-worst left out %s (no better than chance on the held-out "
                    "%s images)",
                    round_number,
                    ", ".join(names[i] for i in dropped),
                    source,
                )
            teachers = [t for i, t in enumerate(teachers) if i not in dropped]
            formats = [f for i, f in enumerate(formats) if i not in dropped]
        ensemble = torch.stack(teachers).mean(0)
        teacher_formats = ", ".join(f"{n} {name}" for name, n in sorted(Counter(formats).items()))
        out: GroupModels = {}
        for group, start in starts.items():
            student = self._model(group, start, context.device)
            result = distill(
                student,
                images,
                ensemble,
                train=train,
                held_out=held_out,
                settings=settings,
                rng=context.rng,
                formats=sorted(run_formats.get(group, {"float"})),
            )
            log.info(
                "round %d: %s distilled from %d teacher(s) (weights %s) on %d %s images in %d "
                "steps, held-out KL %.4f -> %.4f",
                round_number,
                group,
                len(teachers),
                teacher_formats,
                len(images),
                source,
                result.steps,
                result.kl_before,
                result.kl_after,
            )
            out[group] = {"aca": state_arrays(student)}
        return Aggregated(out)

    def _generate(
        self,
        teachers: list[Classifier],
        starts: Mapping[str, Arrays],
        round_number: int,
        context: ServerContext,
    ) -> torch.Tensor:
        """Images of a new generator (seeded by ``context.rng``) trained against the
        ensemble of ``teachers``, the boundary-support term against the students as they
        start (``starts``: group -> weights)."""
        assert self._generator_config is not None
        students = [self._model(group, start, context.device) for group, start in starts.items()]
        generator = new_generator(self._generator_config, context.rng).to(context.device)
        made = generate_images(
            generator,
            teachers,
            students,
            classes=self.config.num_classes,
            settings=self.generation,
            rng=context.rng,
        )
        log.info(
            "round %d: FedDF generated %d images against %d teacher(s) in %d generator steps "
            "(last phase: CE %.4f, BN %.4f, adv %.4f)",
            round_number,
            len(made.images),
            len(teachers),
            self.generation.batches * self.generation.dense.generator_steps,
            made.last.ce,
            made.last.bn,
            made.last.adv,
        )
        return made.images.detach()

    def teacher(
        self, update: Contribution, images: torch.Tensor, device: torch.device
    ) -> torch.Tensor:
        """The logits (N, classes) of ``update``'s model on ``images`` (on ``device``), at
        the weights its device runs (:func:`~models.weight_formats.run_weights_`)."""
        return teacher_logits(self._teacher_model(update, device), images)

    def _teacher_model(self, update: Contribution, device: torch.device) -> Classifier:
        """A new model of ``update``'s group holding its weights as its device runs them."""
        model = copy.deepcopy(self._templates[update.group])
        load_arrays(model, update.weights)
        return run_weights_(model, update.weight_format).to(device)

    def _model(self, group: str, arrays: Arrays, device: torch.device) -> Classifier:
        """The group's architecture with ``arrays`` loaded, on ``device``."""
        model = self._templates[group]
        load_arrays(model, arrays)
        return model.to(device)
