"""Inference-only runtime: classify images with an ONNX model on the device.

This module imports only the standard library, numpy and onnxruntime, never torch, so
that a device deployed for inference (for example with an int8 model from
:func:`models.onnx_export.quantize_onnx_int8`) needs neither torch installed nor its
memory. A test enforces this.

Inputs are never converted silently: the model's input dtype (float32 for every model
this project exports; images scaled to [0, 1]) must be the array's dtype, so a uint8
image must be scaled by the caller, who knows how it was trained.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import onnxruntime as ort

from edge_client.errors import InferenceError

__all__ = ["OnnxClassifier"]

logger = logging.getLogger(__name__)

_ORT_DTYPES: dict[str, np.dtype[Any]] = {
    "tensor(float)": np.dtype(np.float32),
    "tensor(float16)": np.dtype(np.float16),
    "tensor(double)": np.dtype(np.float64),
}


class OnnxClassifier:
    """An ONNX image classifier run by onnxruntime on the CPU.

    Args:
        model: path of an ``.onnx`` file, or the serialized model as bytes. The model
            has one input (batch, C, H, W) with a fixed C, H, W and one output
            (batch, classes) of logits.
        threads: onnxruntime intra-op threads (>= 1); 1 suits small devices and keeps
            latency predictable.

    Raises:
        InferenceError: ``threads`` < 1, the model cannot be read or loaded, or its
            input / output signature is not that of a classifier.
    """

    def __init__(self, model: str | os.PathLike[str] | bytes, *, threads: int = 1) -> None:
        if threads < 1:
            raise InferenceError(f"threads must be >= 1, got {threads}")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3  # errors only; they are raised, not logged
        source: str | bytes = model if isinstance(model, bytes) else os.fspath(model)
        if isinstance(source, str) and not os.path.isfile(source):
            raise InferenceError(f"model file not found: {source}")
        try:
            self._session = ort.InferenceSession(
                source, sess_options=options, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # onnxruntime raises its own pybind error types
            raise InferenceError(f"cannot load ONNX model: {_first_line(exc)}") from exc
        inputs, outputs = self._session.get_inputs(), self._session.get_outputs()
        if len(inputs) != 1 or len(outputs) != 1:
            raise InferenceError(
                f"expected a model with one input and one output, got {len(inputs)} inputs "
                f"and {len(outputs)} outputs"
            )
        meta = inputs[0]
        if len(meta.shape) < 2 or not all(isinstance(d, int) for d in meta.shape[1:]):
            raise InferenceError(
                "expected a model input (batch, *sample_shape) with a fixed sample shape "
                f"(images: C, H, W), got {meta.shape}"
            )
        if meta.type not in _ORT_DTYPES:
            raise InferenceError(f"unsupported model input type {meta.type}")
        self._input_name: str = meta.name
        self._sample_shape: tuple[int, ...] = tuple(meta.shape[1:])
        self._dtype = _ORT_DTYPES[meta.type]
        fixed_batch = meta.shape[0]
        self._fixed_batch: int | None = fixed_batch if isinstance(fixed_batch, int) else None
        classes = outputs[0].shape[-1] if outputs[0].shape else None
        self._num_classes: int | None = classes if isinstance(classes, int) else None
        logger.debug(
            "loaded ONNX classifier: input %s %s, %s classes, %d thread(s)",
            self._input_name,
            meta.shape,
            self._num_classes,
            threads,
        )

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """The shape of one input sample, as the model declares it: (C, H, W) for
        images."""
        return self._sample_shape

    @property
    def num_classes(self) -> int | None:
        """Number of logits per image, or None where the model leaves it symbolic."""
        return self._num_classes

    def predict_logits(self, x: np.ndarray) -> np.ndarray:
        """Logits of a batch of images.

        Args:
            x: images (B, C, H, W), or one image (C, H, W) taken as a batch of 1, of the
                model's input dtype (float32) and image shape; all values finite.

        Returns:
            float logits of shape (B, classes).

        Raises:
            InferenceError: ``x`` is not a numpy array of the model's dtype, rank or
                image shape, is empty, holds NaN / inf, or onnxruntime fails on it.
        """
        batch = self._validate(x)
        try:
            (logits,) = self._session.run(None, {self._input_name: batch})
        except Exception as exc:  # onnxruntime raises its own pybind error types
            raise InferenceError(f"onnxruntime failed: {_first_line(exc)}") from exc
        return np.asarray(logits)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Top-1 class of each image: int64 array of shape (B,).

        Takes the same input as :meth:`predict_logits` and raises the same errors.
        """
        return np.asarray(self.predict_logits(x).argmax(axis=1), dtype=np.int64)

    def _validate(self, x: np.ndarray) -> np.ndarray:
        """Check ``x`` against the model's input; return it as a C-contiguous batch."""
        if not isinstance(x, np.ndarray):
            raise InferenceError(f"expected a numpy array, got {type(x).__name__}")
        if x.dtype != self._dtype:
            raise InferenceError(
                f"expected {self._dtype} input, got {x.dtype}; scale and convert images "
                f"(for example uint8 / 255) before inference"
            )
        rank = len(self._sample_shape)
        if x.ndim == rank:
            x = x[np.newaxis]
        if x.ndim != rank + 1:
            raise InferenceError(
                f"expected input of rank {rank + 1} (B, *{self._sample_shape}) or {rank} "
                f"(one sample), got shape {x.shape}"
            )
        if x.shape[1:] != self._sample_shape:
            raise InferenceError(
                f"expected samples of shape {self._sample_shape}, got {x.shape[1:]} "
                f"(input shape {x.shape})"
            )
        if x.shape[0] == 0:
            raise InferenceError("empty batch")
        if self._fixed_batch is not None and x.shape[0] != self._fixed_batch:
            raise InferenceError(f"model takes batches of {self._fixed_batch}, got {x.shape[0]}")
        if not np.isfinite(x).all():
            raise InferenceError("input holds NaN or infinite values")
        return np.ascontiguousarray(x)


def _first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception message (onnxruntime's are multi-line)."""
    for line in str(exc).splitlines():
        if line.strip():
            return line.strip()
    return type(exc).__name__
