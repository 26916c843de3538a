"""Which torch device a ``--device``-style setting names."""

from __future__ import annotations

import torch

from models.errors import ModelConfigError

__all__ = ["resolve_device"]


def resolve_device(name: str, flag: str = "--device") -> torch.device:
    """``"auto"`` (CUDA when torch sees a GPU, else the CPU), ``"cpu"`` or ``"cuda"``.

    Args:
        name: the setting's value.
        flag: the setting's name, for the error message.

    Raises:
        ModelConfigError: an unknown name, or ``"cuda"`` without a usable GPU.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ModelConfigError(f"{flag} cuda: this torch build sees no usable GPU")
        return torch.device("cuda")
    raise ModelConfigError(f"unknown device {name!r}: give auto, cpu or cuda")
