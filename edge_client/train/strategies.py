"""Device-side learning per strategy: a registry of names and the one local update.

A round task names a strategy; :func:`device_strategy` looks it up (never string
matching elsewhere) and :func:`local_update` runs it: load the received tensor sets into
the model, build the strategy's training hooks, train with
:func:`edge_client.train.training.train_local`, return the new weights. Real devices (through
:class:`edge_client.train.runtime.EdgeClient`) and the simulator call this very function.

================  ============================================================
name              device side
================  ============================================================
``fedavg``        plain local SGD from the global weights (full or head-only sharing)
``fedprox``       local SGD plus ``mu / 2 * ||w - w_global||^2`` over the trainable
                  parameters (``w_global``: the weights received this round)
``fedavg_oca``    as ``fedavg`` (the "FedAvg (OCA)" variant differs on the server only)
``feddf``         as ``fedavg`` (FedDF fuses the models by distillation on the server)
``dense``         as ``fedavg``, once (DENSE is one-shot: the server distils the
                  uploads into a fresh model on generated images)
``fedkf``         the student learns CE plus ``gamma * KL(teacher || student)`` on
                  samples of a local image generator (:mod:`edge_client.train.fedkf`)
``fedgen``        CE plus ``alpha * CE(head(G(eps, y)), y)`` with the coordinator's
                  latent generator; full or head-only sharing (:mod:`edge_client.train.fedgen`)
================  ============================================================

Received tensor sets, by name (each strategy declares those it understands with
:meth:`DeviceStrategy.expected_sets`; anything else is a :class:`TaskError`):

=================  ==========================================  =========================
set                contents                                    used by
=================  ==========================================  =========================
``"global"``       the classifier's full state                 fedprox, fedavg_oca,
                                                               feddf, dense (required);
                                                               fedavg and fedgen (full
                                                               sharing)
``"student"``      the classifier's full state (ACA model)     fedkf (required)
``"teacher"``      the classifier's full state (OCA model)     fedkf (absent: FedKF-)
``"head"``         the classifier's ``head.*`` tensors         fedavg, fedgen (head-only
                                                               sharing)
``"generator"``    a LatentGenerator's full state, BatchNorm   fedgen (absent: plain CE)
                   buffers included
``"prior"``        one tensor ``"label_prior"``, float32       fedgen (absent: uniform)
                   (num_classes,), non-negative, sums to 1
=================  ==========================================  =========================

fedavg and fedgen need exactly one of ``"global"`` and ``"head"``. A task without sets trains
the model as it is. The upload (:attr:`LocalTask.upload`) is the full state or, for
fedgen only, the head alone.

Pure: numpy / torch in, numpy out; no I/O, no global state.
"""

from __future__ import annotations

import logging
import time
from abc import ABC
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Literal, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from edge_client.errors import TaskError
from edge_client.train.binary import BinarizeHook
from edge_client.train.data import DeviceData
from edge_client.train.fedgen import (
    FedGenHook,
    label_prior,
    latent_generator_shapes,
    received_generator,
)
from edge_client.train.fedkf import FedKFHook, frozen_teacher
from edge_client.train.qat import FakeQuantHook
from edge_client.train.training import TrainConfig, TrainHook, train_local
from models import (
    Classifier,
    StateMismatchError,
    StateSubset,
    load_state_arrays,
    state_arrays,
    state_shapes,
)
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
    "GENERATOR_SET",
    "GLOBAL_SET",
    "HEAD_SET",
    "PRIOR_SET",
    "PRIOR_TENSOR",
    "STUDENT_SET",
    "TEACHER_SET",
    "WEIGHTS_SET",
    "DeviceStrategy",
    "FedAvg",
    "FedAvgOCA",
    "FedDF",
    "FedGen",
    "FedKF",
    "FedProx",
    "LocalResult",
    "LocalTask",
    "ProximalHook",
    "ReceivedSets",
    "SetSpec",
    "UploadSubset",
    "device_strategy",
    "local_result",
    "local_update",
    "proximal_term",
    "strategy_names",
    "train_prepared",
    "validate_task",
]

