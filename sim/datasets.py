"""Classification datasets for the emulator, as plain numpy arrays.

:func:`load_dataset` picks a dataset from a registry by name: ``"synthetic"`` (the
embedded default: generated, no files needed), a standard release read from a folder
holding its official files (``"mnist"``, ``"fashion-mnist"``, ``"emnist-letters"``,
``"cifar10"``), or ``"npz"``: samples of any shape from one ``.npz`` file (for a model
of the user's, docs/models.md). Readers use numpy only; torch is imported only by the optional
torchvision downloader (``download=True`` with torchvision installed).

The types live in :mod:`sim.arrays`, the generator in :mod:`sim.synthetic`; the file
readers and the releases' layouts in :mod:`models.datafiles` (the coordinator reads
proxy data with them too), whose errors come out of this module as
:class:`~sim.errors.DatasetError`.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from models import datafiles
from models.datafiles import RELEASES, Release
from models.errors import DataFileError
from sim.arrays import ArrayDataset, DatasetSplits
from sim.errors import DatasetError
from sim.synthetic import make_synthetic

__all__ = [
    "ArrayDataset",
    "DatasetSplits",
    "dataset_names",
    "load_dataset",
    "load_proxy_images",
    "make_synthetic",
]

logger = logging.getLogger(__name__)

# -------------------------------------------------------------------- file datasets


@contextmanager
def _as_dataset_error() -> Iterator[None]:
    """The file readers' errors as this package's."""
    try:
        yield
    except DataFileError as exc:
        raise DatasetError(str(exc)) from exc


def _torchvision_download(layout: Release, data_dir: Path) -> None:
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


def _read_split(name: str, data_dir: Path, split: str) -> ArrayDataset:
    with _as_dataset_error():
        x, labels = datafiles.read_release(name, data_dir, split)
    return ArrayDataset(x, labels, RELEASES[name].num_classes, f"{name}/{split}")


def _load_files(
    name: str, data_dir: Path | None, seed: int, download: bool = False
) -> DatasetSplits:
    del seed  # the official splits are used as stored
    release = RELEASES[name]
    if data_dir is None:
        wanted = ", ".join(release.train + release.test)
        raise DatasetError(
            f"{name}: needs a data folder (--data-dir) holding {wanted} (gzipped or not)"
        )
    try:
        datafiles.find_file(name, data_dir, release.train[0])
    except DataFileError as exc:
        if not download:
            raise DatasetError(
                f"{exc}; or fetch them where torchvision and a network exist: python -m sim "
                f"partition --dataset {name} --data-dir {data_dir} --download ..."
            ) from exc
        _torchvision_download(release, data_dir)
    splits = DatasetSplits(*(_read_split(name, data_dir, s) for s in ("train", "test")))
    logger.info("loaded %s from %s", name, data_dir)
    return splits


# ---------------------------------------------------------------------- npz datasets

NPZ_KEYS = ("x", "y", "x_test", "y_test", "num_classes")
"""Keys an ``npz`` dataset file may hold (``x`` and ``y`` are required)."""


def _npz_loader(data_dir: Path | None, seed: int) -> DatasetSplits:
    """A dataset of any sample shape from one ``.npz`` file (``--data-dir FILE.npz``):
    ``x`` (N, *sample_shape) numbers, ``y`` (N,) integer labels, optionally ``x_test``
    and ``y_test`` (its test split) and ``num_classes`` (else the largest label + 1).
    Read without unpickling; samples become float32 as they are (no scaling)."""
    del seed  # read as it is
    if data_dir is None or not data_dir.is_file():
        raise DatasetError(f"dataset 'npz' reads one .npz file given as --data-dir; got {data_dir}")
    try:
        with np.load(data_dir, allow_pickle=False) as z:
            arrays = {key: z[key] for key in z.files}
    except (OSError, ValueError, EOFError) as exc:
        raise DatasetError(f"{data_dir}: not a readable .npz file: {exc}") from exc
    unknown = sorted(set(arrays) - set(NPZ_KEYS))
    missing = [key for key in ("x", "y") if key not in arrays]
    if missing or unknown:
        raise DatasetError(
            f"{data_dir}: an npz dataset holds {', '.join(NPZ_KEYS)} (x and y required); "
            f"missing {missing}, unknown {unknown}"
        )
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise DatasetError(f"{data_dir}: x_test and y_test come together")
    for key in ("x", "x_test"):
        if key in arrays and arrays[key].dtype.kind not in "biuf":
            raise DatasetError(f"{data_dir}: {key!r} must hold numbers, got {arrays[key].dtype}")
    for key in ("y", "y_test"):
        if key in arrays and arrays[key].dtype.kind not in "iu":
            raise DatasetError(
                f"{data_dir}: {key!r} must hold integer labels, got {arrays[key].dtype}"
            )
    labels = [arrays["y"], arrays.get("y_test", np.zeros(0, np.int64))]
    found = max((int(y.max()) + 1 for y in labels if y.size), default=1)
    classes = int(arrays["num_classes"]) if "num_classes" in arrays else found
    if classes < found:
        raise DatasetError(f"{data_dir}: num_classes {classes} but a label is {found - 1}")
    name = data_dir.stem

    def split(x: str, y: str, part: str) -> ArrayDataset:
        return ArrayDataset(
            np.ascontiguousarray(arrays[x], dtype=np.float32),
            np.ascontiguousarray(arrays[y], dtype=np.int64),
            classes,
            f"{name}/{part}",
        )

    test = split("x_test", "y_test", "test") if "x_test" in arrays else None
    return DatasetSplits(train=split("x", "y", "train"), test=test)


# ------------------------------------------------------------------------- registry

_Loader = Callable[..., DatasetSplits]  # (data_dir: Path | None, seed: int, **options)


def _synthetic_loader(data_dir: Path | None, seed: int, **options: Any) -> DatasetSplits:
    del data_dir  # generated, no files
    return make_synthetic(seed, **options)


def _file_loader(name: str) -> _Loader:
    def load(data_dir: Path | None, seed: int, *, download: bool = False) -> DatasetSplits:
        return _load_files(name, data_dir, seed, download)

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
    **{name: (_file_loader(name), frozenset({"download"})) for name in RELEASES},
    "npz": (_npz_loader, frozenset()),
}


def dataset_names() -> list[str]:
    """Names accepted by :func:`load_dataset`, sorted."""
    return sorted(_REGISTRY)


def load_proxy_images(
    folder: str | os.PathLike[str], *, size: int | None = None, seed: int = 0
) -> np.ndarray:
    """:func:`models.datafiles.load_proxy_images`: the train images of the release
    whose files sit in ``folder`` itself, unlabeled (``size`` of them, seeded, where
    given).

    Raises:
        DatasetError: ``folder`` holds no known dataset, or its files are corrupt.
    """
    with _as_dataset_error():
        return datafiles.load_proxy_images(folder, size=size, seed=seed)


def load_dataset(
    name: str, data_dir: str | os.PathLike[str] | None = None, *, seed: int = 0, **options: Any
) -> DatasetSplits:
    """Load a dataset by registry name.

    Args:
        name: one of :func:`dataset_names` (``"synthetic"``, ``"mnist"``,
            ``"fashion-mnist"``, ``"emnist-letters"``, ``"cifar10"``).
        data_dir: folder with the official files (file datasets; the files may also sit
            in a subfolder named after the dataset, or torchvision's layout); the
            ``.npz`` file itself for ``"npz"``. Ignored by ``"synthetic"``.
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
