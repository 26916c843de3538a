"""Whether a hello may register its device: the checks of docs/protocol.md, section 9,
step 3, in their order. Pure: the engine answers the refusal and changes nothing.

A refusal's detail is written for the person at the device, who reads it in the
device's log: a fingerprint mismatch names the fleet's models in human terms (their
architecture, classes and input shape; never a key) and how the device's model differs:
from what its hello describes (the shape of its samples, its classes and its tensors'
names and shapes, :func:`model_difference`) or, from a hello without that description,
where the device's fingerprint is the fleet's architecture with another number of
classes, that number (26-class data in a 10-class fleet says so).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

from coordinator.config import CoordinatorConfig
from coordinator.groups import ArchitectureGroup
from coordinator.strategies.base import Strategy
from models.imported import is_import_path
from protocol.arrays import architecture_fingerprint
from protocol.messages import Hello, ReasonCode

__all__ = [
    "describe_group",
    "fingerprint_refusal",
    "guess_classes",
    "hello_refusal",
    "model_difference",
    "tensor_difference",
    "unsupported_precision",
]

HEAD_PREFIX = "head."
"""The classifier head's tensors (models.classifiers): the only ones whose shape
depends on the number of classes."""
MAX_GUESSED_CLASSES = 1024
"""The largest number of classes a refused fingerprint is tried against."""


def hello_refusal(
    hello: Hello,
    groups: Mapping[str, ArchitectureGroup],
    registered: Hello | None,
    config: CoordinatorConfig,
    strategy: Strategy,
) -> tuple[ReasonCode, str] | None:
    """Why ``hello`` cannot register its device (its reason code and the ack's detail),
    None when it can. ``registered``: the device's registration so far, if any."""
    group = groups.get(hello.architecture)
    if group is None or hello.fingerprint != group.fingerprint:
        return ReasonCode.FINGERPRINT_MISMATCH, fingerprint_refusal(hello, groups, config)
    if registered is not None and registered.architecture != group.name:
        return (
            ReasonCode.FINGERPRINT_MISMATCH,
            f"registered with {registered.architecture}: a device keeps its architecture "
            "for the run",
        )
    if (unsupported := unsupported_precision(hello, config)) is not None:
        return ReasonCode.UNSUPPORTED_PRECISION, unsupported
    if hello.num_samples < 1:
        return ReasonCode.MALFORMED, "a device without training samples cannot join"
    if (refusal := strategy.refuse(hello)) is not None:
        return ReasonCode.CONSENT_REQUIRED, refusal
    return None


def unsupported_precision(hello: Hello, config: CoordinatorConfig) -> str | None:
    """Why the fleet's default precisions do not suit a device that asks for none."""
    speaks = ", ".join(p.value for p in hello.precisions)
    for direction, asked, default in (
        ("downlink", hello.downlink_precision, config.downlink_precision),
        ("uplink", hello.uplink_precision, config.uplink_precision),
    ):
        if asked is None and default not in hello.precisions:
            fleet = f"this fleet's {direction} precision is {default.value}"
            return f"{fleet}; the device speaks {speaks}"
    return None


def describe_group(group: ArchitectureGroup, config: CoordinatorConfig) -> str:
    """``lenet5 (10 classes, input 1x28x28, fingerprint ...)``: a fleet's model as a
    person at a device can compare it with the device's."""
    shape = "x".join(str(d) for d in config.sample_shape)
    return (
        f"{group.name} ({group.num_classes} classes, input {shape}, "
        f"fingerprint {group.fingerprint})"
    )


def fingerprint_refusal(
    hello: Hello, groups: Mapping[str, ArchitectureGroup], config: CoordinatorConfig
) -> str:
    """The detail of a ``fingerprint_mismatch`` refusal of ``hello``: what the fleet runs,
    what the device announced and, where it can be told, how the two differ."""
    runs = ", ".join(describe_group(g, config) for g in groups.values())
    announced = f"{hello.architecture} (fingerprint {hello.fingerprint})"
    group = groups.get(hello.architecture)
    if group is None:
        names = ", ".join(groups)
        why = f"this fleet runs no {hello.architecture}: start the device with --model {names}"
    elif (described := model_difference(hello, group, config)) is not None:
        why = described
    elif (classes := guess_classes(group, hello.fingerprint)) is not None:
        why = (
            f"that is {group.name} with {classes} classes: the device's data have {classes} "
            f"classes, the fleet's model {group.num_classes}"
        )
    else:
        why = (
            f"its {group.name} differs from the fleet's: other data (classes, channels or "
            "image size) or other model options"
        )
        if is_import_path(group.name):  # a user's model
            why += ", or another version of that factory's code on one side"
    return f"fleet runs {runs}; device announced {announced}: {why}"


def model_difference(
    hello: Hello, group: ArchitectureGroup, config: CoordinatorConfig
) -> str | None:
    """How the model ``hello`` describes (its ``input_shape``, ``num_classes`` and
    ``layout``) differs from ``group``'s, in words: the samples' shape and the classes
    where they differ, else the tensors (:func:`tensor_difference`). None when the hello
    describes nothing (a device of before the description: the caller guesses)."""
    if hello.input_shape is None and hello.num_classes is None and hello.layout is None:
        return None
    parts = []
    if hello.input_shape is not None and tuple(hello.input_shape) != config.sample_shape:
        parts.append(
            f"the device's samples are {_dims(hello.input_shape)}, the fleet's "
            f"{_dims(config.sample_shape)}"
        )
    if hello.num_classes is not None and hello.num_classes != group.num_classes:
        parts.append(
            f"the device's data have {hello.num_classes} classes, the fleet's model "
            f"{group.num_classes}"
        )
    if parts:
        return "; ".join(parts)
    code = "another version of that factory's code" if is_import_path(group.name) else ""
    options = " or ".join(filter(None, ["other model options", code]))
    same = f"same samples and classes, other tensors ({options} on one side)"
    if hello.layout is None:
        return same
    return f"{same}: {tensor_difference(hello.layout, group.shapes)}"


MAX_NAMED_TENSORS = 3
"""Tensors named per kind of difference in a refusal (the rest are counted)."""


def tensor_difference(
    device: Mapping[str, Sequence[int]], fleet: Mapping[str, Sequence[int]]
) -> str:
    """The tensors a device's model and the fleet's do not share, by name: those only
    one side has and those shaped differently (at most :data:`MAX_NAMED_TENSORS` of
    each named, the rest counted)."""

    def named(names: list[str], describe: Callable[[str], str] = str) -> str:
        shown = ", ".join(describe(n) for n in names[:MAX_NAMED_TENSORS])
        more = len(names) - MAX_NAMED_TENSORS
        return shown + (f" (+{more} more)" if more > 0 else "")

    only_device = sorted(set(device) - set(fleet))
    only_fleet = sorted(set(fleet) - set(device))
    reshaped = sorted(n for n in set(device) & set(fleet) if tuple(device[n]) != tuple(fleet[n]))
    parts = []
    if only_device:
        parts.append(f"tensors only the device's model has: {named(only_device)}")
    if only_fleet:
        parts.append(f"tensors only the fleet's has: {named(only_fleet)}")
    if reshaped:
        shapes = named(reshaped, lambda n: f"{n} {_dims(device[n])} (fleet {_dims(fleet[n])})")
        parts.append(f"tensors shaped otherwise: {shapes}")
    return "; ".join(parts) or "the same tensors"


def _dims(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape) or "scalar"


def guess_classes(group: ArchitectureGroup, fingerprint: str) -> int | None:
    """The number of classes ``group``'s architecture has when its fingerprint is
    ``fingerprint`` (the same input shape, only the head resized), None when no number
    up to :data:`MAX_GUESSED_CLASSES` gives it."""
    shapes = tuple(sorted(group.shapes.items()))
    return _classes_by_fingerprint(shapes, group.num_classes).get(fingerprint)


@functools.lru_cache(maxsize=16)
def _classes_by_fingerprint(
    shapes: tuple[tuple[str, tuple[int, ...]], ...], num_classes: int
) -> dict[str, int]:
    """Fingerprint -> number of classes, for the architecture of ``shapes`` (whose head
    has ``num_classes`` outputs) with every other number of classes: a thousand hashes
    of a few lines each, once per architecture."""
    head = {n for n, shape in shapes if n.startswith(HEAD_PREFIX) and shape[:1] == (num_classes,)}
    if not head:
        return {}
    found: dict[str, int] = {}
    for classes in range(2, MAX_GUESSED_CLASSES + 1):
        resized = {name: (classes, *shape[1:]) if name in head else shape for name, shape in shapes}
        found.setdefault(architecture_fingerprint(resized), classes)
    return found
