"""Write the fleet's weights into an ONNX template, with numpy alone.

An inference-only device has numpy and onnxruntime but neither torch nor the ``onnx``
package. It is provisioned with a *template* (:func:`models.onnx_template.export_template`,
fp32 or int8), an ONNX model whose float weights are initializers named by their torch
``state_dict`` keys (int8 weights: see below); after each round,
:meth:`OnnxTemplate.render` writes the fleet's weights (numpy arrays keyed by those
names) into it and returns a new ONNX model that onnxruntime (e.g.
:class:`edge_client.serve.infer.OnnxClassifier`) runs as it is. This module needs neither
torch, onnx nor onnxruntime (a test enforces it): it reads and writes the protobuf wire
format itself (:mod:`edge_client.serve.protobuf`), within the bounds below; the metadata
keys it reads are :mod:`protocol.template_meta`, shared with the exporter.

What is read (everything else is carried over byte for byte, unknown fields included):

- ``ModelProto``: ``graph`` (exactly one) and ``metadata_props``;
- ``GraphProto``: ``initializer`` (``TensorProto``: ``name``, ``dims``, ``data_type``,
  ``raw_data`` or the typed field of its type) and ``node`` (``input``, ``output``,
  ``op_type``, ``domain``, and whether an attribute holds a subgraph).

A template must carry the metadata ``edgefl.template`` = ``"1"``, ``edgefl.precision``
(``"fp32"`` or ``"int8"``) and ``edgefl.model``; an int8 template also
``edgefl.quantization`` = ``"ort-dynamic-int8-symmetric-minmax/1"``,
``edgefl.int8_weights``, a JSON list with the ``state_dict`` name of the weight each
``ConvInteger`` / ``MatMulInteger`` node quantizes (one per node, in graph order), and
``edgefl.transposed``, a JSON list of the weights stored transposed (onnxruntime
rewrites ``Gemm`` as ``MatMul`` on the transposed weight). ``edgefl.exported_graph``,
the digest of the graph as exported, is kept as it is by rendering: :func:`never_trained`
tells by it a template still holding its untrained export weights.

Quantized weights are found by the graph's structure, never by the names of their
initializers (onnxruntime chooses those, and they differ between its versions). Each
``ConvInteger`` / ``MatMulInteger`` node ``k`` (``x`` its fp32 activation)::

    x_q, x_scale, x_zero = DynamicQuantizeLinear(x)
    y = ConvInteger | MatMulInteger(x_q, VALUES, x_zero, ZERO_POINT)
    out = Mul(Cast(y), Mul(x_scale, SCALE))          # Mul inputs in either order

quantizes the ``k``-th weight of ``edgefl.int8_weights``: ``VALUES`` and
``ZERO_POINT`` (all zero) are ``INT8`` initializers and ``SCALE`` a ``FLOAT`` one,
either a scalar (per tensor; the only form for ``ConvInteger``) or one scale per index
of the last axis of ``VALUES`` (per output column of ``MatMulInteger``). Anything else
around an integer node is refused, as is an initializer with two of these roles.

Initializers, by data type:

- ``FLOAT`` (float32): a fleet weight, named by its ``state_dict`` key and replaced on
  render; or the ``SCALE`` of a quantized weight.
- ``INT8``: the ``VALUES`` or ``ZERO_POINT`` of a quantized weight.
- ``INT32``, ``INT64``: constants (shapes), kept as they are.
- Anything else (other float or integer types, external data, segments, sparse
  initializers, subgraphs) is refused: the template could not be kept up to date.

Rendering. A float32 weight is written as little-endian float32; a quantized weight is
recomputed from the float32 weight ``w`` (transposed first when listed in
``edgefl.transposed``) exactly as onnxruntime's ``quantize_dynamic`` computes it with
``weight_type=QInt8``, symmetric weights, no reduced range (bit-identical; ``min`` and
``max`` range over the whole tensor, or per channel over all axes but the last)::

    a     = max(|min(min(w), 0)|, |max(max(w), 0)|)        # float32
    s64   = (float64(a) - float64(-a)) / 254.0              # float64: (127 - -127)
    scale = 1.0 if s64 < 1.1754944e-38 else float32(s64)    # float32 tiny
    zero  = 0
    q     = int8(clip(round_half_even(w / scale), -128, 127))   # float32 division

Each rewritten tensor keeps its fields in place; only its data field changes, in the
encoding the template used (``raw_data``, or the packed ``float_data`` /
``int32_data``), so rendering a template with the weights it was exported with gives
back the same bytes.

Bounds: templates larger than :data:`MAX_TEMPLATE_BYTES` are refused, as are lengths
past the end of their message, varints longer than 10 bytes, more than
:data:`~edge_client.serve.protobuf.MAX_FIELDS_PER_MESSAGE` fields in one message and
more than :data:`MAX_DIMS` dimensions; the parser descends a fixed path (model, graph,
node / tensor, attribute) and never recurses, so nesting is bounded by construction.
Every failure raises :class:`~edge_client.errors.OnnxTemplateError` and no partial output
is produced.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from edge_client.errors import OnnxTemplateError
from edge_client.serve.protobuf import (
    I32,
    LEN,
    VARINT,
    Field,
    count_varints,
    encode_varint,
    expect_wire,
    len_field,
    parse_fields,
    read_text,
    read_varints,
)
from protocol import template_meta as meta

__all__ = [
    "MAX_DIMS",
    "MAX_TEMPLATE_BYTES",
    "OnnxTemplate",
    "never_trained",
]

MAX_TEMPLATE_BYTES = 256 * 1024 * 1024
"""Largest template accepted, bytes (256 MiB)."""
MAX_DIMS = 64
"""Most dimensions a tensor may have."""

# Field numbers of onnx.proto (ModelProto, GraphProto, NodeProto, AttributeProto,
# TensorProto, StringStringEntryProto).
_MODEL_GRAPH, _MODEL_METADATA = 7, 14
_GRAPH_NODE, _GRAPH_INITIALIZER, _GRAPH_SPARSE_INITIALIZER = 1, 5, 15
_NODE_INPUT, _NODE_OUTPUT, _NODE_OP_TYPE, _NODE_ATTRIBUTE, _NODE_DOMAIN = 1, 2, 4, 5, 7
_ATTRIBUTE_GRAPH, _ATTRIBUTE_GRAPHS = 6, 11
_TENSOR_DIMS, _TENSOR_DATA_TYPE, _TENSOR_SEGMENT, _TENSOR_NAME = 1, 2, 3, 8
_TENSOR_FLOAT_DATA, _TENSOR_INT32_DATA, _TENSOR_RAW_DATA = 4, 5, 9
_TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION = 13, 14
_TENSOR_DATA_FIELDS = frozenset({4, 5, 6, 7, 9, 10, 11})  # float/int32/string/int64/raw/...
_ENTRY_KEY, _ENTRY_VALUE = 1, 2

# TensorProto.DataType values.
_FLOAT, _INT8, _INT32, _INT64 = 1, 3, 6, 7
_TYPE_NAMES = {
    0: "UNDEFINED", 1: "FLOAT", 2: "UINT8", 3: "INT8", 4: "UINT16", 5: "INT16", 6: "INT32",
    7: "INT64", 8: "STRING", 9: "BOOL", 10: "FLOAT16", 11: "DOUBLE", 12: "UINT32",
    13: "UINT64", 14: "COMPLEX64", 15: "COMPLEX128", 16: "BFLOAT16",
}  # fmt: skip
_KEPT_TYPES = frozenset({_INT32, _INT64})
_TYPED_FIELD = {_FLOAT: _TENSOR_FLOAT_DATA, _INT8: _TENSOR_INT32_DATA}

_INTEGER_WEIGHT_OPS = frozenset({"ConvInteger", "MatMulInteger"})
_QUANTIZED_OPS = _INTEGER_WEIGHT_OPS | {
    "DynamicQuantizeLinear", "QuantizeLinear", "DequantizeLinear", "QLinearConv",
    "QLinearMatMul", "DynamicQuantizeMatMul", "MatMulIntegerToFloat",
}  # fmt: skip
_INT8_QMAX = 127  # symmetric int8 range [-127, 127]
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)

Precision = Literal["fp32", "int8"]


@dataclass(frozen=True, slots=True)
class _Tensor:
    """An initializer: its graph field, header and data fields."""

    index: int  # index of its field in the graph's fields
    name: str
    dims: tuple[int, ...]
    data_type: int
    fields: tuple[Field, ...]
    data_fields: tuple[Field, ...]

    @property
    def count(self) -> int:
        return math.prod(self.dims)


@dataclass(frozen=True, slots=True)
class _Node:
    """A node of the graph: what the parser reads of it."""

    op_type: str  # prefixed by "domain." outside the default domain
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _Quantized:
    """A weight stored as int8 values, a float32 scale and an int8 zero point."""

    name: str
    values: _Tensor
    scale: _Tensor
    zero_point: _Tensor
    per_channel: bool


def _quantize_int8(
    weight: np.ndarray, per_channel: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Symmetric int8 quantization of float32 ``weight`` as quantize_dynamic does it.

    Returns (int8 values shaped like ``weight``, float32 scales, int8 zero points); the
    scales and zero points have shape () per tensor, (weight.shape[-1],) per channel.
    See the module docstring for the formula.
    """
    if per_channel:
        axes = tuple(range(weight.ndim - 1))
        if weight.size:
            rmin, rmax = weight.min(axis=axes), weight.max(axis=axes)
        else:
            rmin = rmax = np.zeros(weight.shape[-1], dtype=np.float32)
    elif weight.size:
        rmin, rmax = np.asarray(weight.min()), np.asarray(weight.max())
    else:
        rmin = rmax = np.zeros((), dtype=np.float32)
    zero = np.float32(0)
    absmax = np.maximum(np.abs(np.minimum(rmin, zero)), np.abs(np.maximum(rmax, zero)))
    wide = absmax.astype(np.float64)
    scale64 = (wide - (-wide)) / np.float64(2 * _INT8_QMAX)
    scale = np.where(scale64 < _FLOAT32_TINY, 1.0, scale64).astype(np.float32)
    quantized = np.clip(np.round(weight / scale), -128, 127).astype(np.int8)
    return quantized, scale, np.zeros(scale.shape, dtype=np.int8)


