"""Server-side strategies, chosen by name from a registry.

A :class:`Strategy` says what the coordinator sends each selected device (tensor sets,
hyperparameters and the upload it wants back), which devices it can work with, how it
turns a round's accepted updates into the next round's server models, and which global
models it keeps: ``aca`` (the model of the round's active devices) always, ``oca`` (the
sample-weighted average of every device's latest model, the FedKF paper's T1) when
:attr:`Strategy.uses_oca` is set. The round engine does the rest; strategies never touch
the transport or the store.

=============  ===================================================================
name           server side
=============  ===================================================================
fedavg         ACA = sample-weighted average of the round's on-time updates; with
               ``sharing head`` of their heads alone (features stay on the devices)
fedprox        as fedavg; devices add (mu/2)*||w - w_global||^2 (mu in the task)
fedavg_oca     as fedavg, plus the OCA model over every device's latest update
fedkf          FedKF: ACA and OCA as fedavg_oca; downlink ``dual`` sends ACA as the
               student and OCA as the teacher, ``single`` (FedKF-) the ACA alone;
               devices distil through a local image generator
fedgen         FedGen: averages what devices share (``full`` model or ``head`` only)
               and trains a conditional latent generator against the devices' heads
               each round; sends the generator and the label prior with the model
feddf          FedDF: each group's model starts from the average of its group's
               updates and is distilled from the ensemble of every update, whatever
               its architecture, on the server's unlabeled proxy data or (``distill_data
               generator``) on images of a generator trained against the ensemble
dense          DENSE, one-shot: one round, one upload per device; the server trains
               an image generator against the ensemble of every update and distils
               the ensemble into a fresh model per group on its images (no data)
=============  ===================================================================

Server models are kept per architecture group (:mod:`coordinator.groups`): a fleet may
mix architectures, and the engine asks a strategy for each group's downlink. Besides
``aca`` a strategy may keep more arrays between rounds (FedGen's ``generator`` and
``prior``); the engine persists every model :meth:`Strategy.aggregate` returns, by group
and role, and hands them back to :meth:`Strategy.downlink` and the next aggregation. The
strategies here average within a group (FedAvg of a mixed fleet is FedAvg per group);
FedDF and DENSE fuse across groups by distillation; FedGen runs with one group only.

``aggregation median`` / ``trimmed_mean`` (:mod:`coordinator.averaging`) replace the
sample-weighted average of the updates by their unweighted coordinate-wise median or
trimmed mean, for fleets that expect poisoned devices: in fedavg, fedprox, fedavg_oca
and fedkf (the ACA; the OCA cache stays a running sample-weighted mean) and fedgen (the
averaged model or head); feddf and dense fuse by distillation and refuse them.

A strategy may also have its own defaults for the fleet settings a run leaves out
(:attr:`Strategy.fleet_defaults`, read by :class:`~coordinator.config.FleetSettings`
through :func:`fleet_defaults`): DENSE runs one round with every device.

:meth:`Strategy.aggregate` runs in the aggregation phase, off the engine thread, with a
:class:`~coordinator.context.ServerContext` (torch device, proxy data, seeded RNG). It
answers :class:`Aggregated` or, when the round brought nothing to aggregate,
:class:`NothingToAggregate`; an exception is a failure of the server step, never a
way to say "no update".
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from coordinator.averaging import Accumulator, WeightedSum, accumulator
from coordinator.config import CoordinatorConfig, TrainingSettings
from coordinator.context import ServerContext
from coordinator.dense import DenseSettings, dense_distill, image_generator_config
from coordinator.errors import ConfigError
from coordinator.feddf import (
    DistillSettings,
    chance_teachers,
    distill,
    holdout_split,
    teacher_logits,
)
from coordinator.feddf_generated import GeneratedSettings, generate_images
from coordinator.fedgen import GeneratorTraining, label_prior, train_latent_generator
from coordinator.groups import GroupModels
from models import (
    Classifier,
    ImageGenerator,
    ImageGeneratorConfig,
    LatentGenerator,
    LatentGeneratorConfig,
    seeded,
    state_arrays,
)
from models import load_state_arrays as load_arrays
from models.classifiers import HEAD_PREFIX
from models.weight_formats import run_weights_
from protocol.hyperparams import Hyperparameters
from protocol.messages import Hello, UploadSpec, WeightFormat
from protocol.sets import (
    GENERATOR_SET,
    GLOBAL_SET,
    HEAD_SET,
    PRIOR_SET,
    PRIOR_TENSOR,
    STUDENT_SET,
    TEACHER_SET,
    WEIGHTS_SET,
)

__all__ = [
    "GLOBAL_SET",
    "WEIGHTS_SET",
    "AggregateResult",
    "Aggregated",
    "Contribution",
    "Dense",
    "FedAvg",
    "FedAvgOca",
    "FedDF",
    "FedGen",
    "FedKF",
    "FedProx",
    "NothingToAggregate",
    "Strategy",
    "build_strategy",
    "fleet_defaults",
    "strategy_names",
]

log = logging.getLogger(__name__)

Array = npt.NDArray[Any]
Arrays = Mapping[str, Array]
Scalar = bool | int | float | str


_V = TypeVar("_V")


def _head(state: Mapping[str, _V]) -> dict[str, _V]:
    """The ``head.*`` entries of a model state (tensors, or their shapes)."""
    return {k: v for k, v in state.items() if k.startswith(HEAD_PREFIX)}


@dataclass(frozen=True)
class Contribution:
    """One accepted on-time update, as the aggregation sees it."""

    device_id: str
    group: str
    """The device's architecture group."""
    weights: dict[str, Array]
    num_samples: int
    label_counts: tuple[int, ...] | None = None
    weight_format: WeightFormat = "float"
    """The format the device runs ``weights`` at (:mod:`models.weight_formats`); the
    weights themselves are the float (latent) ones it trained."""


