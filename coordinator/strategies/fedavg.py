"""FedAvg (McMahan et al., 2017, "Communication-Efficient Learning of Deep Networks from
Decentralized Data"): the server step is :class:`~coordinator.strategies.base.Strategy`'s
own, the sample-weighted average of the round's updates."""

from __future__ import annotations

from coordinator.strategies.base import Strategy

__all__ = ["FedAvg"]


class FedAvg(Strategy):
    """FedAvg: the sample-weighted average of the updates (of the heads alone with
    ``sharing head``: the feature extractors stay on the devices)."""

    name = "fedavg"
    head_sharing = True
