"""Activity recognition from a wearable: aeon's BasicMotions, a 1-D convolutional network.

BasicMotions (shipped in the ``aeon`` wheel, no download): a smartwatch's 3-axis
accelerometer and 3-axis gyroscope, sampled at 10 Hz for 10 s while its wearer stands,
walks, runs or plays badminton; 40 training and 40 test windows of 6 channels x 100
steps, 4 classes. :func:`load` standardises each channel with the training split's mean
and std, so samples are ``(6, 100)`` float32, channels first as ``nn.Conv1d`` takes them.

:func:`build_cnn` is the factory ``--model edgefl_examples.wearable:build_cnn`` names:
two ``Conv1d`` blocks and a global average over time as the features, a linear head,
declared as the split (so every mode takes it). Every layer has a stacked form, so the
sim's batched engine trains a cohort of them at once.

``python -m edgefl_examples.wearable --out motions.npz`` writes the dataset.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from edgefl_examples._data import Dataset, export_main, integer_labels, standardise

__all__ = ["MotionCnn", "build_cnn", "load", "main"]


class MotionCnn(nn.Module):
    """``(B, channels, steps)`` -> logits: Conv1d(5) 16 -> ReLU -> MaxPool(2) ->
    Conv1d(5) 32 -> ReLU -> mean over time as the 32 features; a linear head.
    3,220 parameters for 6 channels and 4 classes."""

    def __init__(self, num_classes: int, channels: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(channels, 16, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool1d(2),
            nn.Conv1d(16, 32, 5, padding=2),
            nn.ReLU(),
            nn.AdaptiveAvgPool1d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))  # type: ignore[no-any-return]


def build_cnn(*, num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """The example's model for samples ``(channels, steps)``.

    Raises:
        ValueError: samples that are not ``(channels, steps)`` with at least 2 steps.
    """
    if len(input_shape) != 2 or input_shape[1] < 2:
        raise ValueError(f"MotionCnn takes samples (channels, steps), got {input_shape}")
    return MotionCnn(num_classes, input_shape[0])


def load() -> Dataset:
    """BasicMotions from the ``aeon`` package, standardised per channel (training
    statistics), labels as integers in the sorted order of their names.

    Raises:
        ModuleNotFoundError: aeon is not installed (``pip install "edgefl[examples]"``).
    """
    from aeon.datasets import load_basic_motions

    x_train, y_train = load_basic_motions(split="train")
    x_test, y_test = load_basic_motions(split="test")
    x_train, x_test = standardise(np.asarray(x_train), np.asarray(x_test), axes=(0, 2))
    labels, test_labels, names = integer_labels(np.asarray(y_train), np.asarray(y_test))
    return {
        "x": x_train,
        "y": labels,
        "x_test": x_test,
        "y_test": test_labels,
        "num_classes": np.array(len(names)),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m edgefl_examples.wearable --out FILE.npz``."""
    return export_main(
        argv, prog="python -m edgefl_examples.wearable", what="BasicMotions", load=load
    )


if __name__ == "__main__":
    raise SystemExit(main())
