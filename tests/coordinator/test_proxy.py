"""Proxy data for server-side distillation: read from a .npy file, shaped for the models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from coordinator.__main__ import build_parser, config_from_args, run
from coordinator.errors import ConfigError
from coordinator.proxy import proxy_tensor, read_proxy_file


def test_uint8_images_are_scaled_and_get_their_channel() -> None:
    images = np.arange(2 * 8 * 8, dtype=np.uint8).reshape(2, 8, 8)

    tensor = proxy_tensor(images, channels=1, side=8)

    assert tensor.shape == (2, 1, 8, 8) and tensor.dtype == torch.float32
    assert torch.allclose(tensor[1, 0], torch.from_numpy(images[1] / 255).float())


def test_float_images_are_taken_as_they_are() -> None:
    images = np.random.default_rng(0).random((3, 3, 8, 8))

    tensor = proxy_tensor(images, channels=3, side=8)

    assert torch.allclose(tensor, torch.from_numpy(images).float())


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
        proxy_tensor(images, channels=1, side=8)


def test_a_npy_file_is_read_without_pickle(tmp_path: Path) -> None:
    good, bad = tmp_path / "proxy.npy", tmp_path / "objects.npy"
    np.save(good, np.ones((2, 8, 8), np.uint8))
    np.save(bad, np.array([{"a": 1}], dtype=object), allow_pickle=True)

    assert read_proxy_file(good).shape == (2, 8, 8)
    with pytest.raises(ConfigError, match=r"not a readable \.npy array"):
        read_proxy_file(bad)


def test_unreadable_proxy_data_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--embedded-broker", "--proxy-data", str(tmp_path / "missing.npy")]
    config = config_from_args(build_parser().parse_args(argv))

    assert config.proxy_data == tmp_path / "missing.npy"
    assert run(config) == 2
    assert "--proxy-data" in capsys.readouterr().err
