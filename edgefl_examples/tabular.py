"""A diagnosis from measured features: scikit-learn's breast-cancer data, an MLP.

The Wisconsin diagnostic breast-cancer data (shipped in the ``scikit-learn`` wheel, no
download): 569 tumours, 30 features computed from a digitised image of a fine-needle
aspirate (radius, texture, ... : mean, error and worst of each), labelled malignant (0)
or benign (1). :func:`load` keeps a stratified fifth as the test split (seeded, the same
on every machine) and standardises each feature with the training split's statistics,
so samples are ``(30,)`` float32.

:func:`build_mlp` is the factory ``--model edgefl_examples.tabular:build_mlp`` names: two
hidden layers (32, 16) as the features and a linear head, declared as the split; every
layer has a stacked form, so the sim's batched engine trains a cohort of them at once.

``python -m edgefl_examples.tabular --out tumours.npz`` writes the dataset.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from edgefl_examples._data import Dataset, export_main, standardise

__all__ = ["TEST_FRACTION", "FeatureMlp", "build_mlp", "load", "main"]

TEST_FRACTION = 0.2
"""Share of each class kept for the test split."""


class FeatureMlp(nn.Module):
    """``(B, *shape)`` -> logits: Flatten -> Linear 32 -> ReLU -> Linear 16 -> ReLU as
    the features; a linear head. 1,554 parameters for 30 features and 2 classes."""

    def __init__(self, num_classes: int, features: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Flatten(),
            nn.Linear(features, 32),
            nn.ReLU(),
            nn.Linear(32, 16),
            nn.ReLU(),
        )
        self.head = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))  # type: ignore[no-any-return]


def build_mlp(*, num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """The example's model for feature vectors (any shape: it flattens them)."""
    return FeatureMlp(num_classes, math.prod(input_shape))


def load(seed: int = 0) -> Dataset:
    """The breast-cancer data from scikit-learn: a stratified test fifth drawn by
    ``seed``, features standardised with the training split's statistics.

    Raises:
        ModuleNotFoundError: scikit-learn is not installed (``pip install
            "edgefl[examples]"``).
    """
    from sklearn.datasets import load_breast_cancer

    bunch = load_breast_cancer()
    x, y = np.asarray(bunch.data, dtype=np.float64), np.asarray(bunch.target, dtype=np.int64)
    rng = np.random.default_rng(seed)
    test = np.zeros(len(y), dtype=bool)
    for label in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == label))
        test[members[: round(TEST_FRACTION * len(members))]] = True
    x_train, x_test = standardise(x[~test], x[test], axes=(0,))
    return {
        "x": x_train,
        "y": y[~test],
        "x_test": x_test,
        "y_test": y[test],
        "num_classes": np.array(int(y.max()) + 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m edgefl_examples.tabular --out FILE.npz``."""
    return export_main(
        argv, prog="python -m edgefl_examples.tabular", what="the breast-cancer data", load=load
    )


if __name__ == "__main__":
    raise SystemExit(main())
