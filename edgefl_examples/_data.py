"""What the examples share: standardising with the training split's statistics, writing
an ``npz`` dataset, and the command line that does it."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Dataset", "export_main", "integer_labels", "save_dataset", "standardise"]

Dataset = dict[str, npt.NDArray[Any]]
"""An ``npz`` dataset: ``x``, ``y``, ``x_test``, ``y_test``, ``num_classes``."""


def standardise(
    train: npt.NDArray[Any], test: npt.NDArray[Any], axes: tuple[int, ...]
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """Both splits less the training split's mean, over its std, per feature: the
    statistics are taken over ``axes`` of ``train`` only (the test split is not seen)."""
    mean = train.mean(axis=axes, keepdims=True)
    std = train.std(axis=axes, keepdims=True)
    std[std == 0] = 1.0
    return ((train - mean) / std).astype(np.float32), ((test - mean) / std).astype(np.float32)


def integer_labels(
    train: npt.NDArray[Any], test: npt.NDArray[Any]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], tuple[str, ...]]:
    """Labels of any kind as integers: the sorted distinct training labels are 0, 1, ...

    Raises:
        ValueError: a test label the training split does not have.
    """
    names = np.unique(train)
    unknown = set(np.unique(test).tolist()) - set(names.tolist())
    if unknown:
        raise ValueError(f"test labels the training split lacks: {sorted(unknown)}")
    encoded = np.searchsorted(names, train), np.searchsorted(names, test)  # names: sorted
    return (
        encoded[0].astype(np.int64),
        encoded[1].astype(np.int64),
        tuple(str(n) for n in names.tolist()),
    )


def save_dataset(path: Path, data: Dataset) -> Path:
    """Write ``data`` as an ``npz`` dataset (no pickle) at ``path``; returns it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as out:
        np.savez(out, **data)  # type: ignore[arg-type]
    return path


def export_main(
    argv: Sequence[str] | None, *, prog: str, what: str, load: Callable[[], Dataset]
) -> int:
    """``python -m PROG --out FILE.npz``: write the example's dataset."""
    parser = argparse.ArgumentParser(prog=prog, description=f"Write {what} as an npz dataset.")
    parser.add_argument("--out", type=Path, required=True, help="the .npz file to write")
    args = parser.parse_args(argv)
    data = load()
    save_dataset(args.out, data)
    shape = tuple(data["x"].shape[1:])
    print(
        f"wrote {args.out}: {len(data['y'])} training and {len(data['y_test'])} test samples "
        f"of shape {shape}, {int(data['num_classes'])} classes"
    )
    return 0
