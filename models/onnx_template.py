"""ONNX templates: models whose weights an inference-only device replaces with numpy alone.

Devices that receive the fleet's weights after every round but have neither torch nor
onnx get a *template* (:func:`export_template`, fp32 or dynamically quantized int8): an
ONNX model whose float initializers keep their ``state_dict`` names, into which
:class:`edge_client.serve.template.OnnxTemplate` writes new weights with numpy alone.
The int8 weights of a template are found by the graph's structure (the integer node
that consumes them), never by the names onnxruntime gives them, and the template's
metadata says which ``state_dict`` tensor each of them quantizes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from pathlib import Path
from typing import Literal

import onnx
import torch
from onnxruntime.quantization import QuantType, quantize_dynamic
from torch import nn

from models.errors import ModelError
from models.onnx_export import (
    check_batch_dim,
    load_checked,
    root_warnings_to_debug,
    torchscript_export,
)
from protocol import template_meta as meta

__all__ = ["export_template"]

logger = logging.getLogger(__name__)

_FLOAT_TYPES = frozenset(
    {
        onnx.TensorProto.FLOAT,
        onnx.TensorProto.FLOAT16,
        onnx.TensorProto.DOUBLE,
        onnx.TensorProto.BFLOAT16,
    }
)
# Ops whose weights an int8 template quantizes: Conv -> ConvInteger, and MatMul (which
# includes every Gemm: quantize_dynamic rewrites Gemm as MatMul + Add) -> MatMulInteger.
_INT8_OP_TYPES = ("Conv", "MatMul")
# The integer op of an int8 template -> the fp32 ops it may replace.
_INTEGER_OPS = {"ConvInteger": ("Conv",), "MatMulInteger": ("Gemm", "MatMul")}
_DEFAULT_DOMAINS = ("", "ai.onnx")


def export_template(
    model: nn.Module,
    input_shape: tuple[int, int, int],
    *,
    precision: Literal["fp32", "int8"] = "fp32",
    model_name: str = "",
    opset: int = 17,
) -> bytes:
    """Export ``model`` as an ONNX *template* whose weights a device can replace.

    A template is what an inference-only device gets at provisioning time; after each
    round :class:`edge_client.serve.template.OnnxTemplate` writes the fleet's new weights
    into it (numpy only, no torch, no onnx). For that every weight must be an
    initializer named by its ``state_dict`` key, so the export differs from
    :func:`export_onnx` in two settings of the same TorchScript exporter (same input
    and output names, same symbolic batch dimension):

    - ``do_constant_folding=False``: no weight is folded into a renamed constant
      (a folded Conv bias or a pre-transposed Gemm weight would lose its name);
    - ``keep_initializers_as_inputs=True``, after which the weights are removed from
      the graph inputs again: it skips the exporter's de-duplication pass, which
      otherwise merges parameters of equal value (GroupNorm weights, all ones at
      initialisation) into one initializer, so that a later update of one of them
      would be lost.

    The template carries ``model``'s own weights, so it is a working model as it is.

    Which initializers a template may hold (checked here; :class:`ModelError`
    otherwise): every float initializer is a float32 ``state_dict`` key of the same
    shape, and every floating ``state_dict`` tensor is an initializer, except for one
    tied to another (the same storage, as ``b.weight = a.weight`` makes it), whose
    values the initializer of its twin carries. The device treats every float
    initializer as a fleet weight, so one that is not a ``state_dict`` key would be
    refused rather than frozen (the TorchScript exporter names initializers after
    ``state_dict`` keys, so this is a safeguard); a ``state_dict`` tensor that
    ``forward`` does not use could not receive the fleet's updates, so it is refused.
    Constants are kept as they are: with folding off the exporter writes tensors that
    are not parameters or buffers (and non-persistent buffers) as ``Constant`` nodes,
    and non-float initializers (int64 shapes) are never weights. Integer ``state_dict``
    buffers (e.g. ``num_batches_tracked``) need not appear.

    ``precision="int8"`` runs onnxruntime's ``quantize_dynamic`` on that fp32 template:
    weights int8, activations quantized per batch at run time
    (``DynamicQuantizeLinear``), so no calibration data is involved and the template
    stays valid whatever the weights become. The settings, all of which run on the CPU
    execution provider for every registry classifier:

    - ``op_types_to_quantize=["Conv", "MatMul"]``: ``Conv`` becomes ``ConvInteger``;
      ``quantize_dynamic`` rewrites every ``Gemm`` (``nn.Linear``) as ``MatMul`` +
      ``Add``, storing the weight transposed under its own name, and the ``MatMul``
      becomes ``MatMulInteger``. Biases and normalisation weights stay float32. That
      rewrite assumes each Gemm weight has one user, so an int8 template of a model
      whose Linear weights are shared (tied) is refused.
    - ``weight_type=QInt8`` with ``WeightSymmetric=True``, ``reduce_range=False``:
      symmetric int8 weights, zero point 0 (``scale = max|w| / 127``); see
      :mod:`edge_client.serve.template` for the exact formula.
    - ``per_channel=True``: ``MatMulInteger`` weights get one scale per output column;
      onnxruntime's dynamic ``ConvInteger`` quantizer ignores the flag, so ``Conv``
      weights are quantized per tensor.

    Each quantized weight is three initializers, found by the graph's structure and
    never by the names onnxruntime gives them (which change between its versions): a
    ``ConvInteger`` / ``MatMulInteger`` node takes the int8 weight as input 1 and its
    int8 zero point as input 3; its input 0 comes from a ``DynamicQuantizeLinear``,
    and its output goes through ``Cast`` to a ``Mul`` by the product
    ``Mul(activation scale, weight scale)``, the weight scale being a float32
    initializer. The fleet tensor each node quantizes is found by matching the node to
    the fp32 ``Conv`` / ``Gemm`` / ``MatMul`` it replaces (same input activation; the
    ``Mul``, or the bias ``Add`` after it, produces that node's output) and recorded
    in the template's metadata.

    Metadata (``ModelProto.metadata_props``): ``edgefl.template`` = ``"1"``,
    ``edgefl.precision`` = ``precision``, ``edgefl.model`` = ``model_name``, and for
    int8 templates ``edgefl.quantization`` = :data:`protocol.template_meta.INT8_SCHEME`,
    ``edgefl.int8_weights`` = a JSON list with, for each ``ConvInteger`` /
    ``MatMulInteger`` node in graph order, the ``state_dict`` name of the weight it
    quantizes, and ``edgefl.transposed`` = a JSON list of the weights stored
    transposed (the Gemm weights), which a device cannot tell from shapes alone
    (square matrices); last ``edgefl.exported_graph``, the SHA-256 of the serialized
    graph, by which a device tells a template never filled with trained weights
    (:data:`protocol.template_meta.EXPORTED_GRAPH`).

    The device side checks the finished template as it will use it
    (:func:`edge_client.serve.checks.verify_template`, which ``python -m edge_client
    template`` runs on every export; ``models`` may not import the device's code): it
    must load, need only ``model``'s float ``state_dict`` tensors (with their shapes),
    and render ``model``'s own weights back into the same bytes (for int8: the device's
    quantization reproduces onnxruntime's bit for bit, and every quantized weight maps
    to the right tensor). A change of onnxruntime that breaks any of this fails there,
    at export, rather than on a device.

    Args:
        model: the classifier; ``forward`` maps (B, C, H, W) float32 images to logits.
            Traced in eval mode on the device of its parameters; left unchanged.
        input_shape: (C, H, W) of one input image.
        precision: ``"fp32"`` or ``"int8"``.
        model_name: recorded as ``edgefl.model`` (e.g. the registry name).
        opset: ONNX opset version of the exported graph.

    Returns:
        The serialized ONNX template.

    Raises:
        ModelError: ``precision`` or the shape is invalid, the export or the
            quantization failed, an initializer breaks the rules above or is a shared
            Gemm weight of an int8 template (the message names it), the quantized graph
            does not have the structure above.
    """
    if precision not in ("fp32", "int8"):
        raise ModelError(f"precision must be 'fp32' or 'int8', got {precision!r}")
    data = torchscript_export(
        model, input_shape, opset=opset, constant_folding=False, initializers_as_inputs=True
    )
    proto = load_checked(data, what="exported template")
    weight_names = {t.name for t in proto.graph.initializer}
    kept_inputs = [i for i in proto.graph.input if i.name not in weight_names]
    del proto.graph.input[:]
    proto.graph.input.extend(kept_inputs)
    check_batch_dim(proto)
    _check_template_weights(proto, model)
    transposed: list[str] = []
    int8_weights: list[str] = []
    if precision == "int8":
        transposed = _gemm_transposed_weights(proto)
        fp32 = proto
        proto = _quantize_template(fp32)
        int8_weights = _int8_weight_sources(fp32, proto, transposed)
    _set_template_metadata(proto, precision, model_name, transposed, int8_weights)
    template: bytes = proto.SerializeToString()
    load_checked(template, what=f"{precision} template")
    logger.debug(
        "exported %s as an %s template: %d bytes", type(model).__name__, precision, len(template)
    )
    return template


def _check_template_weights(proto: onnx.ModelProto, model: nn.Module) -> None:
    """Float initializers == floating state_dict tensors, float32, same names and shapes."""
    state = model.state_dict()
    found: set[str] = set()
    for tensor in proto.graph.initializer:
        if tensor.data_type not in _FLOAT_TYPES:
            continue
        if tensor.name not in state:
            raise ModelError(
                f"template initializer {tensor.name!r} is a float tensor but not a state_dict "
                f"key of {type(model).__name__}; the fleet's weights could not update it"
            )
        if tensor.data_type != onnx.TensorProto.FLOAT:
            type_name = onnx.TensorProto.DataType.Name(tensor.data_type)
            raise ModelError(
                f"template initializer {tensor.name!r} is {type_name}; templates hold float32 "
                "weights only"
            )
        shape = tuple(state[tensor.name].shape)
        if tuple(tensor.dims) != shape:
            raise ModelError(
                f"template initializer {tensor.name!r} has shape {tuple(tensor.dims)}, its "
                f"state_dict tensor {shape}"
            )
        found.add(tensor.name)
    present = {_storage_key(state[name]) for name in found}
    missing = [
        name
        for name, t in state.items()
        if t.is_floating_point() and name not in found and _storage_key(t) not in present
    ]
    if missing:
        raise ModelError(
            f"state_dict tensors {missing} of {type(model).__name__} are not initializers of "
            "the exported graph (forward does not use them); a template could not apply the "
            "fleet's updates to them"
        )


def _storage_key(tensor: torch.Tensor) -> tuple[object, ...]:
    """Identifies a tensor's memory view: equal for tied parameters."""
    return (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tensor.stride())


def _gemm_transposed_weights(proto: onnx.ModelProto) -> list[str]:
    """Initializers quantize_dynamic will store transposed: B of Gemm(transB=1) it rewrites.

    Mirrors onnxruntime's ``ONNXModel.replace_gemm_with_matmul``: a Gemm with alpha = beta
    = 1, transA = 0 and transB = 1 whose B is an initializer becomes MatMul(A, B^T), B^T
    being a new initializer (under B's own name up to onnxruntime 1.31, under a new name
    since 1.32; the name does not matter here). Up to 1.31 that rewrite assumes no other
    node uses B (a second Gemm would transpose it back, silently computing with the
    wrong layout), so a weight shared by several nodes raises ModelError.
    """
    initializers = {t.name for t in proto.graph.initializer}
    uses: dict[str, int] = {}
    for node in proto.graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    names: list[str] = []
    for node in proto.graph.node:
        if node.op_type != "Gemm" or node.domain not in ("", "ai.onnx"):
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        plain = attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0
        if plain and attrs.get("transA", 0) == 0 and attrs.get("transB", 0) == 1:
            b = node.input[1]
            if b not in initializers:
                continue
            if uses[b] > 1:
                raise ModelError(
                    f"int8 template: weight {b!r} is used by {uses[b]} nodes; onnxruntime's "
                    "dynamic quantizer rewrites Gemm weights in place and only supports "
                    "unshared ones (export an fp32 template instead)"
                )
            names.append(b)
    return names


def _quantize_template(fp32: onnx.ModelProto) -> onnx.ModelProto:
    """quantize_dynamic with the template settings (see export_template)."""
    source = onnx.ModelProto()
    source.CopyFrom(fp32)
    with tempfile.TemporaryDirectory(prefix="edgefl-template-") as tmp:
        int8_path = Path(tmp) / "int8.onnx"
        try:
            with root_warnings_to_debug():
                quantize_dynamic(
                    source,
                    int8_path,
                    op_types_to_quantize=list(_INT8_OP_TYPES),
                    per_channel=True,
                    reduce_range=False,
                    weight_type=QuantType.QInt8,
                    extra_options={"WeightSymmetric": True, "MatMulConstBOnly": True},
                )
        except Exception as exc:
            raise ModelError(f"int8 quantization of the template failed: {exc}") from exc
        return load_checked(int8_path.read_bytes(), what="int8 template")


def _int8_weight_sources(
    fp32: onnx.ModelProto, int8: onnx.ModelProto, transposed: list[str]
) -> list[str]:
    """The fp32 weight each ConvInteger / MatMulInteger node of ``int8`` quantizes.

    Found by structure alone (see :func:`export_template`): each integer node is
    matched to the fp32 Conv / Gemm / MatMul it replaces, which reads the same
    activation and whose output the integer node's ``Mul`` (or the bias ``Add`` after
    it) produces; none of the names onnxruntime gives the new initializers and nodes is
    used. Also checks the layout :mod:`edge_client.serve.template` relies on: every fp32
    weight is in ``int8`` either as a float32 initializer of the same name and shape
    or as an int8 weight in the expected layout (transposed for the ``transposed``
    Gemm weights); every other float initializer is a weight scale and every int8
    initializer a quantized weight or its zero point. So a change of onnxruntime fails
    here rather than on a device.

    Returns:
        One ``state_dict`` name per integer node, in graph order.

    Raises:
        ModelError: the quantized graph does not have the expected structure.
    """
    weights = {t.name: tuple(t.dims) for t in fp32.graph.initializer if t.data_type in _FLOAT_TYPES}
    replaced: dict[str, onnx.NodeProto] = {}  # output of an fp32 Conv / Gemm / MatMul
    for node in fp32.graph.node:
        if (
            node.domain in _DEFAULT_DOMAINS
            and node.op_type in ("Conv", "Gemm", "MatMul")
            and len(node.input) > 1
            and node.input[1] in weights
        ):
            replaced[node.output[0]] = node
    tensors = {t.name: t for t in int8.graph.initializer}
    producers = {name: node for node in int8.graph.node for name in node.output if name}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in int8.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    sources: list[str] = []
    quantized: dict[str, tuple[str, str, str]] = {}  # int8 values -> (weight, scale, zero)
    derived: set[str] = set()
    for position, node in enumerate(int8.graph.node):
        if node.op_type not in _INTEGER_OPS or node.domain not in _DEFAULT_DOMAINS:
            continue
        what = f"int8 template: {node.op_type} node #{position}"
        values, scale, zero_point, dq_input, scaled = _integer_weight(
            node, what, tensors, producers, consumers
        )
        source = _replaced_node(scaled, replaced, consumers)
        if (
            source is None
            or source.op_type not in _INTEGER_OPS[node.op_type]
            or source.input[0] != dq_input
        ):
            raise ModelError(
                f"{what} matches no fp32 {' / '.join(_INTEGER_OPS[node.op_type])} node of the "
                "template (same input, same output); cannot tell which weight it quantizes"
            )
        name = source.input[1]
        expected = weights[name][::-1] if name in transposed else weights[name]
        if tuple(values.dims) != expected:
            raise ModelError(
                f"int8 template: weight {name!r} has layout {tuple(values.dims)}, expected "
                f"{expected}"
            )
        triple = (name, scale.name, zero_point.name)
        if quantized.setdefault(values.name, triple) != triple:
            raise ModelError(
                f"int8 template: one int8 initializer quantizes two weights ({name!r})"
            )
        sources.append(name)
    for values_name, (_, scale_name, zero_point_name) in quantized.items():
        for tensor_name in (values_name, scale_name, zero_point_name):
            if tensor_name in derived:
                raise ModelError("int8 template: quantized weights share an initializer")
            derived.add(tensor_name)

    by_source = {name for name, _, _ in quantized.values()}
    for name, dims in weights.items():
        if name in by_source:
            continue
        tensor = tensors.get(name)
        if tensor is None:
            raise ModelError(f"int8 template: weight {name!r} is missing after quantization")
        if tensor.data_type != onnx.TensorProto.FLOAT or tuple(tensor.dims) != dims:
            raise ModelError(
                f"int8 template: weight {name!r} is not kept as float32 of shape {dims}"
            )
    for tensor in int8.graph.initializer:
        if tensor.name in derived:
            continue
        if tensor.data_type in _FLOAT_TYPES and tensor.name not in weights:
            raise ModelError(f"int8 template: unexpected float initializer {tensor.name!r}")
        if tensor.data_type == onnx.TensorProto.INT8:
            raise ModelError(
                f"int8 template: int8 initializer {tensor.name!r} is not the weight or the "
                "zero point of a ConvInteger / MatMulInteger node"
            )
    if not sources:
        raise ModelError("int8 template: the model has no Conv or Linear weight to quantize")
    return sources


def _integer_weight(
    node: onnx.NodeProto,
    what: str,
    tensors: dict[str, onnx.TensorProto],
    producers: dict[str, onnx.NodeProto],
    consumers: dict[str, list[onnx.NodeProto]],
) -> tuple[onnx.TensorProto, onnx.TensorProto, onnx.TensorProto, str, str]:
    """(weight, scale, zero point, fp32 activation, scaled output) of an integer node.

    The structure quantize_dynamic writes (``x`` the fp32 activation)::

        x_q, x_scale, x_zero = DynamicQuantizeLinear(x)
        y_int32 = ConvInteger | MatMulInteger(x_q, weight, x_zero, weight_zero_point)
        scales  = Mul(x_scale, weight_scale)      # either order; weight_scale float32
        scaled  = Mul(Cast(y_int32, to=FLOAT), scales)   # either order

    ``weight`` and ``weight_zero_point`` are int8 initializers, ``weight_scale`` a
    float32 initializer. Raises ModelError (``what`` first) where the graph differs.
    """

    def fail(detail: str) -> ModelError:
        return ModelError(f"{what}: {detail}; not the layout of onnxruntime's quantize_dynamic")

    def initializer(name: str, data_type: int) -> onnx.TensorProto | None:
        tensor = tensors.get(name)
        return tensor if tensor is not None and tensor.data_type == data_type else None

    def sole_consumer(name: str, op_type: str) -> onnx.NodeProto:
        users = consumers.get(name, [])
        if len(users) != 1 or users[0].op_type != op_type:
            raise fail(f"{name!r} is not used by exactly one {op_type}")
        return users[0]

    if len(node.input) != 4 or len(node.output) != 1:
        raise fail("expected 4 inputs and 1 output")
    values = initializer(node.input[1], onnx.TensorProto.INT8)
    zero_point = initializer(node.input[3], onnx.TensorProto.INT8)
    if values is None or zero_point is None:
        raise fail("inputs 1 and 3 are not int8 initializers")
    dq = producers.get(node.input[0])
    if (
        dq is None
        or dq.op_type != "DynamicQuantizeLinear"
        or len(dq.output) != 3
        or dq.output[0] != node.input[0]
        or dq.output[2] != node.input[2]
    ):
        raise fail("inputs 0 and 2 do not come from one DynamicQuantizeLinear")
    cast = sole_consumer(node.output[0], "Cast")
    scaled = sole_consumer(cast.output[0], "Mul")
    if len(scaled.input) != 2 or cast.output[0] not in scaled.input:
        raise fail("the Cast output is not multiplied by the scales")
    scales_name = scaled.input[1] if scaled.input[0] == cast.output[0] else scaled.input[0]
    scales = producers.get(scales_name)
    if scales is None or scales.op_type != "Mul" or len(scales.input) != 2:
        raise fail("the scales are not a Mul")
    if dq.output[1] not in scales.input:
        raise fail("the scales do not include the activation scale")
    other = scales.input[1] if scales.input[0] == dq.output[1] else scales.input[0]
    scale = initializer(other, onnx.TensorProto.FLOAT)
    if scale is None:
        raise fail("the weight scale is not a float32 initializer")
    return values, scale, zero_point, dq.input[0], scaled.output[0]


def _replaced_node(
    scaled: str, replaced: dict[str, onnx.NodeProto], consumers: dict[str, list[onnx.NodeProto]]
) -> onnx.NodeProto | None:
    """The fp32 node whose output ``scaled`` is, directly or after one bias ``Add``."""
    if scaled in replaced:
        return replaced[scaled]
    users = consumers.get(scaled, [])
    if len(users) == 1 and users[0].op_type == "Add" and len(users[0].output) == 1:
        return replaced.get(users[0].output[0])
    return None


def _set_template_metadata(
    proto: onnx.ModelProto,
    precision: str,
    model_name: str,
    transposed: list[str],
    int8_weights: list[str],
) -> None:
    """Replace any ``edgefl.*`` metadata of ``proto`` with the template's, in place."""
    kept = [(e.key, e.value) for e in proto.metadata_props if not e.key.startswith("edgefl.")]
    entries = [
        *kept,
        (meta.TEMPLATE, meta.TEMPLATE_VERSION),
        (meta.PRECISION, precision),
        (meta.MODEL, model_name),
    ]
    if precision == "int8":
        entries.append((meta.QUANTIZATION, meta.INT8_SCHEME))
        entries.append((meta.INT8_WEIGHTS, json.dumps(int8_weights)))
        entries.append((meta.TRANSPOSED, json.dumps(transposed)))
    graph = proto.graph.SerializeToString()  # the graph is final: only metadata changes
    entries.append((meta.EXPORTED_GRAPH, hashlib.sha256(graph).hexdigest()))
    del proto.metadata_props[:]
    for key, value in entries:
        entry = proto.metadata_props.add()
        entry.key = key
        entry.value = value
