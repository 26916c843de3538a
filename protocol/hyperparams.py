"""The training hyperparameters of a round task: one typed schema for both ends.

A :class:`~protocol.messages.RoundTask` carries its hyperparameters as a msgpack map of
scalars (docs/protocol.md, section 4). :class:`Hyperparameters` is the schema of that
map: the coordinator fills it (``Hyperparameters(...).to_wire()``), the edge client
validates the map it receives with it (unknown keys, wrong types and values out of range
are refused) and trains with the result. A key absent from the map takes the default
below.

:class:`LocalTraining` holds the settings that mean the same on both ends (learning
rate, momentum, the FedProx / FedKF / FedGen weights ...), so that their defaults exist
once: the coordinator's run settings (``coordinator.config.TrainingSettings``) extend it
with what only a run has (epochs left to the strategy, FedGen's alpha schedule),
:class:`Hyperparameters` with what only a task has (this round's alpha, the device's
shuffling seed).

Pydantic only (no torch): the coordinator and the device (train profile) both import it.
"""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["MAX_SEED", "Hyperparameters", "LocalTraining", "WireScalar"]

MAX_SEED = 2**64 - 1
"""Largest shuffling seed (an unsigned 64-bit integer on the wire)."""

WireScalar = bool | int | float | str
"""A value of the task's hyperparameters map."""

_NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class LocalTraining(BaseModel):
    """Training settings that mean the same in a run's configuration and in a task.

    Types are strict: an integer field rejects ``1.0`` and ``True``; a float field
    accepts integers. Unknown keys are rejected.
    """

    model_config = ConfigDict(
        frozen=True, extra="forbid", strict=True, use_attribute_docstrings=True
    )

    lr: float = Field(default=0.01, gt=0, allow_inf_nan=False)
    """Local SGD learning rate."""
    momentum: float = Field(default=0.9, ge=0, lt=1)
    """Local SGD momentum (the optimizer is fresh each round; 0: none)."""
    weight_decay: _NonNegFloat = 0.0
    """L2 penalty SGD adds to the gradient of every trainable parameter."""
    mu: _NonNegFloat = 0.01
    """FedProx: proximal weight, loss + mu/2 ||w - w_global||^2 (other strategies ignore it)."""
    gamma: _NonNegFloat = 1.0
    """FedKF: weight of the distillation term gamma * KL(teacher || student) on generated
    samples (0: no generator work, plain SGD on the student)."""
    lambda1: _NonNegFloat = 0.1
    """FedKF: weight of the one-hot loss in the generator objective L_G."""
    lambda2: _NonNegFloat = 0.1
    """FedKF: weight of the activation loss in the generator objective L_G."""
    generator_lr: float = Field(default=1e-3, gt=0, allow_inf_nan=False)
    """FedKF: Adam learning rate of the device's image generator."""
    generator_width: int = Field(default=16, ge=1)
    """FedKF: base channels of the device's image generator (64 is the DCGAN size, as
    the paper's)."""
    generator_every: int = Field(default=2, ge=1)
    """FedKF: the image generator takes one Adam step every this many local batches (1:
    before every batch, as the paper)."""
    sample_reuse: int = Field(default=4, ge=1)
    """FedKF: local batches that one generated batch and its teacher's logits serve (1: a
    fresh batch every step, as the paper); fewer generator and teacher forward passes."""
    generator_noise_dim: int = Field(default=0, ge=0)
    """Noise width of the generator; 0: the strategy's default (100 for FedKF's image
    generator, 32 for FedGen's latent generator)."""
    generator_hidden: int = Field(default=256, ge=1)
    """FedGen: hidden width of the latent generator (the coordinator's and the
    devices' must match)."""
    qat: bool = False
    """int8 quantization-aware training: weights of rank >= 2 are fake-quantized per
    output channel in every forward pass (matches the int8 ONNX model); a run asks it of
    the devices that run int8 weights (their hello says so, or they have an int8 link)."""


class Hyperparameters(LocalTraining):
    """The ``hyperparameters`` map of a round task (docs/protocol.md, section 4)."""

    local_epochs: int = Field(default=1, ge=0)
    """Passes over the local train set (used when ``local_steps`` is 0)."""
    local_steps: int = Field(default=0, ge=0)
    """When > 0: exactly this many mini-batches, cycling through reshuffled epochs,
    instead of ``local_epochs``."""
    batch_size: int = Field(default=32, ge=1)
    """Samples per mini-batch (the last batch of an epoch may be smaller)."""
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    """Seed of the device's shuffling (distinct per device and round); same seed, same
    batches."""
    generator_batch_size: int = Field(default=0, ge=0)
    """FedKF and FedGen: generated samples per generator step and per distillation (or
    generative) step; 0: ``batch_size``, as the papers (the coordinator sends FedKF's
    own default, 16)."""
    generative_alpha: _NonNegFloat = 0.0
    """FedGen: this round's weight alpha_t of CE(head(G(eps, y)), y) (the coordinator
    applies the decay schedule; 0: plain cross-entropy)."""
    binarize: bool = False
    """Binarized-weights training (BinaryConnect): weights of rank >= 2 are binarized per
    output channel, ``sign(w) * mean|w|``, in every forward pass and the float latent
    weights are clipped to [-1, 1] after every step; asked of the devices whose hello
    says they run binary weights. Excludes ``qat``."""

    @model_validator(mode="after")
    def _one_weight_format(self) -> Hyperparameters:
        if self.qat and self.binarize:
            raise ValueError(
                "qat and binarize exclude each other: a device runs its weights in int8 "
                "or binarized, not both"
            )
        return self

    def to_wire(self) -> dict[str, WireScalar]:
        """The task's map: the keys set on construction (absent ones take the defaults
        on the device)."""
        return self.model_dump(exclude_unset=True)

    def total_steps(self, num_samples: int) -> int:
        """Optimizer steps these settings make on ``num_samples`` samples (0 if none)."""
        if num_samples == 0:
            return 0
        if self.local_steps > 0:
            return self.local_steps
        return self.local_epochs * math.ceil(num_samples / self.batch_size)
