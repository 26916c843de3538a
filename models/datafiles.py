"""The standard releases' files, read with numpy only: a dataset folder to arrays.

IDX files (MNIST, Fashion-MNIST, EMNIST letters; gzip-compressed or plain) and CIFAR-10
python batches, the latter loaded with an unpickler that resolves only numpy array
reconstruction, so a crafted file cannot run code. :data:`RELEASES` says where each
release's files sit and how to decode them; :func:`read_release` reads one split,
:func:`find_release` names the release whose train files sit in a folder
(:func:`find_release_folder` also looks in its usual subfolders), and
:func:`load_proxy_images` gives a folder's train images, unlabeled, as the server's
distillation data (the coordinator reads ``--proxy-data DIR`` with it; the emulator's
datasets are built on :func:`read_release`).

The one module of :mod:`models` that reads files: public datasets, never device data.
"""

from __future__ import annotations

import codecs
import gzip
import io
import os
import pickle
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models.errors import DataFileError

__all__ = [
    "RELEASES",
    "Release",
    "find_file",
    "find_release",
    "find_release_folder",
    "load_proxy_images",
    "read_cifar_batch",
    "read_idx_images",
    "read_idx_labels",
    "read_release",
    "subsample",
]

_IDX_IMAGES_MAGIC = 2051  # 0x00000803: uint8 data, 3 dims (count, rows, cols)
_IDX_LABELS_MAGIC = 2049  # 0x00000801: uint8 data, 1 dim (count)
_reconstruct: Any = np.empty(0).__reduce__()[0]  # numpy's array unpickling helper

# --------------------------------------------------------------------------- IDX files


def _open_maybe_gzip(path: Path) -> io.BufferedIOBase:
    with path.open("rb") as probe:
        gz = probe.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gz else path.open("rb")


def _read_idx(path: Path, magic: int, ndim: int) -> np.ndarray:
    try:
        with _open_maybe_gzip(path) as f:
            found = int.from_bytes(f.read(4), "big")
            if found != magic:
                raise DataFileError(f"{path}: IDX magic {found}, expected {magic}")
            header = f.read(4 * ndim)
            if len(header) < 4 * ndim:
                raise DataFileError(f"{path}: truncated IDX header")
            dims = tuple(int.from_bytes(header[4 * i : 4 * i + 4], "big") for i in range(ndim))
            expected = int(np.prod(dims, dtype=np.int64))
            data = f.read(expected + 1)  # bounded: never more than the header declares
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise DataFileError(f"{path}: cannot read IDX file: {exc}") from exc
    if len(data) != expected:
        state = "truncated" if len(data) < expected else "has trailing data"
        raise DataFileError(f"{path}: {state}; header {dims} declares {expected} bytes")
    return np.frombuffer(data, dtype=np.uint8).reshape(dims)


def read_idx_images(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX image file (gzip-compressed or plain, magic 2051).

    Returns:
        uint8 array of shape (count, rows, cols), as stored.

    Raises:
        DataFileError: unreadable file, wrong magic, truncated or oversized data.
    """
    return _read_idx(Path(path), _IDX_IMAGES_MAGIC, 3)


def read_idx_labels(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX label file (gzip-compressed or plain, magic 2049).

    Returns:
        uint8 array of shape (count,).

    Raises:
        DataFileError: unreadable file, wrong magic, truncated or oversized data.
    """
    return _read_idx(Path(path), _IDX_LABELS_MAGIC, 1)


# ----------------------------------------------------------------- CIFAR-10 batches

# The only globals a CIFAR-10 python batch (or a numpy array pickled by numpy 1 or 2)
# needs. Anything else (os.system, builtins.eval, ...) is refused.
_PICKLE_ALLOWED = frozenset(
    {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # bytes pickled by Python 3 at protocol < 3
    }
)


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that resolves only the globals a CIFAR-10 batch needs."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _PICKLE_ALLOWED:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        if module.startswith("numpy"):  # numpy 2 renamed numpy.core to numpy._core
            return getattr(np, name) if module == "numpy" else _reconstruct
        return codecs.encode


def read_cifar_batch(path: str | os.PathLike[str]) -> tuple[np.ndarray, np.ndarray]:
    """Read one CIFAR-10 python batch (``data_batch_N`` or ``test_batch``).

    The file is a pickle; it is loaded with an unpickler that allows only numpy array
    reconstruction, so a crafted file cannot run code.

    Returns:
        (images uint8 (N, 3, 32, 32), labels int64 (N,)).

    Raises:
        DataFileError: unreadable file, a forbidden global, or unexpected contents.
    """
    p = Path(path)
    try:
        with p.open("rb") as f:
            obj = _RestrictedUnpickler(f, encoding="bytes").load()
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError) as exc:
        raise DataFileError(f"{p}: not a readable CIFAR-10 batch: {exc}") from exc
    if not isinstance(obj, dict) or b"data" not in obj or b"labels" not in obj:
        raise DataFileError(f"{p}: expected a dict with b'data' and b'labels'")
    data, labels = obj[b"data"], np.asarray(obj[b"labels"])
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2:
        got = f"{data.dtype} array {data.shape}" if isinstance(data, np.ndarray) else type(data)
        raise DataFileError(f"{p}: b'data' must be a uint8 (N, 3072) array, got {got}")
    if data.shape[1] != 3 * 32 * 32 or labels.shape != (len(data),):
        raise DataFileError(f"{p}: expected (N, 3072) data and N labels, got {data.shape}")
    if labels.dtype.kind not in "iu":
        raise DataFileError(f"{p}: labels must be integers")
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


