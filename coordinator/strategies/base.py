"""The server side of a federated algorithm: :class:`Strategy`, and what it exchanges
with the round engine.

A :class:`Strategy` says what the coordinator sends each selected device (tensor sets,
hyperparameters and the upload it wants back), which devices it can work with, how it
turns a round's accepted updates into the next round's server models, and which global
models it keeps: ``aca`` (the model of the round's active devices) always, ``oca`` (the
sample-weighted average of every device's latest model, the FedKF paper's T1) when
:attr:`Strategy.uses_oca` is set. The round engine does the rest; strategies never touch
the transport or the store.

Server models are kept per architecture group (:mod:`coordinator.groups`): a fleet may
mix architectures, and the engine asks a strategy for each group's downlink. Besides
``aca`` a strategy may keep more arrays between rounds (FedGen's ``generator`` and
``prior``); the engine persists every model :meth:`Strategy.aggregate` returns, by group
and role, and hands them back to :meth:`Strategy.downlink` and the next aggregation. The
base class averages within a group (FedAvg of a mixed fleet is FedAvg per group); FedDF
and DENSE fuse across groups by distillation; FedGen runs with one group only.

``aggregation median`` / ``trimmed_mean`` (:mod:`coordinator.averaging`) replace the
sample-weighted average of the updates by their unweighted coordinate-wise median or
trimmed mean, for fleets that expect poisoned devices: in fedavg, fedprox, fedavg_oca
and fedkf (the ACA; the OCA cache stays a running sample-weighted mean) and fedgen (the
averaged model or head); feddf and dense fuse by distillation and refuse them.

:meth:`Strategy.aggregate` runs in the aggregation phase, off the engine thread, with a
:class:`~coordinator.context.ServerContext` (torch device, proxy data, seeded RNG). It
answers :class:`Aggregated` or, when the round brought nothing to aggregate,
:class:`NothingToAggregate`; an exception is a failure of the server step, never a
way to say "no update".
"""

from __future__ import annotations

import abc
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import numpy as np
import numpy.typing as npt

from coordinator.averaging import Accumulator, accumulator
from coordinator.config import CoordinatorConfig, TrainingSettings
from coordinator.context import ServerContext
from coordinator.errors import ConfigError
from coordinator.groups import GroupModels
from coordinator.strategies.options import Scalar
from models import Classifier, lacks_split
from models.classifiers import HEAD_PREFIX
from protocol.hyperparams import Hyperparameters
from protocol.messages import Hello, UploadSpec, WeightFormat
from protocol.sets import GLOBAL_SET, HEAD_SET

__all__ = [
    "AggregateResult",
    "Aggregated",
    "Array",
    "Arrays",
    "Contribution",
    "NothingToAggregate",
    "Scalar",
    "Strategy",
    "device_seed",
    "head_of",
]

Array = npt.NDArray[Any]
Arrays = Mapping[str, Array]


_V = TypeVar("_V")


def head_of(state: Mapping[str, _V]) -> dict[str, _V]:
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
    metrics: Mapping[str, float] = field(default_factory=dict)
    """What the server step measured, by name (the oneshot ensemble's held-out accuracy
    ...): logged with the round and kept in its record; not persisted."""


@dataclass(frozen=True)
class NothingToAggregate:
    """The round brought no on-time update: the server models stay as they are."""

    reason: str


AggregateResult = Aggregated | NothingToAggregate


def device_seed(seed: int, round_number: int, device_id: str) -> int:
    """The training seed sent to ``device_id`` in ``round_number`` (31 bits): the task's
    ``seed`` hyperparameter, distinct per device and round."""
    sequence = np.random.SeedSequence([seed, round_number, zlib.crc32(device_id.encode())])
    return int(sequence.generate_state(1)[0] >> 1)


class Strategy(abc.ABC):
    """The server side of one federated algorithm."""

    name: ClassVar[str]
    uses_oca: ClassVar[bool] = False
    """Keep an OCA cache (every device's latest update) and an ``oca`` global model."""
    training_defaults: ClassVar[Mapping[str, int]] = {"local_epochs": 5, "batch_size": 32}
    """Training settings a run gets where the configuration leaves them unset."""
    delta_sets: ClassVar[Mapping[str, str]] = {}
    """Downlink sets sent as a delta against another set of the same message, fitted into
    ``teacher_budget`` of that set's bytes (FedKF: the teacher against the student)."""
    distills_on_proxy: ClassVar[bool] = False
    """Whether the strategy can distil on proxy data (FedDF: with ``distill_data
    proxy``, see :attr:`needs_proxy_data`)."""
    head_sharing: ClassVar[bool] = False
    """Whether ``sharing head`` is supported: devices upload only the prediction head,
    the server averages the heads and sends the aggregated head back as ``head``."""
    needs_split: ClassVar[bool] = False
    """Whether the strategy needs each model's features / head split whatever the
    sharing (FedGen: its generator feeds the head); ``sharing head`` always does."""
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
        if self.needs_split or config.sharing == "head":
            why = f"strategy {self.name!r}" if self.needs_split else "sharing 'head'"
            for template in templates.values():
                if lacks_split(template):
                    raise ConfigError(
                        f"{why} needs a model that declares its features and head; "
                        f"{template.architecture} declares none (docs/models.md)"
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
        return head_of(shapes) if self.head_only else dict(shapes)

    def refuse(self, hello: Hello) -> str | None:
        """Why this strategy cannot run with the device of ``hello`` (None: it can)."""
        return None

    def downlink(self, models: Mapping[str, Arrays]) -> dict[str, Arrays]:
        """Tensor sets to send each selected device of a group, by set name.

        ``models`` holds the group's server models (``aca`` and any the strategy keeps)
        and, for strategies with an OCA cache, ``oca``.
        """
        aca = models["aca"]
        return {HEAD_SET: head_of(aca)} if self.head_only else {GLOBAL_SET: aca}

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
