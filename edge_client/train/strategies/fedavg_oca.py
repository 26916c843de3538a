"""FedAvg (OCA)'s device side: as FedAvg's with full sharing (``"global"``, required).

The variant of the FedKF paper whose server aggregates over its cache of every device's
latest model (the OCA model) rather than over the round's uploads; the devices train as
in FedAvg.
"""

from __future__ import annotations

from edge_client.train.strategies.strategy import DeviceStrategy

__all__ = ["FedAvgOCA"]


class FedAvgOCA(DeviceStrategy):
    """FedAvg (OCA): devices train as in FedAvg; the server aggregates over its cache."""

    name = "fedavg_oca"
