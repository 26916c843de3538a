"""The trainer seam of the fleet driver: the jobs of many devices in, their results out.

A :class:`FleetTrainer` runs the :class:`~edge_client.train.session.DecodeJob` and
:class:`~edge_client.train.session.TrainJob` the emulated devices' sessions ask for, many
devices at a time, and answers each with the result a device's own
:class:`~edge_client.train.trainer.LocalTrainer` would give. :class:`LoopTrainer` is the
per-device reference path: one ``LocalTrainer`` per device, the jobs one after another. A
batched engine (many devices at once) implements the same protocol and is checked
against it.

A trainer is built by a :data:`TrainerFactory` from the fleet's :class:`FleetDevice`
list: each device's configuration, data and :class:`TransferState` (the model it holds
and its uplink residual), the model a resumed device saved and the learning state saved
with it, and the device's learning state (which its shell persists with the model).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy.typing as npt
import torch

from edge_client.config import ClientConfig
from edge_client.train.client_state import SavedLearningState
from edge_client.train.data import DeviceData
from edge_client.train.exchange import Cancelled, Failed, Job, JobResult
from edge_client.train.trainer import (
    CancelHook,
    LocalTrainer,
    build_device_model,
    resumed_learning_state,
)
from edge_client.train.transfer import TransferState
from models import Classifier, ModelError, load_state_arrays

__all__ = ["FleetDevice", "FleetTrainer", "LoopTrainer", "TrainerFactory", "WrappedTrainer"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FleetDevice:
    """One emulated device as its trainer sees it."""

    config: ClientConfig
    """The device's configuration: id, model name, init seed, precisions, state dir."""
    data: DeviceData
    """Its local data."""
    transfer: TransferState
    """The model it holds and its uplink residual (kept in ``config.state_dir`` if set)."""
    saved_model: Mapping[str, npt.NDArray[Any]] | None = None
    """The model a resumed device saved after its last training; it starts from it."""
    saved_learning_state: SavedLearningState | None = None
    """The learning state saved with ``saved_model``; it starts from it too."""
    learning_state: dict[str, Any] = field(default_factory=dict)
    """The device's learning state across rounds: its trainer's, its shell persists it."""


class FleetTrainer(Protocol):
    """Runs the jobs of many devices; never raises for a job that goes wrong.

    The fleet driver calls :meth:`run_many` on its trainer thread, one call at a time,
    with at most one job per device. :meth:`commit_upload` and :meth:`model` are called
    from other threads (the driver's event thread, the sim's evaluation), possibly while
    :meth:`run_many` runs; :meth:`commit_upload` never for a device with a job in that
    call. A trainer may also have a ``close()`` method: the driver calls it when it
    stops, and jobs not yet run should then answer
    :class:`~edge_client.train.session.Cancelled`.
    """

    def run_many(self, jobs: Sequence[tuple[str, Job]]) -> list[JobResult]:
        """The result of each ``(device_id, job)``, in the same order."""
        ...

    def commit_upload(self, device_id: str) -> None:
        """The update of the device's last :class:`TrainJob` was sent: keep its uplink
        residual (error feedback)."""
        ...

    def model(self, device_id: str) -> Classifier:
        """The device's classifier, with the weights of its last training."""
        ...


TrainerFactory = Callable[[Sequence[FleetDevice]], FleetTrainer]
"""Builds the trainer of a fleet from its devices."""


class WrappedTrainer:
    """A :class:`FleetTrainer` around another: every call passes through to ``inner``
    (its ``close()`` too, where it has one); subclasses change :meth:`run_many`."""

    def __init__(self, inner: FleetTrainer) -> None:
        self._inner = inner

    def run_many(self, jobs: Sequence[tuple[str, Job]]) -> list[JobResult]:
        return self._inner.run_many(jobs)

    def commit_upload(self, device_id: str) -> None:
        self._inner.commit_upload(device_id)

    def model(self, device_id: str) -> Classifier:
        return self._inner.model(device_id)

    def close(self) -> None:
        close = getattr(self._inner, "close", None)
        if close is not None:
            close()


class LoopTrainer:
    """The per-device reference :class:`FleetTrainer`: one :class:`LocalTrainer` per
    device, on the device's own model, data and transfer state, jobs one after another.

    A device's model is built when it is first needed (its first job, or :meth:`model`),
    from ``init_seed`` as on a device, so a fleet whose devices mostly sit out a round
    does not hold a model for each of them.

    Args:
        devices: the fleet's devices.
        device: where to train.
    """

    def __init__(
        self,
        devices: Sequence[FleetDevice],
        *,
        device: torch.device = torch.device("cpu"),  # noqa: B008
    ) -> None:
        self._devices = {d.config.device_id: d for d in devices}
        self._device = device
        self._trainers: dict[str, LocalTrainer] = {}
        self._lock = threading.Lock()  # guards building a device's trainer
        self._closed = threading.Event()

    def run_many(self, jobs: Sequence[tuple[str, Job]]) -> list[JobResult]:
        results: list[JobResult] = []
        for device_id, job in jobs:
            task_id = job.message.message_id
            if self._closed.is_set():
                results.append(Cancelled(task_id))
                continue
            try:
                result = self.trainer(device_id).run(job)
            except Exception as exc:  # a bug or an unknown device: this job fails, not all
                logger.exception("device %s: task %s failed unexpectedly", device_id, task_id)
                result = Failed(task_id, exc)
            results.append(result)
        return results

    def commit_upload(self, device_id: str) -> None:
        self.trainer(device_id).commit_upload()

    def model(self, device_id: str) -> Classifier:
        model: Classifier = self.trainer(device_id).model
        return model

    def close(self) -> None:
        """Stop: the training under way ends after its current step (``Cancelled``), and
        so do the jobs not yet run."""
        self._closed.set()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed.is_set()

    def trainer(self, device_id: str) -> LocalTrainer:
        """The device's trainer, built on first use.

        Raises:
            KeyError: not a device of this fleet.
            ConfigError: its model cannot be built for its data.
        """
        with self._lock:
            trainer = self._trainers.get(device_id)
            if trainer is not None:
                return trainer
            spec = self._devices[device_id]
            model = build_device_model(spec.config, spec.data)
            resumed = spec.saved_model is not None and _resume(model, spec.saved_model, device_id)
            if resumed and spec.saved_learning_state is not None:
                saved = spec.saved_learning_state
                spec.learning_state.update(resumed_learning_state(saved, model, self._device))
            trainer = LocalTrainer(
                model,
                spec.data,
                spec.transfer,
                hooks=(CancelHook(self._closed.is_set),),
                device=self._device,
                learning_state=spec.learning_state,
            )
            self._trainers[device_id] = trainer
            return trainer


def _resume(model: Classifier, arrays: Mapping[str, npt.NDArray[Any]], device_id: str) -> bool:
    """Load a resumed device's saved weights into ``model``, if they fit; whether they
    did."""
    try:
        load_state_arrays(model, arrays)
    except (ValueError, ModelError) as exc:
        logger.warning("device %s: ignored its saved model: %s", device_id, exc)
        return False
    return True
