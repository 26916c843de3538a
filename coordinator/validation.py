"""Checks an update must pass before it touches any state.

Each failed check raises :class:`~coordinator.errors.UpdateRejectedError` with the reason code
the device gets back in its Ack:

======================  ==============================================================
reason                  when
======================  ==============================================================
malformed               no ``weights`` set, neither a full nor a delta set, or
                        num_samples out of range
unknown_base            a delta whose base is not the model the device was sent
fingerprint_mismatch    tensor names differ from the coordinator's model
shape_mismatch          same names, some shape differs
dtype_mismatch          a tensor's dtype is not the model's (an int64 tensor where the
                        model holds float32 weights moves the model without the norm
                        screen seeing it)
non_finite              a NaN or infinity in the weights
consent_required        label counts asked for (FedGen) but not sent
malformed               label counts of the wrong length, or not summing to num_samples
======================  ==============================================================

After these the engine screens the update's distance from the model the device was sent
(``update_norm``: :mod:`coordinator.screening`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from coordinator.errors import UpdateRejectedError
from coordinator.state import Base
from protocol.deltas import apply_delta_set
from protocol.errors import DecodeError
from protocol.messages import ReasonCode, Update
from protocol.sets import WEIGHTS_SET

__all__ = ["check_label_counts", "check_update_weights"]

Array = npt.NDArray[Any]


def check_update_weights(
    update: Update,
    model: Mapping[str, Array],
    announced_samples: int,
    base: Base | None = None,
) -> dict[str, Array]:
    """Decode and check the weights of ``update`` against the tensors of ``model``.

    Args:
        update: the update body.
        model: name -> an array of every tensor the update must carry (the current
            model's: their shapes and dtypes are what is checked).
        announced_samples: the training samples the device announced in its hello; an
            update may not claim more (it would outweigh the others).
        base: for a delta update, the model the device was sent whose fingerprint the
            delta names (None: not known, and a delta is rejected).

    Returns:
        The decoded weights, each in its model tensor's dtype.

    Raises:
        UpdateRejectedError: with the reason code of the first failed check.
    """
    if not 1 <= update.num_samples <= announced_samples:
        raise UpdateRejectedError(
            ReasonCode.MALFORMED,
            f"num_samples {update.num_samples} outside 1..{announced_samples} (announced in hello)",
        )
    tensor_set = update.sets.get(WEIGHTS_SET)
    if tensor_set is None or set(update.sets) != {WEIGHTS_SET}:
        raise UpdateRejectedError(
            ReasonCode.MALFORMED, f"an update carries exactly one set {WEIGHTS_SET!r}"
        )
    if tensor_set.mode == "delta" and base is None:
        raise UpdateRejectedError(
            ReasonCode.UNKNOWN_BASE,
            f"delta against {tensor_set.base!r}, which is not the model this device was sent",
        )
    if tensor_set.mode not in ("full", "delta"):
        raise UpdateRejectedError(
            ReasonCode.MALFORMED, f"set mode {tensor_set.mode!r}; expected 'full' or 'delta'"
        )
    names = [t.name for t in tensor_set]
    if set(names) != set(model):
        missing = sorted(set(model) - set(names))[:3]
        extra = sorted(set(names) - set(model))[:3]
        raise UpdateRejectedError(
            ReasonCode.FINGERPRINT_MISMATCH,
            f"tensor names differ from the model (missing {missing}, unexpected {extra})",
        )
    for tensor in tensor_set:
        expected = model[tensor.name]
        if tuple(tensor.shape) != expected.shape:
            raise UpdateRejectedError(
                ReasonCode.SHAPE_MISMATCH,
                f"{tensor.name}: shape {tuple(tensor.shape)}, model has {expected.shape}",
            )
        if tensor.dtype != expected.dtype.name:
            raise UpdateRejectedError(
                ReasonCode.DTYPE_MISMATCH,
                f"{tensor.name}: dtype {tensor.dtype}, model has {expected.dtype.name}",
            )
    try:
        if tensor_set.mode == "delta":
            assert base is not None
            arrays = apply_delta_set(tensor_set, base.arrays)
        else:
            arrays = tensor_set.to_arrays()
    except (DecodeError, ValueError) as exc:
        raise UpdateRejectedError(ReasonCode.MALFORMED, f"cannot decode weights: {exc}") from exc
    for name, array in arrays.items():
        if array.dtype != model[name].dtype:  # a delta added to a base of another dtype
            raise UpdateRejectedError(
                ReasonCode.DTYPE_MISMATCH,
                f"{name}: decodes to {array.dtype.name}, model has {model[name].dtype.name}",
            )
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise UpdateRejectedError(ReasonCode.NON_FINITE, f"{name} holds NaN or infinity")
    return arrays


def check_label_counts(update: Update, num_classes: int) -> None:
    """Check the label counts a strategy asked for: present, one per class, summing to
    ``num_samples``.

    Raises:
        UpdateRejectedError: ``consent_required`` when absent, ``malformed`` otherwise.
    """
    counts = update.label_counts
    if counts is None:
        raise UpdateRejectedError(
            ReasonCode.CONSENT_REQUIRED, "this strategy needs label counts with every update"
        )
    if len(counts) != num_classes:
        raise UpdateRejectedError(
            ReasonCode.MALFORMED, f"{len(counts)} label counts for {num_classes} classes"
        )
    if sum(counts) != update.num_samples:
        raise UpdateRejectedError(
            ReasonCode.MALFORMED,
            f"label counts sum to {sum(counts)}, num_samples is {update.num_samples}",
        )
