"""The trainer seam: the session's jobs in, their results out.

A :class:`Trainer` runs the :class:`~edge_client.train.session.DecodeJob` and
:class:`~edge_client.train.session.TrainJob` a
:class:`~edge_client.train.session.DeviceSession` asks for and returns what came of
them; it never raises for a job that goes wrong. :class:`LocalTrainer` is the per-device
one (:func:`~edge_client.train.local_update.local_update` on the device's model and data,
the transfers through a :class:`~edge_client.train.transfer.TransferState`); the threaded
edge client runs it on its worker thread, the sim's budget tool inline. Its learning
state (what strategies keep across rounds) is persisted with the model by the device's
shell and given back at a restart (:func:`resumed_learning_state`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal, Protocol

import numpy as np
import torch
from torch import nn

from edge_client.config import ClientConfig
from edge_client.errors import ConfigError, TaskError
from edge_client.train.client_state import LEARNING_STATE_FILE, SavedLearningState
from edge_client.train.data import DeviceData
from edge_client.train.exchange import (
    Cancelled,
    Decoded,
    DecodeJob,
    Failed,
    Job,
    JobResult,
    NeedsBase,
    Rejected,
    Trained,
    TrainJob,
)
from edge_client.train.hello import ModelDescription
from edge_client.train.local_update import local_update, validate_task
from edge_client.train.strategies import restore_learning_state
from edge_client.train.task import LocalResult, LocalTask
from edge_client.train.training import TrainHook
from edge_client.train.transfer import TransferState
from models import Classifier, ModelError, build_classifier, seeded
from protocol.deltas import UnknownBaseError
from protocol.errors import DecodeError
from protocol.sets import WEIGHTS_SET
from protocol.tensors import Precision

__all__ = [
    "CancelHook",
    "LocalTrainer",
    "Trainer",
    "build_device_model",
    "describe_model",
    "resumed_learning_state",
]

logger = logging.getLogger(__name__)


class Trainer(Protocol):
    """Runs one job at a time; never raises for a job that goes wrong."""

    def run(self, job: Job) -> JobResult: ...

    def commit_upload(self) -> None:
        """The update of the last :class:`TrainJob` was sent: keep its uplink residual."""


class _StopTrainingError(Exception):
    """Raised by :class:`CancelHook` to end training."""


class CancelHook(TrainHook):
    """Stops training after the current step once ``should_stop()`` is true."""

    def __init__(self, should_stop: Callable[[], bool]) -> None:
        self._should_stop = should_stop

    def after_step(self, model: nn.Module) -> None:
        if self._should_stop():
            raise _StopTrainingError


def build_device_model(config: ClientConfig, data: DeviceData) -> Classifier:
    """The classifier ``config.model`` for ``data`` (its classes and the shape of its
    samples), initialized from ``config.init_seed`` (the global RNG is left as it was).

    Raises:
        ConfigError: the model does not take the data's samples (a built-in classifier
            takes square images), or its name or options are invalid for the data.
    """
    try:
        with seeded(config.init_seed):
            return build_classifier(
                config.model, num_classes=data.num_classes, input_shape=data.sample_shape
            )
    except ModelError as exc:
        raise ConfigError(f"cannot build model {config.model!r} for the data: {exc}") from exc


def describe_model(model: Classifier) -> ModelDescription:
    """What the device's hello says of ``model`` beside its fingerprint: its input
    shape, classes and tensors (the names and shapes its fingerprint is computed from)."""
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    return ModelDescription.of(model.input_shape, model.num_classes, shapes)


def resumed_learning_state(
    saved: SavedLearningState, model: Classifier, device: torch.device
) -> dict[str, Any]:
    """The learning state a device saved with its model, restored for ``model`` on
    ``device``; empty (it starts fresh), with one warning, when it does not fit."""
    try:
        return restore_learning_state(saved.entries, model, device)
    except ValueError as exc:  # StateMismatchError and ValidationError too
        logger.warning("ignored the saved learning state %s: %s", LEARNING_STATE_FILE, exc)
        return {}


class LocalTrainer:
    """Runs jobs with :func:`local_update` on ``model`` and ``data``.

    Args:
        model: the device's classifier, trained in place.
        data: the device's local data.
        transfer: the held model and uplink residual.
        hooks: training hooks (e.g. a :class:`CancelHook`).
        gate: a context manager held while training; None: no gate.
        device: where to train.
        learning_state: the device's learning state across rounds, kept (not copied)
            and updated by training (a resumed device's, see
            :func:`resumed_learning_state`); None: it starts empty.
    """

    def __init__(
        self,
        model: Classifier,
        data: DeviceData,
        transfer: TransferState,
        *,
        hooks: Sequence[TrainHook] = (),
        gate: AbstractContextManager[object] | None = None,
        device: torch.device = torch.device("cpu"),  # noqa: B008
        learning_state: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.data = data
        self.transfer = transfer
        self._hooks = tuple(hooks)
        self._gate = gate
        self._device = device
        self._learning_state: dict[str, Any] = {} if learning_state is None else learning_state

    def run(self, job: Job) -> JobResult:
        if isinstance(job, DecodeJob):
            return self._decode(job)
        return self._train(job)

    def commit_upload(self) -> None:
        self.transfer.commit_upload()

    def _decode(self, job: DecodeJob) -> JobResult:
        task_id = job.message.message_id
        start = time.perf_counter()
        try:
            local = self._local_task(job)
            validate_task(self.model, local)
        except UnknownBaseError as exc:
            return NeedsBase(task_id, str(exc), self.transfer.held_fingerprint)
        except TaskError as exc:
            return Rejected(task_id, str(exc))
        decode_s = time.perf_counter() - start
        return Decoded(task_id, local, decode_s, self.transfer.held_fingerprint)

    def _local_task(self, job: DecodeJob) -> LocalTask:
        """Decode the job's sets into a :class:`LocalTask`.

        Raises:
            UnknownBaseError: a set is a delta against a model this device does not hold.
            TaskError: a named payload is missing or does not decode, or the upload asked
                for is not supported.
        """
        arrays: dict[str, dict[str, np.ndarray]] = {}
        if job.task.model_message is not None:
            names = job.task.payloads or tuple(job.sets)
            try:
                lossy = job.task.downlink_precision is not Precision.FP32
                lossy = lossy or job.task.uplink.mode == "delta"
                arrays = self.transfer.decode(job.sets, names, hold=lossy)
            except UnknownBaseError:
                raise
            except DecodeError as exc:
                raise TaskError(f"cannot decode the model message: {exc}") from exc
        uplink = job.task.uplink
        if uplink.mode not in ("full", "delta") or uplink.subset not in ("all", "head"):
            raise TaskError(
                f"upload mode {uplink.mode!r} / subset {uplink.subset!r} is not supported "
                "by this client (full or delta uploads of all tensors or of the head)"
            )
        upload: Literal["all", "head"] = "head" if uplink.subset == "head" else "all"
        return LocalTask(job.task.strategy, dict(job.task.hyperparameters), arrays, upload)

    @property
    def learning_state(self) -> dict[str, Any]:
        """The device's learning state across rounds (FedKF's generator lives here),
        persisted with the model."""
        return self._learning_state

    def _train(self, job: TrainJob) -> JobResult:
        task_id = job.message.message_id
        try:
            with self._gate if self._gate is not None else contextlib.nullcontext():
                result = local_update(
                    self.model,
                    self.data,
                    job.local,
                    self._learning_state,
                    hooks=self._hooks,
                    device=self._device,
                )
        except _StopTrainingError:
            return Cancelled(task_id)
        except Exception as exc:  # a training failure must not stop the device
            return Failed(task_id, exc)
        return self.finish(job, result)

    def finish(self, job: TrainJob, result: LocalResult) -> JobResult:
        """Encode the upload of ``job`` from its training ``result`` (the residual of a
        lossy uplink is kept until :meth:`commit_upload`); :class:`Failed` if encoding
        raises. The sim's batched engine trains many devices at once and finishes each
        with its own trainer here."""
        task_id = job.message.message_id
        try:
            start = time.perf_counter()
            weights = self.transfer.encode_upload(
                result.sets[WEIGHTS_SET], job.task.uplink, job.local.sets, commit=False
            )
            timings = {"decode_s": job.decode_s, **result.timings}
            timings["encode_s"] = time.perf_counter() - start
        except Exception as exc:  # an encoding failure must not stop the device
            return Failed(task_id, exc)
        return Trained(task_id, result.num_samples, weights, result.metrics, timings)
