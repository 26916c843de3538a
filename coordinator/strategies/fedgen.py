"""FedGen: the strategy, and its server step, the conditional latent generator trained
against the devices' heads.

FedGen (Zhu, Hong and Zhou, "Data-Free Knowledge Distillation for Heterogeneous
Federated Learning", ICML 2021) shares only each device's prediction head ``f_d`` (a
linear layer over the classifier's latent space) and its per-class label counts. Each
round the coordinator trains a generator ``G(eps, y)`` so that the *ensemble* of this
round's heads labels a generated latent as ``y`` (Algorithm 1, Eq. 4, section 3.3)::

    w[y, d]   = n_{d,y} / sum_d' n_{d',y}                  share of label y held by d
    p(y)      = sum_d n_{d,y} / sum_{d,c} n_{d,c}            aggregated label prior
    L_ens     = sum_d mean_b( w[y_b, d] * CE(f_d(G(eps_b, y_b)), y_b) )
    L_div     = exp(-mean_{i,j}( d_noise(i, j) * d_out(i, j) ))
    L         = ensemble_weight * L_ens + diversity_weight * L_div

with ``y_b ~ p(y)``, ``eps_b ~ N(0, I)``, ``d_noise`` the mean squared difference of two
noise vectors and ``d_out`` the mean absolute difference of the two latents they
produce. The diversity term keeps different noise from collapsing onto one latent per
label. Only the generator's parameters are updated; the heads stay frozen. Devices then
use the generator as an inductive bias: they fit their features to ``G(eps, y)`` samples.

Heads arrive as the ``dict[str, ndarray]`` a :class:`~models.classifiers.Classifier`'s
``"head"`` subset produces (``"head.weight"`` of shape ``(C, L)`` and ``"head.bias"``
of shape ``(C,)``). Since every classifier's head is one ``nn.Linear``, the heads are
stacked into one ``(D, C, L)`` tensor and applied together with one ``einsum``: no
scratch module is needed and the cost of a step barely depends on the number of heads.

Defaults (:class:`GeneratorTraining`): 50 Adam steps of batch 32 at learning rate
3e-4 per round, both loss weights 1. They follow the paper's reference code (5 teacher
iterations x 10 epochs, ``gen_batch_size`` 32, ``ensemble_lr`` 3e-4, ``ensemble_alpha``
and ``ensemble_eta`` 1). Where that code differs, the choices here are ours:

- a fresh Adam optimiser each round, with no learning-rate decay, because the
  coordinator keeps only the generator's weights between rounds (the reference code keeps
  one optimiser and decays its rate by 0.98 per round);
- labels are drawn from the aggregated prior ``p(y)``, as in Eq. 4, rather than uniformly
  over the labels some device holds;
- no adversarial "student" term (the reference code's ``ensemble_beta`` is 0 too).

Everything here is pure: no I/O, and randomness only from a CPU ``torch.Generator`` the
caller seeds, so equal seeds and inputs give equal generators.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F  # noqa: N812

from coordinator.config import CoordinatorConfig
from coordinator.context import ServerContext
from coordinator.errors import ConfigError
from coordinator.groups import GroupModels
from coordinator.strategies.base import (
    Aggregated,
    AggregateResult,
    Array,
    Arrays,
    Contribution,
    NothingToAggregate,
    Scalar,
    Strategy,
    head_of,
)
from models import Classifier, LatentGeneratorConfig, state_arrays
from models import load_state_arrays as load_arrays
from models.classifiers import HEAD_PREFIX
from models.generators import LatentGenerator
from models.optim import Adam
from protocol.messages import Hello, UploadSpec
from protocol.sets import GENERATOR_SET, PRIOR_SET, PRIOR_TENSOR

__all__ = [
    "FedGen",
    "GeneratorTraining",
    "diversity_loss",
    "ensemble_accuracy",
    "label_prior",
    "label_weights",
    "train_latent_generator",
]

HeadArrays = Mapping[str, npt.ArrayLike]
"""One device's head state: ``"head.weight"`` ``(C, L)`` and ``"head.bias"`` ``(C,)``."""

HEAD_WEIGHT = HEAD_PREFIX + "weight"
HEAD_BIAS = HEAD_PREFIX + "bias"
_STAT_WINDOW = 5  # steps averaged into the "first" and "last" statistics


