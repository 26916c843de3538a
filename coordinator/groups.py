"""Architecture groups: a fleet may mix architectures, and the coordinator keeps models
for each.

A device's hello names its architecture (a registry name of :mod:`models`) and that
architecture's fingerprint; the coordinator maps it to the :class:`ArchitectureGroup` of
that name, refusing a device whose architecture it does not run or whose fingerprint
differs. Server models are keyed by (group, role): :data:`GroupModels` maps a group's
name to its models by role (``aca``, ``oca``, FedGen's ``generator`` and ``prior``).
Each device gets its own downlink: its group's models, at its own precision. A fleet of
one architecture has one group, named after the architecture.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy.typing as npt

from models import Classifier, state_arrays

__all__ = ["ArchitectureGroup", "GroupModels", "Models"]

Array = npt.NDArray[Any]
Models = dict[str, dict[str, Array]]
"""One group's models: role -> tensor name -> array."""
GroupModels = dict[str, Models]
"""Every group's models: group -> role -> tensor name -> array."""


@dataclass(frozen=True)
class ArchitectureGroup:
    """The devices of one architecture and what the coordinator knows of it."""

    name: str
    """The group's name: the architecture's registry name (``lenet5``)."""
    fingerprint: str
    """The architecture fingerprint its devices announce."""
    num_classes: int
    """Classes of the model (the length of label counts)."""
    initial: Mapping[str, Array]
    """The group's initial global weights, every tensor of the model."""

    @classmethod
    def of(cls, template: Classifier) -> ArchitectureGroup:
        """The group of ``template``'s architecture, starting from its weights."""
        return cls(
            name=template.architecture,
            fingerprint=template.fingerprint(),
            num_classes=template.num_classes,
            initial=state_arrays(template),
        )

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor of the model."""
        return {name: array.shape for name, array in self.initial.items()}
