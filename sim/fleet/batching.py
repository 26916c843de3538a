"""The fleet driver's batching rule: which jobs go to the trainer together, and when.

Decode jobs (cheap: decode a task's model, check it fits) go out as they come, so that a
device's training job follows soon. Training jobs are collected and handed over together,
as one cohort: when ``max_cohort`` of them wait, or when the driver has been quiet
(no inbound message and no new job) for ``linger_s`` — the burst of tasks a round starts
with is then over, and waiting longer would only delay the round.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from edge_client.train.exchange import DecodeJob, Job

__all__ = ["DEFAULT_LINGER_S", "DEFAULT_MAX_COHORT", "CohortQueue"]

DEFAULT_MAX_COHORT = 1024
"""Training jobs handed to the trainer at once, at most (a batched trainer then trains
them in computations as large as its memory holds)."""
DEFAULT_LINGER_S = 0.1
"""Quiet time (seconds) after which the training jobs waiting go to the trainer."""

Batch = list[tuple[str, Job]]


class CohortQueue:
    """Jobs waiting for the trainer (thread-safe): :meth:`submit` from the driver's
    threads, :meth:`next_batch` from the trainer thread.

    Args:
        max_cohort: training jobs handed over at once, at most (>= 1).
        linger_s: quiet seconds after which the waiting training jobs are handed over.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        max_cohort: int = DEFAULT_MAX_COHORT,
        linger_s: float = DEFAULT_LINGER_S,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_cohort < 1 or linger_s < 0:
            raise ValueError(
                f"need max_cohort >= 1 and linger_s >= 0, got {max_cohort}, {linger_s}"
            )
        self.max_cohort = max_cohort
        self.linger_s = linger_s
        self._clock = clock
        self._decodes: Batch = []
        self._trains: Batch = []
        self._last_activity = clock()
        self._closed = False
        self._changed = threading.Condition()

    def submit(self, device_id: str, job: Job) -> None:
        """Queue ``device_id``'s job."""
        with self._changed:
            (self._decodes if isinstance(job, DecodeJob) else self._trains).append((device_id, job))
            self._last_activity = self._clock()
            self._changed.notify()

    def touch(self) -> None:
        """Something arrived for the fleet: the quiet time starts again."""
        self._last_activity = self._clock()  # a float store: no lock needed

    def close(self) -> None:
        """Wake :meth:`next_batch` for good: it returns None from now on."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def take(self) -> tuple[Batch, float | None]:
        """The batch due now (empty: none), and how long to wait for the next one if
        nothing else happens (None: until something is submitted)."""
        with self._changed:
            return self._take()

    def next_batch(self) -> Batch | None:
        """Block until a batch is due and return it; None once closed."""
        with self._changed:
            while not self._closed:
                batch, wait = self._take()
                if batch:
                    return batch
                self._changed.wait(wait)
            return None

    def _take(self) -> tuple[Batch, float | None]:
        if len(self._trains) >= self.max_cohort:
            return self._pop_trains(), None
        if self._decodes:
            batch, self._decodes = self._decodes, []
            return batch, None
        if not self._trains:
            return [], None
        quiet_for = self._clock() - self._last_activity
        if quiet_for >= self.linger_s:
            return self._pop_trains(), None
        return [], self.linger_s - quiet_for

    def _pop_trains(self) -> Batch:
        batch = self._trains[: self.max_cohort]
        del self._trains[: self.max_cohort]
        return batch
