"""Unlabeled proxy samples for server-side distillation (FedDF), and where they come from.

The coordinator never sees device data. A run may give it public, unlabeled samples of
the same shape as the devices' (``--proxy-data PATH``: a ``.npy`` array of any sample
shape, or, for images, a folder holding
the official train files of any dataset :mod:`models.datafiles` reads, such as EMNIST
letters, itself or in the dataset's usual subfolder, as ``--data-dir`` takes them;
``--proxy-size N`` draws N of them, seeded by the run's seed): strategies find them in
:attr:`~coordinator.context.ServerContext.proxy_data`. Only strategies that distil on
the server read them (FedDF with ``--distill-data proxy``); any other refuses them.
Labels, where the source has them, are never read.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from coordinator.errors import ConfigError
from models.datafiles import load_proxy_images, subsample
from models.errors import DataFileError

if TYPE_CHECKING:
    from coordinator.config import CoordinatorConfig
    from coordinator.strategies.base import Strategy

__all__ = [
    "check_proxy_use",
    "proxy_digest",
    "proxy_readers",
    "proxy_tensor",
    "read_proxy_data",
    "server_proxy",
]


def read_proxy_data(path: Path, *, size: int | None = None, seed: int = 0) -> npt.NDArray[Any]:
    """The proxy images at ``path``: a ``.npy`` file (``np.save`` of one array; no
    pickle), or a folder holding a dataset's official train files, itself or in the
    dataset's usual subfolder (``mnist/``, ``emnist-letters/`` ...: a folder that
    ``--data-dir`` takes; its labels are never read). With ``size``: that many of them,
    drawn at random by ``seed`` (all of them where there are fewer).

    Raises:
        ConfigError: nothing there, or nothing readable: not a plain ``.npy`` array, no
            dataset the readers know in the folder (or several), or corrupt files.
    """
    if not path.exists():
        raise ConfigError(f"--proxy-data: no such file or folder: {path}")
    if path.is_dir():
        try:
            return load_proxy_images(path, size=size, seed=seed)
        except DataFileError as exc:
            raise ConfigError(f"--proxy-data {path}: {exc}") from exc
    try:
        images = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"--proxy-data {path}: neither a dataset folder nor a readable .npy array: {exc}"
        ) from exc
    if not isinstance(images, np.ndarray):
        raise ConfigError(f"--proxy-data {path}: holds several arrays; give one .npy array")
    return subsample(images, size, seed)


def server_proxy(
    images: npt.NDArray[Any] | None, strategy: Strategy, config: CoordinatorConfig
) -> torch.Tensor | None:
    """The proxy data every aggregation of a run gets (:func:`proxy_tensor` of
    ``images``), or None without images.

    Raises:
        ConfigError: images that do not fit the models, none for a strategy that
            distils on them, or some for one that would not read them
            (:func:`check_proxy_use`).
    """
    if images is not None:
        check_proxy_use(type(strategy), config.distill_data)
    proxy = None if images is None else proxy_tensor(images, config.sample_shape)
    if strategy.needs_proxy_data and proxy is None:
        raise ConfigError(
            f"strategy {strategy.name!r} distils on the server's proxy data: give --proxy-data "
            "(or --distill-data generator, to distil on generated images instead)"
        )
    return proxy


def proxy_readers() -> list[str]:
    """The registry names of the strategies that can distil on proxy data (those with
    :attr:`~coordinator.strategies.base.Strategy.distills_on_proxy`)."""
    from coordinator.strategies.registry import STRATEGIES

    return [name for name, cls in STRATEGIES.items() if cls.distills_on_proxy]


def check_proxy_use(strategy: str | type[Strategy], distill_data: str) -> None:
    """Refuse proxy data that a run of ``strategy`` (a registry name or a strategy
    class) with ``distill_data`` would not read: a strategy that does not distil on
    the server, or FedDF told to distil on generated images. Cheap: called before the
    images are read, and again by :func:`server_proxy`. An unknown strategy name passes
    (building the strategy refuses it).

    Raises:
        ConfigError: the proxy data would go unused; the message names the strategies
            that read it.
    """
    if isinstance(strategy, str):
        from coordinator.strategies.registry import STRATEGIES

        if strategy not in STRATEGIES:
            return
        strategy = STRATEGIES[strategy]
    if not strategy.distills_on_proxy:
        readers = " or ".join(proxy_readers())
        raise ConfigError(
            f"strategy {strategy.name!r} would not read the proxy data: only server-side "
            f"distillation reads it ({readers}, with --distill-data proxy); leave out "
            "--proxy-data"
        )
    if distill_data != "proxy":
        raise ConfigError(
            f"strategy {strategy.name!r} with --distill-data {distill_data} distils on "
            "generated images and would not read the proxy data: leave out --proxy-data, or "
            "use --distill-data proxy"
        )


def proxy_tensor(
    samples: npt.NDArray[Any], shape: tuple[int, ...], *, what: str = "proxy data"
) -> torch.Tensor:
    """``samples`` as the models' inputs: float32 ``(N, *shape)``.

    Accepts ``(N, *shape)``, and for one-channel images ``(1, H, W)`` also ``(N, H, W)``;
    uint8 values (pixels) are scaled to [0, 1] as the devices' data is, floats are taken
    as they are. Errors name the samples ``what`` (the coordinator's held-out
    ``--eval-data`` are read the same way).

    Raises:
        ConfigError: no sample, a shape that does not fit the models, another dtype, or
            values that are not finite.
    """
    if len(shape) == 3 and shape[0] == 1 and samples.ndim == 3:
        samples = samples[:, None]
    if tuple(samples.shape[1:]) != tuple(shape) or len(samples) == 0:
        extra = f" or, with one channel, (N, {shape[1]}, {shape[2]})" if len(shape) == 3 else ""
        dims = ", ".join(str(d) for d in shape)
        raise ConfigError(
            f"{what} of shape {samples.shape}; the models take (N, {dims}){extra}, N >= 1"
        )
    if samples.dtype == np.uint8:
        return torch.from_numpy(np.multiply(samples, np.float32(1 / 255), dtype=np.float32))
    if samples.dtype.kind != "f":
        raise ConfigError(f"{what} of dtype {samples.dtype}: give uint8 or float values")
    out = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))
    if not torch.isfinite(out).all():
        raise ConfigError(f"{what} holds values that are not finite")
    return out


def proxy_digest(proxy: torch.Tensor) -> str:
    """A content fingerprint of the proxy images (16 hex digits of the SHA-256 of their
    shape and float32 pixels): a resumed run must distil on the images it started with,
    wherever the file now lies."""
    digest = hashlib.sha256(repr(tuple(proxy.shape)).encode())
    digest.update(proxy.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]
