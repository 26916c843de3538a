"""Norm screening: reject updates that move the model far more than the round's others.

An update's *delta norm* is the L2 norm, over every tensor it carries and in float64, of
its weights minus the model the device was sent (for a delta upload, the decoded model
its delta names, so a quantized uplink is judged by its reconstructed weights; for a full
upload, the group's current ``aca`` restricted to the tensors the update carries). The
engine acks each update on arrival, so the decision cannot wait for the round's other
updates; it is taken against a reference known at arrival:

* ``median`` of the delta norms of the on-time updates accepted so far in this round;
* ``floor``: the previous round's median (carried over rounds that accepted none). It
  is persisted in the run record, committed with the round, so a resumed coordinator
  takes the same decisions;
* the reference is ``max(floor, median, MIN_REFERENCE_SHARE x the sent model's norm)``;
  before any round accepted anything (the first updates of round 1) it is the norm of
  the model the device was sent.

An update is rejected with ``update_norm`` when its delta norm exceeds
``max_update_norm_ratio`` times the reference (0: no ratio check), or exceeds the
absolute cap ``max_update_norm`` (None: none). The median is robust: attackers shift
it only once they are half of the round. Every input of a decision (the floor, the
accepted updates' norms, stored with them) is persisted before the Ack, so a decision
depends only on the state a crash leaves behind.

What it catches: gross outliers such as an update with every weight set to 3.0 (its
delta norm is ~100x the model's norm for LeNet-5). What it does not: attacks that stay
within the honest range (a sign-flipped delta of ordinary size); robust aggregation
(:mod:`coordinator.averaging`) is the answer to those.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from coordinator.errors import UpdateRejectedError
from protocol.messages import ReasonCode

__all__ = ["MIN_REFERENCE_SHARE", "NormScreen", "delta_norm", "model_norm"]

Array = npt.NDArray[Any]

MIN_REFERENCE_SHARE = 0.1
"""The reference is never below this share of the sent model's norm: when a round's
updates barely move the model (FedGen's heads, a converged model) an honest one that
moves it more is not an outlier worth rejecting (with K = 10 an update may always move
the model by its own norm)."""


def _squares(values: Array) -> float:
    """The sum of the squares of ``values``, without BLAS: numpy's ``dot`` hands a long
    vector to the BLAS threads, which wake and spin against torch's own threads (7.9 ms
    against 0.11 ms for 61,706 doubles on this project's 2-core CPU)."""
    return float(np.square(values).sum())


def delta_norm(weights: Mapping[str, Array], sent: Mapping[str, Array]) -> float:
    """L2 norm of ``weights - sent`` over every tensor of ``weights`` (float64): integer
    buffers (a BatchNorm's batch counter) count too, whatever moves the model is
    measured."""
    total = 0.0
    for name, array in weights.items():
        diff = np.asarray(array, np.float64) - np.asarray(sent[name], np.float64)
        total += _squares(diff)
    return float(np.sqrt(total))


def model_norm(weights: Mapping[str, Array], names: Any = None) -> float:
    """L2 norm of the tensors of ``weights`` (those in ``names`` when given), float64."""
    total = 0.0
    for name, array in weights.items():
        if names is not None and name not in names:
            continue
        total += _squares(np.asarray(array, np.float64))
    return float(np.sqrt(total))


class NormScreen:
    """The reference of one round and the decisions taken against it.

    Args:
        ratio: reject above ``ratio`` times the reference (0: no ratio check).
        cap: reject above this delta norm whatever the reference (None: no cap).
        floor: the previous rounds' reference (None: no round accepted anything yet).
    """

    def __init__(self, ratio: float, cap: float | None, floor: float | None) -> None:
        self.ratio = ratio
        self.cap = cap
        self.floor = floor
        self._low: list[float] = []
        """The smaller half of the round's accepted norms, negated (a max-heap); it holds
        the middle one when their count is odd."""
        self._high: list[float] = []
        """The larger half (a min-heap). The two halves keep the median at hand: a
        decision costs O(1) and an accepted update O(log n), where sorting every
        accepted norm per decision cost O(n log n) per update."""

    def reference(self, sent_norm: float) -> float:
        """``max(floor, median of this round's accepted norms, MIN_REFERENCE_SHARE x
        sent_norm)``; the sent model's norm ``sent_norm`` when there is neither floor nor
        median."""
        parts = [p for p in (self.floor, self.median()) if p is not None]
        return max(*parts, MIN_REFERENCE_SHARE * sent_norm) if parts else sent_norm

    def median(self) -> float | None:
        """Median delta norm of the on-time updates accepted this round (None: none);
        the mean of the two middle ones for an even count, as ``statistics.median``."""
        if not self._low:
            return None
        if len(self._low) > len(self._high):
            return -self._low[0]
        return (-self._low[0] + self._high[0]) / 2

    def check(self, norm: float, sent_norm: float) -> float:
        """Raise unless an update of delta norm ``norm`` may be accepted; returns the
        reference it was judged against.

        Raises:
            UpdateRejectedError: ``update_norm``, saying the norm and the bound.
        """
        if self.cap is not None and norm > self.cap:
            raise UpdateRejectedError(
                ReasonCode.UPDATE_NORM,
                f"update moves the model by {norm:.4g} (L2), above the cap {self.cap:.4g}",
            )
        reference = self.reference(sent_norm)
        if self.ratio <= 0:
            return reference
        if norm > self.ratio * reference:
            raise UpdateRejectedError(
                ReasonCode.UPDATE_NORM,
                f"update moves the model by {norm:.4g} (L2), above {self.ratio:g} x the "
                f"round's reference {reference:.4g}",
            )
        return reference

    def accepted(self, norm: float) -> None:
        """An on-time update of this round with delta norm ``norm`` was accepted."""
        if self._low and norm > -self._low[0]:
            heapq.heappush(self._high, norm)
        else:
            heapq.heappush(self._low, -norm)
        if len(self._low) > len(self._high) + 1:
            heapq.heappush(self._high, -heapq.heappop(self._low))
        elif len(self._high) > len(self._low):
            heapq.heappush(self._low, -heapq.heappop(self._high))

    def next_floor(self) -> float | None:
        """The floor of the next round: this round's median, or this floor without one."""
        median = self.median()
        return self.floor if median is None else median

    def new_round(self, floor: float | None) -> None:
        """Start a round with ``floor`` and no accepted update."""
        self.floor = floor
        self._low, self._high = [], []
