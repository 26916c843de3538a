"""A fleet's device models resident in stacked tensors: nothing stacked per round.

Every emulated device of the batched engine keeps its own classifier (its shell saves
it, the recorder reads it, the per-device path trains it), but the classifier's
parameters are not tensors of their own: each is a view of the device's row of one
tensor per parameter name, ``(capacity, *shape)``, that holds that parameter of every
device of the architecture. A chunk of the cohort whose devices are consecutive rows
trains on a slice of those tensors in place (on the CPU nothing is stacked before the
round and nothing written back after it); another chunk gathers its rows with one
indexing op per tensor and scatters them back with one; on a GPU a chunk's rows go over
in one transfer per tensor and come back in one. Loading a received model into a device
(its strategy's ``prepare``) writes its row through the views.

A model whose parameter was replaced (moved to a GPU and back by the per-device path,
or reassigned) is adopted again, its current values copied into its row, before its row
is used: the rows never go stale. Buffers (normalisation statistics) stay the models'
own, as the engine stacks them: a deep copy of a buffer that is a view would copy the
whole tensor, where a parameter's copies only its row.

A chunk trained in place that fails part way leaves its models where its training
stopped, as the per-device path, which trains each model in place, does.

Not thread-safe: the batched trainer calls it from its one training thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from edge_client.train.batched import Tensors

__all__ = ["Resident", "ResidentWeights", "StackedParameters"]

_Key = tuple[str, tuple[tuple[str, tuple[int, ...], torch.dtype], ...]]


@dataclass
class _Slot:
    """Where a model's parameters live: its row, and how to find each parameter."""

    model: nn.Module  # held so that the id keying the slot stays this model's
    row: int
    params: list[tuple[dict[str, nn.Parameter | None], str, nn.Parameter]]
    """Per stacked name, in order: the owning module's parameter dict, the name in it,
    the parameter."""