@dataclass(frozen=True)
class Aggregated:
    """The next round's server models: every group's, by role; each holds ``aca``."""

    models: GroupModels


@dataclass(frozen=True)
class NothingToAggregate:
    """The round brought no on-time update: the server models stay as they are."""

    reason: str


AggregateResult = Aggregated | NothingToAggregate


class Strategy(abc.ABC):
    """The server side of one federated algorithm."""

    name: ClassVar[str]
    uses_oca: ClassVar[bool] = False
    """Keep an OCA cache (every device's latest update) and an ``oca`` global model."""
    training_defaults: ClassVar[Mapping[str, int]] = {"local_epochs": 5, "batch_size": 32}
    """Training settings a run gets where the configuration leaves them unset."""
    fleet_defaults: ClassVar[Mapping[str, Scalar]] = {}
    """Fleet settings (:class:`~coordinator.config.FleetSettings` fields) a run with this
    strategy gets where the configuration leaves them out, instead of the fields' own
    defaults (DENSE: one round, every device)."""
    delta_sets: ClassVar[Mapping[str, str]] = {}
    """Downlink sets sent as a delta against another set of the same message, fitted into
    ``teacher_budget`` of that set's bytes (FedKF: the teacher against the student)."""
    distills_on_proxy: ClassVar[bool] = False
    """Whether the strategy can distil on proxy data (FedDF: with ``distill_data
    proxy``, see :attr:`needs_proxy_data`)."""
    head_sharing: ClassVar[bool] = False
    """Whether ``sharing head`` is supported: devices upload only the prediction head,
    the server averages the heads and sends the aggregated head back as ``head``."""
    robust_aggregation: ClassVar[bool] = True
    """Whether ``aggregation median`` / ``trimmed_mean`` is supported (the updates are
    averaged into the ACA; strategies that fuse by distillation refuse it)."""

    def __init__(self, config: CoordinatorConfig, templates: Mapping[str, Classifier]) -> None:
        if config.sharing == "head" and not self.head_sharing:
            raise ConfigError(f"strategy {self.name!r} does not support sharing 'head'")
        final = config.final_model or ("oca" if self.uses_oca else "aca")
        if final == "oca" and not self.uses_oca:
            raise ConfigError(f"strategy {self.name!r} keeps no OCA model; use final_model aca")
        if config.aggregation != "mean" and not self.robust_aggregation:
            raise ConfigError(
                f"strategy {self.name!r} fuses the updates by distillation, not by averaging: "
                f"aggregation {config.aggregation!r} is not supported (use mean)"
            )
        if config.distill_data != "proxy" and not self.distills_on_proxy:
            raise ConfigError(
                f"distill_data {config.distill_data!r} is a feddf setting; strategy "
                f"{self.name!r} does not distil (leave it out)"
            )
        self.config = config
        self.head_only = config.sharing == "head"
        self.final_model: str = final
        """The global model a run delivers (``aca``, or ``oca`` where one is kept)."""
        self.training: TrainingSettings = config.training.with_defaults(self.training_defaults)

    @property
    def needs_proxy_data(self) -> bool:
        """Whether the server step distils on proxy data (the run must give some)."""
        return self.distills_on_proxy and self.config.distill_data == "proxy"

    @property
    def refuses_proxy_data(self) -> bool:
        """Whether proxy data would go unused by a run that asked for another source of
        distillation images (FedDF's ``distill_data generator``): it is refused."""
        return self.distills_on_proxy and self.config.distill_data != "proxy"

    def hyperparameters(self, round_number: int) -> dict[str, Scalar]:
        """What the task tells a device to do in ``round_number`` (1-based): the keys of
        :meth:`task_settings`, validated by the task's schema
        (:class:`protocol.hyperparams.Hyperparameters`)."""
        return Hyperparameters.model_validate(self.task_settings(round_number)).to_wire()

    def task_settings(self, round_number: int) -> dict[str, Scalar]:
        """The hyperparameters this strategy sends (subclasses add their own keys)."""
        t = self.training
        return {
            "local_epochs": t.local_epochs or 0,
            "local_steps": t.local_steps or 0,
            "batch_size": t.batch_size or 1,
            "lr": t.lr,
            "momentum": t.momentum,
            "weight_decay": t.weight_decay,
        }

    def uplink(self) -> UploadSpec:
        """What a device uploads: its fp32 weights, all of them or only the head."""
        return UploadSpec(subset="head" if self.head_only else "all")

    def update_shapes(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """Name -> shape of the tensors an update must carry, given the model's ``shapes``."""
        return _head(shapes) if self.head_only else dict(shapes)

    def refuse(self, hello: Hello) -> str | None:
        """Why this strategy cannot run with the device of ``hello`` (None: it can)."""
        return None

    def downlink(self, models: Mapping[str, Arrays]) -> dict[str, Arrays]:
        """Tensor sets to send each selected device of a group, by set name.

        ``models`` holds the group's server models (``aca`` and any the strategy keeps)
        and, for strategies with an OCA cache, ``oca``.
        """
        aca = models["aca"]
        return {HEAD_SET: _head(aca)} if self.head_only else {GLOBAL_SET: aca}

    def aggregate(
        self,
        current: GroupModels,
        updates: Iterable[Contribution],
        round_number: int,
        context: ServerContext,
    ) -> AggregateResult:
        """The next round's server models of every group from the round's on-time updates.

        ``current`` holds the models the round started from, by group and role.
        ``updates`` loads one update at a time; keep memory O(model) per group. Runs off
        the engine thread; draws come from ``context.rng``, so a re-run gives the same.
        Here: each group's ACA is the sample-weighted average of its devices' updates
        (with ``aggregation median`` / ``trimmed_mean``, their unweighted coordinate-wise
        median / trimmed mean: :mod:`coordinator.averaging`); a group without an update
        keeps its models. The OCA model stays the sample-weighted mean of the cache.

        Raises:
            Exception: the server step failed; the round stays open, and a resumed
                coordinator runs the aggregation again.
        """
        sums: dict[str, Accumulator] = {}
        for update in updates:
            acc = sums.setdefault(update.group, self.accumulator())
            acc.add(update.weights, update.num_samples)
        if not sums:
            return NothingToAggregate(f"no on-time update in round {round_number}")
        return Aggregated(
            {
                group: {"aca": self._merge(models, sums[group].mean())} if group in sums else models
                for group, models in current.items()
            }
        )

    def accumulator(self) -> Accumulator:
        """An empty aggregate of the run's ``aggregation`` (mean, median, trimmed_mean)."""
        return accumulator(self.config.aggregation, self.config.trim_fraction)

    def _merge(self, current: Mapping[str, Arrays], mean: dict[str, Array]) -> dict[str, Array]:
        """The new ACA: the mean itself, or (head-only) the current model with the mean
        head (the features stay those of the initial model: the server never sees any)."""
        return {**current["aca"], **mean} if self.head_only else mean


class FedAvg(Strategy):
    """FedAvg (McMahan et al., 2017): the sample-weighted average of the updates (of
    the heads alone with ``sharing head``)."""

    name = "fedavg"
    head_sharing = True


class FedProx(Strategy):
    """FedProx (Li et al., 2020): FedAvg aggregation; devices get the proximal weight mu."""

    name = "fedprox"

    def task_settings(self, round_number: int) -> dict[str, Scalar]:
        return {**super().task_settings(round_number), "mu": self.training.mu}


class FedAvgOca(Strategy):
    """FedAvg (OCA), the FedKF paper's T1 alone: FedAvg training plus the OCA model."""

    name = "fedavg_oca"
    uses_oca = True


class FedKF(Strategy):
    """FedKF (knowledge distillation and fusion): ACA + OCA on the server, distillation
    through a local image generator on the devices (the paper's Algorithm 1).

    Downlink ``dual``: ``student`` = ACA, ``teacher`` = OCA (two models, twice FedAvg's
    downlink bytes at the same precision). ``single`` (FedKF-): ``student`` only, which
    devices also use as the teacher. Defaults from the paper: E = 10, B = 64.
    """

    name = "fedkf"
    uses_oca = True
    training_defaults: ClassVar[Mapping[str, int]] = {"local_epochs": 10, "batch_size": 64}
    delta_sets: ClassVar[Mapping[str, str]] = {TEACHER_SET: STUDENT_SET}

    def task_settings(self, round_number: int) -> dict[str, Scalar]:
        t = self.training
        return {
            **super().task_settings(round_number),
            "gamma": t.gamma,
            "lambda1": t.lambda1,
            "lambda2": t.lambda2,
            "generator_lr": t.generator_lr,
            "generator_width": t.generator_width,
        }

    def downlink(self, models: Mapping[str, Arrays]) -> dict[str, Arrays]:
        if self.config.downlink == "single":
            return {STUDENT_SET: models["aca"]}
        return {STUDENT_SET: models["aca"], TEACHER_SET: models["oca"]}


class FedGen(Strategy):
    """FedGen (data-free knowledge distillation): see :mod:`coordinator.fedgen`.

    ``sharing full``: devices upload their whole model, the server averages it and sends
    it back as ``global``. ``sharing head``: devices upload only the prediction head
    (the feature extractor never leaves the device) and the server sends the averaged
    head as ``head``. Either way every update carries the device's label counts (which
    needs the device's consent in its hello), the server trains the latent generator
    against this round's heads and sends it with the label prior from round 2 on;
    devices weigh the generator term with ``alpha_t = generative_alpha *
    generative_alpha_decay ** (t - 1)``. Defaults from the paper: 20 local steps of
    batch 32. One architecture group: the generator lives in its latent space.
    """

    name = "fedgen"
    head_sharing = True
    training_defaults: ClassVar[Mapping[str, int]] = {"local_steps": 20, "batch_size": 32}
    generator_training = GeneratorTraining()

    def __init__(self, config: CoordinatorConfig, templates: Mapping[str, Classifier]) -> None:
        super().__init__(config, templates)
        if len(templates) != 1:
            raise ConfigError(f"strategy {self.name!r} runs one architecture, not {len(templates)}")
        (template,) = templates.values()
        self._generator_config = LatentGeneratorConfig.for_classifier(
            template,
            noise_dim=self.training.generator_noise_dim,
            hidden_dim=self.training.generator_hidden,
        )

    def task_settings(self, round_number: int) -> dict[str, Scalar]:
        t = self.training
        alpha = t.generative_alpha * t.generative_alpha_decay ** (round_number - 1)
        return {
            **super().task_settings(round_number),
            "generative_alpha": alpha,
            "generator_noise_dim": self._generator_config.noise_dim,
            "generator_hidden": self._generator_config.hidden_dim,
        }

    def uplink(self) -> UploadSpec:
        return super().uplink().model_copy(update={"label_counts": True})

    def refuse(self, hello: Hello) -> str | None:
        if hello.share_label_counts:
            return None
        return (
            "fedgen needs the device's label counts (the server's generator is trained "
            "against them); the device did not consent: start it with --share-label-counts"
        )

    def downlink(self, models: Mapping[str, Arrays]) -> dict[str, Arrays]:
        sets = super().downlink(models)
        if GENERATOR_SET in models:
            sets[GENERATOR_SET] = models[GENERATOR_SET]
            sets[PRIOR_SET] = models[PRIOR_SET]
        return sets

    def aggregate(
        self,
        current: GroupModels,
        updates: Iterable[Contribution],
        round_number: int,
        context: ServerContext,
    ) -> AggregateResult:
        ((group, models),) = current.items()
        acc = self.accumulator()
        heads: list[dict[str, Array]] = []
        counts: list[tuple[int, ...]] = []
        for update in updates:
            acc.add(update.weights, update.num_samples)
            heads.append(_head(update.weights))
            if update.label_counts is None:  # the engine checks; kept as a guard
                raise ValueError(f"update of {update.device_id} has no label counts")
            counts.append(update.label_counts)
        if acc.weight <= 0:
            return NothingToAggregate(f"no on-time update in round {round_number}")
        aca = self._merge(models, acc.mean())
        generator = self._generator(models).to(context.device)
        train_latent_generator(generator, heads, counts, self.generator_training, rng=context.rng)
        prior = label_prior(np.asarray(counts, dtype=np.int64))
        server = {
            "aca": aca,
            GENERATOR_SET: state_arrays(generator),
            PRIOR_SET: {PRIOR_TENSOR: prior.astype(np.float32)},
        }
        return Aggregated({group: server})

    def _generator(self, current: Mapping[str, Arrays]) -> LatentGenerator:
        """Last round's generator, or in round 1 a new one seeded by the run's seed."""
        if GENERATOR_SET in current:
            with torch.device("meta"):  # every tensor comes from the stored state
                generator = LatentGenerator(self._generator_config)
            generator = generator.to_empty(device="cpu")
            load_arrays(generator, current[GENERATOR_SET])
            return generator
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.config.seed)
            return LatentGenerator(self._generator_config)


