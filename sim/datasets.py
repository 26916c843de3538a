"""Image-classification datasets for the emulator, as plain numpy arrays.

:func:`load_dataset` picks a dataset from a registry by name: ``"synthetic"`` (the
embedded default: generated, no files needed) or a standard release read from a folder
holding its official files (``"mnist"``, ``"fashion-mnist"``, ``"emnist-letters"``,
``"cifar10"``). Readers use numpy only; torch is imported only by the optional
torchvision downloader (``download=True`` with torchvision installed).
"""

from __future__ import annotations

import codecs
import gzip
import importlib
import io
import logging
import os
import pickle
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sim.errors import DatasetError

__all__ = [
    "ArrayDataset",
    "DatasetSplits",
    "dataset_names",
    "load_dataset",
    "make_synthetic",
    "read_cifar_batch",
    "read_idx_images",
    "read_idx_labels",
]

logger = logging.getLogger(__name__)

_IDX_IMAGES_MAGIC = 2051  # 0x00000803: uint8 data, 3 dims (count, rows, cols)
_IDX_LABELS_MAGIC = 2049  # 0x00000801: uint8 data, 1 dim (count)
_reconstruct: Any = np.empty(0).__reduce__()[0]  # numpy's array unpickling helper


@dataclass(frozen=True)
class ArrayDataset:
    """A labelled image set held in memory.

    Attributes:
        x: float32 images, shape (N, C, H, W), values in [0, 1].
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
        if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 4:
            raise DatasetError(f"{what}: x must be a float32 array (N, C, H, W), got {_desc(x)}")
        if not isinstance(y, np.ndarray) or y.dtype != np.int64 or y.ndim != 1:
            raise DatasetError(f"{what}: y must be an int64 array (N,), got {_desc(y)}")
        if len(x) != len(y):
            raise DatasetError(f"{what}: {len(x)} images but {len(y)} labels")
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int):
            raise DatasetError(f"{what}: num_classes must be an int")
        if self.num_classes < 1:
            raise DatasetError(f"{what}: num_classes must be >= 1, got {self.num_classes}")
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= self.num_classes):
            raise DatasetError(f"{what}: labels must lie in [0, {self.num_classes})")
        if x.size and not (float(x.min()) >= 0.0 and float(x.max()) <= 1.0):  # NaN fails too
            raise DatasetError(f"{what}: pixel values must lie in [0, 1]")

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


def _desc(a: object) -> str:
    if isinstance(a, np.ndarray):
        return f"{a.dtype} array of shape {a.shape}"
    return type(a).__name__


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
                raise DatasetError(f"{path}: IDX magic {found}, expected {magic}")
            header = f.read(4 * ndim)
            if len(header) < 4 * ndim:
                raise DatasetError(f"{path}: truncated IDX header")
            dims = tuple(int.from_bytes(header[4 * i : 4 * i + 4], "big") for i in range(ndim))
            expected = int(np.prod(dims, dtype=np.int64))
            data = f.read(expected + 1)  # bounded: never more than the header declares
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise DatasetError(f"{path}: cannot read IDX file: {exc}") from exc
    if len(data) != expected:
        state = "truncated" if len(data) < expected else "has trailing data"
        raise DatasetError(f"{path}: {state}; header {dims} declares {expected} bytes")
    return np.frombuffer(data, dtype=np.uint8).reshape(dims)


def read_idx_images(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX image file (gzip-compressed or plain, magic 2051).

    Returns:
        uint8 array of shape (count, rows, cols), as stored.

    Raises:
        DatasetError: unreadable file, wrong magic, truncated or oversized data.
    """
    return _read_idx(Path(path), _IDX_IMAGES_MAGIC, 3)