@dataclass(frozen=True)
class GeneratorTraining:
    """How the coordinator trains the latent generator each round.

    Raises:
        ConfigError: (also ``ValueError``) a field is out of range.
    """

    steps: int = 50
    """Adam steps per round (the reference code: 5 iterations x 10 epochs)."""
    batch_size: int = 32
    """Pairs ``(eps, y)`` per step; at least 2 (BatchNorm and the diversity loss need pairs)."""
    lr: float = 3e-4
    """Adam learning rate; a fresh optimiser is made each round."""
    diversity_weight: float = 1.0
    """Weight of the diversity loss (the reference code's ``ensemble_eta``)."""
    ensemble_weight: float = 1.0
    """Weight of the label-weighted ensemble cross-entropy (``ensemble_alpha``)."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"steps must be at least 1, got {self.steps}")
        if self.batch_size < 2:
            raise ConfigError(f"batch_size must be at least 2, got {self.batch_size}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"lr must be positive and finite, got {self.lr}")
        for name in ("diversity_weight", "ensemble_weight"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must be non-negative and finite, got {value}")
        if self.ensemble_weight == 0 and self.diversity_weight == 0:
            raise ConfigError("ensemble_weight and diversity_weight cannot both be 0")


def diversity_loss(noise: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """FedGen's diversity loss of a batch, a scalar in ``(0, 1]``.

    With ``d_noise(i, j) = mean_k (eps_ik - eps_jk)^2`` and
    ``d_out(i, j) = mean_k |out_ik - out_jk|`` over all ordered pairs (``(B, B)`` each)::

        loss = exp(-mean_{i,j} d_noise(i, j) * d_out(i, j))

    It is small when samples from distant noise lie far apart, so minimising it spreads
    the outputs out. Gradients flow into both arguments.

    Args:
        noise: the noise ``(B, noise_dim)`` the outputs were generated from.
        outputs: the generated samples ``(B, ...)``; trailing dimensions are flattened.

    Raises:
        ValueError: the batch sizes differ or ``noise`` is not two-dimensional.
    """
    if noise.dim() != 2 or outputs.dim() < 2 or outputs.shape[0] != noise.shape[0]:
        raise ValueError(
            f"expected noise (B, N) and outputs (B, ...), "
            f"got {tuple(noise.shape)} and {tuple(outputs.shape)}"
        )
    flat = outputs.reshape(outputs.shape[0], -1)  # (B, F)
    d_out = (flat[:, None, :] - flat[None, :, :]).abs().mean(dim=2)  # (B, B)
    d_noise = (noise[:, None, :] - noise[None, :, :]).pow(2).mean(dim=2)  # (B, B)
    return torch.exp(-(d_noise * d_out).mean())


def _counts_array(label_counts: npt.ArrayLike) -> npt.NDArray[np.float64]:
    counts = np.asarray(label_counts, dtype=np.float64)
    if counts.ndim != 2 or counts.shape[0] < 1 or counts.shape[1] < 1:
        raise ValueError(f"label counts must be (devices, classes), got shape {counts.shape}")
    if not np.isfinite(counts).all() or (counts < 0).any():
        raise ValueError("label counts must be finite and non-negative")
    return counts


def label_weights(label_counts: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """``w[c, d]``: the share of label ``c``'s samples that device ``d`` holds, ``(C, D)``.

    ``label_counts`` is ``(D, C)``: samples per device and class. Each column of counts is
    normalised over devices; a label no device holds gets weight 0 everywhere.

    Raises:
        ValueError: the counts are not two-dimensional, finite and non-negative.
    """
    counts = _counts_array(label_counts)  # (D, C)
    totals: npt.NDArray[np.float64] = counts.sum(axis=0)  # (C,)
    shares = np.zeros_like(counts)
    np.divide(counts, totals, out=shares, where=totals > 0)
    return shares.T.astype(np.float32)  # (C, D)


def label_prior(label_counts: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """The aggregated label distribution ``p(c)``, ``(C,)``, summing to 1.

    Raises:
        ValueError: the counts are not ``(D, C)``, finite and non-negative, or all zero.
    """
    totals: npt.NDArray[np.float64] = _counts_array(label_counts).sum(axis=0)  # (C,)
    if totals.sum() <= 0:
        raise ValueError("label counts are all zero: no label prior")
    prior: npt.NDArray[np.float32] = (totals / totals.sum()).astype(np.float32)
    return prior


def _stack_heads(
    heads: Sequence[HeadArrays], generator: LatentGenerator
) -> tuple[torch.Tensor, torch.Tensor]:
    """The heads as ``weights (D, C, L)`` and ``biases (D, C)`` on the generator's device."""
    classes, latent = generator.num_classes, generator.latent_dim
    weights: list[npt.NDArray[np.float32]] = []
    biases: list[npt.NDArray[np.float32]] = []
    for d, head in enumerate(heads):
        if set(head) != {HEAD_WEIGHT, HEAD_BIAS}:
            raise ValueError(
                f"head {d}: expected exactly {HEAD_WEIGHT!r} and {HEAD_BIAS!r}, got {sorted(head)}"
            )
        weight = np.asarray(head[HEAD_WEIGHT], dtype=np.float32)
        bias = np.asarray(head[HEAD_BIAS], dtype=np.float32)
        if weight.shape != (classes, latent) or bias.shape != (classes,):
            raise ValueError(
                f"head {d}: expected {HEAD_WEIGHT} {(classes, latent)} and {HEAD_BIAS} "
                f"{(classes,)} for the generator's classes and latent_dim, "
                f"got {weight.shape} and {bias.shape}"
            )
        if not (np.isfinite(weight).all() and np.isfinite(bias).all()):
            raise ValueError(f"head {d}: non-finite values")
        weights.append(weight)
        biases.append(bias)
    param = generator.out.weight
    stacked_weights = torch.from_numpy(np.stack(weights)).to(param.device, param.dtype)
    stacked_biases = torch.from_numpy(np.stack(biases)).to(param.device, param.dtype)
    return stacked_weights, stacked_biases


