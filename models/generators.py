"""Generators: FedGen's conditional latent generator and the sample generators.

:class:`LatentGenerator` produces classifier *latents* ``G(eps, y)`` that the coordinator
trains against the ensemble of uploaded heads (FedGen). The sample generators produce
pseudo-samples of the classifiers' input shape from noise, for FedKF's local generator,
DENSE and FedDF without proxy data: :class:`ImageGenerator` (DCGAN-style) for square
images whose side is a multiple of 4, :class:`SampleGenerator` (an MLP) for samples of
any other shape, series ``(T, C)`` or feature vectors ``(F,)``;
:func:`sample_generator_config` picks the one for a sample shape.
:mod:`models.registry` builds them by kind name ("latent", "image", "sample").
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from models.classifiers import Classifier
from models.errors import ModelInputError

__all__ = [
    "ImageGenerator",
    "ImageGeneratorConfig",
    "LatentGenerator",
    "LatentGeneratorConfig",
    "SampleGenerator",
    "SampleGeneratorConfig",
    "build_sample_generator",
    "sample_generator_config",
]


class LatentGeneratorConfig(BaseModel):
    """Options of FedGen's latent generator (defaults: FedGen's MNIST setting)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    noise_dim: int = Field(default=32, ge=1, description="Width of the Gaussian noise eps.")
    hidden_dim: int = Field(default=256, ge=1, description="Width of the hidden layer.")
    num_classes: int = Field(default=10, ge=2, description="Number of labels y (one-hot width).")
    latent_dim: int = Field(
        default=32, ge=1, description="Output width; must equal the classifiers' latent_dim."
    )

    @classmethod
    def for_classifier(
        cls, classifier: Classifier, *, noise_dim: int = 0, hidden_dim: int = 0
    ) -> LatentGeneratorConfig:
        """The generator over ``classifier``'s latent space and classes; a width of 0
        takes the default above (what the coordinator and the devices must agree on)."""
        widths = {"noise_dim": noise_dim, "hidden_dim": hidden_dim}
        return cls(
            num_classes=classifier.num_classes,
            latent_dim=classifier.latent_dim,
            **{name: value for name, value in widths.items() if value},
        )


