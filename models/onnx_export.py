"""ONNX export, fp32/int8 parity checks and static int8 quantization of classifiers.

The deployment path for inference-only devices: a trained classifier is exported to
ONNX (:func:`export_onnx`), optionally quantized to int8 with onnxruntime's static
QDQ quantizer calibrated on the device's own samples (:func:`quantize_onnx_int8`), and
run on the device by :class:`edge_client.serve.infer.OnnxClassifier`, which needs only numpy
and onnxruntime. :func:`onnx_parity` and :func:`top1_agreement` measure what the export
and the quantization cost in accuracy.

Devices that receive the fleet's weights after every round but have neither torch nor
onnx get a *template* instead: :mod:`models.onnx_template`, which uses the export
helpers here.

Every function takes and returns bytes / arrays; files are used only internally, in a
temporary directory, where onnxruntime's quantizer requires paths.
"""

from __future__ import annotations

import logging
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_static,
)
from onnxruntime.quantization.shape_inference import quant_pre_process
from torch import nn

from models.errors import ModelError

__all__ = [
    "INPUT_NAME",
    "OUTPUT_NAME",
    "export_onnx",
    "onnx_parity",
    "quantize_onnx_int8",
    "top1_agreement",
]

logger = logging.getLogger(__name__)

INPUT_NAME = "input"
"""Name of the graph input of every exported model: float32 images (batch, C, H, W)."""
OUTPUT_NAME = "logits"
"""Name of the graph output of every exported model: float32 logits (batch, classes)."""

_BATCH_DIM = "batch"
_CALIBRATION_BATCH = 64  # images per calibration step of the int8 quantizer
_RUN_CHUNK = 1024  # images per onnxruntime call when scoring large arrays


def export_onnx(model: nn.Module, input_shape: tuple[int, ...], *, opset: int = 17) -> bytes:
    """Export ``model`` to a serialized ONNX model with a dynamic batch dimension.

    Uses torch's TorchScript-based exporter (``torch.onnx.export(..., dynamo=False)``):
    on torch 2.13 it exports every registry classifier in a fraction of a second and
    produces a plain graph, while the dynamo exporter takes seconds per model. The model
    is traced in eval mode (its training flag is restored afterwards) on the device of
    its parameters.

    Args:
        model: the module to export; ``forward`` maps (B, C, H, W) float32 images to
            (B, classes) logits.
        input_shape: the shape of one input sample ((C, H, W) for images).
        opset: ONNX opset version of the exported graph.

    Returns:
        The serialized ``onnx.ModelProto``: input ``"input"`` of shape
        ("batch", C, H, W), output ``"logits"`` of shape ("batch", classes), both float32.

    Raises:
        ModelError: the shape is invalid, the exporter failed, or the exported model
            fails ``onnx.checker.check_model`` or lacks a symbolic batch dimension.
    """
    data = torchscript_export(
        model, input_shape, opset=opset, constant_folding=True, initializers_as_inputs=False
    )
    check_batch_dim(load_checked(data, what="exported model"))
    logger.debug("exported %s to ONNX: %d bytes, opset %d", type(model).__name__, len(data), opset)
    return data


def onnx_parity(model: nn.Module, onnx_bytes: bytes, inputs: np.ndarray) -> float:
    """Largest absolute difference between the logits of ``model`` and its ONNX export.

    Args:
        model: the torch module (run in eval mode, without gradients; its training flag
            is restored afterwards).
        onnx_bytes: the serialized export of ``model``.
        inputs: float32 images (N, C, H, W) with N >= 1.

    Returns:
        max |torch logits - onnxruntime logits| over all outputs (logit units).

    Raises:
        ModelError: the inputs are malformed or the ONNX model cannot be run on them.
    """
    x = _check_images(inputs)
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            expected = model(torch.from_numpy(x).to(device)).cpu().numpy()
    finally:
        model.train(was_training)
    actual = _run_logits(_session(onnx_bytes), x)
    if actual.shape != expected.shape:
        raise ModelError(f"ONNX output shape {actual.shape} != torch shape {expected.shape}")
    return float(np.max(np.abs(actual.astype(np.float64) - expected.astype(np.float64))))


