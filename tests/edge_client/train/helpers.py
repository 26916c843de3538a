"""Small models and data the strategy and local-update tests share."""

from __future__ import annotations

import numpy as np
import torch

from edge_client.train.data import DeviceData
from models import Classifier, build_classifier, state_arrays

HP = {"local_epochs": 2, "batch_size": 16, "lr": 0.1, "seed": 1}
"""Hyperparameters of a short round (64 samples: 8 steps)."""


def model(seed: int = 0) -> Classifier:
    torch.manual_seed(seed)
    return build_classifier("mlp", num_classes=4, in_channels=1, image_size=8)


def small_data() -> DeviceData:
    """64 random 1x8x8 images, 4 balanced classes, no test split."""
    rng = np.random.default_rng(2)
    y = (np.arange(64) % 4).astype(np.int64)
    x = rng.random((64, 1, 8, 8), dtype=np.float32)
    return DeviceData("dev-000", x, y, x[:0], y[:0], 4)


def global_arrays(seed: int = 5) -> dict[str, np.ndarray]:
    return state_arrays(model(seed))


def distance(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in a)))
