"""A device's round as data: the task it gets (:class:`LocalTask`) and what it uploads
(:class:`LocalResult`), before encoding and after decoding.

Pure: numpy / torch in, numpy out; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy.typing as npt
from torch import nn

from models import StateSubset, state_arrays
from protocol.sets import WEIGHTS_SET

__all__ = ["Arrays", "LocalResult", "LocalTask", "ReceivedSets", "UploadSubset", "local_result"]

Arrays = dict[str, npt.NDArray[Any]]
"""One tensor set: tensor name -> array."""
ReceivedSets = Mapping[str, Mapping[str, npt.NDArray[Any]]]
"""Received tensor sets: set name -> tensor name -> array."""
UploadSubset = Literal["all", "head"]
"""What a device uploads: its full state, or only its classifier head."""


@dataclass(frozen=True)
class LocalTask:
    """What a device is asked to do in one round, decoded from the wire."""

    strategy: str
    """Registry name of the strategy (see
    :func:`edge_client.train.strategies.strategy_names`)."""
    hyperparameters: Mapping[str, object] = field(default_factory=dict)
    """Training hyperparameters: the task's map, in the schema of
    :class:`protocol.hyperparams.Hyperparameters` (validated as
    :class:`edge_client.train.training.TrainConfig`)."""
    sets: ReceivedSets = field(default_factory=dict)
    """Received tensor sets by name (e.g. ``"global"``), each name -> array. Empty: train
    the model as it is (a task without a model message)."""
    upload: UploadSubset = "all"
    """What to upload as the ``"weights"`` set (the task's uplink subset): the full
    state, or (fedavg and fedgen only) the head alone."""


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