logger = logging.getLogger(__name__)

Arrays = dict[str, npt.NDArray[Any]]
ReceivedSets = Mapping[str, Mapping[str, npt.NDArray[Any]]]
"""Received tensor sets: set name -> tensor name -> array."""
UploadSubset = Literal["all", "head"]
"""What a device uploads: its full state, or only its classifier head."""

_T = TypeVar("_T")
_NO_SETS: ReceivedSets = MappingProxyType({})


@dataclass(frozen=True)
class LocalTask:
    """What a device is asked to do in one round, decoded from the wire."""

    strategy: str
    """Registry name of the strategy (see :func:`strategy_names`)."""
    hyperparameters: Mapping[str, object] = field(default_factory=dict)
    """Training hyperparameters: the task's map, in the schema of
    :class:`protocol.hyperparams.Hyperparameters` (validated as
    :class:`edge_client.train.training.TrainConfig`)."""
    sets: ReceivedSets = field(default_factory=dict)
    """Received tensor sets by name (e.g. ``"global"``), each name -> array. Empty: train
    the model as it is (a task without a model message)."""
    upload: UploadSubset = "all"
    """What to upload as the ``"weights"`` set (the task's uplink subset): the full
    state, or (fedgen only) the head alone."""


@dataclass(frozen=True)
class LocalResult:
    """What a device uploads after one round, before encoding."""

    sets: dict[str, Arrays]
    """Tensor sets to upload by name (``"weights"``: the trained state, full or the head
    alone as :attr:`LocalTask.upload` asked)."""
    num_samples: int
    """Local train samples the update was trained on."""
    metrics: dict[str, float]
    """Training metrics: ``loss`` (mean cross-entropy), ``accuracy`` (fraction), plus
    what the strategy's hooks measured (fedkf: ``kd_loss``, ``generator_loss``; fedgen:
    ``generator_ce``; present only when measured)."""
    timings: dict[str, float]
    """Seconds per phase: ``load_s`` (received sets into the model, teacher and
    generators built), ``train_s``."""
    steps: int = 0
    """Optimizer steps taken."""


class SetSpec(NamedTuple):
    """A received set as a strategy expects it."""

    shapes: dict[str, tuple[int, ...]]
    """Exactly these tensor names with these shapes."""
    required: bool
    """Whether a task with sets must carry this one."""


def proximal_term(
    params: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor], mu: float
) -> torch.Tensor:
    """FedProx's ``mu / 2 * sum ||w - w_global||^2`` over the tensors of ``anchor``.

    Functional (parameters in, loss out): the per-device loop calls it on a model's
    live parameters, the sim's batched engine on one device's slice of the stacked ones.

    Args:
        params: the weights being trained, by name (at least ``anchor``'s names).
        anchor: the weights received this round, by name (constants).
        mu: the proximal weight.
    """
    total = torch.stack([(params[name] - w).pow(2).sum() for name, w in anchor.items()]).sum()
    return 0.5 * mu * total


class ProximalHook(TrainHook):
    """FedProx: adds :func:`proximal_term` over the trainable parameters.

    ``w_global`` (:attr:`anchor`) is a copy of the trainable parameters taken in
    :meth:`before_training` (after the global weights were loaded).
    """

    def __init__(self, mu: float) -> None:
        if not mu >= 0:
            raise ValueError(f"mu must be >= 0, got {mu}")
        self.mu = mu
        self.anchor: dict[str, torch.Tensor] = {}
        """The received trainable parameters by name (empty before training starts)."""

    def before_training(self, model: nn.Module) -> None:
        self.anchor = {
            name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad
        }

    def extra_loss(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor
    ) -> torch.Tensor | None:
        if self.mu == 0 or not self.anchor:
            return None
        return proximal_term(dict(model.named_parameters()), self.anchor, self.mu)


