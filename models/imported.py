"""Classifiers a user brings: a factory named by its import path.

A classifier name with a colon, ``package.module:factory`` (at most
:data:`MAX_NAME_CHARS` characters: devices announce it in their hello), names a
function that the coordinator, every device and the sim import and call as::

    factory(num_classes=10, input_shape=(1, 28, 28))  # -> torch.nn.Module

The module maps a batch of samples ``(B, *input_shape)`` to logits
``(B, num_classes)``. The factory is called inside the caller's seed, so a seed gives
the same weights everywhere; it must build its module on the CPU and draw its random
numbers from torch's global generator only.

**Declaring the split.** A module with two submodules ``features`` and ``head``, whose
``forward(x)`` is ``head(features(x))`` and whose parameters are all theirs, declares the
split into a feature extractor (samples to ``(B, latent_dim)``) and a prediction head
(``(B, latent_dim)`` to logits, an ``nn.Linear``): what head-only sharing and FedGen
need. A module without them trains in every mode that does not need the split; those
that do refuse it at start, saying why (:func:`lacks_split`). Either way the
classifier's state keys start with ``features.`` (and ``head.``), as the built-in
ones' do.

The module is checked when it is built: its output on a batch of zeros must be
``(2, num_classes)``, a declared split must compute the module's own forward, and a
factory that cannot be imported, is not callable or returns something else raises
:class:`~models.errors.ModelConfigError` with the reason.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from pydantic import Field, field_validator
from torch import nn

from models.classifiers import Classifier, ClassifierConfig
from models.errors import ModelConfigError

__all__ = [
    "MAX_NAME_CHARS",
    "ImportedClassifier",
    "ImportedConfig",
    "imported_class",
    "is_import_path",
    "lacks_split",
]

MAX_NAME_CHARS = 64
"""Longest import path a classifier name may be (a hello's ``architecture``)."""

_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def is_import_path(name: str) -> bool:
    """Whether ``name`` has the form ``package.module:factory``."""
    return bool(_PATH.match(name))


class ImportedConfig(ClassifierConfig):
    """A user's classifier's options: the classes and the shape of one sample (any
    shape; ``in_channels`` and ``image_size`` are not used)."""

    input_shape: tuple[int, ...] = Field(
        min_length=1, max_length=8, description="Shape of one input sample."
    )

    @field_validator("input_shape")
    @classmethod
    def _positive(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(d < 1 for d in value):
            raise ValueError(f"every dimension of a sample must be >= 1, got {value}")
        return value


class ImportedClassifier(Classifier):
    """A user's module as a :class:`Classifier` (module docstring). Built through
    :func:`models.build_classifier` with the import path as the name."""

    config_type: ClassVar[type[ClassifierConfig]] = ImportedConfig
    factory: ClassVar[Callable[..., Any]]
    config: ImportedConfig

    @property
    def input_shape(self) -> tuple[int, ...]:  # type: ignore[override]
        """Shape of one input sample (any shape)."""
        return self.config.input_shape

    def __init__(self, config: ImportedConfig) -> None:
        nn.Module.__init__(self)
        self.config = config
        name = self.architecture
        built = type(self).factory(num_classes=config.num_classes, input_shape=self.input_shape)
        if not isinstance(built, nn.Module):
            raise ModelConfigError(
                f"{name} returned an object of type {type(built).__name__}, not a torch.nn.Module"
            )
        features, head = getattr(built, "features", None), getattr(built, "head", None)
        self.split = isinstance(features, nn.Module) and isinstance(head, nn.Module)
        if self.split:
            assert isinstance(features, nn.Module) and isinstance(head, nn.Module)
            owned = {id(p) for p in features.parameters()} | {id(p) for p in head.parameters()}
            stray = [n for n, p in built.named_parameters() if id(p) not in owned]
            if stray:
                raise ModelConfigError(
                    f"{name} declares features and head but has parameters outside them: "
                    + ", ".join(stray[:8])
                )
            if not isinstance(head, nn.Linear):
                raise ModelConfigError(
                    f"{name}'s head is a {type(head).__name__}; a declared head is an nn.Linear"
                )
            self.features, self.head = features, head
        else:
            self.features, self.head = built, nn.Identity()
        self._latent_dim = self._check(built)

    def _build_features(self) -> tuple[nn.Module, int]:  # pragma: no cover - not called
        raise NotImplementedError

    def _check(self, built: nn.Module) -> int:
        """The latent width, after checking the output's shape and the split's forward."""
        name = self.architecture
        x = torch.zeros((2, *self.input_shape))
        was = built.training
        built.eval()
        try:
            with torch.no_grad():
                logits = built(x)
                latent = self.features(x) if self.split else logits
                split = self.head(latent) if self.split else logits
        except Exception as exc:
            raise ModelConfigError(
                f"{name} fails on a batch of inputs of shape {tuple(x.shape)}: {exc}"
            ) from exc
        finally:
            built.train(was)
        want = (2, self.config.num_classes)
        if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != want:
            got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits)
            raise ModelConfigError(
                f"{name} maps inputs {tuple(x.shape)} to {got}, not logits {want}"
            )
        if self.split:
            if latent.dim() != 2:
                raise ModelConfigError(
                    f"{name}'s features give {tuple(latent.shape)}, not (batch, latent_dim)"
                )
            if not torch.allclose(split, logits, rtol=1e-4, atol=1e-5):
                raise ModelConfigError(
                    f"{name}'s forward is not head(features(x)): declare no features/head, "
                    "or make forward compute exactly that"
                )
            return int(latent.shape[1])
        return self.config.num_classes


def lacks_split(model: Classifier) -> bool:
    """Whether ``model`` lacks the features / head split (a user's module that declares
    none)."""
    return isinstance(model, ImportedClassifier) and not model.split


@functools.cache
def imported_class(path: str) -> type[ImportedClassifier]:
    """The :class:`ImportedClassifier` subclass of the factory at ``path`` (imported
    once per process).

    Raises:
        ModelConfigError: ``path`` is too long, malformed, or does not import to a
            callable.
    """
    if len(path) > MAX_NAME_CHARS:
        raise ModelConfigError(
            f"model import path {path!r} is {len(path)} characters; at most "
            f"{MAX_NAME_CHARS} (devices announce it in their hello)"
        )
    if not is_import_path(path):
        raise ModelConfigError(
            f"model {path!r} is not a registered name nor an import path package.module:factory"
        )
    module_name, _, attribute = path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelConfigError(f"cannot import {module_name} for model {path}: {exc}") from exc
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ModelConfigError(f"{module_name} has no {attribute} (model {path})") from None
    if not callable(target):
        raise ModelConfigError(
            f"{path} is not a callable factory: it is of type {type(target).__name__}"
        )
    name = f"Imported[{path}]"
    return type(
        name, (ImportedClassifier,), {"architecture": path, "factory": staticmethod(target)}
    )