class OnnxTemplate:
    """An ONNX template parsed from its bytes; renders it with new weights.

    Build it with :meth:`from_bytes` (or the constructor) or :meth:`read`. The module
    docstring says which templates are supported. It is immutable: :meth:`render` may
    be called any number of times (once per round).

    Raises:
        OnnxTemplateError: (from the constructors) the bytes are not a supported
            template; (from :meth:`render`) the weights do not fit it.
    """

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"expected bytes, got {type(data).__name__}")
        size = data.nbytes if isinstance(data, memoryview) else len(data)
        if size > MAX_TEMPLATE_BYTES:
            raise OnnxTemplateError(
                f"template of {size} bytes is larger than the {MAX_TEMPLATE_BYTES} allowed"
            )
        self._data = bytes(data)
        self._parse()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> OnnxTemplate:
        """Parse a serialized template (the same as ``OnnxTemplate(data)``).

        Raises:
            OnnxTemplateError: see the class docstring.
        """
        return cls(data)

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> OnnxTemplate:
        """Read and parse a template file.

        Raises:
            OnnxTemplateError: the file cannot be read, is too large or is not a
                supported template.
        """
        try:
            with open(path, "rb") as file:
                size = os.fstat(file.fileno()).st_size
                if size > MAX_TEMPLATE_BYTES:
                    raise OnnxTemplateError(
                        f"template {os.fspath(path)!r} of {size} bytes is larger than the "
                        f"{MAX_TEMPLATE_BYTES} allowed"
                    )
                data = file.read(MAX_TEMPLATE_BYTES + 1)
        except OSError as exc:
            raise OnnxTemplateError(f"cannot read template {os.fspath(path)!r}: {exc}") from exc
        return cls.from_bytes(data)

    @property
    def precision(self) -> Precision:
        """``"fp32"`` or ``"int8"``: from the metadata, checked against the content."""
        return self._precision

    @property
    def model_name(self) -> str:
        """The ``edgefl.model`` metadata (e.g. the registry name; may be empty)."""
        return self._model_name

    @property
    def weights(self) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
        """The fleet tensors :meth:`render` needs: name -> (shape, dtype float32).

        Shapes are those of the ``state_dict`` tensors (not the transposed layout an
        int8 template stores), in the template's initializer order.
        """
        return {name: (shape, np.dtype(np.float32)) for name, shape in self._weights.items()}

    @property
    def nbytes(self) -> int:
        """Size of the serialized template, bytes."""
        return len(self._data)

    def __repr__(self) -> str:
        return (
            f"OnnxTemplate(model={self._model_name!r}, precision={self._precision!r}, "
            f"weights={len(self._weights)}, bytes={len(self._data)})"
        )

    def render(self, tensors: Mapping[str, np.ndarray]) -> bytes:
        """The template with every weight replaced by ``tensors[name]``.

        Args:
            tensors: the fleet's weights by ``state_dict`` name: real-valued arrays of
                exactly the shapes of :attr:`weights` (converted to float32). Names the
                template does not use (e.g. ``num_batches_tracked``) are ignored.

        Returns:
            The serialized ONNX model: float weights as float32, quantized weights
            recomputed (see the module docstring); every other byte as in the template.

        Raises:
            OnnxTemplateError: a weight is missing, not real-valued, of the wrong shape,
                or not finite (as float32); the message names it. Nothing is returned.
        """
        arrays = {
            name: _checked_weight(name, tensors, shape) for name, shape in self._weights.items()
        }
        for name in self._transposed:
            arrays[name] = np.ascontiguousarray(arrays[name].T)
        replaced: dict[int, bytes] = {}
        for tensor in self._float_weights:
            replaced[tensor.index] = self._encode(tensor, arrays[tensor.name])
        for weight in self._quantized:
            values, scale, zero_point = _quantize_int8(arrays[weight.name], weight.per_channel)
            replaced[weight.values.index] = self._encode(weight.values, values)
            replaced[weight.scale.index] = self._encode(weight.scale, scale)
            replaced[weight.zero_point.index] = self._encode(weight.zero_point, zero_point)
        buf = self._data
        graph = b"".join(
            replaced.get(i, buf[f.start : f.end]) for i, f in enumerate(self._graph_fields)
        )
        return b"".join(
            len_field(_MODEL_GRAPH, graph) if i == self._graph_index else buf[f.start : f.end]
            for i, f in enumerate(self._model_fields)
        )

    # -- rendering --------------------------------------------------------------------

    def _encode(self, tensor: _Tensor, values: np.ndarray) -> bytes:
        """The initializer field of ``tensor`` with its data replaced by ``values``."""
        if tensor.count == 0:  # nothing to replace
            field = self._graph_fields[tensor.index]
            return self._data[field.start : field.end]
        first = tensor.data_fields[0]
        if first.number == _TENSOR_RAW_DATA or tensor.data_type == _FLOAT:
            dtype = "<f4" if tensor.data_type == _FLOAT else "i1"
            data = len_field(first.number, values.astype(dtype).tobytes())
        else:  # INT8 in int32_data: packed varints (negative as 10-byte two's complement)
            ints = values.astype(np.int64).ravel()
            if ints.size and ints.min() >= 0:  # every value < 128: one byte each
                payload = ints.astype(np.uint8).tobytes()
            else:
                payload = b"".join(encode_varint(v) for v in ints.tolist())
            data = len_field(_TENSOR_INT32_DATA, payload)
        parts: list[bytes] = []
        for field in tensor.fields:
            if field.number in _TENSOR_DATA_FIELDS:
                if field is first:
                    parts.append(data)
            else:
                parts.append(self._data[field.start : field.end])
        return len_field(_GRAPH_INITIALIZER, b"".join(parts))

    # -- parsing ----------------------------------------------------------------------

    def _parse(self) -> None:
        buf = self._data
        self._model_fields = parse_fields(buf, 0, len(buf), "model")
        graphs = [i for i, f in enumerate(self._model_fields) if f.number == _MODEL_GRAPH]
        if len(graphs) != 1:
            raise OnnxTemplateError(f"model: expected one graph, found {len(graphs)}")
        self._graph_index = graphs[0]
        graph_field = self._model_fields[self._graph_index]
        expect_wire(graph_field, LEN, "model")
        metadata = self._metadata()
        if metadata.get(meta.TEMPLATE) != meta.TEMPLATE_VERSION:
            raise OnnxTemplateError(
                f"not an edgefl template: metadata {meta.TEMPLATE!r} is not '1'"
            )
        precision = metadata.get(meta.PRECISION)
        if precision not in ("fp32", "int8"):
            raise OnnxTemplateError(
                f"template: metadata {meta.PRECISION!r} is {precision!r}, not 'fp32' or 'int8'"
            )
        self._precision: Precision = "fp32" if precision == "fp32" else "int8"
        self._model_name = metadata.get(meta.MODEL, "")
        self._graph_fields = parse_fields(buf, graph_field.data, graph_field.end, "graph")
        tensors: dict[str, _Tensor] = {}
        nodes: list[_Node] = []
        for index, field in enumerate(self._graph_fields):
            if field.number == _GRAPH_INITIALIZER:
                tensor = self._tensor(index, field)
                if tensor.name in tensors:
                    raise OnnxTemplateError(f"tensor {tensor.name!r}: duplicate initializer")
                tensors[tensor.name] = tensor
            elif field.number == _GRAPH_NODE:
                nodes.append(self._node(field))
            elif field.number == _GRAPH_SPARSE_INITIALIZER:
                raise OnnxTemplateError("template: sparse initializers are not supported")
        self._classify(tensors, nodes, metadata)

    def _metadata(self) -> dict[str, str]:
        return _read_metadata(self._data, self._model_fields)

    def _node(self, field: Field) -> _Node:
        """op_type, inputs and outputs of a node; refuses nodes with subgraphs."""
        buf = self._data
        expect_wire(field, LEN, "node")
        op_type, domain = "", ""
        inputs: list[str] = []
        outputs: list[str] = []
        for part in parse_fields(buf, field.data, field.end, "node"):
            if part.number == _NODE_INPUT:
                inputs.append(read_text(buf, part, "node"))
            elif part.number == _NODE_OUTPUT:
                outputs.append(read_text(buf, part, "node"))
            elif part.number == _NODE_OP_TYPE:
                op_type = read_text(buf, part, "node")
            elif part.number == _NODE_DOMAIN:
                domain = read_text(buf, part, "node")
            elif part.number == _NODE_ATTRIBUTE:
                expect_wire(part, LEN, "node attribute")
                for attr in parse_fields(buf, part.data, part.end, "node attribute"):
                    if attr.number in (_ATTRIBUTE_GRAPH, _ATTRIBUTE_GRAPHS):
                        raise OnnxTemplateError(
                            f"template: node {op_type or '?'} has a subgraph; not supported"
                        )
        if domain not in ("", "ai.onnx"):
            op_type = f"{domain}.{op_type}"
        return _Node(op_type, tuple(inputs), tuple(outputs))

    def _tensor(self, index: int, field: Field) -> _Tensor:
        buf = self._data
        expect_wire(field, LEN, "initializer")
        parts = parse_fields(buf, field.data, field.end, "initializer")
        names = [read_text(buf, p, "initializer") for p in parts if p.number == _TENSOR_NAME]
        if len(names) != 1 or not names[0]:
            raise OnnxTemplateError("initializer: expected exactly one non-empty name")
        name = names[0]
        what = f"tensor {name!r}"
        dims: list[int] = []
        data_types: list[int] = []
        for part in parts:
            if part.number == _TENSOR_DIMS:
                dims.extend(read_varints(buf, part, what))
                if len(dims) > MAX_DIMS:
                    raise OnnxTemplateError(f"{what}: more than {MAX_DIMS} dimensions")
            elif part.number == _TENSOR_DATA_TYPE:
                expect_wire(part, VARINT, what)
                data_types.append(part.value)
            elif part.number == _TENSOR_SEGMENT:
                raise OnnxTemplateError(f"{what}: segmented tensors are not supported")
            elif part.number == _TENSOR_DATA_LOCATION:
                expect_wire(part, VARINT, what)
                if part.value != 0:
                    raise OnnxTemplateError(f"{what}: external data is not supported")
            elif part.number == _TENSOR_EXTERNAL_DATA:
                raise OnnxTemplateError(f"{what}: external data is not supported")
        if len(data_types) != 1:
            raise OnnxTemplateError(f"{what}: expected exactly one data_type")
        if any(d < 0 for d in dims):
            raise OnnxTemplateError(f"{what}: negative dimension in {tuple(dims)}")
        data_type = data_types[0]
        if data_type not in (_FLOAT, _INT8) and data_type not in _KEPT_TYPES:
            type_name = _TYPE_NAMES.get(data_type, str(data_type))
            raise OnnxTemplateError(f"{what}: unsupported data type {type_name}")
        data_fields = tuple(p for p in parts if p.number in _TENSOR_DATA_FIELDS)
        tensor = _Tensor(index, name, tuple(dims), data_type, tuple(parts), data_fields)
        if data_type in (_FLOAT, _INT8):
            self._check_data(tensor)
        return tensor

    def _check_data(self, tensor: _Tensor) -> None:
        """The data of a FLOAT / INT8 tensor is one field, of the size its dims say."""
        what = f"tensor {tensor.name!r}"
        numbers = {f.number for f in tensor.data_fields}
        typed = _TYPED_FIELD[tensor.data_type]
        if not numbers <= {_TENSOR_RAW_DATA, typed} or len(numbers) > 1:
            raise OnnxTemplateError(f"{what}: data fields {sorted(numbers)} do not fit its type")
        count = tensor.count
        if not tensor.data_fields:
            if count:
                raise OnnxTemplateError(f"{what}: no data for {count} elements")
            return
        if _TENSOR_RAW_DATA in numbers:
            if len(tensor.data_fields) != 1:
                raise OnnxTemplateError(f"{what}: more than one raw_data field")
            field = tensor.data_fields[0]
            expect_wire(field, LEN, what)
            itemsize = 4 if tensor.data_type == _FLOAT else 1
            found = (field.end - field.data) // itemsize
            exact = (field.end - field.data) % itemsize == 0
        elif tensor.data_type == _FLOAT:
            found, exact = 0, True
            for field in tensor.data_fields:
                if field.wire == I32:
                    found += 1
                else:
                    expect_wire(field, LEN, what)
                    found += (field.end - field.data) // 4
                    exact = exact and (field.end - field.data) % 4 == 0
        else:
            found = sum(count_varints(self._data, f, what) for f in tensor.data_fields)
            exact = True
        if found != count or not exact:
            raise OnnxTemplateError(
                f"{what}: data does not match its shape {tensor.dims} ({count} elements)"
            )

    def _int_values(self, tensor: _Tensor) -> list[int]:
        """Values of a (small) INT8 tensor."""
        buf = self._data
        values: list[int] = []
        for field in tensor.data_fields:
            if field.number == _TENSOR_RAW_DATA:
                values.extend(np.frombuffer(buf[field.data : field.end], dtype=np.int8).tolist())
            else:
                values.extend(read_varints(buf, field, f"tensor {tensor.name!r}"))
        return values

    def _classify(
        self, tensors: dict[str, _Tensor], nodes: list[_Node], metadata: dict[str, str]
    ) -> None:
        """Sort the initializers into weights, quantized weights and constants."""
        self._check_precision(nodes, metadata)
        quantized = self._quantized_weights(tensors, nodes, metadata)
        derived = {t.name for q in quantized for t in (q.values, q.scale, q.zero_point)}
        for tensor in tensors.values():
            if tensor.data_type == _INT8 and tensor.name not in derived:
                raise OnnxTemplateError(
                    f"tensor {tensor.name!r}: an INT8 initializer that is not part of a "
                    "quantized weight; not supported"
                )
        float_weights = [
            t for t in tensors.values() if t.data_type == _FLOAT and t.name not in derived
        ]
        transposed = self._transposed_names(metadata)
        by_values = {q.values.name: q for q in quantized}
        weights: dict[str, tuple[int, ...]] = {}
        for tensor in tensors.values():  # initializer order
            if tensor.data_type == _FLOAT and tensor.name not in derived:
                name = tensor.name
            elif tensor.name in by_values:
                name = by_values[tensor.name].name
            else:
                continue
            dims = tensor.dims
            if name in transposed:
                if len(dims) != 2:
                    raise OnnxTemplateError(
                        f"tensor {name!r}: listed as transposed but stored with shape {dims}"
                    )
                dims = dims[::-1]
            if weights.setdefault(name, dims) != dims:
                raise OnnxTemplateError(f"tensor {name!r}: stored with two different shapes")
        unknown = sorted(transposed - weights.keys())
        if unknown:
            raise OnnxTemplateError(
                f"template: {meta.TRANSPOSED} names tensors it has not: {unknown}"
            )
        if not weights:
            raise OnnxTemplateError("template: it has no weights")
        self._weights = weights
        self._float_weights = tuple(float_weights)
        self._quantized = tuple(quantized)
        self._transposed = tuple(sorted(transposed))

    def _quantized_weights(
        self, tensors: dict[str, _Tensor], nodes: list[_Node], metadata: dict[str, str]
    ) -> list[_Quantized]:
        """The quantized weights, found by structure and named by ``edgefl.int8_weights``.

        The k-th ``ConvInteger`` / ``MatMulInteger`` node quantizes the k-th name of the
        metadata list; its weight and zero point are its inputs 1 and 3, its scale is
        found through the ``Cast`` and ``Mul`` that follow it (see the module docstring).
        """
        if self._precision == "fp32":
            return []  # _check_precision: no quantized op
        integer_nodes = [n for n in nodes if n.op_type in _INTEGER_WEIGHT_OPS]
        names = self._int8_weight_names(metadata)
        if len(names) != len(integer_nodes):
            raise OnnxTemplateError(
                f"template: {meta.INT8_WEIGHTS} names {len(names)} weights for "
                f"{len(integer_nodes)} ConvInteger / MatMulInteger nodes"
            )
        producers: dict[str, _Node] = {}
        consumers: dict[str, list[tuple[_Node, int]]] = {}
        for node in nodes:
            for name in node.outputs:
                if name:
                    if name in producers:
                        raise OnnxTemplateError(f"template: two nodes output {name!r}")
                    producers[name] = node
            for position, name in enumerate(node.inputs):
                consumers.setdefault(name, []).append((node, position))
        by_values: dict[str, _Quantized] = {}
        for node, name in zip(integer_nodes, names, strict=True):
            weight = self._quantized_weight(name, node, tensors, producers, consumers)
            known = by_values.setdefault(weight.values.name, weight)
            if known == weight:
                continue
            raise OnnxTemplateError(
                f"tensor {name!r}: its int8 values are also those of {known.name!r}"
            )
        seen: set[str] = set()
        for weight in by_values.values():
            for tensor in (weight.values, weight.scale, weight.zero_point):
                if tensor.name in seen:
                    raise OnnxTemplateError(
                        f"tensor {weight.name!r}: the initializer {tensor.name!r} has two roles "
                        "in its quantization or another weight's; not supported"
                    )
                seen.add(tensor.name)
        if not by_values:
            raise OnnxTemplateError("template: precision is 'int8' but no weight is quantized")
        return list(by_values.values())

    def _quantized_weight(
        self,
        name: str,
        node: _Node,
        tensors: dict[str, _Tensor],
        producers: dict[str, _Node],
        consumers: dict[str, list[tuple[_Node, int]]],
    ) -> _Quantized:
        """The weight, scale and zero point of an integer node (structure checked)."""
        what = f"tensor {name!r}"

        def fail(detail: str) -> OnnxTemplateError:
            return OnnxTemplateError(f"{what}: its {node.op_type} node {detail}; not supported")

        def sole_consumer(output: str, op_type: str) -> _Node:
            users = consumers.get(output, [])
            if len(users) != 1 or users[0][0].op_type != op_type:
                raise fail(f"is not followed by exactly one {op_type}")
            return users[0][0]

        if len(node.inputs) != 4 or len(node.outputs) != 1:
            raise fail("does not have 4 inputs and 1 output")
        values = tensors.get(node.inputs[1])
        zero_point = tensors.get(node.inputs[3])
        if values is None or values.data_type != _INT8:
            raise fail("does not take an INT8 initializer as input 1")
        if zero_point is None or zero_point.data_type != _INT8:
            raise fail("does not take an INT8 initializer as input 3 (zero point)")
        dq = producers.get(node.inputs[0])
        if (
            dq is None
            or dq.op_type != "DynamicQuantizeLinear"
            or len(dq.outputs) != 3
            or (dq.outputs[0], dq.outputs[2]) != (node.inputs[0], node.inputs[2])
        ):
            raise fail("does not take inputs 0 and 2 from one DynamicQuantizeLinear")
        cast = sole_consumer(node.outputs[0], "Cast")
        if len(cast.outputs) != 1:
            raise fail("is followed by a Cast with several outputs")
        scaled = sole_consumer(cast.outputs[0], "Mul")
        if len(scaled.inputs) != 2:
            raise fail("is followed by a Mul without two inputs")
        scales = producers.get(scaled.inputs[1 - scaled.inputs.index(cast.outputs[0])])
        if scales is None or scales.op_type != "Mul" or len(scales.inputs) != 2:
            raise fail("output is not multiplied by a product of scales")
        if dq.outputs[1] not in scales.inputs:
            raise fail("output is not multiplied by its input's scale")
        scale = tensors.get(scales.inputs[1 - scales.inputs.index(dq.outputs[1])])
        if scale is None or scale.data_type != _FLOAT:
            raise fail("output is not multiplied by a FLOAT initializer (the weight scale)")
        if scale.dims == ():
            per_channel = False
        elif values.dims and scale.dims == (values.dims[-1],):
            per_channel = True
        else:
            raise OnnxTemplateError(
                f"{what}: scale of shape {scale.dims} fits neither per-tensor nor per-channel "
                f"(last axis) quantization of shape {values.dims}"
            )
        if zero_point.dims != scale.dims:
            raise OnnxTemplateError(f"{what}: zero point and scale differ in shape")
        if any(v != 0 for v in self._int_values(zero_point)):
            raise OnnxTemplateError(
                f"{what}: non-zero zero points (asymmetric quantization) are not supported"
            )
        for user, position in consumers.get(values.name, []):
            if user.op_type not in _INTEGER_WEIGHT_OPS or position != 1:
                raise OnnxTemplateError(
                    f"{what}: used as input {position} of {user.op_type}; only the weight "
                    "input of ConvInteger or MatMulInteger is supported"
                )
            if user.op_type == "ConvInteger" and per_channel:
                raise OnnxTemplateError(f"{what}: per-channel ConvInteger weights unsupported")
        return _Quantized(name, values, scale, zero_point, per_channel)

    def _check_precision(self, nodes: list[_Node], metadata: dict[str, str]) -> None:
        if self._precision == "fp32":
            found = sorted({n.op_type for n in nodes} & _QUANTIZED_OPS)
            if found:
                raise OnnxTemplateError(
                    f"template: precision is 'fp32' but it holds quantized ops ({found})"
                )
            return
        scheme = metadata.get(meta.QUANTIZATION)
        if scheme != meta.INT8_SCHEME:
            raise OnnxTemplateError(
                f"template: unsupported quantization {scheme!r}; expected {meta.INT8_SCHEME!r}"
            )

    def _int8_weight_names(self, metadata: dict[str, str]) -> list[str]:
        raw = metadata.get(meta.INT8_WEIGHTS)
        if raw is None:
            raise OnnxTemplateError(
                f"template: int8 without {meta.INT8_WEIGHTS} (made by an older edgefl?); "
                "export it again (python -m edge_client template)"
            )
        try:
            names = json.loads(raw)
        except ValueError:
            names = None
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            raise OnnxTemplateError(f"template: {meta.INT8_WEIGHTS} is not a JSON list of names")
        return names

    def _transposed_names(self, metadata: dict[str, str]) -> frozenset[str]:
        raw = metadata.get(meta.TRANSPOSED, "[]")
        try:
            names = json.loads(raw)
        except ValueError:
            names = None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise OnnxTemplateError(f"template: {meta.TRANSPOSED} is not a JSON list of names")
        return frozenset(names)


