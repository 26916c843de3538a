"""Server-side strategies, chosen by name from a registry.

A :class:`Strategy` says what the coordinator sends each selected device (tensor sets and
hyperparameters), how it turns a round's accepted updates into the next global model,
and which global models it keeps: ``aca`` (the model of the round's active devices)
always, ``oca`` (the sample-weighted average of every device's latest model, the FedKF
paper's T1) when :attr:`Strategy.uses_oca` is set. The round engine does the rest;
strategies never touch the transport or the store.

=============  ===================================================================
name           server side
=============  ===================================================================
fedavg         ACA = sample-weighted average of the round's on-time updates
fedprox        as fedavg; devices add (mu/2)*||w - w_global||^2 (mu in the task)
fedavg_oca     as fedavg, plus the OCA model over every device's latest update
=============  ===================================================================
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import numpy.typing as npt

from coordinator.aggregate import WeightedSum
from coordinator.config import TrainingSettings
from coordinator.errors import ConfigError

__all__ = ["FedAvg", "FedAvgOca", "FedProx", "Strategy", "build_strategy", "strategy_names"]

Array = npt.NDArray[Any]
Arrays = Mapping[str, Array]
Scalar = bool | int | float | str

UPDATE_SET = "weights"
"""Name of the tensor set a device's update carries (all weights, fp32)."""
GLOBAL_SET = "global"
"""Name of the tensor set with the global model in a round's model message."""


class Strategy(abc.ABC):
    """The server side of one federated algorithm."""

    name: ClassVar[str]
    uses_oca: ClassVar[bool] = False
    """Keep an OCA cache (every device's latest update) and an ``oca`` global model."""

    def __init__(self, training: TrainingSettings) -> None:
        self.training = training

    def hyperparameters(self) -> dict[str, Scalar]:
        """What the task tells a device to do (the device adds nothing of its own)."""
        t = self.training
        return {
            "local_epochs": t.local_epochs,
            "local_steps": t.local_steps,
            "batch_size": t.batch_size,
            "lr": t.lr,
            "momentum": t.momentum,
            "weight_decay": t.weight_decay,
        }

    def downlink(self, models: Mapping[str, Arrays]) -> dict[str, Arrays]:
        """Tensor sets to send each selected device, by set name."""
        return {GLOBAL_SET: models["aca"]}

    @abc.abstractmethod
    def aggregate(
        self, current: Mapping[str, Arrays], updates: Iterable[tuple[Arrays, int]]
    ) -> Arrays:
        """The next ACA model from this round's on-time updates ``(weights, num_samples)``.

        ``updates`` is an iterator that loads one update at a time; keep memory O(model).
        Raises ValueError when there is nothing to aggregate.
        """


class FedAvg(Strategy):
    """FedAvg (McMahan et al., 2017): the sample-weighted average of the updates."""

    name = "fedavg"

    def aggregate(
        self, current: Mapping[str, Arrays], updates: Iterable[tuple[Arrays, int]]
    ) -> Arrays:
        acc = WeightedSum()
        for weights, num_samples in updates:
            acc.add(weights, num_samples)
        return acc.mean()


class FedProx(FedAvg):
    """FedProx (Li et al., 2020): FedAvg aggregation; devices get the proximal weight mu."""

    name = "fedprox"

    def hyperparameters(self) -> dict[str, Scalar]:
        return {**super().hyperparameters(), "mu": self.training.mu}


class FedAvgOca(FedAvg):
    """FedAvg (OCA), the FedKF paper's T1 alone: FedAvg training plus the OCA model."""

    name = "fedavg_oca"
    uses_oca = True


_REGISTRY: dict[str, Callable[[TrainingSettings], Strategy]] = {
    cls.name: cls for cls in (FedAvg, FedProx, FedAvgOca)
}


def strategy_names() -> tuple[str, ...]:
    """Names accepted by :func:`build_strategy`."""
    return tuple(_REGISTRY)


def build_strategy(name: str, training: TrainingSettings) -> Strategy:
    """The strategy registered as ``name``.

    Raises:
        ConfigError: unknown name (the message lists the known ones).
    """
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"unknown strategy {name!r}; choose one of {', '.join(strategy_names())}"
        ) from None
    return factory(training)
