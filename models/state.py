"""Convert a module's state to and from plain ``dict[str, numpy.ndarray]``.

These dicts are what :mod:`protocol` encodes on the wire. Keys are state_dict names in
state_dict order. A *subset* selects part of the state:

- ``"all"``: the whole state of any module;
- ``"head"`` / ``"features"``: a :class:`~models.classifiers.Classifier`'s keys under
  ``"head."`` / ``"features."`` (the two partition the state);
- ``"generator"``: the whole state of a :class:`~models.generators.LatentGenerator` or
  :class:`~models.generators.ImageGenerator`.

Buffers: the persistent buffers in a state_dict are normalisation statistics (BatchNorm's
``running_mean``, ``running_var`` and integer ``num_batches_tracked``; the classifiers
here use GroupNorm and have none). ``buffers=True`` (the default) includes them,
``buffers=False`` leaves them out, in every function of this module alike, so a sender
and a receiver that pass the same flag agree on the names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from models.classifiers import FEATURES_PREFIX, HEAD_PREFIX, Classifier
from models.errors import ModelInputError, StateMismatchError
from models.generators import ImageGenerator, LatentGenerator

__all__ = [
    "StateSubset",
    "load_state_arrays",
    "state_arrays",
    "state_shapes",
    "subset_names",
]

StateSubset = Literal["all", "head", "features", "generator"]
"""Names of the parts of a module's state that can be selected."""

_SUBSETS: tuple[str, ...] = ("all", "head", "features", "generator")
_MAX_NAMED = 8  # offending tensor names listed per problem in an error message


def _buffer_names(module: nn.Module) -> set[str]:
    return {name for name, _ in module.named_buffers(remove_duplicate=False)}


def _selected(module: nn.Module, subset: str, buffers: bool) -> dict[str, torch.Tensor]:
    """The state tensors of ``subset`` (sharing storage with the module), in order."""
    if subset not in _SUBSETS:
        raise ModelInputError(f"unknown state subset {subset!r}; known: {', '.join(_SUBSETS)}")
    if subset in ("head", "features") and not isinstance(module, Classifier):
        raise ModelInputError(f"subset {subset!r} needs a Classifier, got {type(module).__name__}")
    if subset == "generator" and not isinstance(module, LatentGenerator | ImageGenerator):
        raise ModelInputError(
            f"subset 'generator' needs a generator module, got {type(module).__name__}"
        )
    prefix = {"head": HEAD_PREFIX, "features": FEATURES_PREFIX}.get(subset, "")
    skip = set() if buffers else _buffer_names(module)
    return {
        name: tensor
        for name, tensor in module.state_dict().items()
        if name.startswith(prefix) and name not in skip
    }


def subset_names(
    module: nn.Module, subset: StateSubset, *, buffers: bool = True
) -> tuple[str, ...]:
    """The state_dict names of ``subset`` of ``module``, in state_dict order.

    Raises:
        ModelInputError: ``subset`` is unknown or does not apply to this module.
    """
    return tuple(_selected(module, subset, buffers))


def state_shapes(
    module: nn.Module, subset: StateSubset = "all", *, buffers: bool = True
) -> dict[str, tuple[int, ...]]:
    """Shapes (in elements per dimension) of the tensors of ``subset``, by name.

    Raises:
        ModelInputError: ``subset`` is unknown or does not apply to this module.
    """
    return {name: tuple(t.shape) for name, t in _selected(module, subset, buffers).items()}


def _to_numpy(tensor: torch.Tensor) -> npt.NDArray[Any]:
    dtype = torch.float32 if tensor.is_floating_point() else tensor.dtype
    t = tensor.detach().to(device="cpu", dtype=dtype)
    return np.array(t.numpy(), order="C", copy=True)  # 0-d stays 0-d


def state_arrays(
    module: nn.Module, subset: StateSubset = "all", *, buffers: bool = True
) -> dict[str, npt.NDArray[Any]]:
    """Copies of the tensors of ``subset`` as C-contiguous CPU numpy arrays, by name.

    Floating tensors (any precision, any device) become float32; integer and boolean
    tensors (such as ``num_batches_tracked``, int64) keep their dtype. The arrays own
    their memory: changing them does not change the module, and vice versa.

    Raises:
        ModelInputError: ``subset`` is unknown or does not apply to this module.
    """
    return {name: _to_numpy(t) for name, t in _selected(module, subset, buffers).items()}


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMED])
    more = len(names) - _MAX_NAMED
    return f"{shown} (and {more} more)" if more > 0 else shown


def _problems(
    targets: Mapping[str, torch.Tensor], arrays: Mapping[str, npt.NDArray[Any]], strict: bool
) -> list[str]:
    problems: list[str] = []
    if strict:
        missing = [name for name in targets if name not in arrays]
        unexpected = [name for name in arrays if name not in targets]
        if missing:
            problems.append(f"missing: {_listed(missing)}")
        if unexpected:
            problems.append(f"unexpected: {_listed(unexpected)}")
    shapes: list[str] = []
    dtypes: list[str] = []
    nonfinite: list[str] = []
    for name, array in arrays.items():
        target = targets.get(name)
        if target is None:
            continue
        if tuple(array.shape) != tuple(target.shape):
            shapes.append(f"{name} {tuple(array.shape)} != {tuple(target.shape)}")
        elif array.dtype.kind not in "biuf":
            dtypes.append(f"{name} ({array.dtype})")
        elif array.dtype.kind == "f" and not np.isfinite(array).all():
            nonfinite.append(name)
    if shapes:
        problems.append(f"shape mismatch (got != expected): {_listed(shapes)}")
    if dtypes:
        problems.append(f"non-numeric dtype: {_listed(dtypes)}")
    if nonfinite:
        problems.append(f"non-finite values: {_listed(nonfinite)}")
    return problems


def load_state_arrays(
    module: nn.Module,
    arrays: Mapping[str, npt.ArrayLike],
    *,
    subset: StateSubset = "all",
    strict: bool = True,
    buffers: bool = True,
) -> None:
    """Copy ``arrays`` into the tensors of ``subset`` of ``module``, all or nothing.

    Everything is validated before anything is copied: names (with ``strict``, every
    name of the subset must be present and no other name may be), shapes, dtypes
    (numeric only) and finiteness of floating values. Then each array is copied under
    ``torch.no_grad()`` onto the module's own tensor, converted to that tensor's device
    and dtype. With ``strict=False`` missing names keep their current values and
    unexpected names are ignored; shape, dtype and finiteness are still checked.

    Args:
        module: the module to update in place.
        arrays: name -> array (anything ``numpy.asarray`` accepts), e.g. from
            :func:`state_arrays` or a decoded wire message.
        subset: which part of the state the arrays are for.
        strict: require exactly the names of the subset.
        buffers: whether the subset's names include the normalisation buffers.

    Raises:
        StateMismatchError: the arrays do not match; the message names the offending
            tensors and the module is unchanged.
        ModelInputError: ``subset`` is unknown or does not apply to this module.
    """
    targets = _selected(module, subset, buffers)
    converted = {name: np.asarray(value) for name, value in arrays.items()}
    problems = _problems(targets, converted, strict)
    if problems:
        raise StateMismatchError(
            f"state of {type(module).__name__} (subset {subset!r}) does not match: "
            + "; ".join(problems)
        )
    with torch.no_grad():
        for name, array in converted.items():
            target = targets.get(name)
            if target is None:
                continue
            native = np.array(array, dtype=array.dtype.newbyteorder("="), order="C", copy=True)
            target.copy_(torch.from_numpy(native))
