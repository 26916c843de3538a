"""DeviceData and load_device_data: the device's own reader of partitioner files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_client.errors import DataError, EdgeClientError
from edge_client.train.data import DeviceData, load_device_data
from sim.partition import partition_dataset, save_device_file
from sim.synthetic import make_synthetic


def arrays(n: int = 12, m: int = 3, classes: int = 4) -> dict[str, object]:
    rng = np.random.default_rng(0)
    return {
        "x": rng.random((n, 1, 6, 6), dtype=np.float32),
        "y": (np.arange(n) % classes).astype(np.int64),
        "x_test": rng.random((m, 1, 6, 6), dtype=np.float32),
        "y_test": (np.arange(m) % classes).astype(np.int64),
        "num_classes": np.int64(classes),
        "device_id": np.str_("dev-007"),
    }


def write(path: Path, **overrides: object) -> Path:
    content = {**arrays(), **overrides}
    np.savez(path, **{k: v for k, v in content.items() if v is not None})  # type: ignore[arg-type]
    return path


def test_reads_a_partitioner_file(tmp_path: Path) -> None:
    fed = partition_dataset(make_synthetic(train_samples=60, image_size=8), 2, 1.0, seed=0)
    path = tmp_path / "dev-001.npz"
    save_device_file(path, fed.devices[1])

    data = load_device_data(path)

    assert data.device_id == "dev-001"
    np.testing.assert_array_equal(data.x, fed.devices[1].train.x)
    np.testing.assert_array_equal(data.y_test, fed.devices[1].test.y)
    assert data.num_classes == 10
    assert data.num_samples == len(fed.devices[1].train)
    assert data.image_shape == (1, 8, 8)
    assert data.label_counts().sum() == data.num_samples


def test_device_id_falls_back_to_the_file_stem_and_test_set_may_be_empty(tmp_path: Path) -> None:
    path = write(
        tmp_path / "dev-042.npz",
        device_id=None,
        x_test=np.zeros((0, 1, 6, 6), np.float32),
        y_test=np.zeros(0, np.int64),
    )

    data = load_device_data(path)

    assert data.device_id == "dev-042"
    assert len(data.y_test) == 0


def test_samples_of_any_shape_load_and_only_images_have_an_image_shape(tmp_path: Path) -> None:
    """Series (T, C) or feature vectors (F,) for a user's model (docs/models.md)."""
    for shape in ((9, 6), (36,)):
        path = write(
            tmp_path / "series.npz",
            x=np.zeros((12, *shape), np.float32),
            x_test=np.zeros((3, *shape), np.float32),
        )
        data = load_device_data(path)
        assert data.sample_shape == shape
        with pytest.raises(DataError, match="are not images"):
            data.image_shape  # noqa: B018


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"y": None}, "missing key 'y'"),
        ({"x": np.zeros((12, 1, 6, 6))}, "'x' must be float32"),
        ({"y_test": np.zeros(3, np.int32)}, "'y_test' must be int64"),
        ({"x": np.zeros(12, np.float32)}, r"'x' must be a float32 array \(N, \*sample_shape\)"),
        ({"y": np.zeros((12, 1), np.int64)}, r"'y' must be an int64 array \(N,\)"),
        ({"y": np.zeros(5, np.int64)}, "12 samples but 'y' 5"),
        ({"x": np.zeros((12, 36), np.float32)}, "samples differ in shape"),
        ({"y": np.full(12, 4, np.int64)}, r"labels must lie in \[0, 4\)"),
        ({"y_test": np.array([0, -1, 2], np.int64)}, r"'y_test' labels must lie in \[0, 4\)"),
        ({"x_test": np.zeros((3, 1, 5, 5), np.float32)}, "differ in shape"),
        ({"x": np.full((12, 1, 6, 6), np.nan, np.float32)}, "non-finite"),
        ({"num_classes": np.array([4, 4])}, "'num_classes' must be a scalar"),
        ({"num_classes": np.int64(0)}, "num_classes must be an int >= 1"),
        ({"device_id": np.int64(3)}, "'device_id' must be a unicode scalar"),
        ({"y": np.array([object(), 1], dtype=object)}, "not a readable"),
    ],
)
def test_bad_files_raise_data_error_naming_file_and_key(
    tmp_path: Path, overrides: dict[str, object], message: str
) -> None:
    path = write(tmp_path / "bad.npz", **overrides)

    with pytest.raises(DataError, match=message) as caught:
        load_device_data(path)

    assert "bad.npz" in str(caught.value)
    assert isinstance(caught.value, EdgeClientError | ValueError)


def test_missing_junk_and_npy_files_are_data_errors(tmp_path: Path) -> None:
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip file at all")
    single = tmp_path / "single.npy"
    np.save(single, np.zeros(3, np.float32))

    with pytest.raises(DataError, match=r"junk\.npz"):
        load_device_data(junk)
    with pytest.raises(DataError, match=r"absent\.npz"):
        load_device_data(tmp_path / "absent.npz")
    with pytest.raises(DataError, match=r"single \.npy array"):
        load_device_data(single)


def test_device_data_validates_on_construction() -> None:
    good = arrays()
    good.pop("device_id")
    good["num_classes"] = 4

    with pytest.raises(DataError, match="num_classes"):
        DeviceData(device_id="d", **{**good, "num_classes": True})  # type: ignore[arg-type]
    with pytest.raises(DataError, match="device_id"):
        DeviceData(device_id="", **good)  # type: ignore[arg-type]
    assert DeviceData(device_id="d", **good).num_samples == 12  # type: ignore[arg-type]
