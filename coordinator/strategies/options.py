"""The base of a strategy's own fleet settings: :class:`StrategyOptions`.

Some fleet settings are read by one strategy alone (FedKF's ``downlink``, FedDF's
``distill_*``, DENSE's ``dense_*``). Each such strategy declares them in a light module
beside it (``fedkf_settings.py`` ...) as a subclass of :class:`StrategyOptions`, which
:class:`~coordinator.config.FleetSettings` mixes in: the keys stay flat (``distill_steps
= 300`` in a TOML file, ``--distill-steps 300`` on a command line) and the configuration
imports no strategy and no server step to know them. A strategy's options may also hold
its own defaults for the shared fleet settings (:attr:`StrategyOptions.fleet_defaults`:
DENSE runs one round with every device), which ``FleetSettings`` applies before it
validates.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

__all__ = ["Scalar", "StrategyOptions"]

Scalar = bool | int | float | str


class StrategyOptions(BaseModel):
    """Fleet settings one strategy reads, mixed into the fleet's settings."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    strategy_name: ClassVar[str]
    """The registry name of the strategy these options belong to."""
    fleet_defaults: ClassVar[Mapping[str, Scalar]] = {}
    """Fleet settings a run of the strategy gets where the configuration leaves them
    out, instead of the fields' own defaults (DENSE: one round, every device)."""
