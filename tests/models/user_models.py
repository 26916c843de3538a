"""Classifiers a user brings, defined outside the ``models`` registry: built by import
path (``tests.models.user_models:NAME``) in the tests of :mod:`models.imported`."""

from __future__ import annotations

import math

import torch
from torch import nn


class _Split(nn.Module):
    """A small CNN that declares its features and head."""

    def __init__(self, num_classes: int, input_shape: tuple[int, ...]) -> None:
        super().__init__()
        channels, side = input_shape[0], input_shape[-1]
        pooled = side // 7
        self.features = nn.Sequential(
            nn.Conv2d(channels, 4, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(7),
            nn.Flatten(),
        )
        self.head = nn.Linear(4 * pooled * pooled, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))  # type: ignore[no-any-return]


def build_split(*, num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    return _Split(num_classes, input_shape)


def build_flat(*, num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """An MLP that declares no split."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(math.prod(input_shape), 16), nn.ReLU(), nn.Linear(16, num_classes)
    )


def build_wrong_output(*, num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes + 1))


def build_not_a_module(*, num_classes: int, input_shape: tuple[int, ...]) -> object:
    return {"num_classes": num_classes}


class _ScaledSplit(_Split):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.head(self.features(x))  # type: ignore[no-any-return]


def build_scaled_split(*, num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """Declares features and head, but its forward is not head(features(x))."""
    return _ScaledSplit(num_classes, input_shape)


class _Stray(_Split):
    def __init__(self, num_classes: int, input_shape: tuple[int, ...]) -> None:
        super().__init__(num_classes, input_shape)
        self.temperature = nn.Parameter(torch.ones(()))


def build_stray(*, num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """Declares features and head, and has a parameter of neither."""
    return _Stray(num_classes, input_shape)


NOT_CALLABLE = 5


class _Series(nn.Module):
    """Series (T, C) to a class: a small MLP over the flattened window, split declared."""

    def __init__(self, num_classes: int, input_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Flatten(), nn.Linear(math.prod(input_shape), 16), nn.ReLU()
        )
        self.head = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))  # type: ignore[no-any-return]


def build_series(*, num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    return _Series(num_classes, input_shape)
