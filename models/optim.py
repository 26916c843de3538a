"""SGD and Adam, written out as the elementwise updates they are.

Both trainers of the project and the coordinator's server-side training step with these
instead of ``torch.optim``, for two reasons:

- **Start-up and memory.** Building any ``torch.optim`` optimizer imports torch's
  compiler (``torch._dynamo``, with sympy and torch.fx): measured on this project's
  2-core machine, 3.4 s and 72 MB of resident memory on first use, which an edge device
  pays at every start and a Pi Zero can hardly afford.
- **One update for one model and for a cohort.** The updates are elementwise, so the
  same functions step one model's tensors or a cohort's stacked ones (a leading device
  axis, as :mod:`sim.cohort.engine` keeps them): the per-device trainer and the batched
  engine take exactly the same step.

The updates are torch's defaults: SGD with momentum and no dampening (the first step's
buffer is the gradient), weight decay added to the gradient, no Nesterov; Adam without
weight decay or amsgrad, bias-corrected. ``tests/models/test_optim.py`` checks both
against ``torch.optim`` over many steps.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["SGD", "Adam", "adam_corrections", "adam_step_", "adam_update_", "sgd_update_"]


def sgd_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    buffer: torch.Tensor | None,
    *,
    lr: float,
    momentum: float,
    weight_decay: float,
) -> None:
    """One SGD step, in place on ``param`` and ``buffer``.

    Args:
        param: the parameter (any shape; a cohort's stacked parameters alike).
        grad: its gradient, of the same shape.
        buffer: the momentum buffer (zeros before the first step), or None when
            ``momentum`` is 0.
        lr, momentum, weight_decay: as ``torch.optim.SGD``'s.
    """
    if weight_decay:
        grad = grad + weight_decay * param
    if buffer is not None:
        buffer.mul_(momentum).add_(grad)
        grad = buffer
    param.sub_(lr * grad)


def adam_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: float | torch.Tensor,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
) -> None:
    """One Adam step, in place on ``param`` and its moments.

    Args:
        param: the parameter (any shape).
        grad: its gradient.
        exp_avg, exp_avg_sq: the first and second moments (zeros before the first step).
        step: the number of this step, from 1: a number, or for stacked parameters a
            tensor broadcastable to ``param`` (each row its own count, e.g. shape
            ``(N, 1, ..., 1)``; float64 keeps the bias corrections as exact as a
            number's).
        lr, betas, eps: as ``torch.optim.Adam``'s.
    """
    correction1, correction2_sqrt = adam_corrections(step, betas, param.dtype)
    adam_step_(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        correction1=correction1,
        correction2_sqrt=correction2_sqrt,
        lr=lr,
        betas=betas,
        eps=eps,
    )


Correction = float | torch.Tensor


def adam_corrections(
    step: float | torch.Tensor, betas: tuple[float, float], dtype: torch.dtype
) -> tuple[Correction, Correction]:
    """Adam's bias corrections at ``step`` (see :func:`adam_update_`):
    ``1 - beta1 ** step`` and ``sqrt(1 - beta2 ** step)``; for a tensor ``step``, computed
    in its dtype and cast to ``dtype``, the parameters' (a cohort computes them once a
    step for all its stacked parameters)."""
    beta1, beta2 = betas
    correction1 = 1 - beta1**step
    correction2_sqrt = (1 - beta2**step) ** 0.5
    if isinstance(correction1, torch.Tensor):  # counted in float64: cast once computed
        return correction1.to(dtype), torch.as_tensor(correction2_sqrt).to(dtype)
    return correction1, correction2_sqrt


def adam_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    correction1: Correction,
    correction2_sqrt: Correction,
    lr: float,
    betas: tuple[float, float],
    eps: float,
) -> None:
    """:func:`adam_update_` with the step's :func:`adam_corrections` given (tensors
    broadcastable to ``param``)."""
    beta1, beta2 = betas
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / correction2_sqrt).add_(eps)
    param.sub_((lr / correction1) * exp_avg / denom)


class _Optimizer:
    """What both optimizers share: their parameters, and dropping the gradients."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float) -> None:
        self.params = list(params)
        self.lr = lr

    def zero_grad(self) -> None:
        """Drop the gradients (set them to None)."""
        for p in self.params:
            p.grad = None


class SGD(_Optimizer):
    """SGD over a model's parameters (:func:`sgd_update_` on each), torch.optim's API.

    The momentum buffers start at zero and live as long as the optimizer.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        *,
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, lr)
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.buffers: list[torch.Tensor] | None = (
            [torch.zeros_like(p) for p in self.params] if momentum else None
        )

    @torch.no_grad()
    def step(self) -> None:
        """One step of every parameter that has a gradient."""
        for index, p in enumerate(self.params):
            if p.grad is None:
                continue
            buffer = None if self.buffers is None else self.buffers[index]
            sgd_update_(
                p,
                p.grad,
                buffer,
                lr=self.lr,
                momentum=self.momentum,
                weight_decay=self.weight_decay,
            )


class Adam(_Optimizer):
    """Adam over a model's parameters (:func:`adam_update_` on each), torch.optim's API.

    Attributes:
        exp_avg, exp_avg_sq: the moments, one per parameter in order (zeros at first).
        steps: steps each parameter took so far (one without a gradient takes none).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        super().__init__(params, lr)
        self.betas = betas
        self.eps = eps
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]
        self.steps = [0] * len(self.params)

    @torch.no_grad()
    def step(self) -> None:
        """One step of every parameter that has a gradient."""
        for index, p in enumerate(self.params):
            if p.grad is None:
                continue
            self.steps[index] += 1
            adam_update_(
                p,
                p.grad,
                self.exp_avg[index],
                self.exp_avg_sq[index],
                self.steps[index],
                lr=self.lr,
                betas=self.betas,
                eps=self.eps,
            )