class LatentGenerator(nn.Module):
    """FedGen's conditional generator ``G(eps, y)`` over a classifier's latent space.

    ``concat(eps, one_hot(y)) -> Linear(noise + classes, hidden) -> BatchNorm1d -> ReLU
    -> Linear(hidden, latent)``. With the defaults it has 19,744 parameters and 513
    BatchNorm buffer elements (running mean and variance, 256 each, and the batch count).
    In training mode BatchNorm1d needs batches of at least two samples.
    """

    def __init__(self, config: LatentGeneratorConfig | None = None) -> None:
        super().__init__()
        self.config = config if config is not None else LatentGeneratorConfig()
        cfg = self.config
        self.fc1 = nn.Linear(cfg.noise_dim + cfg.num_classes, cfg.hidden_dim)
        self.norm1 = nn.BatchNorm1d(cfg.hidden_dim)
        self.out = nn.Linear(cfg.hidden_dim, cfg.latent_dim)

    @property
    def noise_dim(self) -> int:
        """Width of the noise input eps."""
        return self.config.noise_dim

    @property
    def num_classes(self) -> int:
        """Number of labels the generator is conditioned on."""
        return self.config.num_classes

    @property
    def latent_dim(self) -> int:
        """Width of the generated latents."""
        return self.config.latent_dim

    def forward(self, eps: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Latents ``(B, latent_dim)`` for noise ``eps (B, noise_dim)`` and labels ``y (B,)``.

        ``y`` holds int64 labels in ``[0, num_classes)``.

        Raises:
            ModelInputError: ``eps`` does not end in ``noise_dim`` or ``y`` is not ``(B,)``.
        """
        if eps.shape[-1] != self.noise_dim or y.shape != eps.shape[:-1]:
            raise ModelInputError(
                f"expected eps (B, {self.noise_dim}) and y (B,), "
                f"got eps {tuple(eps.shape)} and y {tuple(y.shape)}"
            )
        onehot = F.one_hot(y, self.num_classes).to(eps.dtype)  # (B, classes)
        h = torch.relu(self.norm1(self.fc1(torch.cat([eps, onehot], dim=-1))))  # (B, hidden)
        return self.out(h)  # type: ignore[no-any-return]

    def sample(self, y: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """Latents for labels ``y (B,)`` with fresh noise eps ~ N(0, 1).

        The noise is drawn on the module's device and dtype, from ``generator`` when
        given (it must live on that device). Gradients flow as in :meth:`forward`.

        Raises:
            ModelInputError: ``y`` is not one-dimensional.
        """
        if y.dim() != 1:
            raise ModelInputError(f"expected labels y of shape (B,), got {tuple(y.shape)}")
        weight = self.fc1.weight
        eps = torch.randn(
            y.shape[0],
            self.noise_dim,
            generator=generator,
            device=weight.device,
            dtype=weight.dtype,
        )
        return self(eps, y.to(weight.device))  # type: ignore[no-any-return]


class ImageGeneratorConfig(BaseModel):
    """Options of the DCGAN-style image generator (defaults: MNIST-family images)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    noise_dim: int = Field(default=100, ge=1, description="Width of the noise vector z.")
    image_size: int = Field(
        default=28, ge=4, description="Side of the square output images, pixels; a multiple of 4."
    )
    channels: int = Field(
        default=1, ge=1, description="Output image channels C (1 grey, 3 colour)."
    )
    base_channels: int = Field(
        default=64, ge=1, description="Width of the last stage; earlier stages use twice as many."
    )

    @field_validator("image_size")
    @classmethod
    def _check_image_size(cls, value: int) -> int:
        if value % 4 != 0:
            raise ValueError(f"image_size must be a multiple of 4 (28, 32), got {value}")
        return value


class _FromNoise(nn.Module):
    """A generator whose first layer, ``project``, takes the noise z."""

    project: nn.Linear
    config: ImageGeneratorConfig | SampleGeneratorConfig

    @property
    def noise_dim(self) -> int:
        """Width of the noise input z."""
        return self.config.noise_dim

    def sample(self, batch_size: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """Samples for ``batch_size`` fresh noise vectors z ~ N(0, 1).

        The noise is drawn on the module's device and dtype, from ``generator`` when
        given (it must live on that device).
        """
        weight = self.project.weight
        z = torch.randn(
            batch_size,
            self.noise_dim,
            generator=generator,
            device=weight.device,
            dtype=weight.dtype,
        )
        return self(z)  # type: ignore[no-any-return]


class ImageGenerator(_FromNoise):
    """DCGAN-style generator: noise ``z (B, noise_dim)`` -> images ``(B, C, S, S)`` in [0, 1].

    ``Linear(noise, 128 * s * s)`` with ``s = S // 4`` -> reshape -> BatchNorm2d(128) ->
    [Upsample x2 -> Conv3x3(128, 128) -> BatchNorm2d -> LeakyReLU(0.2)] ->
    [Upsample x2 -> Conv3x3(128, 64) -> BatchNorm2d -> LeakyReLU(0.2)] ->
    Conv3x3(64, C) -> sigmoid (128 and 64 are ``2 * base_channels`` and ``base_channels``).

    Parameters with noise_dim 100: 856,065 for 1x28x28; 1,051,139 for 3x32x32. BatchNorm
    buffers add 643 elements (running mean and variance of 128 + 128 + 64 channels and
    three batch counts).
    """

    config: ImageGeneratorConfig

    def __init__(self, config: ImageGeneratorConfig | None = None) -> None:
        super().__init__()
        self.config = config if config is not None else ImageGeneratorConfig()
        cfg = self.config
        wide, narrow = 2 * cfg.base_channels, cfg.base_channels
        self._init_side = cfg.image_size // 4
        self.project = nn.Linear(cfg.noise_dim, wide * self._init_side**2)
        self.norm0 = nn.BatchNorm2d(wide)
        self.block1 = nn.Sequential(
            nn.Upsample(scale_factor=2),
            nn.Conv2d(wide, wide, 3, padding=1),
            nn.BatchNorm2d(wide),
            nn.LeakyReLU(0.2),
        )
        self.block2 = nn.Sequential(
            nn.Upsample(scale_factor=2),
            nn.Conv2d(wide, narrow, 3, padding=1),
            nn.BatchNorm2d(narrow),
            nn.LeakyReLU(0.2),
        )
        self.to_image = nn.Conv2d(narrow, cfg.channels, 3, padding=1)

    @property
    def output_shape(self) -> tuple[int, int, int]:
        """Shape of one generated image, ``(C, H, W)``."""
        side = self.config.image_size
        return (self.config.channels, side, side)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """Images ``(B, C, S, S)`` with values in [0, 1] for noise ``z (B, noise_dim)``.

        Raises:
            ModelInputError: ``z`` is not ``(B, noise_dim)``.
        """
        if z.dim() != 2 or z.shape[1] != self.noise_dim:
            raise ModelInputError(f"expected z (B, {self.noise_dim}), got {tuple(z.shape)}")
        s = self._init_side
        x = self.project(z).reshape(z.shape[0], -1, s, s)  # (B, 2 * base, S/4, S/4)
        x = self.block1(self.norm0(x))  # (B, 2 * base, S/2, S/2)
        x = self.block2(x)  # (B, base, S, S)
        return torch.sigmoid(self.to_image(x))


class SampleGeneratorConfig(BaseModel):
    """Options of the MLP sample generator (samples of any shape)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    noise_dim: int = Field(default=100, ge=1, description="Width of the noise vector z.")
    sample_shape: tuple[int, ...] = Field(
        min_length=1, max_length=8, description="Shape of one generated sample."
    )
    width: int = Field(
        default=64, ge=1, description="Width unit: the hidden layers have 4x and 2x as many."
    )

    @field_validator("sample_shape")
    @classmethod
    def _check_shape(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(d < 1 for d in value):
            raise ValueError(f"sample_shape must be positive sizes, got {value}")
        return value


class SampleGenerator(_FromNoise):
    """MLP generator: noise ``z (B, noise_dim)`` -> samples ``(B, *sample_shape)``.

    ``Linear(noise, 4w) -> BatchNorm1d -> LeakyReLU(0.2) -> Linear(4w, 2w) -> BatchNorm1d
    -> LeakyReLU(0.2) -> Linear(2w, prod(sample_shape))``, reshaped (``w`` is ``width``).
    The output is unbounded, as standardised series and features are (images come from
    :class:`ImageGenerator`, in [0, 1]). Parameters with the defaults and 54 features
    (a 9 x 6 series): 66,486.
    """

    config: SampleGeneratorConfig

    def __init__(self, config: SampleGeneratorConfig) -> None:
        super().__init__()
        self.config = config
        wide, narrow = 4 * config.width, 2 * config.width
        self.project = nn.Linear(config.noise_dim, wide)
        self.body = nn.Sequential(
            nn.BatchNorm1d(wide),
            nn.LeakyReLU(0.2),
            nn.Linear(wide, narrow),
            nn.BatchNorm1d(narrow),
            nn.LeakyReLU(0.2),
            nn.Linear(narrow, math.prod(config.sample_shape)),
        )

    @property
    def output_shape(self) -> tuple[int, ...]:
        """Shape of one generated sample."""
        return self.config.sample_shape

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """Samples ``(B, *sample_shape)`` for noise ``z (B, noise_dim)``.

        Raises:
            ModelInputError: ``z`` is not ``(B, noise_dim)``.
        """
        if z.dim() != 2 or z.shape[1] != self.noise_dim:
            raise ModelInputError(f"expected z (B, {self.noise_dim}), got {tuple(z.shape)}")
        flat = self.body(self.project(z))  # (B, prod(sample_shape))
        return flat.reshape(z.shape[0], *self.output_shape)  # type: ignore[no-any-return]


def sample_generator_config(
    sample_shape: tuple[int, ...], *, noise_dim: int, width: int
) -> ImageGeneratorConfig | SampleGeneratorConfig:
    """The generator for samples of ``sample_shape``: an image generator for square
    images ``(C, S, S)`` with ``S`` a multiple of 4 (``width`` its ``base_channels``),
    the MLP sample generator for any other shape.

    Raises:
        ValueError: a noise width or width below 1, or an empty or non-positive shape.
    """
    if len(sample_shape) == 3 and sample_shape[1] == sample_shape[2] and sample_shape[1] % 4 == 0:
        return ImageGeneratorConfig(
            noise_dim=noise_dim,
            image_size=sample_shape[1],
            channels=sample_shape[0],
            base_channels=width,
        )
    return SampleGeneratorConfig(noise_dim=noise_dim, sample_shape=sample_shape, width=width)


def build_sample_generator(
    config: ImageGeneratorConfig | SampleGeneratorConfig,
) -> ImageGenerator | SampleGenerator:
    """The generator ``config`` describes (built on the CPU, or under the caller's
    default device, with the caller's RNG)."""
    if isinstance(config, ImageGeneratorConfig):
        return ImageGenerator(config)
    return SampleGenerator(config)