def read_idx_labels(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX label file (gzip-compressed or plain, magic 2049).

    Returns:
        uint8 array of shape (count,).

    Raises:
        DatasetError: unreadable file, wrong magic, truncated or oversized data.
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
        DatasetError: unreadable file, a forbidden global, or unexpected contents.
    """
    p = Path(path)
    try:
        with p.open("rb") as f:
            obj = _RestrictedUnpickler(f, encoding="bytes").load()
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError) as exc:
        raise DatasetError(f"{p}: not a readable CIFAR-10 batch: {exc}") from exc
    if not isinstance(obj, dict) or b"data" not in obj or b"labels" not in obj:
        raise DatasetError(f"{p}: expected a dict with b'data' and b'labels'")
    data, labels = obj[b"data"], np.asarray(obj[b"labels"])
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2:
        raise DatasetError(f"{p}: b'data' must be a uint8 (N, 3072) array, got {_desc(data)}")
    if data.shape[1] != 3 * 32 * 32 or labels.shape != (len(data),):
        raise DatasetError(f"{p}: expected (N, 3072) data and N labels, got {data.shape}")
    if labels.dtype.kind not in "iu":
        raise DatasetError(f"{p}: labels must be integers")
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


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
        "not), or pass download=True with torchvision installed"
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
        raise DatasetError(f"{name}: needs a data_dir holding {wanted} (gzipped or not)")
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


# ------------------------------------------------------------------------ synthetic


def _prototypes(rng: np.random.Generator, k: int, c: int, size: int, blobs: int) -> np.ndarray:
    """One smooth pattern per class and channel: a sum of Gaussian blobs, (K, C, S, S)."""
    grid = np.arange(size, dtype=np.float32)
    centers = rng.uniform(0.25 * size, 0.75 * size, (k, c, blobs, 2)).astype(np.float32)
    widths = rng.uniform(0.06 * size, 0.14 * size, (k, c, blobs, 1, 1)).astype(np.float32)
    gy = np.exp(-((grid - centers[..., 0, None]) ** 2)[..., :, None] / (2 * widths**2))
    gx = np.exp(-((grid - centers[..., 1, None]) ** 2)[..., None, :] / (2 * widths**2))
    protos = (gy * gx).sum(axis=2)  # (K, C, S, S)
    out: np.ndarray = protos / protos.max(axis=(2, 3), keepdims=True)
    return out


def _draw(
    rng: np.random.Generator,
    protos: np.ndarray,
    n: int,
    *,
    noise: float,
    overlap: float,
    max_shift: float,
) -> tuple[np.ndarray, np.ndarray]:
    k, _, size, _ = protos.shape
    y = rng.permutation(np.arange(n) % k).astype(np.int64)  # balanced classes
    other = (y + rng.integers(1, k, n)) % k if k > 1 else y  # a different class to blend in
    scale = rng.uniform(0.8, 1.2, (n, 1)).astype(np.float32)
    shift = rng.uniform(-max_shift, max_shift, (n, 2)).astype(np.float32)
    mid = (size - 1) / 2
    grid = np.arange(size, dtype=np.float32) - mid
    rows = np.clip(np.rint(mid + grid / scale - shift[:, :1]), 0, size - 1).astype(np.intp)
    cols = np.clip(np.rint(mid + grid / scale - shift[:, 1:]), 0, size - 1).astype(np.intp)
    r, c = rows[:, :, None], cols[:, None, :]
    # Advanced indices first, then the channel slice: result is (N, S, S, C).
    own = protos[y[:, None, None], :, r, c]
    mixed = protos[other[:, None, None], :, r, c]
    m = rng.uniform(0.0, overlap, (n, 1, 1, 1)).astype(np.float32)
    contrast = rng.uniform(0.6, 1.0, (n, 1, 1, 1)).astype(np.float32)
    x = contrast * ((1 - m) * own + m * mixed)
    x += noise * rng.standard_normal(x.shape, dtype=np.float32)
    x = np.clip(x, 0.0, 1.0, out=x).transpose(0, 3, 1, 2)
    return np.ascontiguousarray(x), y


def make_synthetic(
    seed: int = 0,
    *,
    num_classes: int = 10,
    channels: int = 1,
    image_size: int = 28,
    train_samples: int = 10_000,
    test_samples: int = 2_000,
    noise: float = 0.25,
    overlap: float = 0.45,
    max_shift: float = 3.0,
) -> DatasetSplits:
    """Generate the deterministic synthetic dataset (the embedded default).

    Each class has a smooth random prototype (a sum of Gaussian blobs per channel). A
    sample is its class prototype, scaled by 0.8-1.2, shifted by up to ``max_shift``
    pixels, blended with a random other class's prototype (weight up to ``overlap``),
    dimmed, plus Gaussian noise of std ``noise``, clipped to [0, 1]. Classes overlap, so
    a small CNN learns it well above chance but not perfectly. Same arguments give
    bit-identical arrays (for a given numpy version).

    Raises:
        DatasetError: a size or count below 1, or negative noise / overlap / shift.
    """
    sizes = dict(
        num_classes=num_classes,
        channels=channels,
        image_size=image_size,
        train_samples=train_samples,
        test_samples=test_samples,
    )
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DatasetError(f"synthetic: {key} must be an int >= 1, got {value!r}")
    if min(noise, overlap, max_shift) < 0 or overlap > 1:
        raise DatasetError("synthetic: noise and max_shift must be >= 0, overlap in [0, 1]")
    proto_seq, train_seq, test_seq = np.random.SeedSequence(seed).spawn(3)
    protos = _prototypes(np.random.default_rng(proto_seq), num_classes, channels, image_size, 4)
    out = []
    for split, seq, n in (("train", train_seq, train_samples), ("test", test_seq, test_samples)):
        rng = np.random.default_rng(seq)
        x, y = _draw(rng, protos, n, noise=noise, overlap=overlap, max_shift=max_shift)
        out.append(ArrayDataset(x, y, num_classes, f"synthetic/{split}"))
    return DatasetSplits(out[0], out[1])


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