def quantize_onnx_int8(
    onnx_bytes: bytes, calibration: np.ndarray, *, per_channel: bool = True
) -> bytes:
    """Statically quantize an fp32 ONNX classifier to int8 (QDQ format).

    Follows onnxruntime's recommended recipe: the model is first pre-processed
    (symbolic shape inference and graph optimization, ``quant_pre_process``), then
    quantized with ``quantize_static`` using MinMax calibration over ``calibration``:
    uint8 activations and int8 weights (U8S8, the CPU default), per output channel for
    weights if ``per_channel``. The result is then stripped for deployment: shape
    annotations (``value_info``), node names and doc strings are dropped and activation
    tensors get short names (``a0``, ``a1``, ...; never a name kept); the names of the
    initializers (the weights, whatever names onnxruntime gave them) and the graph's
    input and output names are kept. Nothing here depends on the names onnxruntime
    chooses. onnxruntime's quantizer logs its warnings (for instance on per-channel axes
    of GroupNorm constants) through the root logger; they are re-logged at DEBUG on this
    module's logger.

    Args:
        onnx_bytes: a serialized fp32 model as returned by :func:`export_onnx`.
        calibration: float32 images (N, C, H, W), N >= 1, representative of the data the
            device will classify (its own samples); N of a few hundred is plenty.
        per_channel: quantize weights per output channel (more accurate) rather than
            per tensor.

    Returns:
        The serialized int8 QDQ model, same input/output names and shapes.

    Raises:
        ModelError: the calibration data is malformed or quantization failed.
    """
    x = _check_images(calibration)
    proto = load_checked(onnx_bytes, what="fp32 model")
    input_name = proto.graph.input[0].name
    with tempfile.TemporaryDirectory(prefix="edgefl-quant-") as tmp:
        fp32_path = Path(tmp) / "fp32.onnx"
        pre_path = Path(tmp) / "fp32-pre.onnx"
        int8_path = Path(tmp) / "int8.onnx"
        fp32_path.write_bytes(onnx_bytes)
        try:
            with root_warnings_to_debug():
                quant_pre_process(fp32_path, pre_path)
                quantize_static(
                    pre_path,
                    int8_path,
                    _ArrayDataReader(input_name, x, _CALIBRATION_BATCH),
                    quant_format=QuantFormat.QDQ,
                    per_channel=per_channel,
                    activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8,
                    calibrate_method=CalibrationMethod.MinMax,
                )
        except Exception as exc:
            raise ModelError(f"int8 quantization failed: {exc}") from exc
        quantized = load_checked(int8_path.read_bytes(), what="int8 model")
    _strip_for_deployment(quantized)
    data: bytes = quantized.SerializeToString()
    load_checked(data, what="stripped int8 model")
    logger.debug("quantized ONNX model: %d -> %d bytes", len(onnx_bytes), len(data))
    return data


def top1_agreement(fp32_bytes: bytes, int8_bytes: bytes, inputs: np.ndarray) -> float:
    """Fraction of ``inputs`` on which two ONNX models predict the same class.

    Args:
        fp32_bytes: the reference model (serialized ONNX).
        int8_bytes: the model to compare, typically the int8 quantization of the first.
        inputs: float32 images (N, C, H, W), N >= 1.

    Returns:
        The agreement of the two top-1 predictions, in [0, 1].

    Raises:
        ModelError: the inputs are malformed or a model cannot be run on them.
    """
    x = _check_images(inputs)
    reference = _run_logits(_session(fp32_bytes), x).argmax(axis=1)
    candidate = _run_logits(_session(int8_bytes), x).argmax(axis=1)
    return float(np.mean(reference == candidate))


class _ArrayDataReader(CalibrationDataReader):  # type: ignore[misc]
    """Feeds an in-memory image array to the calibrator in fixed-size batches."""

    def __init__(self, input_name: str, images: np.ndarray, batch_size: int) -> None:
        self._input_name = input_name
        self._images = images
        self._batch_size = batch_size
        self._batches = self._iterate()

    def _iterate(self) -> Iterator[dict[str, np.ndarray]]:
        for start in range(0, len(self._images), self._batch_size):
            yield {self._input_name: self._images[start : start + self._batch_size]}

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._batches, None)

    def rewind(self) -> None:
        self._batches = self._iterate()


def _strip_for_deployment(proto: onnx.ModelProto) -> None:
    """Drop what inference does not need and shorten activation names, in place."""
    graph = proto.graph
    del graph.value_info[:]
    graph.doc_string = ""
    proto.doc_string = ""
    keep = {t.name for t in graph.initializer} | {""}
    keep |= {t.name for t in graph.input} | {t.name for t in graph.output}
    short: dict[str, str] = {}

    def rename(name: str) -> str:
        if name in keep:
            return name
        if name not in short:
            new = f"a{len(short)}"
            while new in keep:  # whatever names the exporter and the quantizer chose
                new = f"_{new}"
            short[name] = new
        return short[name]

    for node in graph.node:
        node.name = ""
        node.doc_string = ""
        node.input[:] = [rename(name) for name in node.input]
        node.output[:] = [rename(name) for name in node.output]