@dataclass
class StackedParameters:
    """The stacked parameters of every resident model of one architecture."""

    shapes: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    """Each parameter's name, shape and dtype, in named order."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    slots: list[_Slot] = field(default_factory=list)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.shapes)

    @property
    def capacity(self) -> int:
        return next((int(t.shape[0]) for t in self.tensors.values()), 0)

    def bound(self, slot: _Slot) -> bool:
        """Whether each of the slot's parameters is still the view of its row."""
        for owner, leaf, param in slot.params:
            if owner.get(leaf) is not param:
                return False
        for (_, _, param), name in zip(slot.params, self.names, strict=True):
            row = self.tensors[name][slot.row]
            if param.device != row.device or param.data_ptr() != row.data_ptr():
                return False
        return True

    def bind(self, slot: _Slot, *, copy: bool) -> None:
        """Make the slot's parameters views of its row (``copy``: their values first)."""
        with torch.no_grad():
            for (_, _, param), name in zip(slot.params, self.names, strict=True):
                row = self.tensors[name][slot.row]
                if copy:
                    row.copy_(param.detach())
                param.data = row

    def grow(self, rows: int, reserve: int = 0) -> None:
        """Room for ``rows`` models (for ``reserve`` when first made, else at least half
        again the old room); the models bound to the old tensors are bound to the new
        ones, their values moved along."""
        if rows <= self.capacity:
            return
        capacity = max(rows, reserve) if not self.tensors else max(rows, self.capacity * 3 // 2)
        still = [slot for slot in self.slots if self.bound(slot)]
        old = self.tensors
        self.tensors = {
            name: torch.empty((capacity, *shape), dtype=dtype) for name, shape, dtype in self.shapes
        }
        with torch.no_grad():
            for name, tensor in old.items():
                self.tensors[name][: tensor.shape[0]].copy_(tensor)
        for slot in still:
            self.bind(slot, copy=False)


@dataclass(frozen=True)
class Resident:
    """A chunk's rows in its architecture's stacked tensors."""

    architecture: StackedParameters
    rows: tuple[int, ...]

    def take(self, names: Sequence[str], device: torch.device) -> tuple[Tensors, bool]:
        """``{name: (len(rows), ...)}`` of the chunk's parameters ``names`` on
        ``device``, and whether they are the resident tensors themselves (consecutive
        rows on the CPU: training them trains the models, :meth:`put` is not needed)."""
        start = self.rows[0]
        consecutive = self.rows == tuple(range(start, start + len(self.rows)))
        stacked = self.architecture.tensors
        if consecutive:
            taken = {n: stacked[n][start : start + len(self.rows)].to(device) for n in names}
        else:
            index = torch.tensor(self.rows, dtype=torch.int64)
            taken = {n: stacked[n].index_select(0, index).to(device) for n in names}
        in_place = consecutive and all(
            taken[n].data_ptr() == stacked[n][start].data_ptr() for n in names
        )
        return taken, in_place

    def put(self, values: Tensors) -> None:
        """Write the chunk's trained parameters back to their rows (one transfer and
        one indexing op per tensor)."""
        stacked = self.architecture.tensors
        index = torch.tensor(self.rows, dtype=torch.int64)
        with torch.no_grad():
            for name, value in values.items():
                stacked[name].index_copy_(0, index, value.detach().to(stacked[name].device))


class ResidentWeights:
    """The parameters of a fleet's models, stacked per architecture (module docstring).

    Models become resident on first use (:meth:`place`) and stay for the life of this
    object; their parameters are then views of its tensors.

    Args:
        expected: models expected per architecture name (a classifier's
            ``architecture``): the room an architecture's tensors are first made with,
            so that a fleet whose devices join over several calls is not copied as its
            tensors grow, nor given room it will not use.
    """

    def __init__(self, expected: Mapping[str, int] | None = None) -> None:
        self._expected = dict(expected or {})
        self._architectures: dict[_Key, StackedParameters] = {}
        self._slots: dict[int, tuple[StackedParameters, _Slot]] = {}

    def place(self, models: Sequence[nn.Module]) -> list[tuple[StackedParameters, int]]:
        """Each model's stacked parameters and row in them, making resident the models not yet
        resident and adopting again those whose parameters were replaced.

        Raises:
            ValueError: a resident model's parameters changed their names or shapes.
        """
        fresh: dict[_Key, dict[int, nn.Module]] = {}
        for model in models:
            if id(model) not in self._slots:
                fresh.setdefault(_key(model), {})[id(model)] = model
        for key, new in fresh.items():
            architecture = self._architectures.get(key)
            if architecture is None:
                architecture = self._architectures[key] = StackedParameters(shapes=key[1])
            start = len(architecture.slots)
            first = next(iter(new.values()))
            reserve = self._expected.get(getattr(first, "architecture", ""), 0)
            architecture.grow(start + len(new), reserve)
            for k, model in enumerate(new.values()):
                slot = _Slot(model, start + k, _owned(model))
                architecture.slots.append(slot)
                architecture.bind(slot, copy=True)
                self._slots[id(model)] = (architecture, slot)
        placed = []
        for model in models:
            architecture, slot = self._slots[id(model)]
            if not architecture.bound(slot):  # replaced: adopted again
                if _key(model)[1] != architecture.shapes:
                    raise ValueError(f"a resident {type(model).__name__} changed its parameters")
                slot.params = _owned(model)
                architecture.bind(slot, copy=True)
            placed.append((architecture, slot.row))
        return placed

    @property
    def nbytes(self) -> int:
        """Bytes of the stacked tensors (rows not yet used included)."""
        return sum(
            t.numel() * t.element_size()
            for a in self._architectures.values()
            for t in a.tensors.values()
        )


def _named(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(model.named_parameters())


def _key(model: nn.Module) -> _Key:
    return (
        type(model).__qualname__,
        tuple((n, tuple(p.shape), p.dtype) for n, p in _named(model)),
    )


def _owned(model: nn.Module) -> list[tuple[dict[str, nn.Parameter | None], str, nn.Parameter]]:
    """Each parameter's owning dict, its name there and itself, in named order."""
    owned = []
    for name, param in _named(model):
        prefix, _, leaf = name.rpartition(".")
        owner = model.get_submodule(prefix) if prefix else model
        owned.append((owner._parameters, leaf, param))
    return owned