class FedDF(Strategy):
    """FedDF (ensemble distillation for model fusion): see :mod:`coordinator.feddf`.

    One global model per architecture group. Each round a group's model starts from the
    sample-weighted average of its group's on-time updates (a group without one starts
    from its current model) and is distilled from the ensemble of every on-time update
    of the round (their averaged logits), across groups, on unlabeled images: the
    server's proxy data (``distill_data proxy``), or images of a generator trained
    against the round's ensemble (``distill_data generator``,
    :mod:`coordinator.feddf_generated`: no data at all on the server; a new generator
    each round, seeded by the round's RNG). With ``drop_worst`` the teachers no better
    than chance on the held-out images are left out (logged); with generated images
    the generator was trained against every teacher. Devices train as with FedAvg.

    A fleet may mix weight formats: each teacher's logits come from the weights its
    device runs (:func:`~models.weight_formats.run_weights_` of the contribution's
    ``weight_format``: int8 or binarized kernels), while the averages the students start
    from are of the float (latent) weights. A group's student stays float and is
    distilled at float and at every format its group's updates of the round ran at (the
    mean KL; :func:`~coordinator.feddf.distill`), since the group's devices of each
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
            dense=dataclasses.replace(
                GeneratedSettings().dense, generator_steps=config.distill_generator_steps
            ),
        )
        """How the images are generated with ``distill_data generator``."""
        self._generator_config = (
            _image_generator(self.generation.dense, config, "feddf")
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
        generator = _new_generator(self._generator_config, context.rng).to(context.device)
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


def _image_generator(
    settings: DenseSettings, config: CoordinatorConfig, who: str
) -> ImageGeneratorConfig:
    """The image generator of ``settings`` for the run's images.

    Raises:
        ConfigError: the models' images are none it can make.
    """
    try:
        return image_generator_config(
            settings, channels=config.in_channels, image_size=config.image_size
        )
    except ValueError as exc:
        raise ConfigError(f"{who} cannot generate the models' images: {exc}") from exc


def _new_generator(config: ImageGeneratorConfig, rng: torch.Generator) -> ImageGenerator:
    """A new image generator, its initial weights seeded by a draw of ``rng``."""
    with seeded(int(torch.randint(2**62, (), generator=rng))):
        return ImageGenerator(config)


class Dense(Strategy):
    """DENSE (data-free one-shot federated learning): see :mod:`coordinator.dense`.

    Exactly one round: every device trains once, as with FedAvg but for more local
    epochs (its one chance), and uploads once. The server then builds a fresh model per
    architecture group (the run seed's initial weights, untrained), trains an image
    generator against the ensemble of every upload, whatever its group, and distils
    the ensemble into each group's model on the generated images: no proxy data, no
    data of the devices. Left out of the configuration, ``rounds`` is 1 and
    ``participation`` 1.0; a run configured with more rounds is refused. The server
    keeps every upload as a model at once (the ensemble needs them all): memory is
    O(devices x model).
    """

    name = "dense"
    robust_aggregation = False
    fleet_defaults: ClassVar[Mapping[str, Scalar]] = {"rounds": 1, "participation": 1.0}
    training_defaults: ClassVar[Mapping[str, int]] = {"local_epochs": 10, "batch_size": 32}
    defaults: ClassVar[DenseSettings] = DenseSettings()
    """The server step's settings that are no flags (batch, generator width, learning
    rates, loss weights)."""

    def __init__(self, config: CoordinatorConfig, templates: Mapping[str, Classifier]) -> None:
        super().__init__(config, templates)
        self.settings = dataclasses.replace(
            self.defaults,
            epochs=config.dense_epochs,
            generator_steps=config.dense_generator_steps,
            student_steps=config.dense_student_steps,
        )
        """The server step's generator and distillation settings (``--dense-*``)."""
        if config.rounds != 1:
            raise ConfigError(
                f"dense is one-shot: run it with --rounds 1 (the default for dense), "
                f"not {config.rounds}"
            )
        self._generator_config = _image_generator(self.settings, config, "dense")
        self._templates = {name: copy.deepcopy(t) for name, t in templates.items()}

    def aggregate(
        self,
        current: GroupModels,
        updates: Iterable[Contribution],
        round_number: int,
        context: ServerContext,
    ) -> AggregateResult:
        teachers: list[Classifier] = []
        for update in updates:
            teacher = copy.deepcopy(self._templates[update.group])
            load_arrays(teacher, update.weights)
            teachers.append(run_weights_(teacher, update.weight_format))  # as its device runs it
        if not teachers:
            return NothingToAggregate(f"no on-time update in round {round_number}")
        students = {group: self._fresh(group) for group in current}
        generator = _new_generator(self._generator_config, context.rng)
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

    def _fresh(self, group: str) -> Classifier:
        """An untrained model of ``group``'s architecture: a copy of its template, which
        holds the run seed's initial weights every device of the group started from (as
        DENSE, the global model owes nothing to averaging the uploads)."""
        return copy.deepcopy(self._templates[group])


