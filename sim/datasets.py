"""Image-classification datasets for the emulator, as plain numpy arrays.

:func:`load_dataset` picks a dataset from a registry by name: ``"synthetic"`` (the
embedded default: generated, no files needed) or a standard release read from a folder
holding its official files (``"mnist"``, ``"fashion-mnist"``, ``"emnist-letters"``,
``"cifar10"``). Readers use numpy only; torch is imported only by the optional
torchvision downloader (``download=True`` with torchvision installed).

The types live in :mod:`sim.arrays`, the file readers in :mod:`sim.readers` and the
generator in :mod:`sim.synthetic`; all are re-exported here.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sim.arrays import ArrayDataset, DatasetSplits
from sim.errors import DatasetError
from sim.readers import read_cifar_batch, read_idx_images, read_idx_labels
from sim.synthetic import make_synthetic

__all__ = [
    "ArrayDataset",
    "DatasetSplits",
    "dataset_names",
    "load_dataset",
    "load_proxy_images",
    "make_synthetic",
    "read_cifar_batch",
    "read_idx_images",
    "read_idx_labels",
]

logger = logging.getLogger(__name__)

# -------------------------------------------------------------------- file datasets


@dataclass(frozen=True)
class _FileLayout:
    """Where a standard release's files sit, what they are called, how to decode them."""

    train: tuple[str, ...]  # file names without .gz: (images, labels) or CIFAR batches
    test: tuple[str, ...]
    num_classes: int
    subdirs: tuple[str, ...]  # looked in under data_dir, after data_dir itself
    torchvision: str  # the torchvision.datasets class whose downloader fetches them
    cifar: bool = False  # python pickle batches instead of IDX (images, labels)
    emnist: bool = False  # images stored transposed, labels 1..num_classes


def _find(name: str, layout: _FileLayout, data_dir: Path, base: str) -> Path:
    for folder in (data_dir, *(data_dir / s for s in layout.subdirs)):
        for candidate in (folder / f"{base}.gz", folder / base):
            if candidate.is_file():
                return candidate
    wanted = ", ".join(layout.train + layout.test)
    raise DatasetError(
        f"{name}: {base}[.gz] not found in {data_dir} or its subfolders "
        f"{', '.join(layout.subdirs)}; put the official files there ({wanted}; gzipped or "
        "not), or fetch them where torchvision and a network exist: python -m sim partition "
        f"--dataset {name} --data-dir {data_dir} --download ..."
    )


def _torchvision_download(layout: _FileLayout, data_dir: Path) -> None:
    """Fetch the files with torchvision's downloader (imports torch; network needed)."""
    try:
        tv = importlib.import_module("torchvision.datasets")
    except ImportError as exc:
        raise DatasetError("download=True needs torchvision, which is not installed") from exc
    extra = {"split": "letters"} if layout.emnist else {}
    try:
        for train in (True, False):
            getattr(tv, layout.torchvision)(str(data_dir), train=train, download=True, **extra)
    except Exception as exc:  # torchvision raises assorted network and I/O errors
        raise DatasetError(f"torchvision download into {data_dir} failed: {exc}") from exc


def _read_split(name: str, layout: _FileLayout, data_dir: Path, split: str) -> ArrayDataset:
    names = layout.train if split == "train" else layout.test
    files = [_find(name, layout, data_dir, b) for b in names]
    if layout.cifar:
        parts = [read_cifar_batch(f) for f in files]
        images, labels = (
            np.concatenate([p[0] for p in parts]),
            np.concatenate([p[1] for p in parts]),
        )
    else:
        images, raw_labels = read_idx_images(files[0]), read_idx_labels(files[1])
        if len(images) != len(raw_labels):
            raise DatasetError(
                f"{files[0]} has {len(images)} images but {files[1]} has {len(raw_labels)} labels"
            )
        labels = raw_labels.astype(np.int64)
        if layout.emnist:
            images, labels = images.transpose(0, 2, 1), labels - 1
        images = images[:, None]  # (N, 1, H, W)
    bad = (labels < 0) | (labels >= layout.num_classes)
    if bad.any():
        raise DatasetError(f"{files[-1]}: label {int(labels[bad][0])} outside the expected range")
    x = np.multiply(images, np.float32(1 / 255), dtype=np.float32, order="C")  # one allocation
    return ArrayDataset(x, labels, layout.num_classes, f"{name}/{split}")


def _load_files(
    name: str, layout: _FileLayout, data_dir: Path | None, seed: int, download: bool = False
) -> DatasetSplits:
    del seed  # the official splits are used as stored
    if data_dir is None:
        wanted = ", ".join(layout.train + layout.test)
        raise DatasetError(
            f"{name}: needs a data folder (--data-dir) holding {wanted} (gzipped or not)"
        )
    try:
        _find(name, layout, data_dir, layout.train[0])
    except DatasetError:
        if not download:
            raise
        _torchvision_download(layout, data_dir)
    splits = DatasetSplits(*(_read_split(name, layout, data_dir, s) for s in ("train", "test")))
    logger.info("loaded %s from %s", name, data_dir)
    return splits


