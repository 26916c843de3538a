"""Accuracy and fairness of global models on the devices' local test splits, or on a
held-out set.

Pure functions: modules and arrays in, numbers out; no global state. The device is a
parameter (or, in :func:`evaluate_models`, the device the scratch model lives on). Both
the lab emulator (``sim.recorder``, over every emulated device's test split) and the
coordinator (:mod:`coordinator.recording`, over a held-out file, ``--eval-data``:
:func:`read_eval_data`) evaluate with them.

Metric definitions, after the FedKF paper ("Handling Data Heterogeneity in Federated
Learning via Knowledge Distillation and Fusion", Zhou et al., IEEE IoT Journal 2023,
arXiv:2207.11447). Let ``a_k`` be the accuracy of a global model on device ``k``'s test
split, in percent, and ``n_k`` that split's number of samples; devices with ``n_k = 0``
are left out. Then

- AMP (average model performance), percent: ``sum_k n_k a_k / sum_k n_k``, the
  sample-weighted mean, which equals the accuracy over the union of the device splits;
- FM (fairness metric), percent squared: ``mean_k (a_k - mean_k a_k)^2``, the
  population variance of the per-device accuracies, unweighted (every device counts
  once); lower is fairer;
- WLP (worst local performance), percent: ``min_k a_k``.

The paper names the three measures; the weighting and units above are this project's
choice where its text is not at hand, and are what every run report uses
(docs/report.md). With a single held-out set (the coordinator's), it is the one "device":
AMP = WLP = best = the accuracy on it, FM = 0.
"""

from __future__ import annotations

import logging
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from coordinator.errors import ConfigError, CoordinatorError
from coordinator.proxy import proxy_tensor
from models import Classifier, load_state_arrays

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "Fairness",
    "MetricsError",
    "ModelMetrics",
    "evaluate_accuracy",
    "evaluate_held_out",
    "evaluate_models",
    "evaluate_personal",
    "fairness",
    "read_eval_data",
]

logger = logging.getLogger(__name__)


class MetricsError(CoordinatorError, ValueError):
    """A metric cannot be computed: empty or mismatched inputs, values out of range."""


_CPU = torch.device("cpu")
DEFAULT_BATCH_SIZE = 1024
"""Samples per forward pass when evaluating."""


@dataclass(frozen=True)
class Fairness:
    """AMP, FM and WLP of one model over the devices (see the module docstring).

    Attributes:
        amp: average model performance, percent (sample-weighted mean accuracy).
        fm: fairness metric, percent squared (population variance of the per-device
            accuracies); lower is fairer.
        wlp: worst local performance, percent (lowest per-device accuracy).
        best: best local performance, percent (highest per-device accuracy); with
            ``wlp`` the spread of the accuracies across the devices.
    """

    amp: float
    fm: float
    wlp: float
    best: float


@dataclass(frozen=True)
class ModelMetrics:
    """The metrics of one global model after one round.

    Attributes:
        amp: average model performance over the device test splits, percent.
        fm: fairness metric, percent squared.
        wlp: worst local performance, percent.
        global_acc: accuracy on the global test set, percent; None without one.
        best: the best device's accuracy, percent; None where not measured (reports
            written before it was).
    """

    amp: float
    fm: float
    wlp: float
    global_acc: float | None
    best: float | None = None

    def to_dict(self) -> dict[str, float | None]:
        """``{"amp", "fm", "wlp", "best", "global_acc"}`` as plain floats (global_acc and
        best may be None)."""
        return {
            "amp": self.amp,
            "fm": self.fm,
            "wlp": self.wlp,
            "best": self.best,
            "global_acc": self.global_acc,
        }


