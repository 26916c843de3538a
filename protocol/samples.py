"""Trained-looking model weights without torch, for demos, benchmarks and budgets.

Real trained weights are heavy-tailed around zero with a per-layer spread set by the
fan-in, not zeros or uniform noise, and that matters for compression figures. These
samples draw conv / linear weights from a Student-t (5 degrees of freedom) scaled to
He initialisation (``sqrt(2 / fan_in)``), norm scales around 1 and biases around 0.
The shape tables equal the state dicts of the ``models`` registry (a test checks it).
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

__all__ = ["MODEL_SHAPES", "sample_weights"]


def _lenet5() -> dict[str, tuple[int, ...]]:
    return {
        "features.conv1.weight": (6, 1, 5, 5), "features.conv1.bias": (6,),
        "features.conv2.weight": (16, 6, 5, 5), "features.conv2.bias": (16,),
        "features.conv3.weight": (120, 16, 5, 5), "features.conv3.bias": (120,),
        "features.fc.weight": (84, 120), "features.fc.bias": (84,),
        "head.weight": (10, 84), "head.bias": (10,),
    }  # fmt: skip


def _resnet8(widths: tuple[int, int, int], in_channels: int = 3) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}

    def norm(prefix: str, c: int) -> None:
        shapes[f"{prefix}.weight"] = (c,)
        shapes[f"{prefix}.bias"] = (c,)

    shapes["features.stem.conv.weight"] = (widths[0], in_channels, 3, 3)
    norm("features.stem.norm", widths[0])
    c_in = widths[0]
    for i, c in enumerate(widths, start=1):
        s = f"features.stage{i}"
        shapes[f"{s}.conv1.weight"] = (c, c_in, 3, 3)
        norm(f"{s}.norm1", c)
        shapes[f"{s}.conv2.weight"] = (c, c, 3, 3)
        norm(f"{s}.norm2", c)
        if c != c_in:
            shapes[f"{s}.shortcut.conv.weight"] = (c, c_in, 1, 1)
            norm(f"{s}.shortcut.norm", c)
        c_in = c
    shapes["head.weight"] = (10, c_in)
    shapes["head.bias"] = (10,)
    return shapes


MODEL_SHAPES: dict[str, dict[str, tuple[int, ...]]] = {
    "lenet5": _lenet5(),  # 1x28x28 input, 10 classes: 61,706 parameters
    "resnet8": _resnet8((64, 128, 256)),  # FedKF widths, 3x32x32, 10 classes: 1,227,594
    "resnet8_small": _resnet8((16, 32, 64)),  # FedDF widths, 3x32x32, 10 classes: 78,042
}
"""Tensor names and shapes of reference models (state-dict names of ``models``)."""


def sample_weights(model: str, seed: int = 0) -> dict[str, npt.NDArray[np.float32]]:
    """Trained-looking float32 weights for a model of :data:`MODEL_SHAPES`.

    Raises:
        KeyError: ``model`` is not in :data:`MODEL_SHAPES`.
    """
    rng = np.random.default_rng(seed)
    out: dict[str, npt.NDArray[np.float32]] = {}
    for name, shape in MODEL_SHAPES[model].items():
        if len(shape) >= 2:
            fan_in = math.prod(shape[1:])
            std = math.sqrt(2.0 / fan_in)
            # Student-t(5) has variance 5/3; rescale to std
            values = rng.standard_t(5, size=shape) * std / math.sqrt(5 / 3)
        elif ".norm" in name and name.endswith(".weight"):
            values = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            values = 0.02 * rng.standard_normal(shape)
        out[name] = values.astype(np.float32)
    return out
