"""LeNet-5 (LeCun et al., 1998) with ReLU and max-pooling, for 28x28 or 32x32 images."""

from __future__ import annotations

from collections import OrderedDict

from pydantic import field_validator
from torch import nn

from models.classifiers import Classifier, ClassifierConfig

__all__ = ["LENET5_IMAGE_SIZES", "LeNet5", "LeNet5Config"]

LENET5_IMAGE_SIZES = (28, 32)
"""Input sides LeNet-5 accepts; 28 is zero-padded by 2 in the first convolution."""

LENET5_LATENT_DIM = 84


class LeNet5Config(ClassifierConfig):
    """LeNet-5 options: only the shared ones; ``image_size`` must be 28 or 32."""

    @field_validator("image_size")
    @classmethod
    def _check_image_size(cls, value: int) -> int:
        if value not in LENET5_IMAGE_SIZES:
            raise ValueError(f"lenet5 takes image_size 28 or 32, got {value}")
        return value


class LeNet5(Classifier):
    """LeNet-5: three 5x5 convolutions, two max-pools, fc 120 -> 84; latent 84.

    Layers (``features``): conv(C, 6, 5, padding 2 for 28x28 else 0) -> ReLU -> maxpool 2
    -> conv(6, 16, 5) -> ReLU -> maxpool 2 -> conv(16, 120, 5) -> ReLU -> flatten ->
    fc(120, 84) -> ReLU; ``head`` = Linear(84, num_classes). Both input sides reach a
    1x1 map after the third convolution.

    Parameters: 61,706 for 1x28x28 and 10 classes; 62,006 for 3x32x32 and 10 classes.
    """

    architecture = "lenet5"
    config_type = LeNet5Config
    config: LeNet5Config

    def __init__(self, config: LeNet5Config | None = None) -> None:
        super().__init__(config if config is not None else LeNet5Config())

    def _build_features(self) -> tuple[nn.Module, int]:
        padding = 2 if self.config.image_size == 28 else 0
        layers: OrderedDict[str, nn.Module] = OrderedDict(
            [
                ("conv1", nn.Conv2d(self.config.in_channels, 6, 5, padding=padding)),
                ("relu1", nn.ReLU()),
                ("pool1", nn.MaxPool2d(2)),  # (B, 6, 14, 14)
                ("conv2", nn.Conv2d(6, 16, 5)),
                ("relu2", nn.ReLU()),
                ("pool2", nn.MaxPool2d(2)),  # (B, 16, 5, 5)
                ("conv3", nn.Conv2d(16, 120, 5)),
                ("relu3", nn.ReLU()),  # (B, 120, 1, 1)
                ("flatten", nn.Flatten()),
                ("fc", nn.Linear(120, LENET5_LATENT_DIM)),
                ("relu4", nn.ReLU()),  # (B, 84)
            ]
        )
        return nn.Sequential(layers), LENET5_LATENT_DIM