def torchscript_export(
    model: nn.Module,
    input_shape: tuple[int, ...],
    *,
    opset: int,
    constant_folding: bool,
    initializers_as_inputs: bool,
) -> bytes:
    """Serialized TorchScript export of ``model`` (eval mode; training flag restored)."""
    if not 1 <= len(input_shape) <= 8 or any(int(d) < 1 for d in input_shape):
        raise ModelError(
            f"input_shape must be 1 to 8 positive sizes ((C, H, W) for images), got {input_shape}"
        )
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dummy = torch.zeros((1, *input_shape), dtype=torch.float32, device=device)
    was_training = model.training
    model.eval()
    try:
        with tempfile.TemporaryDirectory(prefix="edgefl-export-") as tmp, warnings.catch_warnings():
            # The TorchScript exporter is deprecated in favour of dynamo; see export_onnx.
            warnings.simplefilter("ignore", DeprecationWarning)
            # F.group_norm checks a size in Python; traced as a constant, as it should be.
            warnings.filterwarnings(
                "ignore", "Converting a tensor to a Python boolean", module=r"torch\.nn\.functional"
            )
            path = Path(tmp) / "model.onnx"
            torch.onnx.export(
                model,
                (dummy,),
                path,
                dynamo=False,
                input_names=[INPUT_NAME],
                output_names=[OUTPUT_NAME],
                dynamic_axes={INPUT_NAME: {0: _BATCH_DIM}, OUTPUT_NAME: {0: _BATCH_DIM}},
                opset_version=opset,
                do_constant_folding=constant_folding,
                keep_initializers_as_inputs=initializers_as_inputs,
            )
            return path.read_bytes()
    except Exception as exc:
        raise ModelError(f"ONNX export of {type(model).__name__} failed: {exc}") from exc
    finally:
        model.train(was_training)


def check_batch_dim(proto: onnx.ModelProto) -> None:
    """Raise ModelError unless the first graph input has a symbolic batch dimension."""
    batch_dim = proto.graph.input[0].type.tensor_type.shape.dim[0]
    if not batch_dim.dim_param:
        raise ModelError("exported model has a fixed batch dimension; expected a symbolic one")


@contextmanager
def root_warnings_to_debug() -> Iterator[None]:
    """Re-log records sent straight to the root logger (onnxruntime's) at DEBUG here."""

    def demote(record: logging.LogRecord) -> bool:
        logger.debug("onnxruntime.quantization: %s", record.getMessage())
        return False

    root = logging.getLogger()
    root.addFilter(demote)
    try:
        yield
    finally:
        root.removeFilter(demote)


def _check_images(images: np.ndarray) -> np.ndarray:
    """Validate a float32 (N, *sample_shape) array with N >= 1 (images: (N, C, H, W));
    return it C-contiguous."""
    if not isinstance(images, np.ndarray) or images.dtype != np.float32:
        dtype = getattr(images, "dtype", type(images).__name__)
        raise ModelError(f"expected a float32 numpy array of images, got {dtype}")
    if images.ndim < 2 or images.shape[0] < 1:
        raise ModelError(f"expected samples of shape (N>=1, *sample_shape), got {images.shape}")
    return np.ascontiguousarray(images)


def load_checked(data: bytes, *, what: str) -> onnx.ModelProto:
    """Parse serialized ONNX and run the checker; raise ModelError if either fails."""
    try:
        proto = onnx.load_from_string(data)
        onnx.checker.check_model(proto)
    except Exception as exc:
        raise ModelError(f"{what} is not a valid ONNX model: {exc}") from exc
    return proto


def _session(onnx_bytes: bytes) -> ort.InferenceSession:
    """A single-threaded CPU onnxruntime session over serialized ONNX."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # errors only
    try:
        return ort.InferenceSession(
            onnx_bytes, sess_options=options, providers=["CPUExecutionProvider"]
        )
    except Exception as exc:
        raise ModelError(f"onnxruntime cannot load the model: {exc}") from exc


def _run_logits(session: ort.InferenceSession, images: np.ndarray) -> np.ndarray:
    """Logits (N, classes) of ``session`` over ``images``, in chunks of _RUN_CHUNK."""
    input_name = session.get_inputs()[0].name
    chunks: list[np.ndarray] = []
    try:
        for start in range(0, len(images), _RUN_CHUNK):
            (logits,) = session.run(None, {input_name: images[start : start + _RUN_CHUNK]})
            chunks.append(np.asarray(logits))
    except Exception as exc:
        raise ModelError(f"onnxruntime failed to run the model: {exc}") from exc
    return np.concatenate(chunks, axis=0)
