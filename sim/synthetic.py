"""The deterministic synthetic dataset: the embedded default, generated, no files needed."""

from __future__ import annotations

import numpy as np

from sim.arrays import ArrayDataset, DatasetSplits
from sim.errors import DatasetError

__all__ = ["SAMPLES_PER_DEVICE", "TEST_SAMPLES_MAX", "make_synthetic", "synthetic_size"]

SAMPLES_PER_DEVICE = 100
"""Synthetic samples (train + test) generated per emulated device beyond the default
10,000 + 2,000: enough that a Dirichlet(0.5) split across thousands of devices still
gives every device its minimum of 10 samples."""


TEST_SAMPLES_MAX = 20_000
"""The largest global test set :func:`synthetic_size` asks for: enough for an accuracy
within half a point, and what a 1,000-device fleet gets; a larger fleet's test set stops
growing (10,000 devices would otherwise evaluate 200,000 samples a round)."""


def synthetic_size(num_devices: int, per_device: int | None = None) -> dict[str, int]:
    """The ``train_samples`` / ``test_samples`` of :func:`make_synthetic` for a fleet.

    With ``per_device``, that many train samples per device (each device's local test
    split comes out of them). Without, the default 10,000 / 2,000 up to 100 devices;
    beyond that the dataset grows with the fleet, :data:`SAMPLES_PER_DEVICE` per device
    (1,000 devices: 100,000, about 380 MB of float32 pixels at 28x28). The global test
    set is a fifth of the train set, at least 10 and at most :data:`TEST_SAMPLES_MAX`.
    """
    if per_device is None:
        train = max(10_000, SAMPLES_PER_DEVICE * num_devices)
    else:
        train = per_device * num_devices
    return {"train_samples": train, "test_samples": min(TEST_SAMPLES_MAX, max(10, train // 5))}


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


_CHUNK = 8192
"""Images generated at a time."""


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
    m = rng.uniform(0.0, overlap, (n, 1, 1, 1)).astype(np.float32)
    contrast = rng.uniform(0.6, 1.0, (n, 1, 1, 1)).astype(np.float32)
    channels = protos.shape[1]
    x = np.empty((n, channels, size, size), dtype=np.float32)
    # In chunks, so the temporaries stay small whatever n is; the noise is drawn in the
    # same order as one draw of all of it would take it (the same images either way).
    for start in range(0, n, _CHUNK):
        part = slice(start, min(n, start + _CHUNK))
        r, c = rows[part, :, None], cols[part, None, :]
        # Advanced indices first, then the channel slice: result is (B, S, S, C).
        own = protos[y[part, None, None], :, r, c]
        mixed = protos[other[part, None, None], :, r, c]
        chunk = contrast[part] * ((1 - m[part]) * own + m[part] * mixed)
        chunk += noise * rng.standard_normal(chunk.shape, dtype=np.float32)
        np.clip(chunk, 0.0, 1.0, out=chunk)
        x[part] = chunk.transpose(0, 3, 1, 2)
    return x, y


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
