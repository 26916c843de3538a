"""FedDF's device side: as FedAvg's with full sharing (``"global"``, required).

From "Ensemble Distillation for Robust Model Fusion in Federated Learning" (FedDF): the
server fuses the uploaded models by ensemble distillation on its proxy data, across
architectures; the devices train as in FedAvg.
"""

from __future__ import annotations

from edge_client.train.strategies.strategy import DeviceStrategy

__all__ = ["FedDF"]


class FedDF(DeviceStrategy):
    """FedDF: devices train as in FedAvg; the server fuses the models by ensemble
    distillation on its proxy data, across architectures."""

    name = "feddf"
