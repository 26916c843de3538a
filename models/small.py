"""Small classifiers for the MNIST family: FedGen's CNN and a multi-layer perceptron."""

from __future__ import annotations

from collections import OrderedDict

from pydantic import Field, field_validator
from torch import nn

from models.classifiers import Classifier, ClassifierConfig

__all__ = ["MLP", "FedGenCNN", "FedGenCNNConfig", "MLPConfig"]

FEDGEN_CNN_CHANNELS = (6, 16)
FEDGEN_LATENT_DIM = 32
MLP_HIDDEN = (200, 200)


class FedGenCNNConfig(ClassifierConfig):
    """Options of FedGen's small CNN."""

    channels: tuple[int, int] = Field(
        default=FEDGEN_CNN_CHANNELS, description="Output channels of the two convolutions."
    )
    kernel_size: int = Field(
        default=3, ge=1, description="Side of the square convolution kernels (odd; 'same' padding)."
    )
    latent_dim: int = Field(
        default=FEDGEN_LATENT_DIM, ge=1, description="Width of the fully connected latent layer."
    )

    @field_validator("channels")
    @classmethod
    def _check_channels(cls, value: tuple[int, int]) -> tuple[int, int]:
        if any(c < 1 for c in value):
            raise ValueError(f"channels must be positive, got {value}")
        return value

    @field_validator("kernel_size")
    @classmethod
    def _check_kernel(cls, value: int) -> int:
        if value % 2 == 0:
            raise ValueError(f"kernel_size must be odd, got {value}")
        return value


class FedGenCNN(Classifier):
    """FedGen's MNIST network: two small convolutions, then a 32-d latent layer.

    ``features``: conv(C, 6, k, 'same') -> ReLU -> maxpool 2 -> conv(6, 16, k, 'same')
    -> ReLU -> maxpool 2 -> flatten -> fc(16 * (S // 4)^2, 32) -> ReLU; ``head`` =
    Linear(32, num_classes), the one-layer prediction layer FedGen shares. (FedGen's
    reference code reaches the same 16x7x7 map with stride-2 convolutions and batch
    norm; this version pools instead and has no normalisation buffers.)

    Parameters with 10 classes: 26,390 at 1x28x28; 34,178 at 3x32x32.
    """

    architecture = "fedgen_cnn"
    config_type = FedGenCNNConfig
    config: FedGenCNNConfig

    def __init__(self, config: FedGenCNNConfig | None = None) -> None:
        super().__init__(config if config is not None else FedGenCNNConfig())

    def _build_features(self) -> tuple[nn.Module, int]:
        cfg = self.config
        c1, c2 = cfg.channels
        k = cfg.kernel_size
        side = cfg.image_size // 2 // 2
        layers: OrderedDict[str, nn.Module] = OrderedDict(
            [
                ("conv1", nn.Conv2d(cfg.in_channels, c1, k, padding=k // 2)),
                ("relu1", nn.ReLU()),
                ("pool1", nn.MaxPool2d(2)),  # (B, c1, S/2, S/2)
                ("conv2", nn.Conv2d(c1, c2, k, padding=k // 2)),
                ("relu2", nn.ReLU()),
                ("pool2", nn.MaxPool2d(2)),  # (B, c2, S/4, S/4)
                ("flatten", nn.Flatten()),
                ("fc", nn.Linear(c2 * side * side, cfg.latent_dim)),
                ("relu3", nn.ReLU()),  # (B, latent_dim)
            ]
        )
        return nn.Sequential(layers), cfg.latent_dim


class MLPConfig(ClassifierConfig):
    """Options of the multi-layer perceptron."""

    hidden: tuple[int, ...] = Field(
        default=MLP_HIDDEN,
        min_length=1,
        description="Widths of the hidden layers; the last one is the latent width.",
    )

    @field_validator("hidden")
    @classmethod
    def _check_hidden(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(h < 1 for h in value):
            raise ValueError(f"hidden widths must be positive, got {value}")
        return value


class MLP(Classifier):
    """Multi-layer perceptron: flatten -> (Linear -> ReLU) per hidden width -> head.

    ``features`` ends with the last hidden layer's ReLU; ``head`` = Linear(last hidden,
    num_classes). Parameters with hidden (200, 200) and 10 classes: 199,210 at 1x28x28;
    656,810 at 3x32x32.
    """

    architecture = "mlp"
    config_type = MLPConfig
    config: MLPConfig

    def __init__(self, config: MLPConfig | None = None) -> None:
        super().__init__(config if config is not None else MLPConfig())

    def _build_features(self) -> tuple[nn.Module, int]:
        cfg = self.config
        width = cfg.in_channels * cfg.image_size * cfg.image_size
        layers: OrderedDict[str, nn.Module] = OrderedDict([("flatten", nn.Flatten())])
        for i, hidden in enumerate(cfg.hidden, start=1):
            layers[f"fc{i}"] = nn.Linear(width, hidden)
            layers[f"relu{i}"] = nn.ReLU()
            width = hidden
        return nn.Sequential(layers), width
