"""What each selected device is sent: :class:`TaskComposer`.

A device's model and task depend on what it registered with (its hello: the precisions
it asked for, the format it runs its weights at) and on the run (the strategy's
hyperparameters, the round's deadline, the transfers it holds a base for). The round
engine (:class:`~coordinator.engine.RoundEngine`) asks for them when a round starts, when
a selected device says hello again mid-round and when a resumed round re-sends its tasks.
"""

from __future__ import annotations

from collections.abc import Mapping

from coordinator.actions import Publish
from coordinator.config import CoordinatorConfig, run_weight_format
from coordinator.outbox import Outbox
from coordinator.state import RunMeta
from coordinator.strategies.base import Arrays, Strategy, device_seed
from coordinator.transfer import Link, Transfers
from protocol.messages import Hello, Message, RoundTask, WeightFormat
from protocol.topics import Topics

__all__ = ["TaskComposer"]


class TaskComposer:
    """Builds each device's model message and task for the run of ``config`` with
    ``strategy``; ``transfers`` knows what each device holds, ``outbox`` shares one model
    message among the devices sent the same sets."""

    def __init__(
        self,
        config: CoordinatorConfig,
        strategy: Strategy,
        transfers: Transfers,
        outbox: Outbox,
    ) -> None:
        self.config = config
        self.strategy = strategy
        self._transfers = transfers
        self._outbox = outbox
        self._uplink = strategy.uplink()
        self._topics = Topics(config.fleet)

    def link(self, entry: Hello | None) -> Link:
        """The precisions a device (registered with ``entry``) transfers in: its own
        request, else the fleet's."""
        down = entry.downlink_precision if entry is not None else None
        up = entry.uplink_precision if entry is not None else None
        return Link(down or self.config.downlink_precision, up or self.config.uplink_precision)

    def weight_format(self, entry: Hello | None) -> WeightFormat:
        """The format a device runs its model at, as this run trains it: its hello's
        ``weight_format``, except that a float device with an int8 link counts as int8
        where the run asks for quantization-aware training (it then trains, and runs,
        the int8 model). The task asks ``binarize`` of binary devices always (a float
        model binarized after training loses most of its accuracy) and ``qat`` of int8
        ones only where the run asks for it (post-training int8 costs little)."""
        announced: WeightFormat = "float" if entry is None else entry.weight_format
        link = self.link(entry)
        qat = self.strategy.training.qat
        return run_weight_format(announced, qat=qat, downlink=link.downlink, uplink=link.uplink)

    def messages(
        self,
        run: RunMeta,
        device_id: str,
        entry: Hello | None,
        group: str,
        server_sets: Mapping[str, Mapping[str, Arrays]],
    ) -> list[Publish]:
        """The model (where the strategy sends one) and the task for ``device_id`` of
        architecture ``group`` in ``run``'s round: its group's sets at its precision."""
        link = self.link(entry)
        sets = self._transfers.downlink(
            device_id, run.round, group, server_sets[group], link, against=self.strategy.delta_sets
        )
        models: list[Publish] = []  # none where the strategy sends no model
        if sets:
            models.append(self._outbox.model(device_id, run.round, sets))
        hyper = self.strategy.hyperparameters(run.round)
        hyper["seed"] = device_seed(self.config.seed, run.round, device_id)
        weight_format = self.weight_format(entry)
        if weight_format == "binary":
            hyper["binarize"] = True
        elif weight_format == "int8" and self.strategy.training.qat:
            hyper["qat"] = True
        task = RoundTask(
            strategy=self.strategy.name,
            hyperparameters=hyper,
            deadline=run.deadline,
            downlink_precision=link.downlink,
            uplink=link.upload(self._uplink, next(iter(sets), None)),
            payloads=tuple(sets),
            model_message=models[0].message.message_id if models else None,
        )
        task_message = Message(
            fleet=self.config.fleet,
            sender=self.config.coordinator_id,
            round=run.round,
            body=task,
            message_id=run.task_ids[device_id],
        )
        return [*models, Publish(self._topics.to_device(device_id, "task"), task_message)]