def _checked(
    generator: LatentGenerator, heads: Sequence[HeadArrays], label_counts: npt.ArrayLike
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate the inputs.

    Returns head ``weights (D, C, L)`` and ``biases (D, C)``, label shares ``w (C, D)``
    on the generator's device, and the label prior ``p (C,)`` on the CPU.
    """
    if len(heads) < 1:
        raise ValueError("need at least one head")
    counts = _counts_array(label_counts)
    if counts.shape != (len(heads), generator.num_classes):
        raise ValueError(
            f"label counts must be (heads, classes) = {(len(heads), generator.num_classes)}, "
            f"got {counts.shape}"
        )
    head_weights, head_biases = _stack_heads(heads, generator)
    param = generator.out.weight
    shares = torch.from_numpy(label_weights(counts)).to(param.device, param.dtype)
    prior = torch.from_numpy(label_prior(counts)).to(torch.float64)  # sampled on the CPU
    return head_weights, head_biases, shares, prior


def _head_logits(
    latents: torch.Tensor, weights: torch.Tensor, biases: torch.Tensor
) -> torch.Tensor:
    """Every head's logits ``(B, D, C)`` for latents ``(B, L)``."""
    return torch.einsum("bl,dcl->bdc", latents, weights) + biases


def _draw(
    generator: LatentGenerator, prior: torch.Tensor, batch: int, rng: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels ``y ~ prior`` ``(B,)`` and noise ``eps ~ N(0, I)`` ``(B, noise_dim)``.

    Drawn on the CPU, then moved, so a seed gives the same draws on every device.
    """
    y = torch.multinomial(prior, batch, replacement=True, generator=rng)
    eps = torch.randn(batch, generator.noise_dim, generator=rng, dtype=torch.float32)
    param = generator.out.weight
    return eps.to(param.device, param.dtype), y.to(param.device)


def train_latent_generator(
    generator: LatentGenerator,
    heads: Sequence[HeadArrays],
    label_counts: npt.ArrayLike,
    settings: GeneratorTraining | None = None,
    *,
    rng: torch.Generator,
) -> dict[str, float]:
    """Train ``generator`` in place so the label-weighted ensemble of ``heads`` labels its output.

    Each of ``settings.steps`` Adam steps draws ``y ~ label_prior(label_counts)`` and
    ``eps ~ N(0, I)`` (``batch_size`` of each, from ``rng``), computes
    ``latents = G(eps, y)`` in training mode and minimises
    ``ensemble_weight * L_ens + diversity_weight * L_div`` (see the module docstring) over
    the generator's parameters only. The heads are copied into frozen tensors; the
    arrays passed in are not changed. Runs on the generator's device and dtype; the
    generator's train/eval mode is restored afterwards.

    Args:
        generator: the generator to train; its BatchNorm statistics are updated too.
        heads: per device of this round, its head state (``"head.weight"`` ``(C, L)`` and
            ``"head.bias"`` ``(C,)``), e.g. ``state_arrays(model, "head")``.
        label_counts: per device (same order as ``heads``), its samples per class ``(D, C)``.
        settings: steps, batch size, learning rate and loss weights (defaults when None).
        rng: a CPU generator the draws of labels and noise come from (it advances).

    Returns:
        ``ensemble_loss_first`` / ``ensemble_loss_last``: the ensemble loss ``L_ens`` in
        nats, averaged over the first / last (up to) 5 steps; ``diversity_loss_last``:
        ``L_div`` averaged over the last 5 steps; ``steps``: the number of steps taken.

    Raises:
        ValueError: no heads; the counts are not ``(len(heads), num_classes)``, finite and
            non-negative, or are all zero; a head has other names, other shapes than the
            generator's ``(num_classes, latent_dim)``, or non-finite values.
    """
    settings = settings if settings is not None else GeneratorTraining()
    head_weights, head_biases, shares, prior = _checked(generator, heads, label_counts)
    optimizer = Adam(generator.parameters(), lr=settings.lr)
    ensemble_losses: list[float] = []
    diversity_losses: list[float] = []
    was_training = generator.training
    generator.train()
    try:
        for _ in range(settings.steps):
            eps, y = _draw(generator, prior, settings.batch_size, rng)
            latents = generator(eps, y)  # (B, L)
            logits = _head_logits(latents, head_weights, head_biases)  # (B, D, C)
            per_head = F.cross_entropy(
                logits.permute(0, 2, 1), y[:, None].expand(-1, logits.shape[1]), reduction="none"
            )  # (B, D)
            ensemble = (shares[y] * per_head).mean(dim=0).sum()
            diversity = diversity_loss(eps, latents)
            loss = settings.ensemble_weight * ensemble + settings.diversity_weight * diversity
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            ensemble_losses.append(float(ensemble.detach()))
            diversity_losses.append(float(diversity.detach()))
    finally:
        generator.train(was_training)
    window = min(_STAT_WINDOW, settings.steps)
    return {
        "ensemble_loss_first": float(np.mean(ensemble_losses[:window])),
        "ensemble_loss_last": float(np.mean(ensemble_losses[-window:])),
        "diversity_loss_last": float(np.mean(diversity_losses[-window:])),
        "steps": float(settings.steps),
    }


def ensemble_accuracy(
    generator: LatentGenerator,
    heads: Sequence[HeadArrays],
    label_counts: npt.ArrayLike,
    *,
    samples: int = 1024,
    seed: int = 0,
) -> float:
    """Fraction of generated latents that the label-weighted head ensemble classifies as ``y``.

    Draws ``samples`` pairs ``y ~ label_prior(label_counts)``, ``eps ~ N(0, I)``, runs
    ``G(eps, y)`` in eval mode (BatchNorm running statistics) without gradients, and
    predicts ``argmax_c sum_d w[y, d] * softmax(f_d(G(eps, y)))_c``. The generator's
    mode is restored afterwards. A measure of how well the generator has learned.

    Raises:
        ValueError: ``samples`` is below 1, or the inputs are invalid as for
            :func:`train_latent_generator`.
    """
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    head_weights, head_biases, shares, prior = _checked(generator, heads, label_counts)
    rng = torch.Generator().manual_seed(seed)
    was_training = generator.training
    generator.eval()
    try:
        with torch.no_grad():
            eps, y = _draw(generator, prior, samples, rng)
            probs = _head_logits(generator(eps, y), head_weights, head_biases).softmax(dim=2)
            mixed = (shares[y][:, :, None] * probs).sum(dim=1)  # (B, C)
            correct = (mixed.argmax(dim=1) == y).to(torch.float64).mean()
    finally:
        generator.train(was_training)
    return float(correct)


class FedGen(Strategy):
    """FedGen (data-free knowledge distillation): the module docstring says what the
    server trains.

    ``sharing full``: devices upload their whole model, the server averages it and sends
    it back as ``global``. ``sharing head``: devices upload only the prediction head
    (the feature extractor never leaves the device) and the server sends the averaged
    head as ``head``. Either way every update carries the device's label counts (which
    needs the device's consent in its hello), the server trains the latent generator
    against this round's heads and sends it with the label prior from round 2 on;
    devices weigh the generator term with ``alpha_t = generative_alpha *
    generative_alpha_decay ** (t - 1)``. Defaults from the paper: 20 local steps of
    batch 32. One architecture group: the generator lives in its latent space.
    """

    name = "fedgen"
    head_sharing = True
    needs_split = True
    training_defaults: ClassVar[Mapping[str, int]] = {"local_steps": 20, "batch_size": 32}
    generator_training = GeneratorTraining()

    def __init__(self, config: CoordinatorConfig, templates: Mapping[str, Classifier]) -> None:
        super().__init__(config, templates)
        if len(templates) != 1:
            raise ConfigError(f"strategy {self.name!r} runs one architecture, not {len(templates)}")
        (template,) = templates.values()
        self._generator_config = LatentGeneratorConfig.for_classifier(
            template,
            noise_dim=self.training.generator_noise_dim,
            hidden_dim=self.training.generator_hidden,
        )

    def task_settings(self, round_number: int) -> dict[str, Scalar]:
        t = self.training
        alpha = t.generative_alpha * t.generative_alpha_decay ** (round_number - 1)
        return {
            **super().task_settings(round_number),
            "generative_alpha": alpha,
            "generator_noise_dim": self._generator_config.noise_dim,
            "generator_hidden": self._generator_config.hidden_dim,
            **({"generator_batch_size": t.generator_batch_size} if t.generator_batch_size else {}),
        }

    def uplink(self) -> UploadSpec:
        return super().uplink().model_copy(update={"label_counts": True})

    def refuse(self, hello: Hello) -> str | None:
        if hello.share_label_counts:
            return None
        return (
            "fedgen needs the device's label counts (the server's generator is trained "
            "against them); the device did not consent: start it with --share-label-counts"
        )

    def downlink(self, models: Mapping[str, Arrays]) -> dict[str, Arrays]:
        sets = super().downlink(models)
        if GENERATOR_SET in models:
            sets[GENERATOR_SET] = models[GENERATOR_SET]
            sets[PRIOR_SET] = models[PRIOR_SET]
        return sets

    def aggregate(
        self,
        current: GroupModels,
        updates: Iterable[Contribution],
        round_number: int,
        context: ServerContext,
    ) -> AggregateResult:
        ((group, models),) = current.items()
        acc = self.accumulator()
        heads: list[dict[str, Array]] = []
        counts: list[tuple[int, ...]] = []
        for update in updates:
            acc.add(update.weights, update.num_samples)
            heads.append(head_of(update.weights))
            if update.label_counts is None:  # the engine checks; kept as a guard
                raise ValueError(f"update of {update.device_id} has no label counts")
            counts.append(update.label_counts)
        if acc.weight <= 0:
            return NothingToAggregate(f"no on-time update in round {round_number}")
        aca = self._merge(models, acc.mean())
        generator = self._generator(models).to(context.device)
        train_latent_generator(generator, heads, counts, self.generator_training, rng=context.rng)
        prior = label_prior(np.asarray(counts, dtype=np.int64))
        server = {
            "aca": aca,
            GENERATOR_SET: state_arrays(generator),
            PRIOR_SET: {PRIOR_TENSOR: prior.astype(np.float32)},
        }
        return Aggregated({group: server})

    def _generator(self, current: Mapping[str, Arrays]) -> LatentGenerator:
        """Last round's generator, or in round 1 a new one seeded by the run's seed."""
        if GENERATOR_SET in current:
            with torch.device("meta"):  # every tensor comes from the stored state
                generator = LatentGenerator(self._generator_config)
            generator = generator.to_empty(device="cpu")
            load_arrays(generator, current[GENERATOR_SET])
            return generator
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.config.seed)
            return LatentGenerator(self._generator_config)