_REGISTRY: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (FedAvg, FedProx, FedAvgOca, FedKF, FedGen, FedDF, Dense)
}


def strategy_names() -> tuple[str, ...]:
    """Names accepted by :func:`build_strategy`."""
    return tuple(_REGISTRY)


def fleet_defaults(name: str) -> Mapping[str, Scalar]:
    """The fleet settings strategy ``name`` has its own defaults for (empty for an
    unknown name: :func:`build_strategy` refuses it)."""
    cls = _REGISTRY.get(name)
    return cls.fleet_defaults if cls is not None else {}


def build_strategy(config: CoordinatorConfig, templates: Mapping[str, Classifier]) -> Strategy:
    """The strategy ``config.strategy`` for a fleet of the architecture groups
    ``templates`` (group name -> a classifier of its architecture).

    Raises:
        ConfigError: unknown name (the message lists the known ones), or options the
            strategy cannot honour (``final_model oca`` without an OCA model, ``sharing
            head`` where heads alone cannot be averaged, several groups for FedGen,
            more than one round for DENSE).
    """
    try:
        factory = _REGISTRY[config.strategy]
    except KeyError:
        raise ConfigError(
            f"unknown strategy {config.strategy!r}; choose one of {', '.join(strategy_names())}"
        ) from None
    return factory(config, templates)
