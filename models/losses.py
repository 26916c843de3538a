"""Loss functions of the data-free distillation algorithms (FedKF, DAFL, FedDF).

Pure torch functions of logits and features; no modules, no state, no I/O. Each takes
one batch, ``(B, C)``, or a batch per model with leading axes, ``(..., B, C)`` (the sim's
cohort engine: one batch per emulated device), and then returns one value per model.
Notation: ``B`` samples per batch, ``C`` classes, ``p_i = softmax(z_i)`` the predicted class
distribution of sample ``i`` with logits ``z_i``; ``ln`` is the natural logarithm.

- :func:`information_entropy_loss`: ``sum_c pbar_c ln pbar_c`` with ``pbar = mean_i p_i``;
- :func:`one_hot_loss`: ``mean_i CE(z_i, argmax_c z_ic)``;
- :func:`activation_loss`: ``-mean |f|`` over all feature elements;
- :func:`fedkf_generator_loss`: ``L_IE + lambda1 * L_OH + lambda2 * L_A``;
- :func:`distillation_kl`: ``T^2 mean_i KL(softmax(t_i / T) || softmax(s_i / T))``.

The first three are the losses of DAFL (Chen et al., "Data-Free Learning of Student
Networks", 2019) that FedKF's local generator minimises (Algorithm 1 of "Handling Data
Heterogeneity in Federated Learning via Knowledge Distillation and Fusion").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

__all__ = [
    "activation_loss",
    "distillation_kl",
    "fedkf_generator_loss",
    "fedkf_generator_objective",
    "information_entropy_loss",
    "one_hot_loss",
]

_LOG_EPS = 1e-12
"""Lower clamp of probabilities inside a logarithm (keeps ``0 ln 0`` at 0, not NaN)."""


def information_entropy_loss(logits: torch.Tensor) -> torch.Tensor:
    """Negative entropy of the batch's mean prediction: ``sum_c pbar_c ln pbar_c``.

    ``pbar = (1 / B) sum_i softmax(z_i)`` is the mean predicted class distribution.
    The value lies in ``[-ln C, 0]``: ``-ln C`` when ``pbar`` is uniform (the batch
    covers every class equally), 0 when every sample goes to the same class. Minimising
    it therefore balances the classes of generated samples.

    Args:
        logits: ``(..., B, C)`` logits, ``B >= 1``.

    Returns:
        ``(...)``: a scalar tensor for one batch (differentiable in ``logits``).
    """
    mean_prob = F.softmax(logits, dim=-1).mean(dim=-2)  # (..., C)
    return (mean_prob * torch.log(mean_prob.clamp_min(_LOG_EPS))).sum(dim=-1)


def one_hot_loss(logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits against their own arg-max labels, mean over the batch.

    ``(1 / B) sum_i -ln softmax(z_i)[argmax_c z_ic]``: small when each sample is
    classified confidently (its prediction is close to a one-hot vector).

    Args:
        logits: ``(..., B, C)`` logits.

    Returns:
        ``(...)``: a scalar tensor for one batch (differentiable in ``logits``; the
        arg-max labels are constants).
    """
    pseudo_labels = logits.detach().argmax(dim=-1, keepdim=True)  # (..., B, 1)
    picked = F.log_softmax(logits, dim=-1).gather(-1, pseudo_labels).squeeze(-1)
    return -picked.mean(dim=-1)


def activation_loss(features: torch.Tensor, leading: int = 0) -> torch.Tensor:
    """Negative mean absolute activation: ``-(1 / n) sum_k |f_k|`` over all ``n`` elements
    of a batch.

    DAFL's activation loss (the negative L1 norm per element): minimising it makes the
    features respond strongly, as they do on real samples.

    Args:
        features: the teacher's features of any shape, e.g. ``(B, latent_dim)``, after
            ``leading`` axes of models.
        leading: the axes before the batch's (one value per model is returned).

    Returns:
        ``features.shape[:leading]`` values ``<= 0`` (a scalar tensor for one batch).
    """
    return -features.abs().flatten(leading).mean(dim=-1)


def fedkf_generator_objective(
    logits: torch.Tensor, features: torch.Tensor, lambda1: float, lambda2: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FedKF's generator objective ``L_G = L_IE + lambda1 * L_OH + lambda2 * L_A`` and its
    unweighted parts, all as tensors (no host synchronisation), one value per model for a
    batch per model.

    Args:
        logits: the teacher's logits of the generated batch, ``(..., B, C)``.
        features: the teacher's features of the same batch, ``(..., B, latent_dim)``;
            the logits are ``head(features)``.
        lambda1: weight of :func:`one_hot_loss`.
        lambda2: weight of :func:`activation_loss`.

    Returns:
        ``(total, entropy, one_hot, activation)``: ``L_G`` (differentiable), then L_IE,
        L_OH and L_A; each a scalar for one batch, ``(...)`` for a batch per model.
    """
    entropy = information_entropy_loss(logits)
    one_hot = one_hot_loss(logits)
    activation = activation_loss(features, leading=logits.dim() - 2)
    total = entropy + lambda1 * one_hot + lambda2 * activation
    return total, entropy, one_hot, activation


def fedkf_generator_loss(
    logits: torch.Tensor, features: torch.Tensor, lambda1: float, lambda2: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """:func:`fedkf_generator_objective` with its parts as floats.

    Returns:
        ``(total, parts)``: the scalar ``L_G`` (differentiable) and the unweighted parts
        as floats under ``"entropy"`` (L_IE), ``"one_hot"`` (L_OH) and ``"activation"``
        (L_A).
    """
    total, entropy, one_hot, activation = fedkf_generator_objective(
        logits, features, lambda1, lambda2
    )
    parts = {
        "entropy": float(entropy.detach()),
        "one_hot": float(one_hot.detach()),
        "activation": float(activation.detach()),
    }
    return total, parts


def distillation_kl(
    teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Knowledge-distillation loss ``T^2 (1 / B) sum_i KL(p_i^t || p_i^s)``.

    ``p^t = softmax(t / T)`` and ``p^s = softmax(s / T)``; ``KL(p || q) = sum_c p_c (ln
    p_c - ln q_c)``, summed over classes and averaged over the batch ("batchmean"). The
    ``T^2`` factor keeps gradient magnitudes comparable across temperatures (Hinton et
    al., 2015). The teacher is a constant: no gradient flows into ``teacher_logits``.

    Args:
        teacher_logits: ``(..., B, C)``.
        student_logits: ``(..., B, C)``.
        temperature: ``T > 0``.

    Returns:
        ``(...)`` values ``>= 0`` (a scalar tensor for one batch), zero where the two
        distributions are equal.

    Raises:
        ValueError: ``temperature`` is not positive, or the shapes differ.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"teacher and student logits differ in shape: {tuple(teacher_logits.shape)} "
            f"!= {tuple(student_logits.shape)}"
        )
    log_teacher = F.log_softmax(teacher_logits.detach() / temperature, dim=-1)  # (..., B, C)
    log_student = F.log_softmax(student_logits / temperature, dim=-1)  # (..., B, C)
    kl = (log_teacher.exp() * (log_teacher - log_student)).sum(dim=-1).mean(dim=-1)
    return kl * temperature**2
