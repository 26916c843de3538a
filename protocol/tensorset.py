"""Tensor sets: ordered groups of encoded tensors, as messages carry them.

A :class:`TensorSet` has a mode: ``full`` (the values), ``delta`` (values to add to the
tensors named by ``base``) or ``partial`` (a subset of a model, e.g. its head).
:func:`encode_tensors` builds one from named arrays at a precision.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Literal

import numpy as np
import numpy.typing as npt
from pydantic import (
    BaseModel,
    ConfigDict,
    PlainSerializer,
    PlainValidator,
    ValidationInfo,
    model_validator,
)

from protocol.errors import EncodeError
from protocol.limits import DecodeLimits
from protocol.tensors import EncodedTensor, Encoding, Precision, encode_array, encoding_for

__all__ = ["TensorSet", "encode_tensors"]

Array = npt.NDArray[Any]
_DEFAULT_LIMITS = DecodeLimits()


def _tensor_validator(value: Any, info: ValidationInfo) -> EncodedTensor:
    if isinstance(value, EncodedTensor):
        return value
    limits = (info.context or {}).get("limits") or _DEFAULT_LIMITS
    return EncodedTensor.from_wire(value, limits)


WireTensor = Annotated[
    EncodedTensor,
    PlainValidator(_tensor_validator),
    PlainSerializer(lambda t: t.to_wire(), return_type=list),
]


class TensorSet(BaseModel):
    """An ordered group of encoded tensors with unique names.

    ``mode`` says how to read it: ``full`` (the values), ``delta`` (values to add to the
    tensors of the set named by ``base``) or ``partial`` (a subset of a model's tensors,
    e.g. only the prediction head).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["full", "delta", "partial"] = "full"
    base: str | None = None
    tensors: tuple[WireTensor, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> TensorSet:
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError("tensor names in a set must be unique")
        if (self.mode == "delta") != (self.base is not None):
            raise ValueError("a delta set needs a base, and only a delta set has one")
        if self.base is not None and not 0 < len(self.base) <= 128:
            raise ValueError("base must be 1 to 128 characters")
        return self

    def __iter__(self) -> Iterator[EncodedTensor]:  # type: ignore[override]
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def nbytes(self) -> int:
        """Encoded bytes of all tensors (data and parameters, no metadata)."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    def to_arrays(self) -> dict[str, Array]:
        """Decode every tensor, in order, to new numpy arrays."""
        return {t.name: t.to_array() for t in self.tensors}


def encode_tensors(
    arrays: Mapping[str, npt.ArrayLike],
    precision: Precision | str = Precision.FP32,
    *,
    mode: Literal["full", "delta", "partial"] = "full",
    base: str | None = None,
    shuffle: bool = False,
    rng: np.random.Generator | None = None,
    encodings: Mapping[str, Encoding | str] | None = None,
) -> TensorSet:
    """Encode named arrays into a :class:`TensorSet` at ``precision``.

    Each tensor's encoding comes from :func:`encoding_for` unless ``encodings`` names
    one for it. ``mode``/``base`` are recorded as given (see :func:`protocol.arrays.delta_arrays`).

    Raises:
        EncodeError: as :func:`encode_array`, or a delta without a base.
    """
    if (mode == "delta") != (base is not None):
        raise EncodeError("a delta tensor set needs a base name, and only a delta has one")
    overrides = encodings or {}
    tensors = []
    for name, value in arrays.items():
        arr = np.asarray(value)
        enc = Encoding(overrides[name]) if name in overrides else encoding_for(precision, arr)
        tensors.append(encode_array(name, arr, enc, shuffle=shuffle, rng=rng))
    return TensorSet(mode=mode, base=base, tensors=tuple(tensors))
