"""ResNet-8 with GroupNorm (one channel per group), as used by FedDF and FedKF.

Batch normalisation keeps running statistics that drift apart across non-IID devices and
do not average well; GroupNorm(C, C) normalises each sample and channel on its own, so
the whole state is learnable parameters and aggregation is a plain weighted mean.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from pydantic import Field, field_validator
from torch import nn

from models.classifiers import Classifier, ClassifierConfig

__all__ = ["FEDDF_RESNET8_WIDTHS", "FEDKF_RESNET8_WIDTHS", "BasicBlock", "ResNet8", "ResNet8Config"]

FEDDF_RESNET8_WIDTHS = (16, 32, 64)
"""Stage widths of FedDF's ResNet-8 (78,042 parameters at 3x32x32, 10 classes)."""
FEDKF_RESNET8_WIDTHS = (64, 128, 256)
"""Stage widths of FedKF's ResNet-8 (1,227,594 parameters at 3x32x32, 10 classes)."""


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(channels, channels)


def _conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)


class ResNet8Config(ClassifierConfig):
    """ResNet-8 options."""

    widths: tuple[int, int, int] = Field(
        default=FEDDF_RESNET8_WIDTHS,
        description="Output channels of the stem/stage 1, stage 2 and stage 3; the last "
        "one is the latent width.",
    )

    @field_validator("widths")
    @classmethod
    def _check_widths(cls, value: tuple[int, int, int]) -> tuple[int, int, int]:
        if any(w < 1 for w in value):
            raise ValueError(f"widths must be positive, got {value}")
        return value


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with GroupNorm and an identity or 1x1-conv shortcut.

    ``(B, in_channels, H, W) -> (B, out_channels, ceil(H / stride), ceil(W / stride))``.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = _conv3x3(in_channels, out_channels, stride)
        self.norm1 = _norm(out_channels)
        self.conv2 = _conv3x3(out_channels, out_channels)
        self.norm2 = _norm(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                OrderedDict(
                    [
                        ("conv", nn.Conv2d(in_channels, out_channels, 1, stride, bias=False)),
                        ("norm", _norm(out_channels)),
                    ]
                )
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual block output; see the class docstring for shapes."""
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet8(Classifier):
    """ResNet-8: stem, three one-block stages (strides 1, 2, 2), global average pool.

    ``features``: conv3x3(C, w1) -> GroupNorm -> ReLU -> BasicBlock(w1, w1) ->
    BasicBlock(w1, w2, stride 2) -> BasicBlock(w2, w3, stride 2) -> average pool ->
    flatten, giving latent ``w3``; ``head`` = Linear(w3, num_classes). Convolutions have
    no bias (a norm follows each). Eight weighted layers: stem, six block convolutions,
    head (shortcuts not counted).

    Parameters at 3x32x32 and 10 classes: 78,042 with widths (16, 32, 64) and 1,227,594
    with (64, 128, 256); 77,754 at 1x28x28 with (16, 32, 64). The count does not depend
    on the image side.
    """

    architecture = "resnet8"
    config_type = ResNet8Config
    config: ResNet8Config

    def __init__(self, config: ResNet8Config | None = None) -> None:
        super().__init__(config if config is not None else ResNet8Config())

    def _build_features(self) -> tuple[nn.Module, int]:
        w1, w2, w3 = self.config.widths
        stem = nn.Sequential(
            OrderedDict(
                [
                    ("conv", _conv3x3(self.config.in_channels, w1)),
                    ("norm", _norm(w1)),
                    ("relu", nn.ReLU()),
                ]
            )
        )
        layers: OrderedDict[str, nn.Module] = OrderedDict(
            [
                ("stem", stem),  # (B, w1, H, W)
                ("stage1", BasicBlock(w1, w1)),
                ("stage2", BasicBlock(w1, w2, stride=2)),  # (B, w2, H/2, W/2)
                ("stage3", BasicBlock(w2, w3, stride=2)),  # (B, w3, H/4, W/4)
                ("pool", nn.AdaptiveAvgPool2d(1)),
                ("flatten", nn.Flatten()),  # (B, w3)
            ]
        )
        return nn.Sequential(layers), w3
