"""FedProx (Li et al., 2020, "Federated Optimization in Heterogeneous Networks"): FedAvg's
server step; the devices add the proximal term ``(mu / 2) * ||w - w_global||^2``."""

from __future__ import annotations

from coordinator.strategies.base import Scalar, Strategy

__all__ = ["FedProx"]


class FedProx(Strategy):
    """FedProx: FedAvg aggregation; the task carries the proximal weight ``mu``."""

    name = "fedprox"

    def task_settings(self, round_number: int) -> dict[str, Scalar]:
        return {**super().task_settings(round_number), "mu": self.training.mu}
