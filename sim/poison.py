"""Attack emulation, for measuring defences in the lab: poisoned devices of the sim.

**This is an attack, emulated on purpose** (``python -m sim --poisoned FRACTION``). A
share of the emulated devices, drawn with the run's seed, train as usual and then
replace the weights they upload:

=============  ======================================================================
``constant``   every floating weight set to ``poison_scale`` (3.0 by default: the
               update an impersonated device once got aggregated, after which the
               model was all 3.0 and the next training loss 3.8e16)
``sign_flip``  the model received minus ``poison_scale`` times the device's honest
               delta: ``w0 - s * (w - w0)``, pulling the model back up its gradient
=============  ======================================================================

A poisoned upload is a full fp32 set (an attacker chooses its own encoding; a delta
upload is first reconstructed against the model the device received). Everything
else the device does (hello, sample counts, timing) is honest. The coordinator's
defences are :mod:`coordinator.screening` and robust aggregation
(:mod:`coordinator.averaging`); ``benchmarks/poisoning.py`` measures them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from edge_client.train.exchange import Job, JobResult, Trained, TrainJob
from protocol.deltas import apply_delta_set, encode_full
from protocol.tensors import Precision
from sim.fleet import FleetTrainer, WrappedTrainer

__all__ = ["PoisonKind", "PoisoningTrainer", "poison_weights", "poisoned_devices"]

log = logging.getLogger(__name__)

Array = npt.NDArray[Any]
PoisonKind = Literal["constant", "sign_flip"]


def poisoned_devices(device_ids: Sequence[str], fraction: float, seed: int) -> frozenset[str]:
    """The ``round(fraction * K)`` devices (of ``K``) that poison, drawn with ``seed``."""
    count = int(np.floor(fraction * len(device_ids) + 0.5))
    if count == 0:
        return frozenset()
    rng = np.random.default_rng([seed, 0x9015])
    return frozenset(str(d) for d in rng.choice(list(device_ids), size=count, replace=False))


def poison_weights(
    kind: PoisonKind, scale: float, trained: Mapping[str, Array], received: Mapping[str, Array]
) -> dict[str, Array]:
    """The weights a poisoned device uploads instead of ``trained`` (integer tensors,
    such as counters, stay as trained)."""
    out: dict[str, Array] = {}
    for name, value in trained.items():
        if value.dtype.kind != "f":
            out[name] = value
        elif kind == "constant":
            out[name] = np.full_like(value, scale, dtype=np.float32)
        else:
            base = np.asarray(received[name], np.float32)
            out[name] = (base - scale * (value.astype(np.float32) - base)).astype(np.float32)
    return out


class PoisoningTrainer(WrappedTrainer):
    """A :class:`~sim.fleet.FleetTrainer` whose ``poisoned`` devices replace their
    uploads (:func:`poison_weights`); the others', and every other job, pass through."""

    def __init__(
        self, inner: FleetTrainer, poisoned: frozenset[str], kind: PoisonKind, scale: float
    ) -> None:
        super().__init__(inner)
        self.poisoned = poisoned
        self._kind: PoisonKind = kind
        self._scale = scale

    def run_many(self, jobs: Sequence[tuple[str, Job]]) -> list[JobResult]:
        results = self._inner.run_many(jobs)
        out: list[JobResult] = []
        for (device_id, job), result in zip(jobs, results, strict=True):
            if device_id in self.poisoned and isinstance(result, Trained):
                assert isinstance(job, TrainJob)
                out.append(self._poison(device_id, job, result))
            else:
                out.append(result)
        return out

    def _poison(self, device_id: str, job: TrainJob, result: Trained) -> Trained:
        received = _received_model(job, result)
        if result.weights.mode == "delta":
            trained = apply_delta_set(result.weights, received)
        else:
            trained = result.weights.to_arrays()
        poisoned = poison_weights(self._kind, self._scale, trained, received)
        log.info("attack emulation: %s uploads a %s-poisoned update", device_id, self._kind)
        return dataclasses.replace(result, weights=encode_full(poisoned, Precision.FP32).tensors)


def _received_model(job: TrainJob, result: Trained) -> dict[str, Array]:
    """The model the device received that its upload's tensors come from (the first
    received set holding every uploaded name; the model as it is without one)."""
    names = {t.name for t in result.weights}
    for arrays in job.local.sets.values():
        if names <= set(arrays):
            return {name: arrays[name] for name in names}
    raise ValueError(f"task {result.task_id}: no received model holds the uploaded tensors")
