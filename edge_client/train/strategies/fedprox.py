"""FedProx's device side: local SGD plus a proximal term to the received weights.

From "Federated Optimization in Heterogeneous Networks" (FedProx): the device minimises
``CE + mu / 2 * ||w - w_global||^2`` over its trainable parameters, ``w_global`` being
the weights received this round (``"global"``, required). The term is one function,
:func:`proximal_term`: the per-device loop calls it through :class:`ProximalHook` on the
model's live parameters, the batched engine through the hook's batched form on each
device's slice of the stacked ones.

Pure: tensors in, tensors out; no I/O, no global state.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from edge_client.train.batched import BatchedHook, StackedTerm, Tensors, select_rows, stack
from edge_client.train.strategies.strategy import DeviceStrategy
from edge_client.train.training import TrainConfig, TrainHook
from models.stacked import StackedModule

if TYPE_CHECKING:  # typing.Self is Python 3.11+; devices may run 3.10
    from typing import Self

__all__ = ["FedProx", "ProximalHook", "proximal_term"]


def proximal_term(
    params: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor], mu: float
) -> torch.Tensor:
    """FedProx's ``mu / 2 * sum ||w - w_global||^2`` over the tensors of ``anchor``.

    Functional (parameters in, loss out): the per-device loop calls it on a model's
    live parameters, the sim's batched engine on one device's slice of the stacked ones.

    Args:
        params: the weights being trained, by name (at least ``anchor``'s names).
        anchor: the weights received this round, by name (constants).
        mu: the proximal weight.
    """
    total = torch.stack([(params[name] - w).pow(2).sum() for name, w in anchor.items()]).sum()
    return 0.5 * mu * total


class ProximalHook(BatchedHook):
    """FedProx: adds :func:`proximal_term` over the trainable parameters.

    ``w_global`` (:attr:`anchor`) is a copy of the trainable parameters taken in
    :meth:`before_training` (after the global weights were loaded).
    """

    def __init__(self, mu: float) -> None:
        if not mu >= 0:
            raise ValueError(f"mu must be >= 0, got {mu}")
        self.mu = mu
        self.anchor: dict[str, torch.Tensor] = {}
        """The received trainable parameters by name (empty before training starts)."""

    def before_training(self, model: nn.Module) -> None:
        self.anchor = {
            name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad
        }

    def extra_loss(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor
    ) -> torch.Tensor | None:
        if self.mu == 0 or not self.anchor:
            return None
        return proximal_term(dict(model.named_parameters()), self.anchor, self.mu)

    @classmethod
    def stack(cls, hooks: Sequence[Self], device: torch.device) -> StackedTerm:
        return _StackedProximal(hooks, device)


class _StackedProximal(StackedTerm):
    """:func:`proximal_term` of each device to its own stacked anchor."""

    def __init__(self, hooks: Sequence[ProximalHook], device: torch.device) -> None:
        super().__init__(len(hooks), device)
        self.mu = hooks[0].mu
        self.anchor = {n: stack([h.anchor[n] for h in hooks], device) for n in hooks[0].anchor}

    def inputs(self, rows: Sequence[int], index: torch.Tensor | None, width: int) -> Tensors:
        return select_rows(index, self.anchor)

    def loss(
        self, model: StackedModule, point: Tensors, state: Tensors, inputs: Tensors
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = next(iter(state.values())).shape[0]
        if not inputs:  # no trainable parameter: nothing to anchor
            zero = torch.zeros(rows, device=next(iter(state.values())).device)
            return zero, zero
        squares = [(point[name] - w).pow(2).flatten(1).sum(dim=1) for name, w in inputs.items()]
        term = 0.5 * self.mu * torch.stack(squares).sum(dim=0)  # (n,)
        return term, term.detach()


class FedProx(DeviceStrategy):
    """FedProx: local SGD with a proximal term of weight ``mu`` to the global weights."""

    name = "fedprox"

    def hooks(
        self, model: nn.Module, config: TrainConfig, state: MutableMapping[str, Any]
    ) -> tuple[TrainHook, ...]:
        return (ProximalHook(config.mu),)
