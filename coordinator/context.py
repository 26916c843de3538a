"""What a strategy's server step runs with: :class:`ServerContext`.

Server-side training (FedGen's generator today) runs in the aggregation phase, off the
engine thread (:mod:`coordinator.aggregation_phase`). It gets everything outside its
inputs from the context: the torch device to train on, the unlabeled proxy data where the run
has some, and a random generator seeded by the run's seed and the round, so that an
aggregation re-run after a crash draws exactly what the first attempt drew.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from coordinator.config import ServerDevice
from coordinator.errors import ConfigError
from models.devices import resolve_device
from models.errors import ModelConfigError

__all__ = ["ServerContext", "aggregation_seed", "resolve_server_device"]


@dataclass(frozen=True)
class ServerContext:
    """The resources of one round's aggregation.

    A context belongs to one aggregation: its ``rng`` advances as the strategy draws.
    """

    device: torch.device
    """Where server-side training runs (models come and go as CPU numpy arrays)."""
    rng: torch.Generator
    """A CPU generator seeded with :func:`aggregation_seed`: every random draw of the
    server step comes from it (drawn on the CPU, then moved, so a seed gives the same
    draws on every device)."""
    proxy_data: torch.Tensor | None = None
    """Unlabeled proxy samples ``(N, *sample_shape)`` float32 for server-side
    distillation; None: the run has none."""
    held_out: tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]] | None = None
    """The run's labelled held-out set ``(x, y)``, float32 samples and int64 labels as
    :func:`~coordinator.evaluation.evaluate_accuracy` takes them (the coordinator's
    ``--eval-data``, the sim's test set), for what a server step measures and reports
    (never trained on); None: the run has none."""

    @classmethod
    def for_round(
        cls,
        device: torch.device,
        seed: int,
        round_number: int,
        proxy_data: torch.Tensor | None = None,
        held_out: tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]] | None = None,
    ) -> ServerContext:
        """The context of round ``round_number``'s aggregation in a run seeded ``seed``."""
        rng = torch.Generator().manual_seed(aggregation_seed(seed, round_number))
        return cls(device=device, rng=rng, proxy_data=proxy_data, held_out=held_out)


def aggregation_seed(seed: int, round_number: int) -> int:
    """The seed of round ``round_number``'s aggregation in a run seeded ``seed``."""
    return seed * 1_000_003 + round_number


def resolve_server_device(name: ServerDevice) -> torch.device:
    """``auto`` (CUDA where torch sees a GPU, else the CPU), ``cpu`` or ``cuda``.

    Raises:
        ConfigError: ``cuda`` without a usable GPU.
    """
    try:
        return resolve_device(name, "--server-device")
    except ModelConfigError as exc:
        raise ConfigError(str(exc)) from exc