def _checked_weight(
    name: str, tensors: Mapping[str, np.ndarray], shape: tuple[int, ...]
) -> np.ndarray:
    """``tensors[name]`` as a C-contiguous float32 array of ``shape``, finite."""
    if name not in tensors:
        raise OnnxTemplateError(f"tensor {name!r} is missing from the weights")
    try:
        array = np.asarray(tensors[name])
    except Exception as exc:
        raise OnnxTemplateError(f"tensor {name!r} is not an array: {exc}") from exc
    if array.dtype.kind not in "fiu":
        raise OnnxTemplateError(f"tensor {name!r} has dtype {array.dtype}; expected real numbers")
    if array.shape != shape:
        raise OnnxTemplateError(f"tensor {name!r} has shape {array.shape}, expected {shape}")
    with np.errstate(over="ignore"):
        values = np.ascontiguousarray(array, dtype=np.float32)
    if not np.isfinite(values).all():
        raise OnnxTemplateError(f"tensor {name!r} has non-finite values (as float32)")
    return values


def _read_metadata(buf: bytes, model_fields: list[Field]) -> dict[str, str]:
    """The ``metadata_props`` of a model: key -> value.

    Raises:
        OnnxTemplateError: a malformed entry, or an ``edgefl.*`` key twice.
    """
    metadata: dict[str, str] = {}
    for field in model_fields:
        if field.number != _MODEL_METADATA:
            continue
        expect_wire(field, LEN, "metadata")
        key = value = ""
        for entry in parse_fields(buf, field.data, field.end, "metadata"):
            if entry.number == _ENTRY_KEY:
                key = read_text(buf, entry, "metadata")
            elif entry.number == _ENTRY_VALUE:
                value = read_text(buf, entry, "metadata")
        if key.startswith("edgefl.") and key in metadata:
            raise OnnxTemplateError(f"template: metadata {key!r} appears twice")
        metadata[key] = value
    return metadata


def never_trained(model: bytes) -> bool:
    """Whether the serialized ONNX ``model`` is a template that still holds the weights
    it was exported with (:data:`protocol.template_meta.EXPORTED_GRAPH` is the digest
    of its graph): never filled with trained weights, so its predictions mean nothing.

    False for a rendered model (the weights changed), for any other ONNX model, for a
    template made before the digest was recorded, and for bytes that are not a model
    (loading them says what is wrong).
    """
    try:
        fields = parse_fields(model, 0, len(model), "model")
        recorded = _read_metadata(model, fields).get(meta.EXPORTED_GRAPH)
    except OnnxTemplateError:
        return False
    graphs = [f for f in fields if f.number == _MODEL_GRAPH and f.wire == LEN]
    if recorded is None or len(graphs) != 1:
        return False
    graph = memoryview(model)[graphs[0].data : graphs[0].end]
    return hashlib.sha256(graph).hexdigest() == recorded