def _load_set(
    module: nn.Module, sets: ReceivedSets, name: str, subset: StateSubset = "all"
) -> None:
    """Load the received set ``name`` (if there) into ``subset`` of ``module``."""
    arrays = sets.get(name)
    if arrays is None:
        return
    try:
        load_state_arrays(module, arrays, subset=subset)
    except StateMismatchError as exc:
        raise TaskError(f"received set {name!r} does not fit the model: {exc}") from exc


def _from_set(
    sets: ReceivedSets, name: str, build: Callable[[Mapping[str, npt.NDArray[Any]]], _T]
) -> _T | None:
    """``build(sets[name])``, or None when the set was not received.

    Raises:
        TaskError: the set does not fit what ``build`` makes of it.
    """
    arrays = sets.get(name)
    if arrays is None:
        return None
    try:
        return build(arrays)
    except StateMismatchError as exc:
        raise TaskError(f"received set {name!r} does not fit: {exc}") from exc


def _classifier(model: nn.Module, strategy: str) -> Classifier:
    if not isinstance(model, Classifier):
        raise TaskError(
            f"strategy {strategy!r} needs a classifier with a features / head split, "
            f"got {type(model).__name__}"
        )
    return model


class DeviceStrategy(ABC):
    """The device side of one strategy: which sets it takes, how it trains and uploads.

    Subclasses set :attr:`name`; simple ones override :meth:`hooks`, those that take
    other sets than ``"global"`` override :meth:`expected_sets` and :meth:`prepare`
    (and :meth:`check_sets` for checks beyond names and shapes).
    """

    name: ClassVar[str]
    """Registry name, as round tasks carry it."""
    uploads: ClassVar[tuple[str, ...]] = ("all",)
    """The :attr:`LocalTask.upload` values the strategy supports."""

    def expected_sets(self, model: nn.Module, config: TrainConfig) -> dict[str, SetSpec]:
        """The received sets this strategy understands, by name (default: ``"global"``,
        required, the model's full state).

        Raises:
            TaskError: the strategy cannot run on this model.
        """
        return {GLOBAL_SET: SetSpec(state_shapes(model), required=True)}

    def check_sets(self, model: nn.Module, sets: ReceivedSets) -> None:
        """Checks of received sets beyond names and shapes (values, combinations),
        called by :func:`validate_task` when sets were received; none by default.

        Raises:
            TaskError: naming what is wrong.
        """
        return None

    def prepare(
        self,
        model: nn.Module,
        sets: ReceivedSets,
        config: TrainConfig,
        state: MutableMapping[str, Any],
    ) -> tuple[TrainHook, ...]:
        """Load the received sets into ``model`` and return the round's hooks.

        The default loads ``"global"`` (if received) and returns :meth:`hooks`. All or
        nothing: on error the model is unchanged.

        Raises:
            TaskError: a received set does not fit the model.
        """
        _load_set(model, sets, GLOBAL_SET)
        return self.hooks(model, config, state)

    def hooks(
        self, model: nn.Module, config: TrainConfig, state: MutableMapping[str, Any]
    ) -> tuple[TrainHook, ...]:
        """The training hooks of this strategy for one round (none by default)."""
        return ()

    def run(
        self,
        model: nn.Module,
        data: DeviceData,
        task: LocalTask,
        *,
        config: TrainConfig,
        state: MutableMapping[str, Any],
        device: torch.device,
        extra_hooks: Sequence[TrainHook] = (),
    ) -> LocalResult:
        """:meth:`prepare`, train with its hooks, then the weight format's hook
        (:func:`_format_hooks`), then ``extra_hooks``, and return the new
        state (full or the head, as ``task.upload`` asks) as the ``"weights"`` set.

        Raises:
            TaskError: the received sets do not fit the model (it is then unchanged).
        """
        start = time.perf_counter()
        own = self.prepare(model, task.sets, config, state)
        load_s = time.perf_counter() - start
        return train_prepared(
            model, data, task, config, own, load_s=load_s, device=device, extra_hooks=extra_hooks
        )


