"""DENSE's settings (:mod:`coordinator.strategies.dense`), light to import.

:class:`DenseSettings` sizes the server step (the generator and student phases; FedDF
with generated images runs the same generator phase); :class:`DenseOptions` holds the
``dense_*`` fleet settings that override three of its fields, and DENSE's own defaults
for the shared ones: a one-shot run is one round of every device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from pydantic import Field

from coordinator.strategies.options import Scalar, StrategyOptions

__all__ = ["DenseOptions", "DenseSettings"]


@dataclass(frozen=True)
class DenseSettings:
    """How the server generates and distils: DENSE's loss weights (1 each); far fewer
    steps and a narrower generator than the paper's 200 epochs on a GPU, sized for a
    2-core CPU server. Measured there on one core (five LeNet-5 teachers of non-IID
    synthetic data, one LeNet-5 student): about 90 s, each generator step about 0.3 s
    and each student step 0.03 s; the student reached 67% test accuracy where the
    ensemble had 71% (the generator learning rate is 10x the authors', for the few
    steps)."""

    epochs: int = 20
    """Alternations of a generator phase and a student phase."""
    generator_steps: int = 10
    """Generator Adam steps per epoch."""
    student_steps: int = 20
    """Student Adam steps per epoch (each student)."""
    batch_size: int = 128
    """Generated images per step, both phases."""
    noise_dim: int = 100
    """Width of the generator's noise z."""
    generator_width: int = 16
    """The image generator's ``base_channels`` (its last stage; earlier ones 2x)."""
    generator_lr: float = 1e-2
    """Adam learning rate of the generator and its noise (betas 0.5, 0.999 as DENSE's)."""
    student_lr: float = 1e-3
    """Student Adam learning rate."""
    ce_weight: float = 1.0
    """Weight of the ensemble's cross entropy to the sampled labels."""
    bn_weight: float = 1.0
    """Weight of the BatchNorm statistic matching (zero without BatchNorm teachers)."""
    adv_weight: float = 1.0
    """Weight of the boundary-support (adversarial) term."""
    temperature: float = 1.0
    """Softmax temperature of the student's distillation loss."""
    memory_batches: int = 10
    """Generated batches kept for the student (the oldest goes first)."""
    extra_batches: int = 0
    """Batches drawn from the generator each epoch beside its optimised one, from fresh
    noise and without a step, labelled by the ensemble and kept in the memory (which
    must then be larger): more varied samples for the student at the cost of the
    ensemble's forward passes only. 0: none (DENSE)."""
    eval_size: int = 256
    """Held-out generated images on which the result's KL is measured."""
    hard_steps: int = 0
    """Steps of sign-gradient ascent that move each epoch's generated batch towards where
    the students disagree most with the ensemble (KL), kept beside it in the memory: hard
    samples near the ensemble's decision boundaries. 0: none (DENSE)."""
    hard_epsilon: float = 0.1
    """How far hard samples move from their generated batch, in total (max norm; images
    stay in [0, 1])."""
    start_from_average: bool = False
    """Start each group's student from the sample-weighted average of the group's
    uploads (one-shot FedAvg, as FedDF starts) instead of the run seed's untrained
    weights (DENSE): the average already holds features of the devices' real data,
    which samples of a generator can only approximate."""
    smoothness_weight: float = 0.0
    """Weight of the smoothness prior on generated samples
    (:func:`~coordinator.strategies.sample_generation.total_variation`): neighbouring
    pixels (time steps of a series) alike, as in the devices' data. Teachers without
    BatchNorm (LeNet-5) give the generator no other prior on what their data looked
    like. 0: none (DENSE)."""


_DEFAULTS = DenseSettings()


class DenseOptions(StrategyOptions):
    """The fleet settings only DENSE reads, and its defaults for the shared ones."""

    strategy_name = "dense"
    fleet_defaults: ClassVar[Mapping[str, Scalar]] = {"rounds": 1, "participation": 1.0}

    dense_epochs: int = Field(default=_DEFAULTS.epochs, ge=1)
    """dense, oneshot: alternations of a generator phase and a student phase on the
    server (more: closer students, proportionally more server time); oneshot's default
    is 80."""
    dense_generator_steps: int = Field(default=_DEFAULTS.generator_steps, ge=1)
    """dense, oneshot: generator Adam steps per epoch."""
    dense_student_steps: int = Field(default=_DEFAULTS.student_steps, ge=1)
    """dense, oneshot: student Adam steps per epoch; oneshot's default is 40."""
