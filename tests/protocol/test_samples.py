"""The torch-free sample weights match the real models' state dicts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from models import build_classifier
from models.state import state_shapes
from protocol.samples import MODEL_SHAPES, sample_weights

BUILD = {
    "lenet5": {"name": "lenet5"},
    "resnet8": {"name": "resnet8", "in_channels": 3, "image_size": 32, "widths": (64, 128, 256)},
    "resnet8_small": {
        "name": "resnet8",
        "in_channels": 3,
        "image_size": 32,
        "widths": (16, 32, 64),
    },
}


@pytest.mark.parametrize("model", sorted(MODEL_SHAPES))
def test_shape_tables_equal_the_models_state(model: str) -> None:
    kwargs = dict(BUILD[model])
    module = build_classifier(kwargs.pop("name"), **kwargs)  # type: ignore[arg-type]
    assert MODEL_SHAPES[model] == state_shapes(module)


def test_sample_weights_look_trained_and_are_reproducible() -> None:
    a, b = sample_weights("lenet5", seed=1), sample_weights("lenet5", seed=1)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert sum(v.size for v in a.values()) == 61_706
    conv = a["features.conv3.weight"]
    assert abs(float(conv.std()) - math.sqrt(2 / 400)) < 0.01
    assert float(np.abs(conv).max()) > 4 * float(conv.std())  # heavy tails, not uniform