# ------------------------------------------------------------------------- releases


@dataclass(frozen=True)
class Release:
    """Where a standard release's files sit, what they are called, how to decode them."""

    train: tuple[str, ...]  # file names without .gz: (images, labels) or CIFAR batches
    test: tuple[str, ...]
    num_classes: int
    subdirs: tuple[str, ...]  # looked in under a data folder, after the folder itself
    torchvision: str  # the torchvision.datasets class whose downloader fetches them
    cifar: bool = False  # python pickle batches instead of IDX (images, labels)
    emnist: bool = False  # images stored transposed, labels 1..num_classes


_MNIST_TRAIN = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte")
_MNIST_TEST = ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
RELEASES: dict[str, Release] = {
    "mnist": Release(
        _MNIST_TRAIN,
        _MNIST_TEST,
        num_classes=10,
        subdirs=("mnist", "MNIST/raw"),
        torchvision="MNIST",
    ),
    "fashion-mnist": Release(
        _MNIST_TRAIN,
        _MNIST_TEST,
        num_classes=10,
        subdirs=("fashion-mnist", "FashionMNIST/raw"),
        torchvision="FashionMNIST",
    ),
    "emnist-letters": Release(
        train=("emnist-letters-train-images-idx3-ubyte", "emnist-letters-train-labels-idx1-ubyte"),
        test=("emnist-letters-test-images-idx3-ubyte", "emnist-letters-test-labels-idx1-ubyte"),
        num_classes=26,
        subdirs=("emnist-letters", "EMNIST/raw"),
        torchvision="EMNIST",
        emnist=True,
    ),
    "cifar10": Release(
        train=tuple(f"data_batch_{i}" for i in range(1, 6)),
        test=("test_batch",),
        num_classes=10,
        subdirs=("cifar-10-batches-py", "cifar10/cifar-10-batches-py"),
        torchvision="CIFAR10",
        cifar=True,
    ),
}
"""The releases the readers know, by the name ``python -m sim --dataset`` takes."""


def find_file(name: str, data_dir: Path, base: str, *, subdirs: bool = True) -> Path:
    """The file ``base`` (or ``base.gz``) of release ``name`` in ``data_dir`` or, with
    ``subdirs``, the release's usual subfolders of it.

    Raises:
        DataFileError: not there; the message lists the files the release needs.
    """
    release = RELEASES[name]
    folders = (data_dir, *(data_dir / s for s in release.subdirs)) if subdirs else (data_dir,)
    for folder in folders:
        for candidate in (folder / f"{base}.gz", folder / base):
            if candidate.is_file():
                return candidate
    wanted = ", ".join(release.train + release.test)
    where = f"{data_dir} or its subfolders {', '.join(release.subdirs)}" if subdirs else data_dir
    raise DataFileError(
        f"{name}: {base}[.gz] not found in {where}; put the official files there ({wanted}; "
        "gzipped or not)"
    )


