"""The export-time check of a template: does the device-side renderer
(:mod:`edge_client.serve.template`) take it and reproduce it from the model's own weights?

``python -m edge_client template`` runs it on every export, so a release of onnxruntime
that breaks the template fails there, on the machine that exports, not on a device.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from edge_client.errors import OnnxTemplateError
from edge_client.serve.template import OnnxTemplate, never_trained
from protocol import template_meta as meta

__all__ = ["verify_template"]


def verify_template(template: bytes, state: Mapping[str, np.ndarray]) -> None:
    """Check a freshly exported template as a device will use it.

    ``state`` holds the float weights the template was exported from (the model's
    floating ``state_dict`` tensors as numpy arrays). The template must parse, need
    exactly tensors of ``state`` with their shapes, and render ``state`` back into the
    very same bytes: for int8, the device's quantization reproduces onnxruntime's bit for
    bit and every quantized weight maps to the right tensor. ``python -m edge_client
    template`` runs this on every export, so a change of onnxruntime that breaks the
    template fails there rather than on a device.

    Raises:
        OnnxTemplateError: the renderer refuses the template, needs other tensors, or
            does not reproduce it.
    """
    what = "the device-side renderer (edge_client.serve.template)"
    try:
        device = OnnxTemplate.from_bytes(template)
        needed = {name: shape for name, (shape, _) in device.weights.items()}
        rendered = device.render(state)
    except OnnxTemplateError as exc:
        raise OnnxTemplateError(f"{what} refuses the template: {exc}") from exc
    expected = {name: tuple(state[name].shape) for name in needed if name in state}
    if needed != expected:
        raise OnnxTemplateError(f"{what} needs tensors {sorted(needed)}, not {sorted(state)}")
    if rendered != template:
        raise OnnxTemplateError(
            f"{what} does not reproduce the template from the model's own weights (the "
            "quantization or the weight mapping differs from onnxruntime's)"
        )
    if not never_trained(template):
        raise OnnxTemplateError(
            f"{what} does not find the digest of the exported graph in "
            f"{meta.EXPORTED_GRAPH!r}: a device could not tell the template's untrained "
            "weights"
        )