def train_prepared(
    model: nn.Module,
    data: DeviceData,
    task: LocalTask,
    config: TrainConfig,
    own: Sequence[TrainHook],
    *,
    load_s: float,
    device: torch.device,
    extra_hooks: Sequence[TrainHook] = (),
) -> LocalResult:
    """Train a prepared model (see :meth:`DeviceStrategy.prepare`) with the strategy's
    hooks ``own``, then the weight format's hook (:func:`_format_hooks`), then
    ``extra_hooks``; the per-device reference path."""
    quant = _format_hooks(config)
    result = train_local(model, data.x, data.y, config, (*own, *quant, *extra_hooks), device=device)
    metrics: dict[str, float] = {}
    for hook in own:
        metrics.update(hook.metrics())
    metrics.update(loss=result.loss, accuracy=result.accuracy)
    timings = {"load_s": load_s, "train_s": result.seconds}
    return local_result(
        model,
        task,
        num_samples=result.num_samples,
        metrics=metrics,
        timings=timings,
        steps=result.steps,
    )


def _format_hooks(config: TrainConfig) -> tuple[TrainHook, ...]:
    """The hook that trains through the weights the device runs: a
    :class:`~edge_client.train.qat.FakeQuantHook` when ``config.qat``, a
    :class:`~edge_client.train.binary.BinarizeHook` when ``config.binarize`` (the two
    exclude each other), else none."""
    if config.qat:
        return (FakeQuantHook(),)
    if config.binarize:
        return (BinarizeHook(),)
    return ()


def local_result(
    model: nn.Module,
    task: LocalTask,
    *,
    num_samples: int,
    metrics: dict[str, float],
    timings: dict[str, float],
    steps: int,
) -> LocalResult:
    """The :class:`LocalResult` of a trained ``model``: its state, full or the head as
    ``task.upload`` asks, as the ``"weights"`` set."""
    upload: StateSubset = "head" if task.upload == "head" else "all"
    return LocalResult(
        sets={WEIGHTS_SET: state_arrays(model, upload)},
        num_samples=num_samples,
        metrics=metrics,
        timings=timings,
        steps=steps,
    )


class _Shared(DeviceStrategy):
    """A strategy whose model comes as ``"global"`` (full sharing) or as ``"head"``
    (head-only sharing: the head is loaded, the features stay the device's own), exactly
    one of them; it uploads the full state or the head alone."""

    uploads = ("all", "head")

    def expected_sets(self, model: nn.Module, config: TrainConfig) -> dict[str, SetSpec]:
        classifier = _classifier(model, self.name)
        return {
            GLOBAL_SET: SetSpec(state_shapes(classifier), required=False),
            HEAD_SET: SetSpec(state_shapes(classifier, "head"), required=False),
        }

    def check_sets(self, model: nn.Module, sets: ReceivedSets) -> None:
        weights = [name for name in (GLOBAL_SET, HEAD_SET) if name in sets]
        if len(weights) != 1:
            raise TaskError(
                f"strategy {self.name!r} needs exactly one of the sets {GLOBAL_SET!r} "
                f"(full sharing) and {HEAD_SET!r} (head-only sharing); got {sorted(sets)}"
            )

    def prepare(
        self,
        model: nn.Module,
        sets: ReceivedSets,
        config: TrainConfig,
        state: MutableMapping[str, Any],
    ) -> tuple[TrainHook, ...]:
        if GLOBAL_SET in sets:
            _load_set(model, sets, GLOBAL_SET)
        else:
            _load_set(model, sets, HEAD_SET, subset="head")
        return self.hooks(model, config, state)


class FedAvg(_Shared):
    """FedAvg: plain local SGD from the global weights (or the global head, with the
    device's own features, in head-only sharing)."""

    name = "fedavg"


class FedAvgOCA(DeviceStrategy):
    """FedAvg (OCA): devices train as in FedAvg; the server aggregates over its cache."""

    name = "fedavg_oca"


class FedDF(DeviceStrategy):
    """FedDF: devices train as in FedAvg; the server fuses the models by ensemble
    distillation on its proxy data, across architectures."""

    name = "feddf"


class Dense(DeviceStrategy):
    """DENSE: devices train once as in FedAvg and upload once; the server distils the
    ensemble of the uploads into a fresh model on images of its own generator."""

    name = "dense"


