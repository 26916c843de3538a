"""FedKF's own fleet settings (:mod:`coordinator.strategies.fedkf`), light to import."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from coordinator.strategies.options import StrategyOptions

__all__ = ["FedKFOptions"]


class FedKFOptions(StrategyOptions):
    """The fleet settings only FedKF reads."""

    strategy_name = "fedkf"

    downlink: Literal["dual", "single"] = "dual"
    """fedkf: send ACA (student) + OCA (teacher), or the ACA alone (FedKF-)."""
    teacher_budget: float = Field(default=0.25, gt=0, le=1)
    """fedkf dual: teacher delta bytes as a fraction of the model's."""
