"""The trainer seam for many emulated devices: jobs of a cohort in, their results out.

:class:`BatchedTrainer` runs what the devices' sessions ask for
(:class:`~edge_client.train.session.DecodeJob`,
:class:`~edge_client.train.session.TrainJob`), many devices at a time: each device keeps
its own :class:`~edge_client.train.trainer.LocalTrainer` (its model, data, held model,
uplink residual and learning state); the decode jobs and the encoding of the uploads run
on a thread pool (zstd and numpy release the GIL), the training of every train job at
once in :func:`~sim.cohort.engine.train_cohort`. With ``engine="loop"`` the train jobs run
on the per-device path instead (the reference), one per CPU core at a time: each trains
with one torch thread, and torch releases the GIL while it computes.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, Protocol

import torch

from edge_client.train.exchange import Cancelled, DecodeJob, Failed, Job, JobResult, TrainJob
from edge_client.train.resources import estimate_training, memory_limit
from edge_client.train.training import TrainConfig
from models import Classifier
from sim.cohort.engine import Member, SampleCache, train_cohort
from sim.cohort.resident import ResidentWeights
from sim.fleet.trainer import FleetDevice, LoopTrainer

__all__ = [
    "BatchedTrainer",
    "CohortProgress",
    "Engine",
    "auto_max_cohort",
    "resolve_engine",
]

log = logging.getLogger(__name__)

Engine = Literal["auto", "batched", "loop"]
"""How the sim trains a round's devices: batched (:mod:`sim.cohort.engine`), one after
the other on the per-device path (loop), or auto: batched on a GPU, the loop on a CPU
(the sim trains with one torch thread and the loop runs a device per core: end to end
on 2 CPU cores the two are even at 1,000 devices and the loop is ahead on small rounds,
docs/cohort.md)."""


def resolve_engine(engine: Engine, device: torch.device) -> Literal["batched", "loop"]:
    """The engine ``engine`` means on ``device``."""
    if engine == "auto":
        return "batched" if device.type == "cuda" else "loop"
    return engine


class CohortProgress(Protocol):
    """What a :class:`BatchedTrainer` tells as its train jobs go (from its threads)."""

    def trained(self, devices: int) -> None:
        """``devices`` more train jobs finished training (their uploads not yet encoded)."""

    def steps(self, done: int, total: int) -> None:
        """A batched computation took its local step ``done`` of ``total``."""


MEMORY_SHARE = 0.5
"""Share of the free memory (GPU, or host on the CPU) a batched cohort may plan to use."""
CPU_CHUNK_BYTES = 128 * 2**20
"""On a CPU, the training estimate one batched computation should hold at most: a step
whose activations stay in the caches runs faster than one that streams them through
memory (LeNet-5 at batch 32, 1,000 devices on this project's 2-core CPU: 38.6 client
updates per second in chunks of 10 devices, 37.9 in chunks of 20, 28.9 in chunks of 50,
18.5 in one chunk of 1,000; docs/results.md), while a strategy with per-device work of
its own beside the classifier's (FedKF's generators) gains from larger chunks: 128 MiB
(26 LeNet-5 devices at batch 32, 14 at batch 64) ran FedAvg as fast as 64 MiB and the
budget tool's FedKF rounds (10 devices at batch 64: one chunk instead of 7 and 3) 10 %
faster in wall time, 15 % in CPU time (docs/budget.md)."""

GPU_CHUNK_BYTES = 8 * 2**30
"""On a GPU, the training estimate one batched computation should hold at most: a chunk
of 8 GiB of estimates (about 1,700 LeNet-5 devices at batch 32) keeps a GPU's arithmetic
busy, and more only raises the peak memory (10,000 LeNet-5 devices in one chunk peaked
at 39.7 GB on an H200 for the same updates per second; docs/results.md)."""


def auto_max_cohort(model: Classifier, batch_size: int, device: torch.device) -> int:
    """The most devices one batched computation should hold: :data:`MEMORY_SHARE` of the
    free memory of ``device`` over one device's training estimate (weights, gradients,
    momentum, two more copies and the activations of a batch), and at most
    :data:`GPU_CHUNK_BYTES` (:data:`CPU_CHUNK_BYTES` on a CPU) of such estimates; at
    least 1."""
    estimate = estimate_training(
        model, model.input_shape, batch_size, model_copies=2, optimizer_slots=1
    ).total
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = min(MEMORY_SHARE * free, float(GPU_CHUNK_BYTES))
        return max(1, int(budget // max(1, estimate)))
    budget = min(MEMORY_SHARE * memory_limit().bytes, float(CPU_CHUNK_BYTES))
    return max(1, int(budget // max(1, estimate)))


class BatchedTrainer(LoopTrainer):
    """A :class:`~sim.fleet.FleetTrainer` that trains a cohort's devices at once.

    Each device keeps its own :class:`LocalTrainer` (built on first use, as
    :class:`~sim.fleet.LoopTrainer` builds them); the decode jobs and the encoding of the
    uploads run on a thread pool, the training of all train jobs in one
    :func:`~sim.cohort.engine.train_cohort` call (``engine="loop"``: one after the
    other, as :class:`~sim.fleet.LoopTrainer` does).

    Args:
        devices: the fleet's devices.
        engine: ``"batched"`` or ``"loop"``.
        device: where to train.
        max_cohort: most devices in one batched computation; None: from the free memory
            (:func:`auto_max_cohort`).
        workers: threads decoding and encoding messages.
        train_workers: loop engine: devices training at once, each on its own thread;
            None: one per CPU core this process may use.
        progress: told the devices trained and the local steps of the batched
            computations as they go (an attribute: it may be set later).
    """

    def __init__(
        self,
        devices: Sequence[FleetDevice],
        *,
        engine: Engine = "batched",
        device: torch.device = torch.device("cpu"),  # noqa: B008
        max_cohort: int | None = None,
        workers: int = 4,
        train_workers: int | None = None,
        progress: CohortProgress | None = None,
    ) -> None:
        super().__init__(devices, device=device)
        self.progress = progress
        self.engine = resolve_engine(engine, device)
        self.device = device
        self.max_cohort = max_cohort
        # the devices' samples stay on an accelerator between rounds; on the CPU they
        # are the host's arrays already, and a resident copy would double them
        self._samples = SampleCache() if device.type != "cpu" else None
        # the devices' parameters stay stacked between rounds: none stacked per round
        self._resident = ResidentWeights(Counter(d.config.model for d in devices))
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="cohort-codec")
        slots = train_workers if train_workers is not None else len(os.sched_getaffinity(0))
        self._trainers_pool = ThreadPoolExecutor(max(1, slots), thread_name_prefix="cohort-loop")
        self._warned: set[str] = set()

    def close(self) -> None:
        """Stop: jobs not yet run answer ``Cancelled``; the codec threads end."""
        super().close()
        self._pool.shutdown(wait=False)
        self._trainers_pool.shutdown(wait=False)

    def run_many(self, jobs: Sequence[tuple[str, Job]]) -> list[JobResult]:
        """Run ``(device_id, job)`` pairs; the results in the same order. Never raises
        for a job that goes wrong (its result is :class:`Failed`)."""
        results: list[JobResult | None] = [None] * len(jobs)
        decodes = [k for k, (_, job) in enumerate(jobs) if isinstance(job, DecodeJob)]
        decoded = self._map(lambda k: self._one(jobs[k]), decodes)
        for k, result in zip(decodes, decoded, strict=True):
            results[k] = result
        trains = [k for k, (_, job) in enumerate(jobs) if isinstance(job, TrainJob)]
        if self.engine == "loop":
            looped = self._trainers_pool.map(lambda k: self._trained(self._one(jobs[k])), trains)
            for k, result in zip(trains, looped, strict=True):
                results[k] = result
        elif trains:
            trained = self._train_batched([jobs[k] for k in trains])
            for k, result in zip(trains, trained, strict=True):
                results[k] = result
        return [
            r if r is not None else Failed(job.message.message_id, RuntimeError("no result"))
            for r, (_, job) in zip(results, jobs, strict=True)
        ]

    def _trained(self, result: JobResult) -> JobResult:
        if self.progress is not None:
            self.progress.trained(1)
        return result

    def _one(self, pair: tuple[str, Job]) -> JobResult:
        """One job on the per-device path."""
        return super().run_many([pair])[0]

    def _map(self, work: Callable[[int], JobResult], items: Sequence[int]) -> list[JobResult]:
        return list(self._pool.map(work, items))

    def _train_batched(self, jobs: Sequence[tuple[str, Job]]) -> list[JobResult]:
        if self.closed:
            return [Cancelled(job.message.message_id) for _, job in jobs]
        members, train_jobs = [], []
        failed: dict[int, JobResult] = {}
        for k, (device_id, job) in enumerate(jobs):
            assert isinstance(job, TrainJob)
            try:
                trainer = self.trainer(device_id)
            except Exception as exc:  # an unknown device or a model that cannot be built
                failed[k] = Failed(job.message.message_id, exc)
                continue
            members.append(Member(trainer.model, trainer.data, job.local, trainer.learning_state))
            train_jobs.append((k, trainer, job))
        outcomes = []
        if members:
            limit = self.max_cohort
            if limit is None:
                config = TrainConfig.from_hyperparameters(members[0].task.hyperparameters)
                limit = auto_max_cohort(members[0].model, config.batch_size, self.device)
            progress = self.progress
            outcomes = train_cohort(
                members,
                device=self.device,
                max_cohort=limit,
                samples=self._samples,
                resident=self._resident,
                progress=None if progress is None else progress.trained,
                on_step=None if progress is None else progress.steps,
            )
        reasons = Counter(o.fallback_reason for o in outcomes if o.fallback_reason)
        for reason, count in reasons.items():
            if reason not in self._warned:
                self._warned.add(reason)
                log.warning("%d device(s) trained on the per-device path: %s", count, reason)

        def finish(index: int) -> JobResult:
            _, trainer, job = train_jobs[index]
            outcome = outcomes[index]
            if outcome.result is None:
                error = outcome.error or RuntimeError("training gave no result")
                return Failed(job.message.message_id, error)
            return trainer.finish(job, outcome.result)

        finished = self._map(finish, range(len(train_jobs)))
        results: list[JobResult] = [Failed("", RuntimeError("no result"))] * len(jobs)
        for k, result in failed.items():
            results[k] = result
        for (k, _, _), result in zip(train_jobs, finished, strict=True):
            results[k] = result
        return results