class FedProx(DeviceStrategy):
    """FedProx: local SGD with a proximal term of weight ``mu`` to the global weights."""

    name = "fedprox"

    def hooks(
        self, model: nn.Module, config: TrainConfig, state: MutableMapping[str, Any]
    ) -> tuple[TrainHook, ...]:
        return (ProximalHook(config.mu),)


class FedKF(DeviceStrategy):
    """FedKF: the received student learns from the teacher through a local generator.

    Sets: ``"student"`` (required), ``"teacher"`` (optional; absent, the teacher is a
    frozen copy of the received student: FedKF-). The generator persists in the
    learning state (see :mod:`edge_client.train.fedkf`). ``gamma`` 0: FedAvg on the student.
    """

    name = "fedkf"

    def expected_sets(self, model: nn.Module, config: TrainConfig) -> dict[str, SetSpec]:
        full = state_shapes(_classifier(model, self.name))
        return {STUDENT_SET: SetSpec(full, required=True), TEACHER_SET: SetSpec(full, False)}

    def prepare(
        self,
        model: nn.Module,
        sets: ReceivedSets,
        config: TrainConfig,
        state: MutableMapping[str, Any],
    ) -> tuple[TrainHook, ...]:
        classifier = _classifier(model, self.name)
        if config.gamma == 0:
            _load_set(model, sets, STUDENT_SET)
            return ()
        # built first: a bad teacher leaves the model unchanged
        teacher = _from_set(sets, TEACHER_SET, lambda arrays: frozen_teacher(classifier, arrays))
        _load_set(model, sets, STUDENT_SET)
        if teacher is None:
            teacher = frozen_teacher(classifier)
        return (FedKFHook(teacher, state, config),)


class FedGen(_Shared):
    """FedGen: local CE plus the head's CE on latents of the coordinator's generator.

    Sets: exactly one of ``"global"`` (full sharing: loads the whole model) and
    ``"head"`` (head-only sharing: loads the head; the features stay the device's own);
    ``"generator"`` and ``"prior"`` optional. Uploads the full state or the head alone.
    """

    name = "fedgen"

    def expected_sets(self, model: nn.Module, config: TrainConfig) -> dict[str, SetSpec]:
        classifier = _classifier(model, self.name)
        return {
            **super().expected_sets(model, config),
            GENERATOR_SET: SetSpec(latent_generator_shapes(classifier, config), False),
            PRIOR_SET: SetSpec({PRIOR_TENSOR: (classifier.num_classes,)}, required=False),
        }

    def check_sets(self, model: nn.Module, sets: ReceivedSets) -> None:
        super().check_sets(model, sets)
        prior = sets.get(PRIOR_SET)
        if prior is not None:
            label_prior(prior[PRIOR_TENSOR], _classifier(model, self.name).num_classes)

    def prepare(
        self,
        model: nn.Module,
        sets: ReceivedSets,
        config: TrainConfig,
        state: MutableMapping[str, Any],
    ) -> tuple[TrainHook, ...]:
        classifier = _classifier(model, self.name)
        # built first: a bad generator leaves the model unchanged
        generator = _from_set(
            sets, GENERATOR_SET, lambda arrays: received_generator(classifier, config, arrays)
        )
        prior_set = sets.get(PRIOR_SET)
        prior = label_prior(
            None if prior_set is None else prior_set[PRIOR_TENSOR], classifier.num_classes
        )
        if GLOBAL_SET in sets:
            _load_set(model, sets, GLOBAL_SET)
        else:
            _load_set(model, sets, HEAD_SET, subset="head")
        if generator is None or config.generative_alpha == 0:
            return ()
        return (FedGenHook(classifier, generator, prior, config),)


_STRATEGIES: Mapping[str, DeviceStrategy] = MappingProxyType(
    {cls.name: cls() for cls in (FedAvg, FedAvgOCA, FedDF, Dense, FedProx, FedKF, FedGen)}
)


def strategy_names() -> tuple[str, ...]:
    """Registered strategy names, sorted."""
    return tuple(sorted(_STRATEGIES))