def read_release(
    name: str, data_dir: Path, split: str, *, subdirs: bool = True, pixels: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """One split (``"train"`` or ``"test"``) of release ``name`` from its official files.

    Returns:
        (images float32 ``(N, C, H, W)`` in [0, 1] (with ``pixels``: uint8, as stored),
        labels int64 ``(N,)`` in ``[0, num_classes)``); EMNIST's transposed images are
        turned upright and its labels start at 0.

    Raises:
        DataFileError: a file is missing, truncated or malformed, or the images and
            labels do not match.
    """
    release = RELEASES[name]
    names = release.train if split == "train" else release.test
    files = [find_file(name, data_dir, b, subdirs=subdirs) for b in names]
    if release.cifar:
        parts = [read_cifar_batch(f) for f in files]
        images = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
    else:
        images, raw_labels = read_idx_images(files[0]), read_idx_labels(files[1])
        if len(images) != len(raw_labels):
            raise DataFileError(
                f"{files[0]} has {len(images)} images but {files[1]} has {len(raw_labels)} labels"
            )
        labels = raw_labels.astype(np.int64)
        if release.emnist:
            images, labels = images.transpose(0, 2, 1), labels - 1
        images = images[:, None]  # (N, 1, H, W)
    bad = (labels < 0) | (labels >= release.num_classes)
    if bad.any():
        raise DataFileError(f"{files[-1]}: label {int(labels[bad][0])} outside the expected range")
    return (images if pixels else _unit_floats(images)), labels


def _unit_floats(images: np.ndarray) -> np.ndarray:
    """uint8 pixels as float32 in [0, 1], C-contiguous, in one allocation."""
    out: np.ndarray = np.multiply(images, np.float32(1 / 255), dtype=np.float32, order="C")
    return out


def find_release(folder: Path) -> str | None:
    """The name of the release whose train images sit in ``folder`` itself, or None.
    MNIST and Fashion-MNIST files are named alike and read alike: ``"mnist"``."""
    for name, release in RELEASES.items():
        base = release.train[0]
        if (folder / base).is_file() or (folder / f"{base}.gz").is_file():
            return name
    return None


def find_release_folder(folder: Path) -> tuple[str, Path] | None:
    """The release whose train images sit in ``folder`` itself or, as a data folder
    holds them (``--data-dir``), in one of the releases' usual subfolders of it
    (``mnist``, ``EMNIST/raw``, ``cifar-10-batches-py`` ...), and the folder holding
    them; None where there is none. A release found in several of its own subfolders
    is taken from the first, in :attr:`Release.subdirs` order, as :func:`find_file`
    takes it.

    Raises:
        DataFileError: ``folder`` does not exist, is not a folder, or holds the files
            of several releases in their subfolders (the message names them: give one).
    """
    if not folder.exists():
        raise DataFileError(f"no such file or folder: {folder}")
    if not folder.is_dir():
        raise DataFileError(f"{folder}: not a folder (give the folder of a dataset's files)")
    name = find_release(folder)
    if name is not None:
        return name, folder
    found: dict[Path, str] = {}
    for release in RELEASES.values():
        for sub in release.subdirs:
            name = find_release(folder / sub)
            if name is not None:
                found.setdefault(folder / sub, name)
                break
    if len(found) > 1:
        where = ", ".join(str(path) for path in found)
        raise DataFileError(
            f"{folder} holds the train images of several datasets ({where}): give one of "
            "these folders"
        )
    return next(((name, path) for path, name in found.items()), None)


def load_proxy_images(
    folder: str | os.PathLike[str], *, size: int | None = None, seed: int = 0
) -> np.ndarray:
    """The train images of the release whose official files sit in ``folder``, or in
    one of its usual subfolders (:func:`find_release_folder`: what ``--data-dir``
    takes), as unlabeled proxy data: float32 ``(N, C, H, W)`` in [0, 1]. Their labels
    are never used. With ``size``: that many of them, drawn at random (seeded by
    ``seed``) without replacement, in file order; all of them where the files hold
    fewer.

    Raises:
        DataFileError: ``folder`` does not exist, holds no known release or several, or
            its files are corrupt.
    """
    data_dir = Path(folder)
    found = find_release_folder(data_dir)
    if found is None:
        wanted = ", ".join(sorted({r.train[0] for r in RELEASES.values()}))
        subdirs = ", ".join(sorted({s for r in RELEASES.values() for s in r.subdirs}))
        raise DataFileError(
            f"{data_dir}: no dataset's train images in it or in its subfolders {subdirs} "
            f"(looked for {wanted})"
        )
    name, data_dir = found
    pixels = read_release(name, data_dir, "train", subdirs=False, pixels=True)[0]
    return _unit_floats(subsample(pixels, size, seed))  # drawn before the float copy


def subsample(images: np.ndarray, size: int | None, seed: int) -> np.ndarray:
    """``size`` of ``images`` drawn at random by ``seed`` without replacement, in their
    order; all of them where ``size`` is None or not smaller than their count."""
    if size is None or size >= len(images):
        return images
    pick = np.random.default_rng(seed).choice(len(images), size, replace=False)
    return images[np.sort(pick)]
