"""FedGen's device side: the coordinator's latent generator regularises the local head.

From "Data-Free Knowledge Distillation for Heterogeneous Federated Learning" (FedGen),
Eq. 5 and Algorithm 1. The coordinator learns a conditional generator ``G(eps, y)`` over
the classifiers' latent space (``features`` output) and sends it with the label prior
``p(y)``; each device then minimises, per mini-batch ``(x, y)``,

    CE(model(x), y) + alpha_t * CE(head(G(eps, y_g)), y_g),
    y_g ~ Categorical(p(y)), eps ~ N(0, I),

so the generated latents carry the other devices' knowledge of each class into the
local head. ``alpha_t`` (``TrainConfig.generative_alpha``) is the round's weight; the
coordinator applies the decay and sends the value. G is used frozen, in evaluation mode
(its BatchNorm uses the received running statistics); no gradient reaches it.

The term is added by :class:`FedGenHook` in the one training loop and by the hook's
batched form in the sim's batched engine, both on latents from the hook's
:meth:`FedGenHook.sample_latents`.

Sets (:class:`FedGen`): exactly one of ``"global"`` (full sharing) and ``"head"``
(head-only sharing: the features stay the device's own); ``"generator"`` (absent: plain
CE) and ``"prior"`` (absent: uniform) optional. Uploads the full state or the head alone.

Pure: the generated labels and noise come from a ``torch.Generator`` seeded from
``TrainConfig.seed``, drawn on the CPU (a seed gives the same samples on every device),
separate from the loop's shuffling generator.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from edge_client.errors import TaskError
from edge_client.train.batched import BatchedHook, StackedTerm, Tensors, unprefixed
from edge_client.train.strategies.strategy import (
    FullOrHeadSharing,
    SetSpec,
    as_classifier,
    from_set,
)
from edge_client.train.task import ReceivedSets
from edge_client.train.training import TrainConfig, TrainHook
from models import (
    Classifier,
    LatentGenerator,
    LatentGeneratorConfig,
    load_state_arrays,
    state_shapes,
)
from models.classifiers import HEAD_PREFIX
from models.stacked import StackedModule
from protocol.sets import GENERATOR_SET, PRIOR_SET, PRIOR_TENSOR

if TYPE_CHECKING:  # typing.Self is Python 3.11+; devices may run 3.10
    from typing import Self

__all__ = [
    "PRIOR_TOLERANCE",
    "FedGen",
    "FedGenHook",
    "label_prior",
    "latent_generator_shapes",
    "received_generator",
]

logger = logging.getLogger(__name__)

PRIOR_TOLERANCE = 1e-2
"""Largest accepted ``|sum(prior) - 1|`` (room for a lossy downlink precision); the
prior is renormalised before use."""


def _generator_config(model: Classifier, config: TrainConfig) -> LatentGeneratorConfig:
    """The configuration of the generator the coordinator trains for ``model``."""
    return LatentGeneratorConfig.for_classifier(
        model, noise_dim=config.generator_noise_dim, hidden_dim=config.generator_hidden
    )


def latent_generator_shapes(model: Classifier, config: TrainConfig) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of that generator's full state (BatchNorm buffers
    included), computed on the meta device: no memory, no random numbers used."""
    with torch.device("meta"):
        generator = LatentGenerator(_generator_config(model, config))
    return state_shapes(generator)


def received_generator(
    model: Classifier, config: TrainConfig, arrays: Mapping[str, npt.ArrayLike]
) -> LatentGenerator:
    """The received generator on the CPU, frozen (evaluation mode, no gradients).

    Built without initialising weights (every tensor comes from ``arrays``).

    Raises:
        StateMismatchError: ``arrays`` are not exactly its full state, or hold
            non-finite values.
    """
    with torch.device("meta"):
        generator = LatentGenerator(_generator_config(model, config))
    generator = generator.to_empty(device="cpu")
    load_state_arrays(generator, arrays)
    generator.eval()
    generator.requires_grad_(False)
    return generator