def device_strategy(name: str) -> DeviceStrategy:
    """The device side of the strategy registered as ``name``.

    Raises:
        TaskError: ``name`` is not registered (the message lists the known names).
    """
    try:
        return _STRATEGIES[name]
    except KeyError:
        known = ", ".join(strategy_names())
        raise TaskError(f"unknown strategy {name!r}; known: {known}") from None


def _check_shapes(name: str, arrays: Mapping[str, npt.NDArray[Any]], spec: SetSpec) -> None:
    expected = spec.shapes
    got = {key: tuple(np.shape(value)) for key, value in arrays.items()}
    if got != expected:
        missing = sorted(set(expected) - set(got))[:4]
        unexpected = sorted(set(got) - set(expected))[:4]
        wrong = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])[:4]
        raise TaskError(
            f"set {name!r} does not fit the model: missing {missing}, unexpected "
            f"{unexpected}, wrong shape {wrong}"
        )


def validate_task(model: nn.Module, task: LocalTask) -> TrainConfig:
    """Check that ``task`` can run on ``model`` without touching either.

    Checks the strategy name, the hyperparameters, the upload subset and, when sets
    were received, that every required set is there, that every set is one the
    strategy understands, with exactly the expected tensor names and shapes, and the
    strategy's own checks (:meth:`DeviceStrategy.check_sets`).

    Returns:
        The validated training config.

    Raises:
        TaskError: naming what is wrong.
    """
    strategy = device_strategy(task.strategy)
    config = TrainConfig.from_hyperparameters(task.hyperparameters)
    if task.upload not in strategy.uploads:
        raise TaskError(
            f"strategy {strategy.name!r} uploads {list(strategy.uploads)}, not {task.upload!r}"
        )
    expected = strategy.expected_sets(model, config)
    if not task.sets:
        return config
    for name, spec in expected.items():
        if spec.required and name not in task.sets:
            raise TaskError(
                f"strategy {strategy.name!r} needs the set {name!r}; got {sorted(task.sets)}"
            )
    unknown = sorted(set(task.sets) - set(expected))
    if unknown:
        raise TaskError(
            f"strategy {strategy.name!r} does not use the set(s) {unknown}; "
            f"it takes {sorted(expected)}"
        )
    for name, arrays in task.sets.items():
        _check_shapes(name, arrays, expected[name])
    strategy.check_sets(model, task.sets)
    return config


def local_update(
    model: nn.Module,
    data: DeviceData,
    task: LocalTask,
    state: MutableMapping[str, Any] | None = None,
    *,
    hooks: Sequence[TrainHook] = (),
    device: torch.device = torch.device("cpu"),  # noqa: B008
) -> LocalResult:
    """Run one round of ``task.strategy`` on this device's data; the pure device step.

    Validates the task (:func:`validate_task`), loads the received sets into ``model``
    (all or nothing), trains it in place with the strategy's hooks and returns its new
    state, full or the head alone as ``task.upload`` asks.

    Args:
        model: the device's classifier (updated in place; in fedgen's head-only mode its
            features are the device's own and must persist between rounds).
        data: the device's local data (its train part is used).
        task: strategy, hyperparameters, received sets and upload subset.
        state: the device's persistent learning state across rounds (fedkf keeps its
            image generator and its optimizer here; fedavg, fedprox, fedavg_oca and
            fedgen keep nothing). None: a fresh, throw-away dict.
        hooks: hooks of the caller, run after the strategy's own (the runtime cancels
            training with one when it stops).
        device: where to train.

    Raises:
        TaskError: unknown strategy, invalid hyperparameters, unsupported upload subset,
            missing, unknown or mismatched received sets; raised before training, the
            model unchanged.
        Whatever a hook raises (training stops there).
    """
    config = validate_task(model, task)
    strategy = device_strategy(task.strategy)
    learning_state: MutableMapping[str, Any] = {} if state is None else state
    return strategy.run(
        model,
        data,
        task,
        config=config,
        state=learning_state,
        device=device,
        extra_hooks=hooks,
    )
