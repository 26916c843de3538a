"""The classifier contract: a ``features`` extractor followed by a linear ``head``.

Every classifier maps images ``(B, C, H, W)`` to logits ``(B, num_classes)`` as
``head(features(x))``, where ``features`` yields a ``(B, latent_dim)`` representation.
The split is what FedGen shares (the head alone) and what FedKF / FedDF distil through.
The concrete architectures live in :mod:`models.lenet`, :mod:`models.resnet` and
:mod:`models.small`; :mod:`models.registry` builds them by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from protocol.arrays import architecture_fingerprint

__all__ = [
    "DEFAULT_IMAGE_SIZE",
    "DEFAULT_IN_CHANNELS",
    "DEFAULT_NUM_CLASSES",
    "Classifier",
    "ClassifierConfig",
    "square_images",
]

DEFAULT_NUM_CLASSES = 10
"""Classes of MNIST, Fashion-MNIST and CIFAR-10."""
DEFAULT_IN_CHANNELS = 1
"""Grey-scale input (MNIST family)."""
DEFAULT_IMAGE_SIZE = 28
"""MNIST-family image side, pixels."""


def square_images(shape: tuple[int, ...]) -> bool:
    """Whether samples of ``shape`` are square images (C, H, W) with H == W, what the
    built-in classifiers and the image generators take."""
    return len(shape) == 3 and shape[1] == shape[2]


HEAD_PREFIX = "head."
FEATURES_PREFIX = "features."


class ClassifierConfig(BaseModel):
    """Options every classifier shares; architectures subclass it with their own."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_classes: int = Field(
        default=DEFAULT_NUM_CLASSES,
        ge=2,
        description="Number of output classes (logits per sample).",
    )
    in_channels: int = Field(
        default=DEFAULT_IN_CHANNELS, ge=1, description="Input channels C (1 grey, 3 colour)."
    )
    image_size: int = Field(
        default=DEFAULT_IMAGE_SIZE,
        ge=4,
        description="Side of the square input image H = W, pixels.",
    )


class Classifier(nn.Module, ABC):
    """Abstract classifier: ``forward(x) == head(features(x))``.

    Subclasses set the class attributes :attr:`architecture` (the registry name) and
    :attr:`config_type`, and implement :meth:`_build_features`. The base class builds
    the head as ``nn.Linear(latent_dim, num_classes)`` after the features, so parameter
    initialisation order (and hence seeding) is features first, then head.

    Submodules are exactly ``features`` (``(B, C, H, W) -> (B, latent_dim)``) and
    ``head`` (``(B, latent_dim) -> (B, num_classes)``), so every state_dict key starts
    with ``"features."`` or ``"head."``.
    """

    architecture: ClassVar[str]
    """Registry name of the architecture, e.g. ``"lenet5"``."""
    config_type: ClassVar[type[ClassifierConfig]]
    """The pydantic configuration class of the architecture."""

    config: ClassifierConfig
    features: nn.Module
    head: nn.Module
    """``nn.Linear(latent_dim, num_classes)`` (``nn.Identity`` for a user's module that
    declares no split, :mod:`models.imported`)."""

    def __init__(self, config: ClassifierConfig) -> None:
        super().__init__()
        self.config = config
        features, latent_dim = self._build_features()
        self.features = features
        self.head = nn.Linear(latent_dim, config.num_classes)
        self._latent_dim = latent_dim

    @abstractmethod
    def _build_features(self) -> tuple[nn.Module, int]:
        """Return the feature extractor for ``self.config`` and its latent width."""

    @property
    def num_classes(self) -> int:
        """Number of output classes (width of the logits)."""
        return self.config.num_classes

    @property
    def latent_dim(self) -> int:
        """Width of the representation that ``features`` produces and ``head`` consumes."""
        return self._latent_dim

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """Shape of one input sample, ``(C, H, W)``."""
        side = self.config.image_size
        return (self.config.in_channels, side, side)

    @property
    def head_param_names(self) -> tuple[str, ...]:
        """The state_dict keys of the head (those under ``"head."``), in state_dict order."""
        return tuple(name for name in self.state_dict() if name.startswith(HEAD_PREFIX))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, num_classes)`` for images ``x`` of shape ``(B, C, H, W)``."""
        return self.head(self.features(x))  # type: ignore[no-any-return]

    def fingerprint(self) -> str:
        """Architecture fingerprint: 16 hex digits over state_dict names and shapes.

        Equal for two instances of the same architecture and configuration whatever
        their weights, device or dtype; different when any tensor name or shape differs.
        See :func:`protocol.arrays.architecture_fingerprint`.
        """
        return architecture_fingerprint(
            {name: tuple(t.shape) for name, t in self.state_dict().items()}
        )

    def extra_repr(self) -> str:
        return (
            f"architecture={self.architecture!r}, num_classes={self.num_classes}, "
            f"latent_dim={self.latent_dim}, input_shape={self.input_shape}"
        )
