"""A device's local data: the arrays it trains and evaluates on, and their file format.

The file format is the one ``python -m sim partition`` writes (``sim.partition.
save_device_file``): an uncompressed ``.npz`` with

===============  =======================  ==============================================
key              dtype, shape             meaning
===============  =======================  ==============================================
``x``            float32 (N, *shape)      train samples: images (C, H, W) for the built-in
                                         classifiers (the partitioner scales them to
                                         [0, 1]), any shape for a user's model
                                         (docs/models.md): series (T, C), vectors (F,)
``y``            int64 (N,)               train labels in [0, num_classes)
``x_test``       float32 (M, *shape)      local test samples (M may be 0), same shape
``y_test``       int64 (M,)               local test labels
``num_classes``  int64, 0-d               classes of the task (not only those present)
``device_id``    unicode, 0-d (optional)  the device's id; else the file name's stem
===============  =======================  ==============================================

Files are read with ``allow_pickle=False``: nothing in them is ever executed. This module
imports numpy only (no torch), so reading data costs a device little memory.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from edge_client.errors import DataError

__all__ = ["DeviceData", "load_device_data"]

_ARRAY_KEYS: dict[str, type[np.generic]] = {
    "x": np.float32,
    "y": np.int64,
    "x_test": np.float32,
    "y_test": np.int64,
}


def _describe(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype} array of shape {value.shape}"
    return type(value).__name__


@dataclass(frozen=True)
class DeviceData:
    """One device's train and local test arrays, validated on construction.

    Attributes:
        device_id: the device's id (as in the data file).
        x: float32 train samples, shape (N, *sample_shape) (images: (N, C, H, W)),
            finite.
        y: int64 train labels, shape (N,), in [0, num_classes).
        x_test: float32 local test samples, shape (M, *sample_shape); M may be 0.
        y_test: int64 local test labels, shape (M,).
        num_classes: number of classes of the task (>= 1), not only those present.

    Raises:
        DataError: on construction, if any of the above does not hold.
    """

    device_id: str
    x: npt.NDArray[np.float32]
    y: npt.NDArray[np.int64]
    x_test: npt.NDArray[np.float32]
    y_test: npt.NDArray[np.int64]
    num_classes: int

    def __post_init__(self) -> None:
        what = f"device data {self.device_id!r}"
        if not isinstance(self.device_id, str) or not self.device_id:
            raise DataError(f"{what}: device_id must be a non-empty string")
        nc = self.num_classes
        if isinstance(nc, bool) or not isinstance(nc, int) or nc < 1:
            raise DataError(f"{what}: num_classes must be an int >= 1, got {nc!r}")
        pairs = (("x", self.x, "y", self.y), ("x_test", self.x_test, "y_test", self.y_test))
        for x_key, xs, y_key, ys in pairs:
            if not isinstance(xs, np.ndarray) or xs.dtype != np.float32 or xs.ndim < 2:
                raise DataError(
                    f"{what}: {x_key!r} must be a float32 array (N, *sample_shape), got "
                    f"{_describe(xs)}"
                )
            if not isinstance(ys, np.ndarray) or ys.dtype != np.int64 or ys.ndim != 1:
                raise DataError(
                    f"{what}: {y_key!r} must be an int64 array (N,), got {_describe(ys)}"
                )
        if self.x.shape[1:] != self.x_test.shape[1:]:
            raise DataError(
                f"{what}: 'x' and 'x_test' samples differ in shape "
                f"({self.x.shape[1:]} != {self.x_test.shape[1:]})"
            )
        for x_key, xs, y_key, ys in pairs:
            if len(xs) != len(ys):
                raise DataError(f"{what}: {x_key!r} has {len(xs)} samples but {y_key!r} {len(ys)}")
            if len(ys) and (int(ys.min()) < 0 or int(ys.max()) >= nc):
                raise DataError(f"{what}: {y_key!r} labels must lie in [0, {nc})")
            if xs.size and not bool(np.isfinite(xs).all()):
                raise DataError(f"{what}: {x_key!r} holds non-finite values")

    @property
    def num_samples(self) -> int:
        """Number of train samples N."""
        return len(self.y)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """Shape of one sample: (C, H, W) for images."""
        return tuple(int(d) for d in self.x.shape[1:])

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """Shape of one image, (C, H, W).

        Raises:
            DataError: the samples are not images (C, H, W).
        """
        shape = self.sample_shape
        if len(shape) != 3:
            raise DataError(
                f"device data {self.device_id!r}: samples of shape {shape} are not images (C, H, W)"
            )
        return (shape[0], shape[1], shape[2])

    def label_counts(self) -> npt.NDArray[np.int64]:
        """Train samples per class: int64 array of shape (num_classes,)."""
        return np.bincount(self.y, minlength=self.num_classes).astype(np.int64)


def load_device_data(path: str | os.PathLike[str]) -> DeviceData:
    """Read a device data file (format in the module docstring) without unpickling.

    ``device_id`` falls back to the file name's stem when the key is absent.

    Raises:
        DataError: missing or unreadable file, pickled objects, a missing key, or arrays
            of the wrong dtype, shape or label range (the message names the file and key).
    """
    p = Path(path)
    try:
        loaded = np.load(p, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{p}: not a readable device .npz file: {exc}") from exc
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise DataError(f"{p}: not a device .npz archive (a single .npy array)")
    try:
        with loaded as z:
            arrays: dict[str, npt.NDArray[Any]] = {key: z[key] for key in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{p}: not a readable device .npz file: {exc}") from exc
    for key, dtype in {**_ARRAY_KEYS, "num_classes": np.int64}.items():
        if key not in arrays:
            raise DataError(f"{p}: missing key {key!r}; expected {sorted(_ARRAY_KEYS)}")
        if arrays[key].dtype != dtype:
            raise DataError(f"{p}: {key!r} must be {np.dtype(dtype)}, got {arrays[key].dtype}")
    if arrays["num_classes"].shape != ():
        raise DataError(f"{p}: 'num_classes' must be a scalar")
    dev_arr = arrays.get("device_id", np.array(p.stem))
    if dev_arr.shape != () or dev_arr.dtype.kind != "U":
        raise DataError(f"{p}: 'device_id' must be a unicode scalar")
    try:
        return DeviceData(
            device_id=str(dev_arr),
            x=arrays["x"],
            y=arrays["y"],
            x_test=arrays["x_test"],
            y_test=arrays["y_test"],
            num_classes=int(arrays["num_classes"]),
        )
    except DataError as exc:
        raise DataError(f"{p}: {exc}") from exc
