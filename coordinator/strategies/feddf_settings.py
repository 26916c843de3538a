"""FedDF's settings (:mod:`coordinator.strategies.feddf`), light to import.

:class:`DistillSettings` sizes the distillation, :class:`GeneratedSettings` the images
generated with ``distill_data generator``; :class:`FedDFOptions` holds the fleet
settings (``drop_worst``, ``distill_*``) that set them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field

from coordinator.strategies.dense_settings import DenseSettings
from coordinator.strategies.options import StrategyOptions

__all__ = ["DistillSettings", "FedDFOptions", "GeneratedSettings"]


@dataclass(frozen=True)
class DistillSettings:
    """How a student is distilled from the ensemble (defaults after the FedDF paper's
    Adam with learning rate 1e-3, scaled down in steps for small servers)."""

    max_steps: int = 500
    """Most Adam steps per student and round."""
    batch_size: int = 64
    """Proxy images per step."""
    lr: float = 1e-3
    """Adam learning rate."""
    temperature: float = 1.0
    """Softmax temperature of teacher and student."""
    eval_every: int = 25
    """Steps between measurements of the held-out KL."""
    patience: int = 4
    """Measurements without improvement before stopping."""
    holdout: float = 0.2
    """Share of the proxy images held out for early stopping (and drop-worst)."""


@dataclass(frozen=True)
class GeneratedSettings:
    """How FedDF generates its distillation images."""

    batches: int = 8
    """Generated batches per round, each from its own generator phase (1,024 images of
    DENSE's batch of 128)."""
    dense: DenseSettings = field(default_factory=DenseSettings)
    """The generator phase's settings: ``generator_steps`` per batch, ``batch_size``,
    noise and generator widths, learning rate and loss weights (DENSE's defaults)."""


_DISTILL = DistillSettings()
_GENERATED = GeneratedSettings()


class FedDFOptions(StrategyOptions):
    """The fleet settings only FedDF reads."""

    strategy_name = "feddf"

    drop_worst: bool = False
    """feddf: leave out of the ensemble the teachers no better than chance on the
    held-out proxy images (their predictions agree with the ensemble's on at most
    1 / classes of them); the log names them."""
    distill_steps: int = Field(default=_DISTILL.max_steps, ge=1)
    """feddf: most Adam steps of server-side distillation per group and round (it stops
    earlier when the held-out KL stops improving)."""
    distill_batch_size: int = Field(default=_DISTILL.batch_size, ge=1)
    """feddf: proxy images per distillation step."""
    distill_lr: float = Field(default=_DISTILL.lr, gt=0, allow_inf_nan=False)
    """feddf: Adam learning rate of the distillation."""
    distill_temperature: float = Field(default=_DISTILL.temperature, gt=0, allow_inf_nan=False)
    """feddf: softmax temperature of teachers and student."""
    distill_patience: int = Field(default=_DISTILL.patience, ge=1)
    """feddf: held-out measurements (one every 25 steps) without improvement before the
    distillation stops."""
    distill_data: Literal["proxy", "generator"] = "proxy"
    """feddf: what the server distils on: ``proxy``, the run's unlabeled proxy images
    (``proxy_data``, required), or ``generator``, images of an image generator trained
    each round against the round's ensemble (DENSE's generator phase; no proxy data,
    which is then refused)."""
    distill_generator_batches: int = Field(default=_GENERATED.batches, ge=1)
    """feddf with distill_data generator: generated batches (of 128 images, each from
    its own generator phase) per round, a fifth of the images held out for early
    stopping and drop-worst."""
    distill_generator_steps: int = Field(default=_GENERATED.dense.generator_steps, ge=1)
    """feddf with distill_data generator: generator Adam steps per generated batch."""
