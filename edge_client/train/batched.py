"""The batched form of a training hook: one strategy's term over many devices at once.

A batched trainer (the sim's cohort engine) stacks the weights of N devices along a
leading device axis, runs every device's batch through a
:class:`~models.stacked.StackedModule` of the architecture at once, and takes every
device's gradient from the sum of the devices' losses (no weight is shared, so row ``i``
of each gradient is device ``i``'s own). A strategy whose device side adds to
the loss of :func:`~edge_client.train.training.train_local` gives its hook a batched form
by deriving it from :class:`BatchedHook`: :meth:`BatchedHook.stack` turns the N devices'
prepared hooks into one :class:`StackedTerm`, which

1. builds each step's per-device inputs (:meth:`StackedTerm.inputs`, outside the
   gradient: received anchors, generated batches, their own optimizer steps),
2. computes each stepping device's term of the loss from them (:meth:`StackedTerm.loss`;
   functional: stacked parameters in, one loss per device out, what the hook's
   per-device ``extra_loss`` computes),
3. keeps what it measured per device (:meth:`StackedTerm.record`,
   :meth:`StackedTerm.metrics`) and writes its per-device state back
   (:meth:`StackedTerm.write_back`).

The batched trainer knows no strategy: it asks each hook for this form, and a hook
without one trains on the per-device path. The stacking tools below (:func:`stacked`,
:func:`select_rows`, :func:`write_back`, :class:`StackedAdam`) are shared by the trainer and
the strategies' terms.

Pure: tensors in, tensors out; no I/O, no global RNG.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from edge_client.train.training import TrainHook
from models.optim import Adam, adam_corrections, adam_step_
from models.stacked import StackedModule

if TYPE_CHECKING:  # typing.Self is Python 3.11+; devices may run 3.10
    from typing import Self

__all__ = [
    "BatchedHook",
    "StackedAdam",
    "StackedTerm",
    "Tensors",
    "select_rows",
    "stack",
    "stacked",
    "unprefixed",
    "write_back",
]

Tensors = dict[str, torch.Tensor]
"""Tensors by name; stacked ones have a leading device axis (N, ...)."""


class StackedTerm(ABC):
    """One hook's part of the loss for the N devices of a batched round (rows 0..N-1).

    Subclasses implement :meth:`loss`, and override the rest as they need.
    """

    def __init__(self, count: int, device: torch.device) -> None:
        """
        Args:
            count: N, the devices of the round.
            device: where the stacked tensors live.
        """
        self.measured = torch.zeros(count, dtype=torch.float64, device=device)
        """Sum over the steps taken of the value :meth:`loss` measured, per device (N,)."""

    def inputs(self, rows: Sequence[int], index: torch.Tensor | None, width: int) -> Tensors:
        """The per-device inputs of one step's :meth:`loss`, each stacked (len(rows), ...);
        none by default.

        Args:
            rows: the devices that step, in order.
            index: ``rows`` as a tensor on the device, or None when every device steps.
            width: the step's batch width (padded batches are this wide).
        """
        return {}

    @abstractmethod
    def loss(
        self, model: StackedModule, point: Tensors, state: Tensors, inputs: Tensors
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The term of the loss of each of the n devices that step.

        Args:
            model: the classifier's architecture, stacked: ``model(state, x)`` with
                ``x`` (n, B, ...) gives each device's logits (n, B, classes).
            point: the trainable weights the gradient is taken at, by name, (n, ...).
            state: ``point`` and the constants (frozen parameters, buffers): the model's
                full state by name, (n, ...).
            inputs: :meth:`inputs` of this step.

        Returns:
            The weighted term added to each device's loss (n,), and the unweighted value
            the term measures (n,), detached, for :meth:`record`.
        """

    def record(self, rows: torch.Tensor, measured: torch.Tensor) -> None:
        """Add one step's measured values (len(rows),) to :attr:`measured` at ``rows``."""
        self.measured.index_add_(0, rows, measured.double())

    def metrics(self, row: int, steps: int) -> dict[str, float]:
        """What the hook's ``metrics`` would report for device ``row`` after ``steps``
        steps (``steps`` > 0); none by default."""
        return {}

    def write_back(self) -> None:
        """Write the per-device state the term trained back to the devices' objects
        (their learning states); nothing by default."""
        return None


class BatchedHook(TrainHook, ABC):
    """A training hook with a batched form (see the module docstring)."""

    @classmethod
    @abstractmethod
    def stack(cls, hooks: Sequence[Self], device: torch.device) -> StackedTerm:
        """The batched form of ``hooks``, one per device, each prepared (its
        ``before_training`` called) and of one round configuration.

        Args:
            hooks: the devices' hooks, in row order.
            device: where the stacked tensors live.
        """

    def unbatchable(self) -> str:
        """Why this prepared hook cannot train in a batched round, or "" when it can."""
        return ""


