"""Build classifiers and generators by registered name.

Names are the only way other packages pick an architecture (never string matching in
their own code). Options are validated into the model's pydantic configuration; a bad
option raises :class:`~models.errors.ModelConfigError`, an unknown name
:class:`~models.errors.UnknownModelError`. Seeding is the caller's business: build inside
:func:`seeded` to get reproducible weights. Modules are built on the CPU and then moved
to ``device``, so a seed gives the same weights on every device.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Literal, TypeVar, overload

import torch
from pydantic import BaseModel, ValidationError
from torch import nn

from models.classifiers import (
    DEFAULT_IMAGE_SIZE,
    DEFAULT_IN_CHANNELS,
    DEFAULT_NUM_CLASSES,
    Classifier,
    square_images,
)
from models.errors import ModelConfigError, UnknownModelError
from models.generators import (
    ImageGenerator,
    ImageGeneratorConfig,
    LatentGenerator,
    LatentGeneratorConfig,
    SampleGenerator,
    SampleGeneratorConfig,
)
from models.imported import ImportedClassifier, imported_class
from models.lenet import LeNet5
from models.resnet import ResNet8
from models.small import MLP, FedGenCNN

__all__ = [
    "build_classifier",
    "classifier_class",
    "classifier_problem",
    "build_generator",
    "classifier_names",
    "generator_kinds",
    "seeded",
]

logger = logging.getLogger(__name__)

_CLASSIFIERS: Mapping[str, type[Classifier]] = MappingProxyType(
    {cls.architecture: cls for cls in (LeNet5, ResNet8, FedGenCNN, MLP)}
)
_GENERATOR_KINDS = ("image", "latent", "sample")

_ConfigT = TypeVar("_ConfigT", bound=BaseModel)

_SEEDED = threading.Lock()


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Inside: torch's global CPU RNG seeded with ``seed``; outside it is as it was.

    The global RNG is one per process, so one thread at a time holds it: devices that
    train on several threads (the sim's) still build each module from its own seed.
    """
    with _SEEDED, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def classifier_names() -> tuple[str, ...]:
    """Registered classifier names, sorted (``"fedgen_cnn"``, ``"lenet5"``, ...)."""
    return tuple(sorted(_CLASSIFIERS))


def generator_kinds() -> tuple[str, ...]:
    """Registered generator kinds, sorted: ``("image", "latent", "sample")``."""
    return _GENERATOR_KINDS


def _validate(config_type: type[_ConfigT], what: str, options: Mapping[str, object]) -> _ConfigT:
    try:
        return config_type.model_validate(dict(options))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in err['loc']) or '(config)'}: {err['msg']}"
            for err in exc.errors()
        )
        raise ModelConfigError(f"invalid options for {what}: {problems}") from None


def classifier_class(name: str) -> type[Classifier]:
    """The classifier class of ``name``: a registered name, or a user's factory named by
    its import path ``package.module:factory`` (:mod:`models.imported`, imported here).

    Raises:
        UnknownModelError: ``name`` is neither (the message lists the known names).
        ModelConfigError: an import path that does not import to a callable.
    """
    cls = _CLASSIFIERS.get(name)
    if cls is not None:
        return cls
    if ":" in name:
        return imported_class(name)
    known = ", ".join(classifier_names())
    raise UnknownModelError(
        f"unknown classifier {name!r}; known: {known}, or a factory's import path "
        "package.module:factory"
    )


def classifier_problem(name: str) -> str | None:
    """Why ``name`` names no classifier (:func:`classifier_class`), or None: a registered
    name, or an import path that imports to a callable."""
    try:
        classifier_class(name)
    except (UnknownModelError, ModelConfigError) as exc:
        return str(exc.args[0])
    return None


