"""Per-device transfers: models down in each device's precision, updates up as deltas.

The round engine decides *what* a device gets (the strategy's sets); this module decides
*how* it travels and keeps what that needs (see docs/protocol.md, section 10):

* **Downlink.** The first set of a strategy's downlink is the device's model (``global``,
  ``student`` or ``head``). It travels full at the device's downlink precision or, where
  the device is known to hold an earlier model and the precision is lossy, as a delta
  against that model (``base`` = its content fingerprint). Sets a strategy sends as a
  delta against another set (FedKF's ``teacher`` against ``student``) are fitted into a
  byte budget (:func:`protocol.deltas.fit_delta`). Other sets travel full.
* **What each device holds.** For a device with a lossy precision in either direction
  the model as the device will decode it is stored (``bases/DEVICE/sent``) before the
  task goes out; it becomes ``held`` once the device proves it holds it (an update
  for that task, or a hello announcing its fingerprint). A device that announces something
  else loses its ``held`` base and gets a full model next time.
* **Uplink.** A lossy uplink is a delta against the task's model as the device decoded
  it; :meth:`Transfers.uplink_base` returns the stored ``sent`` model it must name. The
  coordinator adds, aggregates and stores fp32.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy.typing as npt

from coordinator.state import Base, RunState
from protocol.deltas import (
    Encoded,
    compressed_size,
    encode_delta,
    encode_full,
    fit_delta,
    set_base,
)
from protocol.messages import UploadSpec
from protocol.tensors import Precision
from protocol.tensorset import TensorSet

__all__ = ["Link", "Transfers"]

Array = npt.NDArray[Any]
Arrays = Mapping[str, Array]


@dataclass(frozen=True)
class Link:
    """The precisions one device transfers in."""

    downlink: Precision = Precision.FP32
    uplink: Precision = Precision.FP32

    @property
    def lossless(self) -> bool:
        return self.downlink is Precision.FP32 and self.uplink is Precision.FP32

    def upload(self, spec: UploadSpec, model_set: str | None) -> UploadSpec:
        """The strategy's upload ``spec`` in this link's uplink precision: a delta against
        the device's model set ``model_set`` when lossy, else the full weights (fp32, or
        lossy where the downlink sends no model to take a delta against)."""
        if self.uplink is Precision.FP32 or model_set is None:
            return spec.model_copy(update={"precision": self.uplink})
        return spec.model_copy(
            update={"precision": self.uplink, "mode": "delta", "base": model_set}
        )


class Transfers:
    """Encodes each device's downlink and tracks the models devices hold.

    Args:
        state: where the per-device bases persist.
        deltas: send a delta against the model a device holds where possible.
        teacher_budget: compressed bytes of a set sent as a delta against another set, as
            a fraction of that other set's as sent (full or delta).
    """

    def __init__(self, state: RunState, *, deltas: bool = True, teacher_budget: float = 0.25):
        self._state = state
        self._deltas = deltas
        self._teacher_budget = teacher_budget
        self._cache: dict[tuple[int, str, str, Precision, str | None], Encoded] = {}
        """Encodings of this round, by (round, group, set, precision, base): devices of a
        group at one precision share the full one, and those holding the same base (the
        content fingerprint of the model they hold; FedAvg: last round's global model)
        the delta against it. Each is quantized and compressed once."""

    def new_round(self) -> None:
        """Forget the encodings cached for the previous round."""
        self._cache.clear()

    def downlink(
        self,
        device_id: str,
        round_number: int,
        group: str,
        sets: Mapping[str, Arrays],
        link: Link,
        *,
        against: Mapping[str, str] = {},
    ) -> dict[str, TensorSet]:
        """The tensor sets for ``device_id`` of architecture group ``group``; the first of
        ``sets`` (its group's downlink) is its model.

        ``against`` maps a set to the set it travels as a delta against. For a lossy
        link the decoded model is stored as the device's ``sent`` base first.

        Raises:
            EncodeError: a value cannot be encoded at the link's precision.
        """
        precision = link.downlink
        done: dict[str, Encoded] = {}
        for position, (name, arrays) in enumerate(sets.items()):
            if position == 0:
                encoded = self._model(device_id, round_number, group, name, arrays, link=link)
            elif name in against and against[name] in done:
                other = done[against[name]]
                ref = set_base(against[name])
                key = (round_number, group, name, precision, f"{ref}@{other.fingerprint}")
                if key not in self._cache:
                    budget = max(1, int(self._teacher_budget * compressed_size(other.tensors)))
                    self._cache[key] = fit_delta(arrays, other.received, ref, precision, budget)
                encoded = self._cache[key]
            else:
                encoded = self._full(round_number, group, name, arrays, precision)
            done[name] = encoded
        return {name: encoded.tensors for name, encoded in done.items()}

    def _model(
        self,
        device_id: str,
        round_number: int,
        group: str,
        name: str,
        arrays: Arrays,
        *,
        link: Link,
    ) -> Encoded:
        precision = link.downlink
        held = None
        if self._deltas and precision is not Precision.FP32:
            held = self._state.load_base(device_id, "held")
            if held is not None and held.arrays.keys() != arrays.keys():
                held = None  # another model subset (e.g. a changed sharing mode)
        if held is None:
            encoded = self._full(round_number, group, name, arrays, precision)
        else:
            key = (round_number, group, name, precision, held.fingerprint)
            if key not in self._cache:
                self._cache[key] = encode_delta(arrays, held.arrays, held.fingerprint, precision)
            encoded = self._cache[key]
        if not link.lossless:
            base = Base(round_number, encoded.fingerprint, encoded.received)
            self._state.save_base(device_id, "sent", base)
        return encoded

    def _full(
        self, round_number: int, group: str, name: str, arrays: Arrays, precision: Precision
    ) -> Encoded:
        key = (round_number, group, name, precision, None)
        if key not in self._cache:
            self._cache[key] = encode_full(arrays, precision)
        return self._cache[key]

    # -- what devices hold -----------------------------------------------------------

    def uplink_base(self, device_id: str, fingerprint: str | None) -> Base | None:
        """The model ``device_id`` was sent whose fingerprint is ``fingerprint``, if any."""
        sent = self._state.load_base(device_id, "sent")
        if sent is None or fingerprint is None or sent.fingerprint != fingerprint:
            return None
        return sent

    def updated(self, device_id: str, round_number: int) -> None:
        """``device_id`` answered its task of ``round_number``: it holds what it was sent."""
        sent = self._state.load_base(device_id, "sent")
        if sent is not None and sent.round == round_number:
            self.confirm(device_id, sent)

    def confirm(self, device_id: str, base: Base) -> None:
        """``device_id`` proved it holds ``base`` (a model it was sent)."""
        if self._state.base_fingerprint(device_id, "held") != base.fingerprint:
            self._state.save_base(device_id, "held", base)

    def announced_mid_round(
        self, device_id: str, round_number: int, fingerprint: str | None
    ) -> None:
        """A hello of a device whose task of ``round_number`` is out and unanswered (it
        reconnected, or the coordinator restarted). Where the device still holds its base
        (``fingerprint`` is its ``held`` model or this round's ``sent`` one), nothing
        changes: the task goes out again encoded as the first time (the encodings are
        deterministic), so the model it may be training on and the base the coordinator
        checks its upload against stay in agreement (re-encoding against a newly confirmed
        base gave another ``sent`` base and refused the device's upload ``unknown_base``).
        Otherwise it lost its model: :meth:`announced`."""
        if fingerprint is not None:
            held = self._state.base_fingerprint(device_id, "held")
            sent = self._state.load_base(device_id, "sent")
            if fingerprint == held or (
                sent is not None and sent.round == round_number and sent.fingerprint == fingerprint
            ):
                return
        self.announced(device_id, fingerprint)

    def announced(self, device_id: str, fingerprint: str | None) -> None:
        """A hello says which model the device holds (None: none); keep what agrees."""
        if fingerprint is not None:
            if self._state.base_fingerprint(device_id, "held") == fingerprint:
                return
            sent = self.uplink_base(device_id, fingerprint)
            if sent is not None:
                self.confirm(device_id, sent)
                return
        self._state.delete_base(device_id, "held")
