"""Test helpers: drive a RoundEngine by hand, playing the devices."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from coordinator.actions import Action, AggregateRequested, Publish
from coordinator.config import CoordinatorConfig
from coordinator.context import ServerContext
from coordinator.engine import RoundEngine
from coordinator.events import AggregateDone, Event, Received
from coordinator.groups import ArchitectureGroup
from coordinator.runtime import build_models
from coordinator.store import Store
from coordinator.strategies.base import Strategy
from coordinator.strategies.registry import build_strategy
from models import Classifier
from protocol.messages import DeviceStatus, Hello, Message, RoundTask, Update
from protocol.tensors import Precision
from protocol.tensorset import encode_tensors

FLEET = "test"
GROUP = "mlp"
"""The architecture group of the fleet :func:`config` describes (its model)."""


def config(**overrides: Any) -> CoordinatorConfig:
    base: dict[str, Any] = {
        "fleet": FLEET,
        "model": "mlp",
        "rounds": 3,
        "participation": 1.0,
        "round_timeout_s": 60.0,
        "seed": 1,
        "insecure_no_auth": True,  # the engine's tests; tests/coordinator/test_auth.py has keys
        # the hand-made updates of these tests are constant shifts of the model, the
        # very shape norm screening rejects; tests/coordinator/test_screening.py turns it on
        "max_update_norm_ratio": 0.0,
    }
    base.update(overrides)
    return CoordinatorConfig.model_validate(base)


def templates(cfg: CoordinatorConfig) -> dict[str, Classifier]:
    """The fleet's architecture groups: their names -> the classifiers of ``cfg``."""
    return build_models(cfg)


class InlineEngine(RoundEngine):
    """A RoundEngine whose aggregations run at once, on the CPU of the calling thread, as
    ``sim.budget`` runs them: :meth:`start` and :meth:`handle` return the
    AggregateRequested and, after it, the actions of its AggregateDone."""

    def start(self, now: float) -> list[Action]:
        return self._inline(super().start(now), now)

    def handle(self, event: Event) -> list[Action]:
        now = event.now
        return self._inline(super().handle(event), now)

    def _inline(self, actions: list[Action], now: float) -> list[Action]:
        out: list[Action] = []
        for action in actions:
            out.append(action)
            if isinstance(action, AggregateRequested):
                out += self._inline(super().handle(aggregate(self, action, now)), now)
        return out


def aggregate(engine: RoundEngine, request: AggregateRequested, now: float) -> AggregateDone:
    """Carry out ``request`` on the CPU, as the runtime does on its aggregation thread."""
    job = request.job
    context = ServerContext.for_round(torch.device("cpu"), engine.config.seed, job.round)
    return AggregateDone(job.round, job.run(context), now)


def make_engine(
    cfg: CoordinatorConfig,
    store: Store,
    *,
    inline: bool = True,
    strategy: Strategy | None = None,
    fleet: Mapping[str, Classifier] | None = None,
) -> RoundEngine:
    """The engine of ``cfg`` on ``store`` (an :class:`InlineEngine` unless not ``inline``)
    for the architecture groups of ``fleet`` (default: the model of ``cfg``), with
    ``strategy`` or the one ``cfg`` names."""
    fleet = fleet or templates(cfg)
    engine_type = InlineEngine if inline else RoundEngine
    return engine_type(
        cfg,
        strategy or build_strategy(cfg, fleet),
        store,
        {name: ArchitectureGroup.of(template) for name, template in fleet.items()},
    )


def hello(engine: RoundEngine, device_id: str, samples: int = 100, **fields: Any) -> Message:
    (template,) = build_models(engine.config).values()
    body = {
        "device_id": device_id,
        "architecture": template.architecture,
        "fingerprint": template.fingerprint(),
        "precisions": (Precision.FP32,),
        "memory_bytes": 0,
        "threads": 1,
        "software_version": "test",
        "num_samples": samples,
    }
    body.update(fields)
    return Message(fleet=FLEET, sender=device_id, body=Hello(**body))


def received(message: Message, now: float, topic_device: str | None = None) -> Received:
    return Received(topic_device or message.sender, message, now)


def status(device_id: str, state: str) -> Message:
    return Message(fleet=FLEET, sender=device_id, body=DeviceStatus(state=state))


def published(actions: list[Action], leaf: str | None = None) -> list[Publish]:
    return [
        a
        for a in actions
        if isinstance(a, Publish) and (leaf is None or a.topic.endswith("/" + leaf))
    ]


def tasks_by_device(actions: list[Action]) -> dict[str, Message]:
    return {a.topic.split("/")[3]: a.message for a in published(actions, "task")}


def update(
    device_id: str,
    round_number: int,
    weights: Mapping[str, np.ndarray],
    samples: int = 100,
    task: Message | None = None,
    label_counts: tuple[int, ...] | None = None,
    **metrics: float,
) -> Message:
    task_id = task.message_id if task is not None else None
    assert task is None or isinstance(task.body, RoundTask)
    body = Update(
        task_message=task_id,
        num_samples=samples,
        sets={"weights": encode_tensors(weights, Precision.FP32)},
        label_counts=label_counts,
        metrics=metrics,
    )
    return Message(fleet=FLEET, sender=device_id, round=round_number, body=body)


def shifted(weights: Mapping[str, np.ndarray], delta: float) -> dict[str, np.ndarray]:
    return {k: (v + delta).astype(v.dtype) for k, v in weights.items()}


def shapes_of(engine: RoundEngine) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the tensors an update of ``GROUP`` must carry."""
    return {k: v.shape for k, v in engine._update_tensors[GROUP].items()}
