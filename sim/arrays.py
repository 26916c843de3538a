"""The in-memory dataset types shared by the readers, the generator and the registry."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.errors import DatasetError

__all__ = ["ArrayDataset", "DatasetSplits", "describe"]


@dataclass(frozen=True)
class ArrayDataset:
    """A labelled sample set held in memory.

    Attributes:
        x: float32 samples, shape (N, *sample_shape): images (N, C, H, W) with values in
            [0, 1], or samples of another shape (an ``npz`` dataset), finite.
        y: int64 labels, shape (N,), values in [0, num_classes).
        num_classes: number of classes of the task (not only those present).
        name: a human-readable name, e.g. ``"mnist/train"`` or ``"dev-003/test"``.

    Raises:
        DatasetError: on construction, if any of the above does not hold.
    """

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    name: str

    def __post_init__(self) -> None:
        x, y = self.x, self.y
        what = f"dataset {self.name!r}"
        if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim < 2:
            raise DatasetError(
                f"{what}: x must be a float32 array (N, *sample_shape), got {describe(x)}"
            )
        if not isinstance(y, np.ndarray) or y.dtype != np.int64 or y.ndim != 1:
            raise DatasetError(f"{what}: y must be an int64 array (N,), got {describe(y)}")
        if len(x) != len(y):
            raise DatasetError(f"{what}: {len(x)} samples but {len(y)} labels")
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int):
            raise DatasetError(f"{what}: num_classes must be an int")
        if self.num_classes < 1:
            raise DatasetError(f"{what}: num_classes must be >= 1, got {self.num_classes}")
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= self.num_classes):
            raise DatasetError(f"{what}: labels must lie in [0, {self.num_classes})")
        if x.ndim == 4 and x.size and not (float(x.min()) >= 0.0 and float(x.max()) <= 1.0):
            raise DatasetError(f"{what}: pixel values must lie in [0, 1]")  # NaN fails too
        if x.ndim != 4 and x.size and not bool(np.isfinite(x).all()):
            raise DatasetError(f"{what}: samples hold non-finite values")

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, indices: np.ndarray, name: str | None = None) -> ArrayDataset:
        """Return the samples at ``indices`` (an integer index array) as a new dataset."""
        return ArrayDataset(self.x[indices], self.y[indices], self.num_classes, name or self.name)

    def label_counts(self) -> np.ndarray:
        """Number of samples per class: int64 array of shape (num_classes,)."""
        return np.bincount(self.y, minlength=self.num_classes).astype(np.int64)


@dataclass(frozen=True)
class DatasetSplits:
    """The train split of a dataset and its official test split (None if it has none)."""

    train: ArrayDataset
    test: ArrayDataset | None


def describe(a: object) -> str:
    """Name an array's dtype and shape (or a non-array's type) for error messages."""
    if isinstance(a, np.ndarray):
        return f"{a.dtype} array of shape {a.shape}"
    return type(a).__name__
