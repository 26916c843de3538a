"""What the coordinator publishes, as messages: acks, its retained status, the fleet's
broadcast model, and each selected device's model message.

:class:`Outbox` builds them for the :class:`~coordinator.engine.RoundEngine` (which
decides *when* to send what). It keeps the two things that make them cheap to send to a
fleet: the status goes out only when it changes, and a model message many devices get
in a round (the same encoded sets) is one message, built once, with one id (docs/protocol.md,
section 7).

Pure: no broker, no clock; messages in, :class:`~coordinator.actions.Publish` out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from coordinator.actions import Action, Publish
from coordinator.config import CoordinatorConfig
from coordinator.strategies.base import Arrays
from protocol.deltas import encode_full
from protocol.messages import Ack, CoordinatorStatus, Message, ModelPayload, ReasonCode
from protocol.sets import GLOBAL_SET
from protocol.tensorset import TensorSet
from protocol.topics import Topics

__all__ = ["Outbox", "mean_metric", "some", "weighted_metric"]


class Outbox:
    """The coordinator's outbound messages (see the module docstring).

    Args:
        config: the fleet, the coordinator's id and the broadcast precision.
        topics: the fleet's topics.
    """

    def __init__(self, config: CoordinatorConfig, topics: Topics) -> None:
        self.config = config
        self.topics = topics
        self._models: dict[tuple[int, tuple[tuple[str, int], ...]], Message] = {}
        self.status_sent = ""
        """The state of the last status published ("" before the first)."""

    def ack(
        self, device_id: str, ref: Message, accepted: bool, reason: ReasonCode, detail: str = ""
    ) -> Publish:
        """The ack of ``ref`` to ``device_id`` (the detail cut to 512 characters)."""
        body = Ack(accepted=accepted, reason=reason, ref=ref.message_id, detail=detail[:512])
        message = Message(
            fleet=self.config.fleet, sender=self.config.coordinator_id, round=ref.round, body=body
        )
        return Publish(self.topics.to_device(device_id, "ack"), message)

    def status(
        self, state: str, strategy: str, registered: int, online: int, *, force: bool = False
    ) -> list[Action]:
        """The retained coordinator status; none when the state did not change (unless
        ``force``)."""
        if state == self.status_sent and not force:
            return []
        body = CoordinatorStatus(
            state=state,
            strategy=strategy,
            rounds_total=self.config.rounds,
            devices_registered=registered,
            devices_online=online,
        )
        self.status_sent = state
        message = Message(fleet=self.config.fleet, sender=self.config.coordinator_id, body=body)
        return [Publish(self.topics.coordinator_status, message, retain=True)]

    def broadcast(self, round_number: int, model: Arrays) -> Publish:
        """The fleet's model for devices that serve it (``broadcast_model``): one full set
        ``global`` at the fleet's downlink precision, retained when it fits one frame."""
        body = ModelPayload(
            sets={GLOBAL_SET: encode_full(model, self.config.downlink_precision).tensors}
        )
        message = Message(
            fleet=self.config.fleet,
            sender=self.config.coordinator_id,
            round=round_number,
            body=body,
        )
        return Publish(self.topics.broadcast_model, message, latest=True)

    def model(self, device_id: str, round_number: int, sets: Mapping[str, TensorSet]) -> Publish:
        """The model message of ``sets`` to ``device_id``: devices sent the very same
        encoded sets in a round share one message (one id, compressed once)."""
        key = (round_number, tuple((name, id(tensors)) for name, tensors in sets.items()))
        message = self._models.get(key)
        if message is None:
            body = ModelPayload(sets=dict(sets))
            message = Message(
                fleet=self.config.fleet,
                sender=self.config.coordinator_id,
                round=round_number,
                body=body,
            )
            self._models[key] = message
        return Publish(self.topics.to_device(device_id, "model"), message)

    def new_round(self) -> None:
        """Forget the last round's model messages."""
        self._models.clear()


def weighted_metric(stats: list[tuple[int, dict[str, float]]], name: str) -> float | None:
    """The sample-weighted mean of metric ``name`` over ``(samples, metrics)`` pairs
    (non-finite values left out; None when there is none)."""
    pairs = [(n, m[name]) for n, m in stats if name in m and math.isfinite(m[name])]
    total = sum(n for n, _ in pairs)
    return sum(n * v for n, v in pairs) / total if total else None


def mean_metric(stats: list[tuple[int, dict[str, float]]], name: str) -> float | None:
    """The plain mean of metric ``name`` (non-finite values left out; None: none)."""
    values = [m[name] for _, m in stats if name in m and math.isfinite(m[name])]
    return sum(values) / len(values) if values else None


def some(names: list[str], shown: int = 10) -> str:
    """The first ``shown`` of ``names``, and how many more there are."""
    head = ", ".join(names[:shown])
    return head if len(names) <= shown else f"{head} and {len(names) - shown} more"
