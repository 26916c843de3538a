"""The server strategies by name: :func:`build_strategy` makes the one a run names.

Adding a strategy: its file in this package (the class, its server step, its defaults;
its own fleet settings, if any, in a light ``NAME_settings.py`` mixed into
:class:`~coordinator.config.FleetSettings`), an entry in :data:`STRATEGIES`, its device
side in ``edge_client``, and tests.
"""

from __future__ import annotations

from collections.abc import Mapping

from coordinator.config import CoordinatorConfig
from coordinator.errors import ConfigError
from coordinator.strategies.base import Strategy
from coordinator.strategies.dense import Dense
from coordinator.strategies.fedavg import FedAvg
from coordinator.strategies.fedavg_oca import FedAvgOca
from coordinator.strategies.feddf import FedDF
from coordinator.strategies.fedgen import FedGen
from coordinator.strategies.fedkf import FedKF
from coordinator.strategies.fedprox import FedProx
from coordinator.strategies.oneshot import OneShot
from models import Classifier

__all__ = ["STRATEGIES", "build_strategy", "strategy_names"]

STRATEGIES: Mapping[str, type[Strategy]] = {
    cls.name: cls for cls in (FedAvg, FedProx, FedAvgOca, FedKF, FedGen, FedDF, Dense, OneShot)
}
"""Every server strategy, by its registry name (the ``strategy`` setting)."""


def strategy_names() -> tuple[str, ...]:
    """Names accepted by :func:`build_strategy`."""
    return tuple(STRATEGIES)


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
        factory = STRATEGIES[config.strategy]
    except KeyError:
        raise ConfigError(
            f"unknown strategy {config.strategy!r}; choose one of {', '.join(strategy_names())}"
        ) from None
    return factory(config, templates)
