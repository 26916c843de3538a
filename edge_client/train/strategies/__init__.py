"""The device side of each strategy, one module per strategy, and their registry.

A round task names a strategy; :func:`device_strategy` looks it up (never string
matching elsewhere) and :func:`edge_client.train.local_update.local_update` runs it.
Each module holds one strategy's device side: its :class:`~.strategy.DeviceStrategy`
(the sets it takes, how it loads them, its training hooks) and, where it adds to the
loss, the hook's batched form (:class:`~edge_client.train.batched.BatchedHook`) that the
sim's batched engine runs. A new strategy is its module here plus an entry in
:data:`_STRATEGIES` (and its server side in the coordinator).

================  ===============  ============================================================
name              module           device side
================  ===============  ============================================================
``fedavg``        ``fedavg``       plain local SGD from the global weights (full or head-only
                                   sharing)
``fedprox``       ``fedprox``      local SGD plus ``mu / 2 * ||w - w_global||^2`` over the
                                   trainable parameters (``w_global``: the weights received
                                   this round)
``fedavg_oca``    ``fedavg_oca``   as ``fedavg`` (the "FedAvg (OCA)" variant differs on the
                                   server only)
``feddf``         ``feddf``        as ``fedavg`` (FedDF fuses the models by distillation on the
                                   server)
``dense``         ``dense``        as ``fedavg``, once (DENSE is one-shot: the server distils
                                   the uploads into a fresh model on generated images)
``fedkf``         ``fedkf``        the student learns CE plus ``gamma * KL(teacher ||
                                   student)`` on samples of a local image generator
``fedgen``        ``fedgen``       CE plus ``alpha * CE(head(G(eps, y)), y)`` with the
                                   coordinator's latent generator; full or head-only sharing
================  ===============  ============================================================

Received tensor sets, by name (each strategy declares those it understands with
:meth:`~.strategy.DeviceStrategy.expected_sets`; anything else is a :class:`TaskError`):

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

fedavg and fedgen need exactly one of ``"global"`` and ``"head"``. A task without sets
trains the model as it is. The upload
(:attr:`~edge_client.train.task.LocalTask.upload`) is the full state or, for fedavg and
fedgen, the head alone.

What a strategy keeps in the device's learning state across rounds (the ``state`` of
:meth:`~.strategy.DeviceStrategy.prepare`) is persisted with the device's model:
:func:`learning_state_entries` turns it into what
:class:`~edge_client.train.client_state.DeviceStore` writes, :func:`restore_learning_state`
turns that back. Only FedKF keeps anything (its image generator and its Adam state,
:data:`~.fedkf.GENERATOR_STATE_KEY`); the other strategies start every round from the
received sets, the device's model and the round's seed alone. A new piece of learning
state is its key in :data:`_PERSISTED`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from edge_client.errors import TaskError
from edge_client.train.client_state import LearningStateEntry
from edge_client.train.strategies.dense import Dense, OneShot
from edge_client.train.strategies.fedavg import FedAvg
from edge_client.train.strategies.fedavg_oca import FedAvgOCA
from edge_client.train.strategies.feddf import FedDF
from edge_client.train.strategies.fedgen import FedGen
from edge_client.train.strategies.fedkf import GENERATOR_STATE_KEY, FedKF, LocalGenerator
from edge_client.train.strategies.fedprox import FedProx
from edge_client.train.strategies.strategy import DeviceStrategy
from models import Classifier

__all__ = ["device_strategy", "learning_state_entries", "restore_learning_state", "strategy_names"]

_STRATEGIES: Mapping[str, DeviceStrategy] = MappingProxyType(
    {cls.name: cls() for cls in (FedAvg, FedAvgOCA, FedDF, Dense, OneShot, FedProx, FedKF, FedGen)}
)
"""The registry: name -> the strategy's device side."""


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


_PERSISTED: Mapping[str, type[LocalGenerator]] = MappingProxyType(
    {GENERATOR_STATE_KEY: LocalGenerator}
)
"""Every key of the learning state and the type of what it holds, which stores itself
(``entry()``) and is restored from what it stored (``from_entry(entry, model, device)``)."""


def learning_state_entries(state: Mapping[str, Any]) -> dict[str, LearningStateEntry]:
    """The device's learning ``state`` as its store keeps it, by key.

    Raises:
        TypeError: a key, or the type of what it holds, is not in :data:`_PERSISTED` (a
            strategy keeps state that would not survive a restart).
    """
    entries = {}
    for key, value in state.items():
        kind = _PERSISTED.get(key)
        if kind is None or not isinstance(value, kind):
            raise TypeError(
                f"the learning state {key!r} ({type(value).__name__}) has no stored form"
            )
        entries[key] = value.entry()
    return entries


def restore_learning_state(
    entries: Mapping[str, LearningStateEntry], model: Classifier, device: torch.device
) -> dict[str, Any]:
    """The learning state stored as ``entries``, for ``model``, on ``device``.

    Raises:
        ValueError: a key is unknown, or an entry does not fit ``model`` or is damaged.
    """
    state: dict[str, Any] = {}
    for key, entry in entries.items():
        if key not in _PERSISTED:
            raise ValueError(f"unknown learning state {key!r}; known: {sorted(_PERSISTED)}")
        state[key] = _PERSISTED[key].from_entry(entry, model, device)
    return state
