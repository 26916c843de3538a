"""Device-side learning per strategy: a registry of names and the one local update.

A round task names a strategy; :func:`device_strategy` looks it up (never string
matching elsewhere) and :func:`local_update` runs it: load the received global weights
into the model, build the strategy's training hooks, train with
:func:`edge_client.training.train_local`, return the new weights. Real devices (through
:class:`edge_client.runtime.EdgeClient`) and the simulator call this very function.

================  ============================================================
name              device side
================  ============================================================
``fedavg``        plain local SGD from the global weights
``fedprox``       local SGD plus ``mu / 2 * ||w - w_global||^2`` over the trainable
                  parameters (``w_global``: the weights received this round)
``fedavg_oca``    as ``fedavg`` (the "FedAvg (OCA)" variant differs on the server only)
================  ============================================================

Pure: numpy / torch in, numpy out; no I/O, no global state.
"""

from __future__ import annotations

import logging
import time
from abc import ABC
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from edge_client.data import DeviceData
from edge_client.errors import TaskError
from edge_client.training import TrainConfig, TrainHook, train_local
from models import StateMismatchError, load_state_arrays, state_arrays, state_shapes

__all__ = [
    "GLOBAL_SET",
    "WEIGHTS_SET",
    "DeviceStrategy",
    "FedAvg",
    "FedAvgOCA",
    "FedProx",
    "LocalResult",
    "LocalTask",
    "ProximalHook",
    "device_strategy",
    "local_update",
    "strategy_names",
    "validate_task",
]

logger = logging.getLogger(__name__)

Arrays = dict[str, npt.NDArray[Any]]
GLOBAL_SET = "global"
"""Name of the received tensor set holding the global model's full state."""
WEIGHTS_SET = "weights"
"""Name of the uploaded tensor set holding the trained model's full state."""


@dataclass(frozen=True)
class LocalTask:
    """What a device is asked to do in one round, decoded from the wire."""

    strategy: str
    """Registry name of the strategy (see :func:`strategy_names`)."""
    hyperparameters: Mapping[str, object] = field(default_factory=dict)
    """Training hyperparameters (see :class:`edge_client.training.TrainConfig`)."""
    sets: Mapping[str, Mapping[str, npt.NDArray[Any]]] = field(default_factory=dict)
    """Received tensor sets by name (e.g. ``"global"``), each name -> array. Empty: train
    the model as it is (a task without a model message)."""


@dataclass(frozen=True)
class LocalResult:
    """What a device uploads after one round, before encoding."""

    sets: dict[str, Arrays]
    """Tensor sets to upload by name (``"weights"``: the trained full state)."""
    num_samples: int
    """Local train samples the update was trained on."""
    metrics: dict[str, float]
    """Training metrics: ``loss`` (mean cross-entropy), ``accuracy`` (fraction)."""
    timings: dict[str, float]
    """Seconds per phase: ``load_s`` (weights into the model), ``train_s``."""
    steps: int = 0
    """Optimizer steps taken."""


class ProximalHook(TrainHook):
    """FedProx: adds ``mu / 2 * sum ||w - w_global||^2`` over the trainable parameters.

    ``w_global`` is a copy of the parameters taken in :meth:`before_training` (after the
    global weights were loaded).
    """

    def __init__(self, mu: float) -> None:
        if not mu >= 0:
            raise ValueError(f"mu must be >= 0, got {mu}")
        self.mu = mu
        self._anchor: list[tuple[nn.Parameter, torch.Tensor]] = []

    def before_training(self, model: nn.Module) -> None:
        self._anchor = [(p, p.detach().clone()) for p in model.parameters() if p.requires_grad]

    def extra_loss(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor
    ) -> torch.Tensor | None:
        if self.mu == 0 or not self._anchor:
            return None
        total = torch.stack([(p - anchor).pow(2).sum() for p, anchor in self._anchor]).sum()
        return 0.5 * self.mu * total


