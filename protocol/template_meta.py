"""The metadata of an ONNX template: the contract between the code that writes templates
(:func:`models.onnx_template.export_template`) and the device that renders them
(:class:`edge_client.serve.template.OnnxTemplate`), defined once for both.

A template carries these ``metadata_props`` entries. Plain constants: no onnx, no torch.
"""

from __future__ import annotations

__all__ = [
    "EXPORTED_GRAPH",
    "INT8_SCHEME",
    "INT8_WEIGHTS",
    "MODEL",
    "PRECISION",
    "QUANTIZATION",
    "TEMPLATE",
    "TEMPLATE_VERSION",
    "TRANSPOSED",
]

TEMPLATE = "edgefl.template"
"""Marks an edgefl template; its value is :data:`TEMPLATE_VERSION`."""
TEMPLATE_VERSION = "1"
PRECISION = "edgefl.precision"
"""``"fp32"`` or ``"int8"``."""
MODEL = "edgefl.model"
"""The model's registry name (informational)."""
QUANTIZATION = "edgefl.quantization"
"""int8 templates: the weight quantization they carry, :data:`INT8_SCHEME`."""
INT8_WEIGHTS = "edgefl.int8_weights"
"""int8 templates: JSON list, the ``state_dict`` name each ConvInteger / MatMulInteger
node quantizes, one per node in graph order."""
TRANSPOSED = "edgefl.transposed"
"""JSON list of the weights stored transposed (Gemm rewritten as MatMul)."""
EXPORTED_GRAPH = "edgefl.exported_graph"
"""The SHA-256 (hex) of the template's serialized ``GraphProto`` as exported, with the
untrained weights it was exported with. Rendering keeps the metadata and replaces the
weights, so a model whose graph still has this digest was never filled with trained
weights (``python -m edge_client infer`` warns); templates made before the key existed
lack it, and nothing is said of them."""

INT8_SCHEME = "ort-dynamic-int8-symmetric-minmax/1"
"""onnxruntime's ``quantize_dynamic`` with int8 symmetric min/max weights, no reduced
range, per tensor for ``ConvInteger`` and per output column for ``MatMulInteger``; the
device reproduces exactly this and refuses templates that name another."""
