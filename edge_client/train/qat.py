"""int8 quantization-aware training: fake-quantized weights, straight-through gradients.

Devices that run the int8 ONNX model (:func:`models.onnx_export.quantize_onnx_int8`)
do not run the float weights they were trained with: onnxruntime's static quantizer
stores the weight of every Conv and Gemm (torch's ``Conv2d`` and ``Linear``) as int8,
*symmetric* (zero point 0, range [-127, 127]) and *per output channel*, with
``scale = max|w| / 127`` for each channel, and computes with ``round(w / scale) * scale``.
:func:`~models.weight_formats.fake_quantize_int8` computes exactly that in torch
(round half to even, like numpy's ``round``; the scale rounded from float64, as
onnxruntime does), so training can see the weights the device will run.

:class:`FakeQuantHook` (``TrainConfig.qat``) implements the straight-through estimator
(STE) inside :func:`edge_client.train.training.train_local`, one batch at a time:

1. ``before_batch``: keep the float ("master") value of every trainable parameter of
   rank >= 2 and overwrite it in place with its fake-quantized value;
2. the forward pass and ``backward()`` run at the quantized point ``Q(w)``, so the loss
   is the loss of the model the device will run and the gradient is ``dL/dQ(w)``;
3. ``before_step``: put the float values back; the optimizer then applies
   ``dL/dQ(w)`` to the float weights (the STE takes ``dQ(w)/dw`` as the identity).

Small updates thus accumulate in the float weights until they move a weight across a
quantization step, which rounding every step would never do. Biases and normalisation
parameters (rank 1) stay float: onnxruntime keeps normalisation in float and quantizes
biases to int32 with a scale far finer than the weights'. Activations are not
fake-quantized: the quantizer calibrates their uint8 ranges on the device's data later.
The loss and accuracy that :func:`~edge_client.train.training.train_local` reports are those
of the quantized weights.

Pure: tensors in, tensors out; no I/O, no global state.
"""

from __future__ import annotations

import torch
from torch import nn

from edge_client.train.training import TrainHook
from models.weight_formats import INT8_LEVELS, fake_quantize_int8

__all__ = ["INT8_LEVELS", "FakeQuantHook", "fake_quantize_int8"]


class FakeQuantHook(TrainHook):
    """Trains the float weights through their int8 fake-quantized values (the STE).

    Every trainable parameter of rank >= 2 (convolution and linear weights) is replaced
    by :func:`fake_quantize_int8` of itself in :meth:`before_batch` and restored in
    :meth:`before_step`, so the forward and backward passes see the int8 weights and the
    optimizer updates the float ones. Place it after hooks whose ``before_batch`` should
    see the float model (FedKF's generator training). Subclasses train through another
    format by overriding :meth:`run_value`
    (:class:`~edge_client.train.binary.BinarizeHook`).
    """

    def __init__(self) -> None:
        self._saved: list[tuple[nn.Parameter, torch.Tensor]] = []

    def before_batch(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad and p.ndim >= 2:
                    self._saved.append((p, p.detach().clone()))
                    p.copy_(self.run_value(p))

    def run_value(self, weight: torch.Tensor) -> torch.Tensor:
        """The value the device runs ``weight`` at: :func:`fake_quantize_int8`."""
        return fake_quantize_int8(weight)

    def before_step(self, model: nn.Module) -> None:
        self._restore()

    def _restore(self) -> None:
        with torch.no_grad():
            for p, float_value in self._saved:
                p.copy_(float_value)
        self._saved = []
