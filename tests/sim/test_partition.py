"""Dirichlet partitioning, per-device splits, label statistics and device files."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim import partition
from sim.datasets import ArrayDataset, DatasetSplits, make_synthetic
from sim.errors import DatasetError, PartitionError
from sim.partition import (
    DeviceSplit,
    Federation,
    dirichlet_partition,
    label_counts,
    load_device_file,
    mean_label_entropy,
    partition_dataset,
    reorder_rows,
    save_device_file,
)


def balanced_labels(n: int, classes: int = 10) -> np.ndarray:
    return np.arange(n, dtype=np.int64) % classes


def indexed_splits(n: int, classes: int = 10) -> DatasetSplits:
    """A dataset whose first pixel encodes the sample index, to trace samples."""
    x = np.zeros((n, 1, 2, 2), np.float32)
    x[:, 0, 0, 0] = np.arange(n) / n
    return DatasetSplits(ArrayDataset(x, balanced_labels(n, classes), classes, "idx"), None)


def traced(data: ArrayDataset, n: int) -> np.ndarray:
    indices: np.ndarray = np.rint(data.x[:, 0, 0, 0] * n).astype(np.int64)
    return indices


# ---------------------------------------------------------- dirichlet_partition


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(50, 400),
    classes=st.integers(1, 6),
    devices=st.integers(1, 5),
    alpha=st.sampled_from([0.3, 1.0, 10.0, math.inf]),
    seed=st.integers(0, 2**32 - 1),
)
def test_partition_is_disjoint_covering_and_respects_min_samples(
    n: int, classes: int, devices: int, alpha: float, seed: int
) -> None:
    labels = np.random.default_rng(seed).integers(0, classes, n)

    shards = dirichlet_partition(labels, devices, alpha, seed=seed, min_samples=5)

    assert len(shards) == devices
    joined = np.concatenate(shards)
    assert len(joined) == n and np.array_equal(np.sort(joined), np.arange(n))
    assert min(len(s) for s in shards) >= 5


def test_partition_is_reproducible_and_seed_dependent() -> None:
    labels = balanced_labels(1000)

    a = dirichlet_partition(labels, 8, 0.5, seed=1)
    b = dirichlet_partition(labels, 8, 0.5, seed=1)
    c = dirichlet_partition(labels, 8, 0.5, seed=2)

    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_infinite_alpha_gives_even_random_split() -> None:
    shards = dirichlet_partition(balanced_labels(103), 10, math.inf, seed=0)

    assert sorted({len(s) for s in shards}) == [10, 11]
    assert not np.array_equal(shards[0], np.arange(len(shards[0])))  # shuffled, not blocks


def test_small_alpha_concentrates_classes_on_few_devices() -> None:
    labels = balanced_labels(5000)

    shards = dirichlet_partition(labels, 10, 0.05, seed=3, min_samples=1)

    classes_per_device = [len(np.unique(labels[s])) for s in shards]
    assert np.mean(classes_per_device) < 5  # IID would give 10 on every device


@pytest.mark.parametrize("alpha", [1.0, math.inf])
def test_empty_label_array_gives_empty_shards(alpha: float) -> None:
    shards = dirichlet_partition(np.zeros(0, np.int64), 3, alpha, seed=0, min_samples=0)

    assert [s.tolist() for s in shards] == [[], [], []]


def test_too_few_samples_for_devices_is_a_partition_error() -> None:
    with pytest.raises(PartitionError, match="cannot give 20 devices 10 samples"):
        dirichlet_partition(balanced_labels(150), 20, 1.0, seed=0, min_samples=10)


def test_unreachable_min_samples_gives_actionable_error() -> None:
    with pytest.raises(PartitionError, match="raise alpha, or lower min_samples"):
        dirichlet_partition(balanced_labels(400), 20, 0.01, seed=0, min_samples=20, max_attempts=5)


@pytest.mark.parametrize("alpha", [0.0, -1.0, math.nan])
def test_non_positive_alpha_is_rejected(alpha: float) -> None:
    with pytest.raises(PartitionError, match="alpha must be > 0"):
        dirichlet_partition(balanced_labels(100), 2, alpha, seed=0)


def test_non_integer_labels_are_rejected() -> None:
    with pytest.raises(PartitionError, match="integer"):
        dirichlet_partition(np.zeros(100), 2, 1.0, seed=0)


# ------------------------------------------------------------ partition_dataset


def test_devices_get_80_20_splits_of_disjoint_samples() -> None:
    n = 2000
    splits = indexed_splits(n)

    fed = partition_dataset(splits, 7, 0.5, seed=4)

    assert [d.device_id for d in fed.devices] == [f"dev-00{k}" for k in range(7)]
    seen = []
    for dev in fed.devices:
        total = len(dev.train) + len(dev.test)
        assert len(dev.test) == round(0.2 * total)
        seen += [traced(dev.train, n), traced(dev.test, n)]
    all_seen = np.concatenate(seen)
    assert np.array_equal(np.sort(all_seen), np.arange(n))  # disjoint and covering
    assert fed.num_classes == 10 and fed.test is None


def test_test_fraction_is_configurable_and_keeps_a_train_sample() -> None:
    fed = partition_dataset(indexed_splits(100), 4, math.inf, seed=0, test_fraction=0.5)
    tiny = partition_dataset(indexed_splits(4), 4, math.inf, seed=0, min_samples=1)

    assert [(len(d.train), len(d.test)) for d in fed.devices] == [(13, 12)] * 4  # 25 each
    assert all(len(d.train) == 1 and len(d.test) == 0 for d in tiny.devices)


@pytest.mark.parametrize("fraction", [-0.1, 1.0])
def test_bad_test_fraction_is_rejected(fraction: float) -> None:
    with pytest.raises(PartitionError, match="test_fraction"):
        partition_dataset(indexed_splits(100), 2, 1.0, seed=0, test_fraction=fraction)


def test_partition_dataset_is_reproducible() -> None:
    splits = indexed_splits(500)

    a = partition_dataset(splits, 5, 0.3, seed=9)
    b = partition_dataset(splits, 5, 0.3, seed=9)

    for da, db in zip(a.devices, b.devices, strict=True):
        assert np.array_equal(da.train.x, db.train.x) and np.array_equal(da.test.y, db.test.y)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mean_label_entropy_grows_with_alpha(seed: int) -> None:
    splits = indexed_splits(60_000)  # MNIST-sized label array, tiny images

    entropies = [
        mean_label_entropy(partition_dataset(splits, 20, alpha, seed=seed))
        for alpha in (0.1, 1.0, 100.0, math.inf)
    ]

    assert all(lo < hi for lo, hi in itertools.pairwise(entropies))
    assert entropies[0] < 1.2 and entropies[-1] > math.log(10) - 0.005


def test_entropy_extremes_and_label_counts() -> None:
    x = np.zeros((4, 1, 1, 1), np.float32)
    one_class = ArrayDataset(x, np.zeros(4, np.int64), 2, "a")
    uniform = ArrayDataset(x, np.array([0, 1, 0, 1]), 2, "b")
    empty = ArrayDataset(x[:0], np.zeros(0, np.int64), 2, "c")
    fed = Federation(
        (DeviceSplit("a", one_class, empty), DeviceSplit("b", uniform, one_class)), None, 2
    )

    counts = label_counts(fed)

    assert mean_label_entropy(fed) == pytest.approx(math.log(2) / 2)
    assert [(c.device_id, c.train, c.test) for c in counts] == [
        ("a", [4, 0], [0, 0]),
        ("b", [2, 2], [4, 0]),
    ]


# ---------------------------------------------------------------- device files


def small_device() -> DeviceSplit:
    fed = partition_dataset(make_synthetic(train_samples=60, image_size=8), 2, 1.0, seed=0)
    return fed.devices[1]


def test_device_file_round_trip(tmp_path: Path) -> None:
    dev = small_device()
    path = tmp_path / "dev-001.npz"

    save_device_file(path, dev)
    loaded = load_device_file(path)

    assert loaded.device_id == "dev-001"
    np.testing.assert_array_equal(loaded.train.x, dev.train.x)
    np.testing.assert_array_equal(loaded.test.y, dev.test.y)
    assert loaded.train.num_classes == 10
    assert [p.name for p in tmp_path.iterdir()] == ["dev-001.npz"]  # no temp file left
    with np.load(path, allow_pickle=False) as z:
        assert {"x", "y", "x_test", "y_test", "num_classes"} <= set(z.files)


def write_npz(path: Path, **overrides: object) -> Path:
    dev = small_device()
    arrays: dict[str, object] = {
        "x": dev.train.x,
        "y": dev.train.y,
        "x_test": dev.test.x,
        "y_test": dev.test.y,
        "num_classes": np.int64(10),
    }
    arrays.update(overrides)
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})  # type: ignore[arg-type]
    return path


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"y_test": None}, "missing key 'y_test'"),
        ({"x": np.zeros((3, 1, 8, 8))}, "'x' must be float32"),
        ({"y": np.array([object(), 1], dtype=object)}, "not a readable"),
        ({"num_classes": np.array([10, 10])}, "scalar"),
        ({"x_test": np.zeros((1, 1, 4, 4), np.float32)}, "differ in shape"),
        ({"num_classes": np.int64(2)}, r"labels must lie in \[0, 2\)"),
        ({"device_id": np.int64(3)}, "device_id"),
    ],
)
def test_malformed_device_files_are_rejected(
    tmp_path: Path, overrides: dict[str, object], message: str
) -> None:
    path = write_npz(tmp_path / "dev-000.npz", **overrides)

    with pytest.raises(DatasetError, match=message):
        load_device_file(path)


def test_non_npz_and_missing_device_files_are_rejected(tmp_path: Path) -> None:
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip file at all")

    with pytest.raises(DatasetError, match=r"junk\.npz"):
        load_device_file(junk)
    with pytest.raises(DatasetError, match=r"absent\.npz"):
        load_device_file(tmp_path / "absent.npz")


# ------------------------------------------------------------ shared memory


def test_devices_share_one_array_and_the_input_is_left_alone() -> None:
    # Prepare
    splits = indexed_splits(3000)
    before = splits.train.x.copy()

    # Execute
    fed = partition_dataset(splits, 50, 0.5, seed=1)

    # Assert: every device's arrays are views of one base, not of the input, in order
    base = fed.devices[0].train.x.base
    assert base is not None and not np.shares_memory(base, splits.train.x)
    for dev in fed.devices:
        assert dev.train.x.base is base and (len(dev.test) == 0 or dev.test.x.base is base)
    assert np.array_equal(splits.train.x, before)
    in_order = [part for d in fed.devices for part in (d.train.x, d.test.x)]
    assert np.array_equal(np.concatenate(in_order), base)


def test_in_place_gives_the_same_devices_in_the_input_s_own_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prepare: small blocks, so the reorder takes many of them
    monkeypatch.setattr(partition, "_BLOCK_BYTES", 64)
    copied = partition_dataset(indexed_splits(2000), 30, 0.3, seed=5)
    splits = indexed_splits(2000)

    # Execute
    moved = partition_dataset(splits, 30, 0.3, seed=5, in_place=True)

    # Assert
    for a, b in zip(copied.devices, moved.devices, strict=True):
        assert np.array_equal(a.train.x, b.train.x) and np.array_equal(a.test.y, b.test.y)
        assert np.shares_memory(b.train.x, splits.train.x)


@pytest.mark.parametrize("block_bytes", [4, 12, 1 << 20])
@pytest.mark.parametrize("n", [0, 1, 2, 7, 500])
def test_reorder_rows_equals_fancy_indexing(
    monkeypatch: pytest.MonkeyPatch, n: int, block_bytes: int
) -> None:
    monkeypatch.setattr(partition, "_BLOCK_BYTES", block_bytes)
    rng = np.random.default_rng(n)
    a = rng.standard_normal((n, 3)).astype(np.float32)
    order = rng.permutation(n)
    expected = a[order]

    out = reorder_rows(a, order)

    assert out is a and np.array_equal(a, expected)


@pytest.mark.parametrize("order", [[0, 0, 1], [0, 1], [0, 1, 3], [-1, 0, 1], [2, 1, 0, 0]])
def test_reorder_rows_refuses_what_is_not_a_permutation(order: list[int]) -> None:
    a = np.arange(3.0)

    with pytest.raises(PartitionError, match="permutation"):
        reorder_rows(a, np.array(order))

    assert np.array_equal(a, np.arange(3.0))