def label_prior(prior: npt.ArrayLike | None, num_classes: int) -> torch.Tensor:
    """The label prior as a float64 CPU tensor (num_classes,) that sums to 1.

    Args:
        prior: the received prior, or None for the uniform prior.
        num_classes: the classifier's classes.

    Raises:
        TaskError: the prior is not a finite, non-negative float vector of length
            ``num_classes`` whose sum is within :data:`PRIOR_TOLERANCE` of 1.
    """
    if prior is None:
        return torch.full((num_classes,), 1.0 / num_classes, dtype=torch.float64)
    values = np.asarray(prior)
    if values.shape != (num_classes,) or values.dtype.kind != "f":
        raise TaskError(
            f"label prior must be a float vector of shape ({num_classes},), "
            f"got {values.dtype} {values.shape}"
        )
    values = values.astype(np.float64)
    if not np.isfinite(values).all() or (values < 0).any():
        raise TaskError("label prior must be finite and non-negative")
    total = float(values.sum())
    if abs(total - 1.0) > PRIOR_TOLERANCE:
        raise TaskError(f"label prior must sum to 1, sums to {total:.6g}")
    return torch.from_numpy(values / total)


class FedGenHook(BatchedHook):
    """Adds ``alpha * CE(head(G(eps, y_g)), y_g)`` to every batch's loss.

    Metrics (:meth:`metrics`): ``generator_ce``, the mean unweighted cross-entropy of
    the head on the generated latents; none when no step was taken.
    """

    def __init__(
        self,
        model: Classifier,
        generator: LatentGenerator,
        prior: torch.Tensor,
        config: TrainConfig,
    ) -> None:
        """
        Args:
            model: the classifier being trained (its ``head`` gets the term).
            generator: the frozen received generator (see :func:`received_generator`);
                moved to the training device when training starts.
            prior: class probabilities (num_classes,) to draw ``y_g`` from (see
                :func:`label_prior`).
            config: the round's hyperparameters (``generative_alpha``,
                ``generator_batch_size``, ``batch_size``, ``seed``).

        Raises:
            ValueError: the generator's latents or labels do not fit the model.
        """
        if generator.latent_dim != model.latent_dim or generator.num_classes != model.num_classes:
            raise ValueError(
                f"generator (latent {generator.latent_dim}, {generator.num_classes} classes) "
                f"does not fit the model (latent {model.latent_dim}, {model.num_classes} classes)"
            )
        self.model = model
        self.generator = generator
        self.prior = prior.to(torch.float64)
        self.alpha = config.generative_alpha
        self.batch_size = config.generator_batch_size or config.batch_size
        self._noise = torch.Generator().manual_seed(config.seed)
        self._ce_sum = 0.0
        self._steps = 0

    def before_training(self, model: nn.Module) -> None:
        self.generator.to(next(model.parameters()).device)
        self.generator.eval()

    def sample_latents(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The next generated batch: latents ``G(eps, y_g)`` (Bg, latent_dim), without
        gradient, and their labels ``y_g`` (Bg,), on ``device``. Labels and noise are
        drawn from the hook's own generator, labels first."""
        labels = torch.multinomial(
            self.prior, self.batch_size, replacement=True, generator=self._noise
        )  # (Bg,)
        eps = torch.randn(self.batch_size, self.generator.noise_dim, generator=self._noise)
        labels = labels.to(device)
        with torch.no_grad():
            latents = self.generator(eps.to(device), labels)  # (Bg, latent_dim)
        return latents, labels

    def extra_loss(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor
    ) -> torch.Tensor | None:
        if self.alpha == 0:
            return None
        latents, labels = self.sample_latents(x.device)
        ce = F.cross_entropy(self.model.head(latents), labels)
        self._ce_sum += float(ce.detach())
        self._steps += 1
        return self.alpha * ce

    def metrics(self) -> dict[str, float]:
        if self._steps == 0:
            return {}
        return {"generator_ce": self._ce_sum / self._steps}

    @classmethod
    def stack(cls, hooks: Sequence[Self], device: torch.device) -> StackedTerm:
        return _StackedFedGen(hooks, device)


class _StackedFedGen(StackedTerm):
    """The batched form of :class:`FedGenHook`: each device's latents from its own
    hook's noise, and the head's cross-entropy on them."""

    def __init__(self, hooks: Sequence[FedGenHook], device: torch.device) -> None:
        super().__init__(len(hooks), device)
        self.hooks = list(hooks)
        self.device = device
        self.alpha = hooks[0].alpha
        self.head = StackedModule(hooks[0].model.head)

    def inputs(self, rows: Sequence[int], index: torch.Tensor | None, width: int) -> Tensors:
        """Each row's next latents and labels, from its own hook's noise (none when
        ``alpha`` is 0: the term is off, as in the loop)."""
        if self.alpha == 0:
            return {}
        drawn = [self.hooks[i].sample_latents(torch.device("cpu")) for i in rows]
        return {
            "latents": torch.stack([d[0] for d in drawn]).to(self.device),
            "labels": torch.stack([d[1] for d in drawn]).to(self.device),
        }

    def loss(
        self, model: StackedModule, point: Tensors, state: Tensors, inputs: Tensors
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not inputs:
            some = next(iter(state.values()))
            zero = torch.zeros(some.shape[0], device=some.device)
            return zero, zero
        logits = self.head(unprefixed(state, HEAD_PREFIX), inputs["latents"])  # (n, Bg, C)
        labels = inputs["labels"]
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        ce = ce.view(labels.shape).mean(dim=1)  # (n,)
        return self.alpha * ce, ce.detach()

    def metrics(self, row: int, steps: int) -> dict[str, float]:
        if self.alpha == 0:
            return {}
        return {"generator_ce": float(self.measured[row]) / steps}


class FedGen(FullOrHeadSharing):
    """FedGen: local CE plus the head's CE on latents of the coordinator's generator.

    Sets: exactly one of ``"global"`` (full sharing: loads the whole model) and
    ``"head"`` (head-only sharing: loads the head; the features stay the device's own);
    ``"generator"`` and ``"prior"`` optional. Uploads the full state or the head alone.
    """

    name = "fedgen"

    def expected_sets(self, model: nn.Module, config: TrainConfig) -> dict[str, SetSpec]:
        classifier = as_classifier(model, self.name)
        return {
            **super().expected_sets(model, config),
            GENERATOR_SET: SetSpec(latent_generator_shapes(classifier, config), False),
            PRIOR_SET: SetSpec({PRIOR_TENSOR: (classifier.num_classes,)}, required=False),
        }

    def check_sets(self, model: nn.Module, sets: ReceivedSets) -> None:
        super().check_sets(model, sets)
        prior = sets.get(PRIOR_SET)
        if prior is not None:
            label_prior(prior[PRIOR_TENSOR], as_classifier(model, self.name).num_classes)

    def prepare(
        self,
        model: nn.Module,
        sets: ReceivedSets,
        config: TrainConfig,
        state: MutableMapping[str, Any],
    ) -> tuple[TrainHook, ...]:
        classifier = as_classifier(model, self.name)
        # built first: a bad generator leaves the model unchanged
        generator = from_set(
            sets, GENERATOR_SET, lambda arrays: received_generator(classifier, config, arrays)
        )
        prior_set = sets.get(PRIOR_SET)
        prior = label_prior(
            None if prior_set is None else prior_set[PRIOR_TENSOR], classifier.num_classes
        )
        self.load_shared(model, sets)
        if generator is None or config.generative_alpha == 0:
            return ()
        return (FedGenHook(classifier, generator, prior, config),)
