"""The number formats a device runs its classifier's weights at, computed in float.

A device announces in its hello the format it *runs* its model at
(:data:`protocol.messages.WeightFormat`): ``float`` (the weights as trained), ``int8``
(the int8 ONNX model: :func:`fake_quantize_int8`) or ``binary`` (BinaryConnect-style
binarized weights: :func:`binarize`). Both ends need the same arithmetic: the device
trains through it (quantization-aware training, ``edge_client.train.qat`` and
``edge_client.train.binary``) and the coordinator's FedDF computes each teacher's logits
with the weights its device runs (:func:`run_weights_`). Only weights of rank >= 2
(convolution and linear kernels) change; biases and normalisation parameters stay float
in every format.

Pure: tensors in, tensors out; no I/O, no global state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from protocol.messages import WeightFormat

__all__ = ["INT8_LEVELS", "binarize", "fake_quantize_int8", "run_weights_", "weights_at"]

_M = TypeVar("_M", bound=nn.Module)

INT8_LEVELS = 127
"""Quantization levels on each side of zero: symmetric int8 uses [-127, 127]."""


def _check_weight(weight: torch.Tensor) -> None:
    if weight.ndim < 1 or not weight.is_floating_point():
        shape = tuple(weight.shape)
        raise ValueError(
            f"expected a floating-point tensor of rank >= 1, got {weight.dtype} {shape}"
        )


def fake_quantize_int8(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` rounded to symmetric int8 per output channel (axis 0), in float.

    For each channel ``c`` (``weight[c]``): ``scale = max|weight[c]| / 127`` and the result
    is ``clamp(round(weight[c] / scale), -127, 127) * scale``, so every value moves by at
    most ``scale / 2``. An all-zero channel stays zero (no division by zero, no NaN).
    This is what onnxruntime's static quantizer stores for Conv and Gemm weights
    (symmetric, per channel; round half to even; the scale rounded from float64).

    Args:
        weight: a floating-point tensor of rank >= 1, (out_channels, ...).

    Returns:
        A new tensor of the same shape, dtype and device, without autograd history.

    Raises:
        ValueError: ``weight`` is a scalar or not floating point.
    """
    _check_weight(weight)
    with torch.no_grad():
        w = weight.detach().to(torch.float32)
        absmax = w.abs().amax(dim=tuple(range(1, w.ndim)), keepdim=True)  # (C, 1, ...)
        scale = (absmax.double() / INT8_LEVELS).to(torch.float32)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # zero channel: q = 0
        q = torch.clamp(torch.round(w / scale), -INT8_LEVELS, INT8_LEVELS)
        return (q * scale).to(weight.dtype)


def binarize(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` binarized per output channel (axis 0): ``sign(w) * mean|w|``, in float.

    For each channel ``c``: ``scale = mean|weight[c]|`` and every value becomes
    ``+scale`` or ``-scale`` by its sign, so a channel holds one bit per weight and one
    float. The scale (XNOR-Net's, rather than BinaryConnect's bare +-1) keeps each
    channel's L1 norm, so layers keep the magnitude their float training gave them and a
    network without normalisation still works. A zero weight maps to ``+scale``: every
    binarized value is one of two levels (a third level, 0, would need a second bit).
    An all-zero channel has scale 0 and stays zero.

    Args:
        weight: a floating-point tensor of rank >= 1, (out_channels, ...).

    Returns:
        A new tensor of the same shape, dtype and device, without autograd history.

    Raises:
        ValueError: ``weight`` is a scalar or not floating point.
    """
    _check_weight(weight)
    with torch.no_grad():
        w = weight.detach().to(torch.float32)
        scale = w.abs().mean(dim=tuple(range(1, w.ndim)), keepdim=True)  # (C, 1, ...)
        ones = torch.ones_like(w)
        sign = torch.where(w >= 0, ones, -ones)
        return (sign * scale).to(weight.dtype)


def _function(weight_format: WeightFormat) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The kernel arithmetic of ``weight_format`` (None for ``float``: none)."""
    if weight_format == "float":
        return None
    return fake_quantize_int8 if weight_format == "int8" else binarize


def run_weights_(model: _M, weight_format: WeightFormat) -> _M:
    """Put into ``model``, in place, the weights a device of ``weight_format`` runs.

    Every trainable parameter of rank >= 2 is replaced by :func:`fake_quantize_int8`
    (``int8``) or :func:`binarize` (``binary``) of itself, exactly the parameters the
    device's training hooks replace; the others stay. ``float`` changes nothing.
    Returns ``model``.
    """
    function = _function(weight_format)
    if function is None:
        return model
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.ndim >= 2:
                p.copy_(function(p))
    return model


def weights_at(model: nn.Module, weight_format: WeightFormat) -> dict[str, torch.Tensor]:
    """``model``'s parameters by name as a device of ``weight_format`` runs them, for
    :func:`torch.func.functional_call`, with straight-through gradients: each kernel's
    value is its ``weight_format`` value, and its gradient flows to the float parameter
    unchanged (``w + (Q(w) - w).detach()``); the model itself is left as it is."""
    function = _function(weight_format)
    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    if function is None:
        return params
    return {
        name: p + (function(p) - p).detach() if p.requires_grad and p.ndim >= 2 else p
        for name, p in params.items()
    }