_MNIST_TRAIN = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte")
_MNIST_TEST = ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
_LAYOUTS: dict[str, _FileLayout] = {
    "mnist": _FileLayout(
        _MNIST_TRAIN,
        _MNIST_TEST,
        num_classes=10,
        subdirs=("mnist", "MNIST/raw"),
        torchvision="MNIST",
    ),
    "fashion-mnist": _FileLayout(
        _MNIST_TRAIN,
        _MNIST_TEST,
        num_classes=10,
        subdirs=("fashion-mnist", "FashionMNIST/raw"),
        torchvision="FashionMNIST",
    ),
    "emnist-letters": _FileLayout(
        train=("emnist-letters-train-images-idx3-ubyte", "emnist-letters-train-labels-idx1-ubyte"),
        test=("emnist-letters-test-images-idx3-ubyte", "emnist-letters-test-labels-idx1-ubyte"),
        num_classes=26,
        subdirs=("emnist-letters", "EMNIST/raw"),
        torchvision="EMNIST",
        emnist=True,
    ),
    "cifar10": _FileLayout(
        train=tuple(f"data_batch_{i}" for i in range(1, 6)),
        test=("test_batch",),
        num_classes=10,
        subdirs=("cifar-10-batches-py", "cifar10/cifar-10-batches-py"),
        torchvision="CIFAR10",
        cifar=True,
    ),
}

# ------------------------------------------------------------------------- registry

_Loader = Callable[..., DatasetSplits]  # (data_dir: Path | None, seed: int, **options)


def _synthetic_loader(data_dir: Path | None, seed: int, **options: Any) -> DatasetSplits:
    del data_dir  # generated, no files
    return make_synthetic(seed, **options)


def _file_loader(name: str) -> _Loader:
    def load(data_dir: Path | None, seed: int, *, download: bool = False) -> DatasetSplits:
        return _load_files(name, _LAYOUTS[name], data_dir, seed, download)

    return load


_REGISTRY: dict[str, tuple[_Loader, frozenset[str]]] = {
    "synthetic": (
        _synthetic_loader,
        frozenset(
            {
                "num_classes",
                "channels",
                "image_size",
                "train_samples",
                "test_samples",
                "noise",
                "overlap",
                "max_shift",
            }
        ),
    ),
    **{name: (_file_loader(name), frozenset({"download"})) for name in _LAYOUTS},
}


def dataset_names() -> list[str]:
    """Names accepted by :func:`load_dataset`, sorted."""
    return sorted(_REGISTRY)


def load_proxy_images(
    folder: str | os.PathLike[str], *, size: int | None = None, seed: int = 0
) -> np.ndarray:
    """The train images of the dataset whose official files sit in ``folder`` itself
    (any file dataset of :func:`dataset_names`; MNIST and Fashion-MNIST files read
    alike), as unlabeled proxy data: float32 ``(N, C, H, W)`` in [0, 1]. Their labels
    are never used. With ``size``: that many of them, drawn at random (seeded by
    ``seed``) without replacement, in file order; all of them where the file has fewer.

    Raises:
        DatasetError: ``folder`` holds no known dataset, or its files are corrupt.
    """
    data_dir = Path(folder)
    for name, layout in _LAYOUTS.items():
        base = layout.train[0]
        if (data_dir / base).is_file() or (data_dir / f"{base}.gz").is_file():
            flat = dataclasses.replace(layout, subdirs=())
            images = _read_split(name, flat, data_dir, "train").x
            if size is None or size >= len(images):
                return images
            pick = np.random.default_rng(seed).choice(len(images), size, replace=False)
            return images[np.sort(pick)]
    wanted = ", ".join(sorted({layout.train[0] for layout in _LAYOUTS.values()}))
    raise DatasetError(f"{data_dir}: no dataset's train images in it (looked for {wanted})")


def load_dataset(
    name: str, data_dir: str | os.PathLike[str] | None = None, *, seed: int = 0, **options: Any
) -> DatasetSplits:
    """Load a dataset by registry name.

    Args:
        name: one of :func:`dataset_names` (``"synthetic"``, ``"mnist"``,
            ``"fashion-mnist"``, ``"emnist-letters"``, ``"cifar10"``).
        data_dir: folder with the official files (file datasets; the files may also sit
            in a subfolder named after the dataset, or torchvision's layout). Ignored
            by ``"synthetic"``.
        seed: generation seed of ``"synthetic"``; the file datasets ignore it.
        options: ``"synthetic"``: the keyword arguments of :func:`make_synthetic`;
            file datasets: ``download`` (bool, uses torchvision when files are missing).

    Returns:
        The train split and the official test split, pixels float32 in [0, 1].

    Raises:
        DatasetError: unknown name or option, missing or corrupt files.
    """
    if name not in _REGISTRY:
        raise DatasetError(f"unknown dataset {name!r}; known: {', '.join(dataset_names())}")
    loader, allowed = _REGISTRY[name]
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise DatasetError(f"dataset {name!r} takes options {sorted(allowed)}, not {unknown}")
    return loader(None if data_dir is None else Path(data_dir), seed, **options)
