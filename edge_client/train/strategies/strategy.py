"""The device side of a strategy as an interface (:class:`DeviceStrategy`), and what
several strategies share: loading a received set, and full or head-only sharing
(:class:`FullOrHeadSharing`).

Pure: numpy / torch in, models changed in place; no I/O, no global state.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, ClassVar, NamedTuple, TypeVar

import numpy.typing as npt
from torch import nn

from edge_client.errors import TaskError
from edge_client.train.task import ReceivedSets, UploadSubset
from edge_client.train.training import TrainConfig, TrainHook
from models import Classifier, StateMismatchError, StateSubset, load_state_arrays, state_shapes
from protocol.sets import GLOBAL_SET, HEAD_SET

__all__ = [
    "DeviceStrategy",
    "FullOrHeadSharing",
    "SetSpec",
    "as_classifier",
    "from_set",
    "load_set",
]

_T = TypeVar("_T")


class SetSpec(NamedTuple):
    """A received set as a strategy expects it."""

    shapes: dict[str, tuple[int, ...]]
    """Exactly these tensor names with these shapes."""
    required: bool
    """Whether a task with sets must carry this one."""


def load_set(module: nn.Module, sets: ReceivedSets, name: str, subset: StateSubset = "all") -> None:
    """Load the received set ``name`` (if there) into ``subset`` of ``module``.

    Raises:
        TaskError: the set does not fit the module (the module is then unchanged).
    """
    arrays = sets.get(name)
    if arrays is None:
        return
    try:
        load_state_arrays(module, arrays, subset=subset)
    except StateMismatchError as exc:
        raise TaskError(f"received set {name!r} does not fit the model: {exc}") from exc


def from_set(
    sets: ReceivedSets, name: str, build: Callable[[Mapping[str, npt.NDArray[Any]]], _T]
) -> _T | None:
    """``build(sets[name])``, or None when the set was not received.

    Raises:
        TaskError: the set does not fit what ``build`` makes of it.
    """
    arrays = sets.get(name)
    if arrays is None:
        return None
    try:
        return build(arrays)
    except StateMismatchError as exc:
        raise TaskError(f"received set {name!r} does not fit: {exc}") from exc


def as_classifier(model: nn.Module, strategy: str) -> Classifier:
    """``model``, which ``strategy`` needs to be a :class:`~models.Classifier`.

    Raises:
        TaskError: it is not one.
    """
    if not isinstance(model, Classifier):
        raise TaskError(
            f"strategy {strategy!r} needs a classifier with a features / head split, "
            f"got {type(model).__name__}"
        )
    return model


class DeviceStrategy(ABC):
    """The device side of one strategy: which sets it takes, how it trains and uploads.

    Subclasses set :attr:`name`; simple ones override :meth:`hooks`, those that take
    other sets than ``"global"`` override :meth:`expected_sets` and :meth:`prepare`
    (and :meth:`check_sets` for checks beyond names and shapes). A hook that adds to the
    loss derives from :class:`~edge_client.train.batched.BatchedHook` to train in the
    sim's batched engine too.
    """

    name: ClassVar[str]
    """Registry name, as round tasks carry it."""
    uploads: ClassVar[tuple[UploadSubset, ...]] = ("all",)
    """The :attr:`~edge_client.train.task.LocalTask.upload` values the strategy supports."""

    def expected_sets(self, model: nn.Module, config: TrainConfig) -> dict[str, SetSpec]:
        """The received sets this strategy understands, by name (default: ``"global"``,
        required, the model's full state).

        Raises:
            TaskError: the strategy cannot run on this model.
        """
        return {GLOBAL_SET: SetSpec(state_shapes(model), required=True)}

    def check_sets(self, model: nn.Module, sets: ReceivedSets) -> None:
        """Checks of received sets beyond names and shapes (values, combinations),
        called by :func:`~edge_client.train.local_update.validate_task` when sets were
        received; none by default.

        Raises:
            TaskError: naming what is wrong.
        """
        return None

    def prepare(
        self,
        model: nn.Module,
        sets: ReceivedSets,
        config: TrainConfig,
        state: MutableMapping[str, Any],
    ) -> tuple[TrainHook, ...]:
        """Load the received sets into ``model`` and return the round's hooks.

        The default loads ``"global"`` (if received) and returns :meth:`hooks`. All or
        nothing: on error the model is unchanged.

        Raises:
            TaskError: a received set does not fit the model.
        """
        load_set(model, sets, GLOBAL_SET)
        return self.hooks(model, config, state)

    def hooks(
        self, model: nn.Module, config: TrainConfig, state: MutableMapping[str, Any]
    ) -> tuple[TrainHook, ...]:
        """The training hooks of this strategy for one round (none by default)."""
        return ()


class FullOrHeadSharing(DeviceStrategy):
    """A strategy whose model comes as ``"global"`` (full sharing) or as ``"head"``
    (head-only sharing: the head is loaded, the features stay the device's own), exactly
    one of them; it uploads the full state or the head alone."""

    uploads = ("all", "head")

    def expected_sets(self, model: nn.Module, config: TrainConfig) -> dict[str, SetSpec]:
        classifier = as_classifier(model, self.name)
        return {
            GLOBAL_SET: SetSpec(state_shapes(classifier), required=False),
            HEAD_SET: SetSpec(state_shapes(classifier, "head"), required=False),
        }

    def check_sets(self, model: nn.Module, sets: ReceivedSets) -> None:
        weights = [name for name in (GLOBAL_SET, HEAD_SET) if name in sets]
        if len(weights) != 1:
            raise TaskError(
                f"strategy {self.name!r} needs exactly one of the sets {GLOBAL_SET!r} "
                f"(full sharing) and {HEAD_SET!r} (head-only sharing); got {sorted(sets)}"
            )

    def prepare(
        self,
        model: nn.Module,
        sets: ReceivedSets,
        config: TrainConfig,
        state: MutableMapping[str, Any],
    ) -> tuple[TrainHook, ...]:
        self.load_shared(model, sets)
        return self.hooks(model, config, state)

    @staticmethod
    def load_shared(model: nn.Module, sets: ReceivedSets) -> None:
        """Load ``"global"`` into the whole model if received, else ``"head"`` (if
        received) into its head.

        Raises:
            TaskError: the set does not fit the model (it is then unchanged).
        """
        if GLOBAL_SET in sets:
            load_set(model, sets, GLOBAL_SET)
        else:
            load_set(model, sets, HEAD_SET, subset="head")