class DeviceStrategy(ABC):
    """The device side of one strategy: which sets it needs and how it trains.

    Subclasses set :attr:`name` and override :meth:`hooks`; strategies that need more
    than hooks (several received models, generators) override :meth:`run`.
    """

    name: ClassVar[str]
    """Registry name, as round tasks carry it."""
    payloads: ClassVar[tuple[str, ...]] = (GLOBAL_SET,)
    """Received sets :meth:`run` uses (each must match the model's full state)."""

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
        """Load the received global weights (if any), train with :meth:`hooks` and then
        ``extra_hooks``, return the new full state as the ``"weights"`` set.

        Raises:
            TaskError: the received weights do not fit the model (it is then unchanged).
        """
        start = time.perf_counter()
        received = task.sets.get(GLOBAL_SET)
        if received is not None:
            try:
                load_state_arrays(model, received)
            except StateMismatchError as exc:
                raise TaskError(
                    f"received set {GLOBAL_SET!r} does not fit the model: {exc}"
                ) from exc
        load_s = time.perf_counter() - start
        hooks = (*self.hooks(model, config, state), *extra_hooks)
        result = train_local(model, data.x, data.y, config, hooks, device=device)
        return LocalResult(
            sets={WEIGHTS_SET: state_arrays(model)},
            num_samples=result.num_samples,
            metrics={"loss": result.loss, "accuracy": result.accuracy},
            timings={"load_s": load_s, "train_s": result.seconds},
            steps=result.steps,
        )


class FedAvg(DeviceStrategy):
    """FedAvg: plain local SGD from the global weights."""

    name = "fedavg"


class FedAvgOCA(FedAvg):
    """FedAvg (OCA): devices train as in FedAvg; the server aggregates over its cache."""

    name = "fedavg_oca"


class FedProx(DeviceStrategy):
    """FedProx: local SGD with a proximal term of weight ``mu`` to the global weights."""

    name = "fedprox"

    def hooks(
        self, model: nn.Module, config: TrainConfig, state: MutableMapping[str, Any]
    ) -> tuple[TrainHook, ...]:
        return (ProximalHook(config.mu),)


_STRATEGIES: Mapping[str, DeviceStrategy] = MappingProxyType(
    {cls.name: cls() for cls in (FedAvg, FedAvgOCA, FedProx)}
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


def validate_task(model: nn.Module, task: LocalTask) -> TrainConfig:
    """Check that ``task`` can run on ``model`` without touching either.

    Checks the strategy name, the hyperparameters and, when sets were received, that
    the strategy's sets are there with exactly the model's tensor names and shapes.

    Returns:
        The validated training config.

    Raises:
        TaskError: naming what is wrong.
    """
    strategy = device_strategy(task.strategy)
    config = TrainConfig.from_hyperparameters(task.hyperparameters)
    if not task.sets:
        return config
    expected = state_shapes(model)
    for name in strategy.payloads:
        arrays = task.sets.get(name)
        if arrays is None:
            raise TaskError(
                f"strategy {strategy.name!r} needs the set {name!r}; got {sorted(task.sets)}"
            )
        got = {key: tuple(np.shape(value)) for key, value in arrays.items()}
        if got != expected:
            missing = sorted(set(expected) - set(got))[:4]
            unexpected = sorted(set(got) - set(expected))[:4]
            wrong = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])[:4]
            raise TaskError(
                f"set {name!r} does not fit the model: missing {missing}, unexpected "
                f"{unexpected}, wrong shape {wrong}"
            )
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

    Loads the received global weights into ``model`` (all or nothing), trains it in
    place with the strategy's hooks and returns its new full state.

    Args:
        model: the device's classifier (updated in place).
        data: the device's local data (its train part is used).
        task: strategy, hyperparameters and received sets.
        state: the device's persistent learning state across rounds (strategies that
            keep some, such as generators, store it here; unused by fedavg, fedprox and
            fedavg_oca). None: a fresh, throw-away dict.
        hooks: hooks of the caller, run after the strategy's own (the runtime cancels
            training with one when it stops).
        device: where to train.

    Raises:
        TaskError: unknown strategy, invalid hyperparameters, missing or mismatched
            received sets; raised before training, the model unchanged.
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
