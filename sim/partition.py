"""Split a dataset across emulated devices: Dirichlet(alpha) label skew, then a
per-device train/test split (the FedKF protocol: 80/20), and per-device ``.npz`` files.

Small ``alpha`` gives each device few classes; ``alpha = math.inf`` gives an IID split.
Everything is reproducible from ``seed``.
"""

from __future__ import annotations

import logging
import math
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_client.errors import DataError
from edge_client.train.data import load_device_data
from sim.datasets import ArrayDataset, DatasetSplits
from sim.errors import DatasetError, PartitionError

__all__ = [
    "DeviceSplit",
    "Federation",
    "LabelCounts",
    "device_id",
    "dirichlet_partition",
    "label_counts",
    "load_device_file",
    "mean_label_entropy",
    "partition_dataset",
    "reorder_rows",
    "save_device_file",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceSplit:
    """One emulated device's local data: a train set and a held-out local test set."""

    device_id: str
    train: ArrayDataset
    test: ArrayDataset


@dataclass(frozen=True)
class Federation:
    """A partitioned dataset: one :class:`DeviceSplit` per device, in device-id order,
    plus the dataset's global test set (None if it has none) and its class count."""

    devices: tuple[DeviceSplit, ...]
    test: ArrayDataset | None
    num_classes: int


@dataclass(frozen=True)
class LabelCounts:
    """Samples per class (index = class) on one device, train and test."""

    device_id: str
    train: list[int]
    test: list[int]


def device_id(index: int) -> str:
    """The id of the device at ``index``: ``"dev-000"``, ``"dev-001"``, ..."""
    return f"dev-{index:03d}"


def dirichlet_partition(
    labels: np.ndarray,
    num_devices: int,
    alpha: float,
    *,
    seed: int,
    min_samples: int = 10,
    max_attempts: int = 10_000,
) -> list[np.ndarray]:
    """Assign sample indices to devices with Dirichlet(alpha) label skew.

    For each class, its (shuffled) indices are cut across devices in proportions drawn
    from Dirichlet(alpha, ..., alpha). Draws are repeated until every device has at
    least ``min_samples`` samples. ``alpha = math.inf`` gives an IID split: a random
    permutation cut into near-equal parts.

    Args:
        labels: integer class labels, shape (N,).
        num_devices: number of devices K >= 1.
        alpha: Dirichlet concentration > 0, or ``math.inf``.
        seed: seed of the shuffles and draws; same seed, same result.
        min_samples: minimum samples per device.
        max_attempts: Dirichlet draws tried before giving up.

    Returns:
        K sorted int64 index arrays, disjoint, together covering ``range(N)``.

    Raises:
        PartitionError: bad arguments, fewer than ``K * min_samples`` samples, or no
            draw meeting ``min_samples`` within ``max_attempts``.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or (labels.size and labels.dtype.kind not in "iu"):
        raise PartitionError(f"labels must be a 1-D integer array, got shape {labels.shape}")
    if labels.size and int(labels.min()) < 0:
        raise PartitionError("labels must be >= 0")
    if num_devices < 1 or min_samples < 0 or max_attempts < 1:
        raise PartitionError("need num_devices >= 1, min_samples >= 0 and max_attempts >= 1")
    if not alpha > 0:  # also rejects NaN
        raise PartitionError(f"alpha must be > 0 (or math.inf), got {alpha}")
    n = len(labels)
    if n < num_devices * min_samples:
        raise PartitionError(
            f"{n} samples cannot give {num_devices} devices {min_samples} samples each"
        )
    rng = np.random.default_rng(seed)
    if math.isinf(alpha):
        parts = np.array_split(rng.permutation(n), num_devices)
        return [np.sort(p).astype(np.int64) for p in parts]

    # Shuffle each class once; each attempt only redraws the cut proportions.
    by_class = [rng.permutation(np.flatnonzero(labels == k)) for k in np.unique(labels)]
    sizes = np.array([len(idx) for idx in by_class])
    for attempt in range(1, max_attempts + 1):
        props = rng.dirichlet(np.full(num_devices, alpha), size=len(by_class))  # (C, K)
        cuts = np.floor(np.cumsum(props, axis=1) * sizes[:, None]).astype(np.int64)
        cuts[:, -1] = sizes  # guard against float round-off at the end
        counts = np.diff(cuts, axis=1, prepend=0)  # (C, K) samples of class c on device k
        if counts.sum(axis=0).min() >= min_samples:
            logger.debug("Dirichlet partition met min_samples after %d draw(s)", attempt)
            shards = [[np.empty(0, np.int64)] for _ in range(num_devices)]
            for idx, row in zip(by_class, cuts, strict=True):
                for k, part in enumerate(np.split(idx, row[:-1])):
                    shards[k].append(part)
            return [np.sort(np.concatenate(s)).astype(np.int64) for s in shards]
    raise PartitionError(
        f"no Dirichlet(alpha={alpha}) draw in {max_attempts} gave all {num_devices} devices "
        f">= {min_samples} samples; raise alpha, or lower min_samples or the device count"
    )


def partition_dataset(
    splits: DatasetSplits,
    num_devices: int,
    alpha: float,
    *,
    seed: int,
    min_samples: int = 10,
    test_fraction: float = 0.2,
    in_place: bool = False,
) -> Federation:
    """Partition ``splits.train`` across devices and split each device's share.

    Each device's samples are shuffled (seeded) and ``round(test_fraction * n)`` of them
    become its local test set, the rest its train set (not stratified).

    The devices' sets are views of one array holding the train samples in device order
    (device 0's train then test samples, then device 1's, ...): the fleet's data take the
    dataset's memory once, whatever the number of devices. With ``in_place`` that array is
    ``splits.train``'s own, reordered where it lies (for a caller that owns the dataset
    and needs no second copy of it: 10,000 devices of 375 MNIST-sized samples are 11.8 GB);
    otherwise it is a copy and ``splits`` is left as it was.

    Raises:
        PartitionError: as :func:`dirichlet_partition`, or ``test_fraction`` outside
            [0, 1).
    """
    if not 0.0 <= test_fraction < 1.0:
        raise PartitionError(f"test_fraction must lie in [0, 1), got {test_fraction}")
    part_seq, split_seq = np.random.SeedSequence(seed).spawn(2)
    part_seed = int(part_seq.generate_state(1)[0])
    train = splits.train
    shards = dirichlet_partition(
        train.y, num_devices, alpha, seed=part_seed, min_samples=min_samples
    )
    order, cuts = [], []
    for indices, seq in zip(shards, split_seq.spawn(num_devices), strict=True):
        shuffled = np.random.default_rng(seq).permutation(indices)
        n_test = min(round(test_fraction * len(shuffled)), max(len(shuffled) - 1, 0))
        order += [np.sort(shuffled[n_test:]), np.sort(shuffled[:n_test])]
        cuts.append(len(shuffled) - n_test)
    index = np.concatenate(order) if order else np.empty(0, np.int64)
    if in_place:
        x, y = reorder_rows(train.x, index), reorder_rows(train.y, index)
    else:
        x, y = train.x[index], train.y[index]
    devices, start = [], 0
    for k, (indices, n_train) in enumerate(zip(shards, cuts, strict=True)):
        dev, mid, end = device_id(k), start + n_train, start + len(indices)
        devices.append(
            DeviceSplit(
                dev,
                ArrayDataset(x[start:mid], y[start:mid], train.num_classes, f"{dev}/train"),
                ArrayDataset(x[mid:end], y[mid:end], train.num_classes, f"{dev}/test"),
            )
        )
        start = end
    return Federation(tuple(devices), splits.test, train.num_classes)


_BLOCK_BYTES = 64 << 20
"""Rows moved at a time by :func:`reorder_rows`: its scratch memory is two such blocks."""


def reorder_rows(a: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Reorder the rows of ``a`` in place so that row ``i`` becomes the old ``a[order[i]]``.

    The same as ``a[:] = a[order]`` for a permutation ``order``, without a second copy of
    ``a``: the rows are placed block by block, each block's rows gathered from where they
    lie now, and the rows they displace moved into the places the gathered rows left. The
    scratch memory is at most two blocks of 64 MiB of rows and a few index arrays.

    Returns:
        ``a`` itself.

    Raises:
        PartitionError: ``order`` is not a permutation of ``range(len(a))``.
    """
    n = len(a)
    order = np.asarray(order, dtype=np.int64)
    in_range = order.shape == (n,) and not (n and (order.min() < 0 or order.max() >= n))
    if not in_range or not np.array_equal(np.bincount(order, minlength=n), np.ones(n)):
        raise PartitionError(f"reorder_rows needs a permutation of range({n})")
    where = np.arange(n, dtype=np.int64)  # where each original row lies now
    held = np.arange(n, dtype=np.int64)  # which original row each place holds now
    staying = np.zeros(n, dtype=bool)  # the original rows wanted by the current block
    row_bytes = max(1, a[:1].nbytes)
    block = max(1, _BLOCK_BYTES // row_bytes)
    for start in range(0, n, block):
        stop = min(n, start + block)
        wanted = order[start:stop]
        source = where[wanted]  # all >= start: the places before hold their final rows
        moving = a[source]  # a copy: the block's rows, from where they lie
        freed = source[source >= stop]  # places emptied outside the block
        staying[wanted] = True
        here = np.arange(start, stop, dtype=np.int64)
        displaced = here[~staying[held[start:stop]]]  # rows of the block's places not wanted
        staying[wanted] = False
        # as many rows are displaced as places freed outside the block
        a[freed] = a[displaced]
        held[freed] = held[displaced]
        where[held[freed]] = freed
        a[start:stop] = moving
        held[start:stop] = wanted
        where[wanted] = here
    return a


def label_counts(federation: Federation) -> list[LabelCounts]:
    """Per-device class counts of the train and local test sets, in device order."""
    return [
        LabelCounts(d.device_id, d.train.label_counts().tolist(), d.test.label_counts().tolist())
        for d in federation.devices
    ]


def mean_label_entropy(federation: Federation) -> float:
    """Mean over devices of the entropy (nats) of each device's train label distribution.

    0 when every device holds one class; ``ln(num_classes)`` at most (uniform labels).
    Devices with no train samples count as entropy 0.
    """
    entropies = []
    for d in federation.devices:
        counts = d.train.label_counts().astype(np.float64)
        total = counts.sum()
        p = counts[counts > 0] / total if total else counts[:0]
        entropies.append(float(-(p * np.log(p)).sum()))
    return float(np.mean(entropies)) if entropies else 0.0


def save_device_file(path: str | os.PathLike[str], split: DeviceSplit) -> None:
    """Write one device's data as an uncompressed ``.npz`` file, atomically.

    Format (every array readable with ``np.load(path, allow_pickle=False)``):
    ``x`` float32 (N, C, H, W) train images in [0, 1]; ``y`` int64 (N,) train labels;
    ``x_test`` float32 (M, C, H, W) and ``y_test`` int64 (M,), the local test set;
    ``num_classes`` int64 scalar (0-d); ``device_id`` unicode scalar (0-d).
    The file is written to a temporary file in the same folder, then renamed over
    ``path``, so readers never see a partial file.

    Raises:
        OSError: the file cannot be written.
    """
    target = Path(path)
    # Same folder, so os.replace is an atomic rename; default permissions (umask).
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with tmp.open("xb") as f:
            np.savez(
                f,
                x=split.train.x,
                y=split.train.y,
                x_test=split.test.x,
                y_test=split.test.y,
                num_classes=np.int64(split.train.num_classes),
                device_id=np.str_(split.device_id),
            )
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_device_file(path: str | os.PathLike[str]) -> DeviceSplit:
    """Read a file written by :func:`save_device_file` (format in its docstring).

    The reader is the device's own (:func:`edge_client.train.data.load_device_data`), so the
    simulator and real devices accept exactly the same files. ``device_id`` falls back
    to the file name's stem when the key is absent.

    Raises:
        DatasetError: missing or unreadable file, pickled objects, a missing key, or
            arrays of the wrong dtype, shape, label or pixel range (the message names
            the file and key).
    """
    p = Path(path)
    try:
        data = load_device_data(p)
    except DataError as exc:
        raise DatasetError(str(exc)) from exc
    try:
        train = ArrayDataset(data.x, data.y, data.num_classes, f"{data.device_id}/train")
        test = ArrayDataset(data.x_test, data.y_test, data.num_classes, f"{data.device_id}/test")
    except DatasetError as exc:
        raise DatasetError(f"{p}: {exc}") from exc
    return DeviceSplit(data.device_id, train, test)
