"""Proxy data for server-side distillation: read from a .npy file or a dataset folder,
shaped for the models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from coordinator.__main__ import build_parser, config_from_args, run
from coordinator.errors import ConfigError, StateMismatchError
from coordinator.proxy import proxy_readers, proxy_tensor, read_proxy_data
from coordinator.runtime import Coordinator
from coordinator.store import FileStore
from protocol.transport import MemoryBroker, MemoryTransport
from tests.coordinator.helpers import config


def test_uint8_images_are_scaled_and_get_their_channel() -> None:
    images = np.arange(2 * 8 * 8, dtype=np.uint8).reshape(2, 8, 8)

    tensor = proxy_tensor(images, (1, 8, 8))

    assert tensor.shape == (2, 1, 8, 8) and tensor.dtype == torch.float32
    assert torch.allclose(tensor[1, 0], torch.from_numpy(images[1] / 255).float())


def test_float_images_are_taken_as_they_are() -> None:
    images = np.random.default_rng(0).random((3, 3, 8, 8))

    tensor = proxy_tensor(images, (3, 8, 8))

    assert torch.allclose(tensor, torch.from_numpy(images).float())


def test_series_and_feature_vectors_are_taken_in_the_models_shape() -> None:
    series = np.random.default_rng(0).standard_normal((4, 9, 6)).astype(np.float32)

    assert torch.equal(proxy_tensor(series, (9, 6)), torch.from_numpy(series))
    assert proxy_tensor(np.zeros((3, 30)), (30,)).shape == (3, 30)
    with pytest.raises(ConfigError, match=r"of shape \(4, 9, 6\); the models take \(N, 6, 9\)"):
        proxy_tensor(series, (6, 9))  # a (T, C) series is not (C, T)


@pytest.mark.parametrize(
    ("images", "match"),
    [
        (np.zeros((2, 1, 9, 9), np.uint8), "shape"),
        (np.zeros((0, 1, 8, 8), np.uint8), "shape"),
        (np.zeros((2, 1, 8, 8), np.int32), "dtype"),
        (np.full((2, 1, 8, 8), np.nan, np.float32), "not finite"),
    ],
)
def test_images_that_do_not_fit_the_models_are_refused(images: np.ndarray, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        proxy_tensor(images, (1, 8, 8))


def test_a_npy_file_is_read_without_pickle(tmp_path: Path) -> None:
    good, bad = tmp_path / "proxy.npy", tmp_path / "objects.npy"
    np.save(good, np.ones((2, 8, 8), np.uint8))
    np.save(bad, np.array([{"a": 1}], dtype=object), allow_pickle=True)

    assert read_proxy_data(good).shape == (2, 8, 8)
    with pytest.raises(ConfigError, match=r"nor a readable \.npy array"):
        read_proxy_data(bad)


def _idx(path: Path, magic: int, array: np.ndarray) -> None:
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    path.write_bytes(header + array.tobytes())


def _letters_folder(folder: Path, count: int) -> np.ndarray:
    """A folder with EMNIST-letters-named train files (stored transposed, as EMNIST is);
    returns the upright images."""
    folder.mkdir()
    upright = np.random.default_rng(3).integers(0, 256, (count, 28, 28), dtype=np.uint8)
    _idx(folder / "emnist-letters-train-images-idx3-ubyte", 2051, upright.transpose(0, 2, 1))
    _idx(folder / "emnist-letters-train-labels-idx1-ubyte", 2049, np.ones(count, np.uint8))
    return upright


def test_a_dataset_folder_gives_its_train_images_and_a_size_draws_some(tmp_path: Path) -> None:
    upright = _letters_folder(tmp_path / "letters", 12)

    every = read_proxy_data(tmp_path / "letters")
    some = read_proxy_data(tmp_path / "letters", size=5, seed=7)

    assert every.shape == (12, 1, 28, 28) and every.dtype == np.float32
    np.testing.assert_allclose(every[:, 0] * 255, upright, atol=1e-3)  # upright, in [0, 1]
    assert some.shape == (5, 1, 28, 28)
    assert np.array_equal(some, read_proxy_data(tmp_path / "letters", size=5, seed=7))
    assert not np.array_equal(some, read_proxy_data(tmp_path / "letters", size=5, seed=8))
    assert all(any(np.array_equal(s, e) for e in every) for s in some)  # drawn from them


def test_a_npy_file_is_subsampled_like_a_folder(tmp_path: Path) -> None:
    images = np.arange(10 * 4, dtype=np.uint8).reshape(10, 2, 2)
    np.save(tmp_path / "p.npy", images)

    some = read_proxy_data(tmp_path / "p.npy", size=4, seed=1)

    assert some.shape == (4, 2, 2)
    assert np.array_equal(some, images[np.sort(np.unique(some[:, 0, 0]) // 4)])  # in order


def test_a_folder_without_a_known_dataset_or_with_corrupt_files_is_refused(
    tmp_path: Path,
) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no dataset's train images"):
        read_proxy_data(tmp_path / "empty")
    _letters_folder(tmp_path / "cut", 4)
    images = tmp_path / "cut" / "emnist-letters-train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:-1])
    with pytest.raises(ConfigError, match="truncated"):
        read_proxy_data(tmp_path / "cut")


def test_the_coordinator_cli_takes_a_dataset_folder_and_a_size(tmp_path: Path) -> None:
    argv = ["--embedded-broker", "--proxy-data", str(tmp_path), "--proxy-size", "300"]

    config = config_from_args(build_parser().parse_args(argv))

    assert config.proxy_data == tmp_path and config.proxy_size == 300


def test_unreadable_proxy_data_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.npy"
    argv = ["--embedded-broker", "--strategy", "feddf", "--proxy-data", str(missing)]
    config = config_from_args(build_parser().parse_args(argv))

    assert config.proxy_data == missing
    assert run(config) == 2
    assert f"--proxy-data: no such file or folder: {missing}" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=f"^--proxy-data: no such file or folder: {missing}$"):
        read_proxy_data(missing)


def test_a_parent_folder_of_a_dataset_folder_is_taken_as_data_dir_takes_it(
    tmp_path: Path,
) -> None:
    (tmp_path / "data").mkdir()
    _letters_folder(tmp_path / "data" / "emnist-letters", 6)

    parent = read_proxy_data(tmp_path / "data")

    assert np.array_equal(parent, read_proxy_data(tmp_path / "data" / "emnist-letters"))
    assert parent.shape == (6, 1, 28, 28)
    _letters_folder(tmp_path / "data" / "mnist", 2)  # letters files, in an mnist folder
    with pytest.raises(ConfigError, match=r"several datasets.*give one of these folders"):
        read_proxy_data(tmp_path / "data")


@pytest.mark.parametrize("strategy", ["fedavg", "fedprox", "fedkf", "dense"])
def test_proxy_data_is_refused_by_a_strategy_that_would_not_read_it(
    tmp_path: Path, strategy: str, capsys: pytest.CaptureFixture[str]
) -> None:
    images = np.zeros((4, 28, 28), np.uint8)
    cfg = config(strategy=strategy, rounds=1)
    transport = MemoryTransport(MemoryBroker(), "coordinator")
    expected = (
        f"strategy '{strategy}' would not read the proxy data: only server-side "
        "distillation reads it (feddf, with --distill-data proxy); leave out --proxy-data"
    )

    with pytest.raises(ConfigError) as refused:
        Coordinator(cfg, transport, FileStore(tmp_path), proxy_data=images)
    assert str(refused.value) == expected
    # the command line refuses before it reads anything (the path does not even exist)
    argv = ["--embedded-broker", "--strategy", strategy, "--proxy-data", str(tmp_path / "no")]
    assert run(config_from_args(build_parser().parse_args(argv))) == 2
    assert expected in capsys.readouterr().err
    assert proxy_readers() == ["feddf"]


def test_a_resume_distils_on_the_images_it_started_with(tmp_path: Path) -> None:
    """The proxy images' content is part of the run's fingerprint: the same images
    resume, wherever they were read from; other images are refused, naming the change."""
    first = np.random.default_rng(0).integers(0, 256, (16, 28, 28), dtype=np.uint8)
    other = first.copy()
    other[0, 0, 0] ^= 1

    def start(images: np.ndarray, resume: bool) -> None:
        cfg = config(strategy="feddf", state_dir=tmp_path, resume=resume)
        transport = MemoryTransport(MemoryBroker(), "coordinator")
        coordinator = Coordinator(cfg, transport, FileStore(tmp_path), proxy_data=images)
        coordinator.engine.start(0.0)

    start(first, resume=False)
    start(first.copy(), resume=True)
    with pytest.raises(StateMismatchError, match=r"another run \(proxy_data '[0-9a-f]{16}' ->"):
        start(other, resume=True)