def stack(values: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``values`` (each detached) stacked along a new leading axis on ``device``."""
    return torch.stack([v.detach() for v in values]).to(device)


def stacked(modules: Sequence[nn.Module], names: Sequence[str], device: torch.device) -> Tensors:
    """``{name: (N, ...)}`` of the named parameters / buffers of ``modules``."""
    states = [dict(m.named_parameters()) | dict(m.named_buffers()) for m in modules]
    return {name: stack([s[name] for s in states], device) for name in names}


def write_back(modules: Sequence[nn.Module], values: Mapping[str, torch.Tensor]) -> None:
    """Copy row i of each stacked tensor in ``values`` into the parameter / buffer of
    that name of ``modules[i]`` (each stacked tensor moved to the modules' device in one
    transfer, not one per row)."""
    if not modules:
        return
    with torch.no_grad():
        first = dict(modules[0].named_parameters()) | dict(modules[0].named_buffers())
        moved = {name: value.to(first[name].device) for name, value in values.items()}
        for index, module in enumerate(modules):
            state = dict(module.named_parameters()) | dict(module.named_buffers())
            for name, value in moved.items():
                state[name].copy_(value[index])


def select_rows(index: torch.Tensor | None, tensors: Mapping[str, torch.Tensor]) -> Tensors:
    """The rows ``index`` of each stacked tensor (None: all of them, not copied)."""
    if index is None:
        return dict(tensors)
    return {k: v.index_select(0, index) for k, v in tensors.items()}


def unprefixed(tensors: Mapping[str, torch.Tensor], prefix: str) -> Tensors:
    """The tensors whose names start with ``prefix``, by their names without it."""
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


class StackedAdam:
    """N independent Adam optimizers over stacked parameters (:func:`adam_update_` with
    each row's own step count), each one's state taken from and written back to its
    :class:`~models.optim.Adam`."""

    def __init__(self, optimizers: Sequence[Adam], names: Sequence[str], device: torch.device):
        """
        Args:
            optimizers: one per device, each over parameters of the same shapes, in the
                same order, all of which step together.
            names: the names of those parameters, in the optimizers' order (the keys of
                the stacked parameters :meth:`update` gets).
            device: where the stacked moments live.
        """
        self._optimizers = optimizers
        first = optimizers[0]
        self.lr, self.betas, self.eps = first.lr, first.betas, first.eps
        self.names = list(names)
        self.exp_avg = {
            n: stack([o.exp_avg[i] for o in optimizers], device) for i, n in enumerate(self.names)
        }
        self.exp_avg_sq = {
            n: stack([o.exp_avg_sq[i] for o in optimizers], device)
            for i, n in enumerate(self.names)
        }
        # every parameter of an optimizer steps together: one count per device
        steps = [float(o.steps[0]) for o in optimizers]
        self.step = torch.tensor(steps, dtype=torch.float64, device=device)  # (N,)

    def update(self, params: Tensors, grads: Tensors, index: torch.Tensor | None) -> None:
        """One step for the optimizers ``index`` (None: all), in place on ``params``
        (the stacked parameters of those rows)."""
        with torch.no_grad():
            if index is None:
                self.step += 1
                step = self.step
            else:
                self.step[index] += 1
                step = self.step[index]
            if not self.names:
                return
            # the rows' corrections once, for all parameters (one dtype: the module's)
            correction1, correction2_sqrt = adam_corrections(
                step, self.betas, params[self.names[0]].dtype
            )
            assert isinstance(correction1, torch.Tensor)  # a tensor step gives tensors
            assert isinstance(correction2_sqrt, torch.Tensor)
            for name in self.names:
                p = params[name]
                m = self.exp_avg[name] if index is None else self.exp_avg[name][index]
                v = self.exp_avg_sq[name] if index is None else self.exp_avg_sq[name][index]
                shape = (-1,) + (1,) * (p.ndim - 1)
                adam_step_(
                    p,
                    grads[name],
                    m,
                    v,
                    correction1=correction1.view(shape),
                    correction2_sqrt=correction2_sqrt.view(shape),
                    lr=self.lr,
                    betas=self.betas,
                    eps=self.eps,
                )
                if index is not None:
                    self.exp_avg[name][index] = m
                    self.exp_avg_sq[name][index] = v

    def write_back(self) -> None:
        """Each row's state into its :class:`~models.optim.Adam`."""
        for row, optimizer in enumerate(self._optimizers):
            for i, name in enumerate(self.names):
                device = optimizer.params[i].device
                optimizer.exp_avg[i] = self.exp_avg[name][row].detach().to(device).clone()
                optimizer.exp_avg_sq[i] = self.exp_avg_sq[name][row].detach().to(device).clone()
                optimizer.steps[i] = int(self.step[row])
