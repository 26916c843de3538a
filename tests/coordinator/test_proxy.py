"""Proxy data for server-side distillation: read from a .npy file, shaped for the models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from coordinator.__main__ import build_parser, config_from_args, run
from coordinator.errors import ConfigError, StateMismatchError
from coordinator.proxy import proxy_tensor, read_proxy_file
from coordinator.runtime import Coordinator
from coordinator.store import FileStore
from protocol.transport import MemoryBroker, MemoryTransport
from tests.coordinator.helpers import config


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
