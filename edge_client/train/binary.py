"""Binarized-weights training (BinaryConnect): binary forward, float latent weights.

A device whose hello says it runs binary weights (``weight_format = "binary"``) computes
with :func:`~models.weight_formats.binarize` of every convolution and linear weight:
``sign(w) * mean|w|`` per output channel, one bit per weight plus one float per channel
(the FedDF paper's binarized local models, Lin et al. 2020, Table 4). Such a device is
trained as BinaryConnect (Courbariaux et al. 2015) trains:

1. the forward pass and ``backward()`` run at the binarized weights ``B(w)``, so the
   loss and accuracy :func:`~edge_client.train.training.train_local` reports are those of
   the model the device runs, and the gradient is ``dL/dB(w)``;
2. the optimizer applies that gradient to the float *latent* weights ``w`` (the
   straight-through estimator takes ``dB(w)/dw`` as the identity), so small updates
   accumulate until they flip a sign;
3. after every step the latent weights are clipped to ``[-LATENT_CLIP, LATENT_CLIP]``
   (:func:`clip_latent_`). Without the clip a weight the gradient keeps pushing one way
   grows without bound and no later gradient can flip its sign again; BinaryConnect
   clips to its binary levels, +-1. Ours are +-scale, a channel's mean magnitude; we
   keep BinaryConnect's fixed bound [-1, 1] (simple, identical in every trainer and per
   element, so batched and per-device training agree exactly): it is far above the
   magnitudes the classifiers' initialisations and learning rates give, so it only
   catches runaway weights, and a clipped weight still binarizes to its sign.

Steps 1 and 2 are :class:`~edge_client.train.qat.FakeQuantHook`'s with another rounding;
:class:`BinarizeHook` adds step 3. What travels (and what FedAvg averages) are the latent
float weights; the device runs, and the coordinator's FedDF takes its teacher at, their
binarized values. The task asks for it with the ``binarize`` hyperparameter, which
excludes ``qat``.

Pure: tensors in, tensors out; no I/O, no global state.
"""

from __future__ import annotations

import torch
from torch import nn

from edge_client.train.qat import FakeQuantHook
from models.weight_formats import binarize

__all__ = ["LATENT_CLIP", "BinarizeHook", "binarize", "clip_latent_"]

LATENT_CLIP = 1.0
"""Latent (float) weights of rank >= 2 stay within [-LATENT_CLIP, LATENT_CLIP]."""


def clip_latent_(weight: torch.Tensor) -> torch.Tensor:
    """Clip ``weight`` in place to ``[-LATENT_CLIP, LATENT_CLIP]``; returns it."""
    with torch.no_grad():
        return weight.clamp_(-LATENT_CLIP, LATENT_CLIP)


class BinarizeHook(FakeQuantHook):
    """Trains the float latent weights through their binarized values (BinaryConnect).

    Every trainable parameter of rank >= 2 is replaced by :func:`binarize` of itself in
    :meth:`before_batch` and restored in :meth:`before_step` (the straight-through
    estimator), and clipped by :func:`clip_latent_` in :meth:`after_step`. Place it
    where :class:`~edge_client.train.qat.FakeQuantHook` would go.
    """

    def run_value(self, weight: torch.Tensor) -> torch.Tensor:
        """The value the device runs ``weight`` at: :func:`binarize`."""
        return binarize(weight)

    def after_step(self, model: nn.Module) -> None:
        for p in model.parameters():
            if p.requires_grad and p.ndim >= 2:
                clip_latent_(p)
