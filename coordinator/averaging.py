"""Aggregation arithmetic: streaming weighted sums in float64, the OCA update rule, and
the robust (coordinate-wise) aggregates.

Everything here is pure numpy on ``dict[str, ndarray]`` model states. Sums are kept in
float64 so that the OCA model, maintained incrementally over many rounds
(``S += n_k * (w_new - w_old)``), does not drift from the direct average.

:class:`WeightedSum` streams: memory is one model whatever the number of updates.
:class:`CoordinateWise` (``median``, ``trimmed_mean``) needs every update at once:
memory is O(updates x model) (float32 stacks, per architecture group), and it is
**unweighted**: each update counts once whatever its ``num_samples`` (a sample count is
the device's own claim, and a weighted median would let one device that claims many
samples decide alone). The trimmed mean cuts ``floor(fraction * k)`` of the ``k``
values at each end of every coordinate and averages the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Accumulator", "CoordinateWise", "WeightedSum", "accumulator", "check_same_names"]

Array = npt.NDArray[Any]
Arrays = Mapping[str, Array]


def check_same_names(a: Arrays, b: Arrays) -> None:
    """Raise ValueError unless ``a`` and ``b`` have the same names and shapes."""
    if a.keys() != b.keys():
        raise ValueError(f"tensor names differ: {sorted(a.keys() ^ b.keys())}")
    for name, array in a.items():
        if array.shape != b[name].shape:
            raise ValueError(f"{name}: shape {array.shape} != {b[name].shape}")


class WeightedSum:
    """``sum_k n_k * w_k`` and ``sum_k n_k`` over model states, in float64.

    Memory is one float64 copy of the model, whatever the number of terms. ``dtypes``
    remembers each tensor's dtype so :meth:`mean` returns arrays like the inputs.
    """

    def __init__(
        self, sums: Mapping[str, Array] | None = None, weight: float = 0.0, *, dtypes: Any = None
    ) -> None:
        self.sums: dict[str, Array] = {
            k: np.asarray(v, np.float64) for k, v in (sums or {}).items()
        }
        self.weight = float(weight)
        self.dtypes: dict[str, np.dtype[Any]] = dict(dtypes or {})

    def add(self, arrays: Arrays, weight: float) -> None:
        """Add ``weight * arrays`` (``weight`` may be negative, to take a term out)."""
        if not self.sums:
            self.sums = {k: np.zeros(v.shape, np.float64) for k, v in arrays.items()}
        check_same_names(self.sums, arrays)
        for name, array in arrays.items():
            self.sums[name] += weight * np.asarray(array, np.float64)
            self.dtypes.setdefault(name, np.asarray(array).dtype)
        self.weight += weight

    def replace(
        self, old: Arrays | None, old_weight: float, new: Arrays, new_weight: float
    ) -> None:
        """Swap one term: ``S += new_weight * new - old_weight * old`` (the OCA rule)."""
        self.add(new, new_weight)
        if old is not None and old_weight:
            self.add(old, -old_weight)

    def mean(self) -> dict[str, Array]:
        """``S / total weight`` in each tensor's original dtype (integers rounded).

        Raises:
            ValueError: the total weight is not positive.
        """
        if self.weight <= 0 or not self.sums:
            raise ValueError("cannot average: no weight")
        out: dict[str, Array] = {}
        for name, total in self.sums.items():
            value = total / self.weight
            dtype = self.dtypes.get(name, np.dtype(np.float32))
            out[name] = np.rint(value).astype(dtype) if dtype.kind in "iub" else value.astype(dtype)
        return out


class CoordinateWise:
    """The coordinate-wise ``median`` or ``trimmed_mean`` of model states (unweighted).

    Same interface as :class:`WeightedSum` (:meth:`add`, :meth:`mean`, ``weight``);
    keeps every state added, as float32: O(terms x model) memory.

    Args:
        method: ``median`` or ``trimmed_mean``.
        trim_fraction: trimmed_mean: share of the terms cut at each end, in [0, 0.5).
    """

    def __init__(self, method: str, trim_fraction: float = 0.2) -> None:
        if method not in ("median", "trimmed_mean"):
            raise ValueError(f"unknown coordinate-wise aggregate {method!r}")
        if not 0 <= trim_fraction < 0.5:
            raise ValueError(f"trim_fraction {trim_fraction} outside [0, 0.5)")
        self.method = method
        self.trim_fraction = trim_fraction
        self.weight = 0.0
        """Total sample weight added (reported only: the aggregate is unweighted)."""
        self._terms: dict[str, list[Array]] = {}
        self._dtypes: dict[str, np.dtype[Any]] = {}

    def add(self, arrays: Arrays, weight: float) -> None:
        """Keep ``arrays`` (``weight`` is counted in :attr:`weight`, not used)."""
        if self._terms:
            check_same_names({k: v[0] for k, v in self._terms.items()}, arrays)
        for name, array in arrays.items():
            value = np.asarray(array)
            self._dtypes.setdefault(name, value.dtype)
            self._terms.setdefault(name, []).append(value.astype(np.float32, copy=False))
        self.weight += weight

    def mean(self) -> dict[str, Array]:
        """The coordinate-wise aggregate in each tensor's dtype (integers rounded).

        Raises:
            ValueError: nothing was added.
        """
        if not self._terms:
            raise ValueError("cannot average: no update")
        out: dict[str, Array] = {}
        for name, terms in self._terms.items():
            stack = np.stack(terms).astype(np.float64)  # (K, *shape)
            if self.method == "median":
                value = np.median(stack, axis=0)
            else:
                cut = int(np.floor(self.trim_fraction * len(terms)))
                ordered = np.sort(stack, axis=0)
                value = ordered[cut : len(terms) - cut].mean(axis=0)
            dtype = self._dtypes[name]
            out[name] = np.rint(value).astype(dtype) if dtype.kind in "iub" else value.astype(dtype)
        return out


Accumulator = WeightedSum | CoordinateWise


def accumulator(method: str, trim_fraction: float = 0.2) -> Accumulator:
    """An empty aggregate of ``method``: ``mean`` (the sample-weighted streaming mean),
    ``median`` or ``trimmed_mean``."""
    return WeightedSum() if method == "mean" else CoordinateWise(method, trim_fraction)
