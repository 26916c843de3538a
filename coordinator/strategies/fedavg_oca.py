"""FedAvg (OCA), the FedKF paper's T1 alone: FedAvg training, plus the OCA model (the
sample-weighted average of every device's latest update) kept and delivered."""

from __future__ import annotations

from coordinator.strategies.base import Strategy

__all__ = ["FedAvgOca"]


class FedAvgOca(Strategy):
    """FedAvg (OCA): FedAvg's rounds, with an OCA cache and the ``oca`` model."""

    name = "fedavg_oca"
    uses_oca = True
