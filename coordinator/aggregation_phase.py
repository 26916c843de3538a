"""The aggregation phase of a round: what the engine hands off, and what comes back.

When a round closes, :class:`~coordinator.engine.RoundEngine` persists the set of updates
the round aggregates (the run's phase becomes ``aggregating``) and returns an
:class:`~coordinator.actions.AggregateRequested` action holding an
:class:`AggregationJob`. The runtime runs the job off the engine thread (server-side
training may take a while, on a GPU where there is one) and feeds the engine an
:class:`~coordinator.events.AggregateDone` event with its result; only then does the
round close. A job is a pure function of the persisted state: the models the round
started from and the accepted updates it names. A coordinator that crashed before the
round closed requests the same job again on resume, and it gives the same result.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from coordinator.context import ServerContext
from coordinator.groups import GroupModels
from coordinator.state import RunState
from coordinator.strategies.base import AggregateResult, Contribution, Strategy

__all__ = ["AggregationJob"]


@dataclass(frozen=True)
class AggregationJob:
    """One round's aggregation: ``strategy`` over the updates of ``devices``.

    Safe to run on another thread than the engine's: it only reads the store records of
    the named updates, which nothing changes or deletes before the round closes.
    """

    strategy: Strategy
    round: int
    current: GroupModels
    """The server models the round started from, by group and role."""
    devices: tuple[str, ...]
    """Devices whose accepted on-time update of ``round`` is aggregated."""
    state: RunState

    def contributions(self) -> Iterator[Contribution]:
        """The updates, loaded one at a time from the store."""
        for device_id in self.devices:
            stored, weights = self.state.read_update(device_id, self.round)
            counts = None if stored.label_counts is None else tuple(stored.label_counts)
            yield Contribution(
                device_id,
                stored.group,
                weights,
                stored.num_samples,
                counts,
                weight_format=stored.weight_format,
            )

    def run(self, context: ServerContext) -> AggregateResult:
        """Aggregate; raises whatever the strategy's server step raises."""
        return self.strategy.aggregate(self.current, self.contributions(), self.round, context)
