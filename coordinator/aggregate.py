"""Aggregation arithmetic: streaming weighted sums in float64, and the OCA update rule.

Everything here is pure numpy on ``dict[str, ndarray]`` model states. Sums are kept in
float64 so that the OCA model, maintained incrementally over many rounds
(``S += n_k * (w_new - w_old)``), does not drift from the direct average.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["WeightedSum", "check_same_names"]

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