def fairness(accuracies: npt.ArrayLike, weights: npt.ArrayLike) -> Fairness:
    """AMP, FM and WLP from per-device accuracies and test-split sizes.

    Args:
        accuracies: per-device accuracy as a fraction in [0, 1] (e.g. from
            :func:`evaluate_accuracy`); the entry of a device with weight 0 is ignored
            and may be NaN.
        weights: per-device number of test samples (non-negative); 0 marks an empty
            split, which is skipped.

    Returns:
        :class:`Fairness` in percent (AMP, WLP) and percent squared (FM).

    Raises:
        MetricsError: (a ValueError) the two are not 1-D of the same length, a weight is
            negative or not finite, a kept accuracy is outside [0, 1], or no device
            with a non-empty split is left.
    """
    acc = np.asarray(accuracies, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if acc.ndim != 1 or w.shape != acc.shape:
        raise MetricsError(
            f"fairness: accuracies and weights must be 1-D of equal length, "
            f"got shapes {acc.shape} and {w.shape}"
        )
    if not np.isfinite(w).all() or (w < 0).any():
        raise MetricsError(f"fairness: weights must be finite and >= 0, got {w.tolist()}")
    keep = w > 0
    if not keep.any():
        raise MetricsError(
            f"fairness: no device with a non-empty test split ({len(w)} devices given)"
        )
    kept = acc[keep]
    if not np.isfinite(kept).all() or (kept < 0).any() or (kept > 1).any():
        raise MetricsError(f"fairness: accuracies must be fractions in [0, 1], got {kept.tolist()}")
    percent = 100.0 * kept
    return Fairness(
        amp=float(np.average(percent, weights=w[keep])),
        fm=float(np.var(percent)),
        wlp=float(percent.min()),
        best=float(percent.max()),
    )


def _check_split(x: np.ndarray, y: np.ndarray, what: str) -> None:
    if not isinstance(x, np.ndarray) or not isinstance(y, np.ndarray):
        raise MetricsError(f"{what}: x and y must be numpy arrays")
    if y.ndim != 1 or x.ndim < 1 or len(x) != len(y):
        raise MetricsError(
            f"{what}: need x (N, ...) and y (N,) with the same N, got shapes "
            f"{x.shape} and {y.shape}"
        )


def _batches(xs: Sequence[np.ndarray], batch_size: int) -> Iterator[np.ndarray]:
    """Successive runs of ``batch_size`` rows across ``xs`` in order; the last may be short.

    Batches span array boundaries, so many small splits still make full batches; only
    one batch is ever copied at a time.
    """
    pending: list[np.ndarray] = []
    count = 0
    for x in xs:
        start = 0
        while start < len(x):
            take = min(batch_size - count, len(x) - start)
            pending.append(x[start : start + take])
            count += take
            start += take
            if count == batch_size:
                yield pending[0] if len(pending) == 1 else np.concatenate(pending)
                pending, count = [], 0
    if pending:
        yield pending[0] if len(pending) == 1 else np.concatenate(pending)


def _weights_layout(model: nn.Module, layout: torch.memory_format) -> bool:
    """Lay ``model``'s 4-D weights out as ``layout``; whether it has any."""
    found = False
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 4:
                parameter.data = parameter.data.contiguous(memory_format=layout)
                found = True
    return found


def _predict(
    model: nn.Module, xs: Sequence[np.ndarray], *, batch_size: int, device: torch.device
) -> npt.NDArray[np.int64]:
    """Arg-max class of every row of ``xs`` (concatenated), in eval mode, without grad.

    Image batches and the model's convolution weights are channels-last while it runs
    (on a CPU twice as fast for the built-in CNNs: their max pooling is); the model's
    weights return to their layout, and every submodule to its train/eval mode, after.
    """
    if batch_size < 1:
        raise MetricsError(f"batch_size must be >= 1, got {batch_size}")
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    images = _weights_layout(model, torch.channels_last)
    predictions: list[npt.NDArray[np.int64]] = []
    try:
        with torch.no_grad():
            for chunk in _batches(xs, batch_size):
                inputs = torch.from_numpy(np.ascontiguousarray(chunk, dtype=np.float32))
                inputs = inputs.to(device)
                if images and inputs.dim() == 4:
                    inputs = inputs.contiguous(memory_format=torch.channels_last)
                logits = model(inputs)
                predictions.append(logits.argmax(dim=1).to(_CPU).numpy().astype(np.int64))
    finally:
        if images:
            _weights_layout(model, torch.contiguous_format)
        for module, mode in modes:  # parents first, so each child ends in its own mode
            module.train(mode)
    if not predictions:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(predictions)


def evaluate_accuracy(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    device: torch.device = _CPU,
) -> float:
    """Fraction of ``x`` that ``model`` classifies as ``y``, in [0, 1].

    Runs in eval mode under ``torch.no_grad()`` and restores the train/eval mode of
    the model (and of each submodule) afterwards.

    Args:
        model: a classifier returning logits (B, num_classes); must already be on
            ``device``.
        x: inputs (N, C, H, W), float (converted to float32).
        y: integer labels (N,).
        batch_size: samples per forward pass.
        device: where the batches are sent.

    Raises:
        MetricsError: (a ValueError) the set is empty, x and y disagree in length or
            y is not 1-D, or batch_size < 1.
    """
    _check_split(x, y, "evaluate_accuracy")
    if len(y) == 0:
        raise MetricsError("evaluate_accuracy: empty test set (0 samples); accuracy undefined")
    predictions = _predict(model, [x], batch_size=batch_size, device=device)
    return float(np.mean(predictions == y))


def _module_device(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else _CPU


def evaluate_models(
    models: Mapping[str, Mapping[str, np.ndarray]],
    model: Classifier,
    device_tests: Sequence[tuple[np.ndarray, np.ndarray]],
    global_test: tuple[np.ndarray, np.ndarray] | None,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> dict[str, ModelMetrics]:
    """Evaluate each named global model on every device's test split and the global set.

    For each entry of ``models`` the state is loaded into ``model`` (a scratch instance
    the caller owns; its weights are overwritten and stay those of the last entry),
    one batched pass runs over all device test samples together, and the correctness
    vector is split back per device to give AMP, FM and WLP (see the module docstring).
    Devices with an empty test split are skipped.

    Args:
        models: model name (e.g. ``"aca"``, ``"oca"``) -> full state arrays, as from
            :func:`models.state_arrays`.
        model: the classifier to evaluate with; batches go to the device of its
            parameters.
        device_tests: per device, ``(x, y)`` of its local test split.
        global_test: ``(x, y)`` of a global test set, or None.
        batch_size: samples per forward pass.

    Returns:
        Name -> :class:`ModelMetrics` (percent), in the order of ``models``.

    Raises:
        MetricsError: (a ValueError) every device split is empty, a split's x and y
            disagree, the splits' sample shapes differ, or the global test set is empty.
        StateMismatchError: a state does not fit ``model`` (from
            :func:`models.load_state_arrays`).
    """
    for index, (x, y) in enumerate(device_tests):
        _check_split(x, y, f"evaluate_models: device test split {index}")
    if global_test is not None:
        _check_split(*global_test, "evaluate_models: global test set")
        if len(global_test[1]) == 0:
            raise MetricsError("evaluate_models: the global test set is empty (0 samples)")
    counts = np.array([len(y) for _, y in device_tests], dtype=np.int64)
    if counts.sum() == 0:
        raise MetricsError(
            f"evaluate_models: every device test split is empty ({len(device_tests)} devices)"
        )
    xs = [x for x, y in device_tests if len(y)]
    shapes = {x.shape[1:] for x in xs}
    if len(shapes) > 1:
        raise MetricsError(f"evaluate_models: device test splits differ in sample shape: {shapes}")
    labels = np.concatenate([y for _, y in device_tests if len(y)])
    ends = np.cumsum(counts)
    starts = ends - counts
    device = _module_device(model)

    results: dict[str, ModelMetrics] = {}
    for name, state in models.items():
        load_state_arrays(model, state)
        correct = _predict(model, xs, batch_size=batch_size, device=device) == labels
        accuracies = [
            float(correct[start:end].mean()) if end > start else float("nan")
            for start, end in zip(starts, ends, strict=True)
        ]
        fair = fairness(accuracies, counts)
        global_acc = (
            100.0 * evaluate_accuracy(model, *global_test, batch_size=batch_size, device=device)
            if global_test is not None
            else None
        )
        results[name] = ModelMetrics(fair.amp, fair.fm, fair.wlp, global_acc, fair.best)
        logger.debug(
            "model %s: AMP %.2f%% FM %.2f WLP %.2f%% global %s",
            name,
            fair.amp,
            fair.fm,
            fair.wlp,
            "n/a" if global_acc is None else f"{global_acc:.2f}%",
        )
    return results


def evaluate_personal(
    states: Sequence[Mapping[str, np.ndarray]],
    model: Classifier,
    device_tests: Sequence[tuple[np.ndarray, np.ndarray]],
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> ModelMetrics:
    """AMP, FM and WLP of per-device models: ``states[d]`` evaluated on device d's test
    split (FedGen's head-only sharing, where each device keeps its own feature
    extractor). ``global_acc`` is None: there is no single model to test globally.

    Raises:
        MetricsError: ``states`` and ``device_tests`` differ in length, a split's x and
            y disagree, or every split is empty.
        StateMismatchError: a state does not fit ``model``.
    """
    if len(states) != len(device_tests):
        raise MetricsError(
            f"evaluate_personal: {len(states)} states for {len(device_tests)} device splits"
        )
    accuracies, counts = [], []
    for index, (state, (x, y)) in enumerate(zip(states, device_tests, strict=True)):
        _check_split(x, y, f"evaluate_personal: device test split {index}")
        counts.append(len(y))
        if len(y) == 0:
            accuracies.append(float("nan"))
            continue
        load_state_arrays(model, state)
        accuracies.append(evaluate_accuracy(model, x, y, batch_size=batch_size))
    if sum(counts) == 0:
        raise MetricsError("evaluate_personal: every device test split is empty")
    fair = fairness(accuracies, np.asarray(counts, dtype=np.int64))
    return ModelMetrics(fair.amp, fair.fm, fair.wlp, None, fair.best)


def evaluate_held_out(
    models: Mapping[str, Mapping[str, np.ndarray]],
    model: Classifier,
    held_out: tuple[np.ndarray, np.ndarray],
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> dict[str, ModelMetrics]:
    """Evaluate each named global model on one held-out set (the coordinator's
    ``--eval-data``), which stands for the single "device": AMP, WLP, best and
    ``global_acc`` are all the accuracy on it, FM is 0.

    Args:
        models: model name -> full state arrays.
        model: the scratch classifier to evaluate with (its weights are overwritten).
        held_out: ``(x, y)``, as from :func:`read_eval_data`.
        batch_size: samples per forward pass.

    Raises:
        MetricsError: the set is empty, or its x and y disagree.
        StateMismatchError: a state does not fit ``model``.
    """
    device = _module_device(model)
    results: dict[str, ModelMetrics] = {}
    for name, state in models.items():
        load_state_arrays(model, state)
        accuracy = 100.0 * evaluate_accuracy(model, *held_out, batch_size=batch_size, device=device)
        results[name] = ModelMetrics(accuracy, 0.0, accuracy, accuracy, accuracy)
        logger.debug("model %s: %.2f%% on the held-out set", name, accuracy)
    return results


def read_eval_data(
    path: Path, *, shape: tuple[int, ...], num_classes: int
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """The held-out set of ``--eval-data``: an ``.npz`` (read without unpickling) with
    ``x``, samples (N, *shape) (one-channel images also (N, H, W)), uint8 (scaled to
    [0, 1] as the devices' data is) or floats taken as they are, and ``y``, integer
    labels (N,) in
    [0, num_classes). A device file of ``python -m sim partition`` is one (its ``x`` and
    ``y``; other keys are ignored).

    Returns:
        ``(x, y)``: float32 (N, *shape) and int64 (N,).

    Raises:
        ConfigError: no such file, not a readable ``.npz``, a key missing, or arrays of
            the wrong shape, dtype, label range or length, or not finite (the message
            names the file).
    """
    what = f"--eval-data {path}"
    if not path.is_file():
        raise ConfigError(f"{what}: no such file")
    arrays: dict[str, npt.NDArray[Any]] = {}
    try:
        loaded = np.load(path, allow_pickle=False)
        if isinstance(loaded, np.lib.npyio.NpzFile):
            with loaded as archive:
                arrays = {key: archive[key] for key in ("x", "y") if key in archive.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"{what}: not a readable .npz file: {exc}") from exc
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise ConfigError(f"{what}: a single .npy array; give an .npz with x and y")
    missing = sorted({"x", "y"} - set(arrays))
    if missing:
        raise ConfigError(f"{what}: missing key(s) {missing}; expected x and y")
    x, y = arrays["x"], arrays["y"]
    samples = proxy_tensor(x, shape, what=f"{what}: x").numpy()
    if y.dtype.kind not in "iu" or y.shape != (len(x),):
        raise ConfigError(
            f"{what}: y must be integer labels of shape ({len(x)},), got {y.dtype} {y.shape}"
        )
    if int(y.min()) < 0 or int(y.max()) >= num_classes:
        raise ConfigError(f"{what}: labels must lie in [0, {num_classes})")
    return samples, y.astype(np.int64)
