"""The one local update: a device's round, whatever its strategy.

:func:`local_update` validates the round's task (:func:`validate_task`), looks its
strategy up in the registry (:func:`edge_client.train.strategies.device_strategy`), lets
the strategy load the received tensor sets into the model and build its training hooks,
trains with :func:`edge_client.train.training.train_local` (:func:`train_prepared`) and
returns the new weights. Real devices (through
:class:`edge_client.train.runtime.EdgeClient`) and the simulator call this very function;
the sim's batched engine shares :func:`validate_task` and :func:`train_prepared` with it.

Pure: numpy / torch in, numpy out; no I/O, no global state.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from edge_client.errors import TaskError
from edge_client.train.binary import BinarizeHook
from edge_client.train.data import DeviceData
from edge_client.train.qat import FakeQuantHook
from edge_client.train.strategies import device_strategy
from edge_client.train.strategies.strategy import SetSpec
from edge_client.train.task import LocalResult, LocalTask, local_result
from edge_client.train.training import TrainConfig, TrainHook, train_local

__all__ = ["local_update", "train_prepared", "validate_task"]


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
    """Train a prepared model (see
    :meth:`~edge_client.train.strategies.strategy.DeviceStrategy.prepare`) with the
    strategy's hooks ``own``, then the weight format's hook (:func:`_format_hooks`), then
    ``extra_hooks``; the per-device reference path.

    Args:
        load_s: seconds the preparation took (reported as ``timings["load_s"]``).

    Raises:
        Whatever a hook raises (training stops there).
    """
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
    strategy's own checks
    (:meth:`~edge_client.train.strategies.strategy.DeviceStrategy.check_sets`).

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
    start = time.perf_counter()
    own = strategy.prepare(model, task.sets, config, learning_state)
    load_s = time.perf_counter() - start
    return train_prepared(
        model, data, task, config, own, load_s=load_s, device=device, extra_hooks=hooks
    )