def build_classifier(
    name: str,
    *,
    num_classes: int = DEFAULT_NUM_CLASSES,
    in_channels: int = DEFAULT_IN_CHANNELS,
    image_size: int = DEFAULT_IMAGE_SIZE,
    input_shape: tuple[int, ...] | None = None,
    device: torch.device | str | None = None,
    **options: object,
) -> Classifier:
    """Build the classifier registered as ``name``.

    Args:
        name: one of :func:`classifier_names`, or a factory's import path
            (:func:`classifier_class`).
        num_classes: number of output classes (logits).
        in_channels: input channels C.
        image_size: side of the square input images, pixels.
        input_shape: the shape of one sample, which then sets ``in_channels`` and
            ``image_size``: square images ``(C, S, S)`` for the built-in classifiers, any
            shape for a user's model (None: ``(in_channels, image_size, image_size)``).
        device: where to place the module (CPU when None); built on the CPU first.
        **options: architecture-specific fields of its config, e.g. ``widths=(64, 128,
            256)`` for ``"resnet8"`` or ``hidden=(100,)`` for ``"mlp"``.

    Raises:
        UnknownModelError: ``name`` is not registered (the message lists known names).
        ModelConfigError: an option is unknown, of the wrong type or out of range, or
            a user's factory failed its checks (:mod:`models.imported`).
    """
    cls = classifier_class(name)
    imported = issubclass(cls, ImportedClassifier)
    shape: dict[str, object] = {"in_channels": in_channels, "image_size": image_size}
    if input_shape is not None and square_images(input_shape):
        shape = {"in_channels": input_shape[0], "image_size": input_shape[1]}  # images
    elif input_shape is not None and not imported:
        raise ModelConfigError(
            f"{name} takes square images (C, H, W), not samples of shape {input_shape}: "
            "bring a model of your own for them (docs/models.md)"
        )
    if imported:
        shape["input_shape"] = input_shape or (in_channels, image_size, image_size)
    fields = {"num_classes": num_classes, **shape, **options}
    config = _validate(cls.config_type, f"classifier {name!r}", fields)
    model = cls(config)
    logger.debug("built classifier %s (%s)", name, config)
    return model.to(device) if device is not None else model


@overload
def build_generator(
    kind: Literal["latent"], *, device: torch.device | str | None = None, **options: object
) -> LatentGenerator: ...
@overload
def build_generator(
    kind: Literal["image"], *, device: torch.device | str | None = None, **options: object
) -> ImageGenerator: ...
@overload
def build_generator(
    kind: Literal["sample"], *, device: torch.device | str | None = None, **options: object
) -> SampleGenerator: ...
@overload
def build_generator(
    kind: str, *, device: torch.device | str | None = None, **options: object
) -> nn.Module: ...
def build_generator(
    kind: str, *, device: torch.device | str | None = None, **options: object
) -> nn.Module:
    """Build a generator of ``kind`` ``"latent"`` (FedGen), ``"image"`` or ``"sample"``
    (FedKF, DENSE, FedDF: images, or samples of any shape).

    Args:
        kind: one of :func:`generator_kinds`.
        device: where to place the module (CPU when None); built on the CPU first.
        **options: fields of :class:`~models.generators.LatentGeneratorConfig` or
            :class:`~models.generators.ImageGeneratorConfig` or
            :class:`~models.generators.SampleGeneratorConfig`.

    Raises:
        UnknownModelError: ``kind`` is not registered.
        ModelConfigError: an option is unknown, of the wrong type or out of range.
    """
    module: nn.Module
    if kind == "latent":
        module = LatentGenerator(_validate(LatentGeneratorConfig, "latent generator", options))
    elif kind == "image":
        module = ImageGenerator(_validate(ImageGeneratorConfig, "image generator", options))
    elif kind == "sample":
        module = SampleGenerator(_validate(SampleGeneratorConfig, "sample generator", options))
    else:
        known = ", ".join(_GENERATOR_KINDS)
        raise UnknownModelError(f"unknown generator kind {kind!r}; known: {known}")
    logger.debug("built %s generator", kind)
    return module.to(device) if device is not None else module
