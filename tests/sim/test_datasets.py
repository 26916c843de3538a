"""Dataset readers (models.datafiles), the synthetic dataset and the registry, on tiny
files made here."""

from __future__ import annotations

import gzip
import importlib.util
import os
import pickle
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from models.datafiles import read_cifar_batch, read_idx_images, read_idx_labels
from models.errors import DataFileError
from sim.datasets import (
    ArrayDataset,
    dataset_names,
    load_dataset,
    load_proxy_images,
    make_synthetic,
)
from sim.errors import DatasetError, SimError
from sim.partition import partition_dataset
from sim.synthetic import synthetic_size

RNG = np.random.default_rng(1234)


def idx_bytes(magic: int, array: np.ndarray) -> bytes:
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write(path: Path, data: bytes, gz: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def write_mnist_like(folder: Path, n_train: int, n_test: int, gz: bool = True) -> dict[str, Any]:
    arrays: dict[str, Any] = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = RNG.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = RNG.integers(0, 10, n, dtype=np.uint8)
        write(folder / f"{prefix}-images-idx3-ubyte", idx_bytes(2051, images), gz)
        write(folder / f"{prefix}-labels-idx1-ubyte", idx_bytes(2049, labels), gz)
        arrays[prefix] = (images, labels)
    return arrays


# ------------------------------------------------------------------------ IDX


@pytest.mark.parametrize("gz", [True, False])
def test_idx_readers_return_stored_arrays(tmp_path: Path, gz: bool) -> None:
    images = RNG.integers(0, 256, (3, 5, 7), dtype=np.uint8)
    labels = np.array([0, 9, 4], dtype=np.uint8)
    img_path = write(tmp_path / "img-idx3-ubyte", idx_bytes(2051, images), gz)
    lbl_path = write(tmp_path / "lbl-idx1-ubyte", idx_bytes(2049, labels), gz)

    got_images, got_labels = read_idx_images(img_path), read_idx_labels(lbl_path)

    np.testing.assert_array_equal(got_images, images)
    np.testing.assert_array_equal(got_labels, labels)


@pytest.mark.parametrize("gz", [True, False])
def test_idx_wrong_magic_is_rejected(tmp_path: Path, gz: bool) -> None:
    path = write(tmp_path / "labels", idx_bytes(2049, np.zeros(4, np.uint8)), gz)

    with pytest.raises(DataFileError, match="magic 2049, expected 2051"):
        read_idx_images(path)


@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize(
    ("cut", "message"), [(-1, "truncated"), (10, "truncated IDX header"), (None, "trailing")]
)
def test_idx_truncated_or_padded_data_is_rejected(
    tmp_path: Path, gz: bool, cut: int | None, message: str
) -> None:
    data = idx_bytes(2051, np.ones((2, 4, 4), np.uint8))
    data = data + b"\x00" if cut is None else data[:cut]
    path = write(tmp_path / "images", data, gz)

    with pytest.raises(DataFileError, match=message):
        read_idx_images(path)


def test_corrupt_gzip_is_a_data_file_error(tmp_path: Path) -> None:
    good = gzip.compress(idx_bytes(2049, np.arange(200, dtype=np.uint8)))
    path = tmp_path / "labels.gz"
    path.write_bytes(good[:20] + b"garbage" * 5)

    with pytest.raises(DataFileError, match=str(path)):
        read_idx_labels(path)


@pytest.mark.parametrize("gz", [True, False])
def test_mnist_loads_from_subfolder_as_float_in_unit_range(tmp_path: Path, gz: bool) -> None:
    stored = write_mnist_like(tmp_path / "mnist", n_train=6, n_test=4, gz=gz)

    splits = load_dataset("mnist", tmp_path)

    assert splits.test is not None
    assert splits.train.x.shape == (6, 1, 28, 28) and splits.test.x.shape == (4, 1, 28, 28)
    assert splits.train.x.dtype == np.float32 and splits.train.y.dtype == np.int64
    np.testing.assert_allclose(splits.train.x[:, 0] * 255, stored["train"][0], atol=1e-4)
    np.testing.assert_array_equal(splits.test.y, stored["t10k"][1])
    assert splits.train.num_classes == 10


def test_image_label_count_mismatch_is_rejected(tmp_path: Path) -> None:
    write_mnist_like(tmp_path, n_train=6, n_test=4)
    write(tmp_path / "t10k-labels-idx1-ubyte", idx_bytes(2049, np.zeros(3, np.uint8)), True)

    with pytest.raises(DatasetError, match=r"4 images but .* has 3 labels"):
        load_dataset("fashion-mnist", tmp_path)


def test_missing_files_error_names_file_and_folder(tmp_path: Path) -> None:
    with pytest.raises(DatasetError) as info:
        load_dataset("mnist", tmp_path)

    assert "train-images-idx3-ubyte" in str(info.value) and str(tmp_path) in str(info.value)


def test_file_dataset_without_data_dir_says_what_to_provide() -> None:
    with pytest.raises(DatasetError, match=r"--data-dir\) holding .*t10k-labels-idx1-ubyte"):
        load_dataset("mnist")


def test_download_without_torchvision_is_a_dataset_error(tmp_path: Path) -> None:
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed; the download path would use the network")

    with pytest.raises(DatasetError, match="torchvision"):
        load_dataset("mnist", tmp_path, download=True)


def test_emnist_letters_are_transposed_and_labels_shifted(tmp_path: Path) -> None:
    images = RNG.integers(0, 256, (26, 28, 28), dtype=np.uint8)
    labels = np.arange(1, 27, dtype=np.uint8)
    for split in ("train", "test"):
        base = tmp_path / f"emnist-letters-{split}"
        write(Path(f"{base}-images-idx3-ubyte"), idx_bytes(2051, images), True)
        write(Path(f"{base}-labels-idx1-ubyte"), idx_bytes(2049, labels), True)

    splits = load_dataset("emnist-letters", tmp_path)

    assert splits.train.num_classes == 26
    np.testing.assert_array_equal(splits.train.y, np.arange(26))
    np.testing.assert_allclose(splits.train.x[3, 0] * 255, images[3].T, atol=1e-4)
    assert splits.train.x.flags.c_contiguous


def test_emnist_label_zero_is_out_of_range(tmp_path: Path) -> None:
    for split in ("train", "test"):
        base = tmp_path / f"emnist-letters-{split}"
        write(Path(f"{base}-images-idx3-ubyte"), idx_bytes(2051, np.zeros((2, 28, 28))), False)
        write(Path(f"{base}-labels-idx1-ubyte"), idx_bytes(2049, np.array([0, 1])), False)

    with pytest.raises(DatasetError, match="outside the expected range"):
        load_dataset("emnist-letters", tmp_path)


# ---------------------------------------------------------------------- CIFAR


def write_cifar_batch(path: Path, n: int, seed: int) -> tuple[np.ndarray, list[int]]:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    labels = [int(v) for v in rng.integers(0, 10, n)]
    batch = {b"batch_label": b"x", b"labels": labels, b"data": data, b"filenames": [b"a"] * n}
    path.write_bytes(pickle.dumps(batch, protocol=2))
    return data, labels


def test_cifar10_batches_load_as_channel_first_images(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    stored = [write_cifar_batch(folder / f"data_batch_{i}", 2, i) for i in range(1, 6)]
    test_data, test_labels = write_cifar_batch(folder / "test_batch", 3, 99)

    splits = load_dataset("cifar10", tmp_path)

    assert splits.test is not None
    assert splits.train.x.shape == (10, 3, 32, 32) and splits.test.x.shape == (3, 3, 32, 32)
    np.testing.assert_array_equal(splits.train.y, [v for s in stored for v in s[1]])
    np.testing.assert_array_equal(splits.test.y, test_labels)
    red_row0 = test_data[1, :32]  # the first 1024 bytes are the red plane, row-major
    np.testing.assert_allclose(splits.test.x[1, 0, 0] * 255, red_row0, atol=1e-4)


def py2_str(b: bytes) -> bytes:
    """A Python 2 ``str`` as pickled by Python 2: SHORT_BINSTRING or BINSTRING."""
    return b"U" + bytes([len(b)]) + b if len(b) < 256 else b"T" + struct.pack("<i", len(b)) + b


def py2_int(v: int) -> bytes:
    return b"J" + struct.pack("<i", v)


def py2_uint8_array(a: np.ndarray) -> bytes:
    """Pickle opcodes of a uint8 array as numpy 1 under Python 2 wrote it (CIFAR's era)."""
    shape = b"(" + b"".join(py2_int(d) for d in a.shape) + b"t"
    state = b"(" + py2_int(3) + py2_str(b"|") + b"NNN" + py2_int(-1) + py2_int(-1) + py2_int(0)
    dtype = b"cnumpy\ndtype\n(" + py2_str(b"u1") + py2_int(0) + py2_int(1) + b"tR" + state + b"tb"
    head = b"cnumpy.core.multiarray\n_reconstruct\n(cnumpy\nndarray\n(" + py2_int(0) + b"t"
    return (
        head
        + py2_str(b"b")
        + b"tR("
        + py2_int(1)
        + shape
        + dtype
        + b"\x89"
        + py2_str(a.tobytes())
        + b"tb"
    )


def test_cifar_reader_reads_python2_era_numpy1_pickles(tmp_path: Path) -> None:
    data = RNG.integers(0, 256, (2, 3072), dtype=np.uint8)
    labels = b"](" + py2_int(3) + py2_int(7) + b"e"
    body = py2_str(b"data") + py2_uint8_array(data) + py2_str(b"labels") + labels
    path = tmp_path / "data_batch_1"
    path.write_bytes(b"\x80\x02}(" + body + b"u.")

    images, got_labels = read_cifar_batch(path)

    np.testing.assert_array_equal(images.reshape(2, -1), data)
    assert got_labels.tolist() == [3, 7]


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_cifar_reader_refuses_pickles_that_would_run_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": _Evil(marker), b"labels": [1]}, protocol=2))

    with pytest.raises(DataFileError, match="system is not allowed"):
        read_cifar_batch(path)
    assert not marker.exists()


def test_cifar_reader_refuses_builtins_eval(tmp_path: Path) -> None:
    path = tmp_path / "test_batch"
    path.write_bytes(b"cbuiltins\neval\n(S'1+1'\ntR.")  # protocol-0 call of eval("1+1")

    with pytest.raises(DataFileError, match=r"builtins\.eval is not allowed"):
        read_cifar_batch(path)


def test_cifar_reader_rejects_wrong_contents(tmp_path: Path) -> None:
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": np.zeros((2, 10), np.uint8), b"labels": [0, 1]}))

    with pytest.raises(DataFileError, match="3072"):
        read_cifar_batch(path)


# ------------------------------------------------------------- ArrayDataset


@pytest.mark.parametrize(
    ("x", "y", "message"),
    [
        (np.zeros((2, 1, 4, 4), np.float64), np.zeros(2, np.int64), "float32"),
        (np.zeros(2, np.float32), np.zeros(2, np.int64), "float32"),  # no sample axis
        (np.full((2, 9, 6), np.inf, np.float32), np.zeros(2, np.int64), "non-finite"),
        (np.zeros((2, 1, 4, 4), np.float32), np.zeros(2, np.int32), "int64"),
        (np.zeros((2, 1, 4, 4), np.float32), np.zeros(3, np.int64), "2 samples but 3 labels"),
        (np.zeros((2, 1, 4, 4), np.float32), np.array([0, 3]), r"labels must lie in \[0, 3\)"),
        (np.full((2, 1, 4, 4), 1.5, np.float32), np.zeros(2, np.int64), "pixel values"),
        (np.full((2, 1, 4, 4), np.nan, np.float32), np.zeros(2, np.int64), "pixel values"),
    ],
)
def test_array_dataset_rejects_contract_violations(
    x: np.ndarray, y: np.ndarray, message: str
) -> None:
    with pytest.raises(DatasetError, match=message):
        ArrayDataset(x, y, 3, "bad")


def test_array_dataset_subset_and_label_counts() -> None:
    data = ArrayDataset(np.zeros((4, 1, 2, 2), np.float32), np.array([0, 2, 2, 1]), 4, "d")

    sub = data.subset(np.array([1, 2]), "sub")

    assert len(sub) == 2 and sub.name == "sub"
    assert data.label_counts().tolist() == [1, 1, 2, 0]


# ----------------------------------------------------------------- synthetic


def test_synthetic_is_bit_identical_for_a_seed_and_differs_across_seeds() -> None:
    opts: dict[str, Any] = {"train_samples": 300, "test_samples": 50}

    a, b = load_dataset("synthetic", seed=7, **opts), load_dataset("synthetic", seed=7, **opts)
    c = load_dataset("synthetic", seed=8, **opts)

    assert a.test is not None and b.test is not None
    assert a.train.x.tobytes() == b.train.x.tobytes() and a.test.x.tobytes() == b.test.x.tobytes()
    np.testing.assert_array_equal(a.train.y, b.train.y)
    assert not np.array_equal(a.train.x, c.train.x)


def test_synthetic_honours_shape_options_and_balances_classes() -> None:
    splits = make_synthetic(num_classes=5, channels=3, image_size=16, train_samples=100)

    assert splits.train.x.shape == (100, 3, 16, 16)
    assert splits.train.label_counts().tolist() == [20] * 5


def test_synthetic_10k_generation_is_fast() -> None:
    start = time.perf_counter()
    make_synthetic(train_samples=10_000, test_samples=1)
    assert time.perf_counter() - start < 3.0  # measured about 0.2 s


def test_synthetic_is_learnable_but_not_trivial() -> None:
    splits = make_synthetic(seed=0, train_samples=2000, test_samples=1000)
    train, test = splits.train, splits.test
    assert test is not None

    means = np.stack([train.x[train.y == k].mean(axis=0) for k in range(10)]).reshape(10, -1)
    dist = ((test.x.reshape(len(test), 1, -1) - means[None]) ** 2).sum(axis=-1)
    accuracy = float((dist.argmin(axis=1) == test.y).mean())

    assert 0.35 < accuracy < 0.9  # chance is 0.1; measured about 0.6


def test_synthetic_rejects_bad_sizes() -> None:
    with pytest.raises(DatasetError, match="image_size"):
        make_synthetic(image_size=0)


# ------------------------------------------------------------------ registry


def test_registry_names() -> None:
    assert dataset_names() == [
        "cifar10",
        "emnist-letters",
        "fashion-mnist",
        "mnist",
        "npz",
        "synthetic",
    ]


def test_unknown_dataset_and_option_are_dataset_errors() -> None:
    with pytest.raises(DatasetError, match="unknown dataset 'imagenet'"):
        load_dataset("imagenet")
    with pytest.raises(DatasetError, match="not \\['colour'\\]"):
        load_dataset("synthetic", colour=True)


def test_dataset_error_is_a_sim_error_and_a_value_error() -> None:
    assert issubclass(DatasetError, SimError) and issubclass(DatasetError, ValueError)


def test_synthetic_grows_with_the_fleet_so_a_thousand_devices_partition() -> None:
    # Prepare: the size the sim asks for with 1,000 devices.
    sizes = synthetic_size(1000)

    # Execute
    splits = make_synthetic(0, **sizes)
    fed = partition_dataset(splits, 1000, 0.5, seed=0, min_samples=10)

    # Assert: 100 samples per device on average, every device at least its minimum, and
    # small fleets keep the default dataset (so earlier results stay comparable).
    assert (len(splits.train), len(splits.test)) == (100_000, 20_000)
    assert min(len(d.train) + len(d.test) for d in fed.devices) >= 10
    assert synthetic_size(50) == {"train_samples": 10_000, "test_samples": 2_000}


def test_the_global_test_set_stops_growing_with_the_fleet() -> None:
    assert synthetic_size(10_000) == {"train_samples": 1_000_000, "test_samples": 20_000}
    assert synthetic_size(10, 375) == {"train_samples": 3_750, "test_samples": 750}
    assert synthetic_size(1, 20) == {"train_samples": 20, "test_samples": 10}
    assert synthetic_size(10_000, 375)["test_samples"] == 20_000


def test_synthetic_images_do_not_depend_on_how_many_are_made_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    whole = make_synthetic(3, train_samples=300, test_samples=60)
    monkeypatch.setattr("sim.synthetic._CHUNK", 7)
    chunked = make_synthetic(3, train_samples=300, test_samples=60)

    assert np.array_equal(whole.train.x, chunked.train.x)
    assert np.array_equal(whole.train.y, chunked.train.y)
    assert whole.test is not None and chunked.test is not None
    assert np.array_equal(whole.test.x, chunked.test.x)


def test_proxy_images_are_the_train_images_of_the_dataset_in_the_folder(tmp_path: Path) -> None:
    arrays = write_mnist_like(tmp_path / "mnist", n_train=12, n_test=3)
    images = RNG.integers(0, 256, (5, 28, 28), dtype=np.uint8)
    base = tmp_path / "letters" / "emnist-letters-train"
    write(Path(f"{base}-images-idx3-ubyte"), idx_bytes(2051, images), False)
    write(Path(f"{base}-labels-idx1-ubyte"), idx_bytes(2049, np.ones(5)), False)

    mnist = load_proxy_images(tmp_path / "mnist")
    letters = load_proxy_images(tmp_path / "letters")

    assert mnist.shape == (12, 1, 28, 28) and mnist.dtype == np.float32
    np.testing.assert_allclose(mnist[:, 0] * 255, arrays["train"][0], atol=1e-4)
    np.testing.assert_allclose(letters[2, 0] * 255, images[2].T, atol=1e-4)  # as read for training
    (tmp_path / "empty" / "letters").mkdir(parents=True)
    with pytest.raises(DatasetError, match="no dataset's train images in it or in its subf"):
        load_proxy_images(tmp_path / "empty")


def test_proxy_data_takes_a_parent_folder_as_data_dir_does(tmp_path: Path) -> None:
    write_mnist_like(tmp_path / "data" / "mnist", n_train=12, n_test=3)
    write_mnist_like(tmp_path / "torchvision" / "MNIST" / "raw", n_train=4, n_test=1)

    parent = load_proxy_images(tmp_path / "data")

    assert np.array_equal(parent, load_proxy_images(tmp_path / "data" / "mnist"))
    assert load_proxy_images(tmp_path / "torchvision").shape == (4, 1, 28, 28)
    base = tmp_path / "data" / "emnist-letters" / "emnist-letters-train"
    images = RNG.integers(0, 256, (5, 28, 28), dtype=np.uint8)
    write(Path(f"{base}-images-idx3-ubyte"), idx_bytes(2051, images), False)
    write(Path(f"{base}-labels-idx1-ubyte"), idx_bytes(2049, np.ones(5)), False)
    with pytest.raises(DatasetError, match=r"several datasets \(.*mnist, .*emnist-letters\)"):
        load_proxy_images(tmp_path / "data")  # which one: the message names both
    assert load_proxy_images(tmp_path / "data" / "emnist-letters").shape == (5, 1, 28, 28)


def test_a_missing_proxy_folder_is_said_to_be_missing(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=f"^no such file or folder: {tmp_path / 'nope'}$"):
        load_proxy_images(tmp_path / "nope")


def test_a_proxy_size_draws_that_many_distinct_images_by_seed(tmp_path: Path) -> None:
    write_mnist_like(tmp_path / "mnist", n_train=12, n_test=3)
    every = load_proxy_images(tmp_path / "mnist")

    some = load_proxy_images(tmp_path / "mnist", size=5, seed=1)
    again = load_proxy_images(tmp_path / "mnist", size=5, seed=1)
    other = load_proxy_images(tmp_path / "mnist", size=5, seed=2)

    rows = [next(i for i, img in enumerate(every) if np.array_equal(img, x)) for x in some]
    assert len(set(rows)) == 5 and rows == sorted(rows)  # distinct, in file order
    assert np.array_equal(some, again) and not np.array_equal(some, other)
    assert load_proxy_images(tmp_path / "mnist", size=50).shape == every.shape


def test_an_npz_dataset_reads_samples_of_any_shape_and_refuses_bad_files(tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((30, 9, 6))  # float64: read as float32
    y = np.arange(30) % 3
    path = tmp_path / "watch.npz"
    np.savez(path, x=x, y=y, x_test=x[:6], y_test=y[:6], num_classes=np.int64(4))
    splits = load_dataset("npz", path)
    assert splits.train.x.shape == (30, 9, 6) and splits.train.x.dtype == np.float32
    assert splits.test is not None and len(splits.test.y) == 6
    assert splits.train.num_classes == 4  # as the file says, not only the labels seen
    np.savez(path, x=x, y=y)
    found = load_dataset("npz", path)
    assert found.test is None and found.train.num_classes == 3
    for content, message in [
        ({"x": x}, r"missing \['y'\]"),
        ({"x": x, "y": y, "labels": y}, r"unknown \['labels'\]"),
        ({"x": x, "y": y.astype(np.float32)}, "integer labels"),
        ({"x": x, "y": y, "x_test": x}, "x_test and y_test come together"),
        ({"x": x, "y": y, "num_classes": np.int64(2)}, "num_classes 2 but a label is 2"),
    ]:
        np.savez(path, **content)
        with pytest.raises(DatasetError, match=message):
            load_dataset("npz", path)
    with pytest.raises(DatasetError, match=r"reads one \.npz file given as --data-dir"):
        load_dataset("npz", tmp_path)
