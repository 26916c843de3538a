"""What the round engine takes in: the events of :class:`~coordinator.engine.RoundEngine`.

The runtime (or the sim, the budget tool, a test) turns what happens (a message on a
device's topic, a clock tick, a reconnection, a finished aggregation) into one of these
and hands it to :meth:`~coordinator.engine.RoundEngine.handle` with the current time.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.strategies.base import AggregateResult
from protocol.messages import Message, ReasonCode

__all__ = ["AggregateDone", "Event", "Received", "Reconnected", "Tick", "Undecodable"]


@dataclass(frozen=True)
class Received:
    """A decoded message from a device, with the device id its topic names."""

    topic_device: str
    message: Message
    now: float
    """Unix time (s) of arrival."""
    skew_ms: int = 0
    """The message's ``sent_at_ms`` minus the wall clock at arrival (ms), as the runtime
    measured it; hellos and updates further off than the replay window are refused."""


@dataclass(frozen=True)
class Tick:
    """Time passes (the runtime sends one every fraction of a second)."""

    now: float


@dataclass(frozen=True)
class Reconnected:
    """The connection to the broker was restored (retained messages may be gone)."""

    now: float


@dataclass(frozen=True)
class AggregateDone:
    """The aggregation an :class:`AggregateRequested` asked for has finished."""

    round: int
    result: AggregateResult
    now: float
    """Unix time (s) it finished."""
    seconds: float = 0.0
    """How long the server step ran (the strategy's ``aggregate``), seconds."""


@dataclass(frozen=True)
class Undecodable:
    """Input on a device's topic that never became a message: it failed decoding or
    reassembly (the runtime maps the error to a reason code)."""

    topic_device: str
    reason: ReasonCode
    """``malformed`` (failed a check of the codec or the reassembler) or ``oversize``
    (no room for it within the device's quota)."""
    detail: str
    now: float
    ref: str | None = None
    """Id of the message, where its envelope could be read."""
    round: int | None = None
    """Round of the message, where its envelope could be read."""


Event = Received | Tick | Reconnected | AggregateDone | Undecodable
