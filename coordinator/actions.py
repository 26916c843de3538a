"""What the round engine asks for: the actions of :class:`~coordinator.engine.RoundEngine`.

Its caller carries them out in order: publish a message, report a started or closed
round, run an aggregation off the engine thread (answered by
:class:`~coordinator.events.AggregateDone`), deliver the final models.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from coordinator.aggregation_phase import AggregationJob
from coordinator.groups import GroupModels
from protocol.messages import Message, ReasonCode

__all__ = [
    "Action",
    "AggregateRequested",
    "Finished",
    "Publish",
    "RoundClosed",
    "RoundStarted",
    "UpdateOutcome",
]


@dataclass(frozen=True)
class Publish:
    topic: str
    message: Message
    retain: bool = False
    latest: bool = False  # retained when it fits in one frame (protocol.channel.Channel.send)


@dataclass(frozen=True)
class RoundStarted:
    round: int
    selected: tuple[str, ...]


@dataclass(frozen=True)
class AggregateRequested:
    """Run ``job`` (off the engine thread) and hand its result back as
    :class:`AggregateDone`; the round closes then. A failure of the job is fatal to the
    run: its state stays consistent and a resumed coordinator requests the job again."""

    job: AggregationJob


@dataclass(frozen=True)
class RoundClosed:
    """A finished round: what came in and the new global models of each group (``aca``,
    ``oca``)."""

    round: int
    selected: int
    on_time: int
    late: int
    rejected: int
    duration_s: float
    models: GroupModels
    train_loss: float | None = None
    """Mean training loss the on-time devices reported (sample-weighted)."""
    train_accuracy: float | None = None
    device_train_s: float | None = None
    """Mean local training time the on-time devices reported, seconds."""
    aggregate_s: float = 0.0
    """How long the round's server step ran (distillation, generator training ...),
    seconds."""
    server_metrics: Mapping[str, float] = field(default_factory=dict)
    """What the server step measured (:attr:`~coordinator.strategies.base.Aggregated.
    metrics`), by name; empty for most strategies."""


@dataclass(frozen=True)
class Finished:
    """The last round closed; ``models`` are the final global models of each group,
    ``final`` the role of the one the run delivers (``aca`` or ``oca``)."""

    models: GroupModels
    final: str = "aca"


@dataclass(frozen=True)
class UpdateOutcome:
    """What became of an authenticated update (nothing to carry out: for observers, the
    metrics and the dashboard). Comes with the update's acknowledgement."""

    device_id: str
    round: int
    reason: ReasonCode
    """``ok`` (taken on time), ``late``, ``duplicate``, or why it was rejected."""
    screening_ratio: float | None = None
    """An update taken on time: its distance from the model the device was sent over
    the round's screening reference."""


Action = Publish | RoundStarted | AggregateRequested | RoundClosed | Finished | UpdateOutcome
