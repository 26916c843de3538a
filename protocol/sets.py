"""Names of the tensor sets that ``model`` and ``update`` messages carry.

Both ends of the wire use these names (the coordinator's strategies send and accept
them, the edge client's strategies read and upload them); docs/protocol.md section 9
lists which strategy sends which.

=================  ======================================================================
set                contents
=================  ======================================================================
``global``         the global model's full state (FedAvg, FedProx, FedAvg (OCA), FedGen);
                   also the fleet's final model on ``fl/{fleet}/broadcast/model``
``student``        FedKF: the ACA model's full state
``teacher``        FedKF dual downlink: the OCA model's full state
``head``           head-only sharing: the ``head.*`` tensors of the global model
``generator``      FedGen: the latent generator's full state (BatchNorm buffers included)
``prior``          FedGen: one tensor :data:`PRIOR_TENSOR`, float32 ``(classes,)``
``weights``        an update: the device's trained state (all tensors, or the head)
=================  ======================================================================
"""

from __future__ import annotations

__all__ = [
    "GENERATOR_SET",
    "GLOBAL_SET",
    "HEAD_SET",
    "PRIOR_SET",
    "PRIOR_TENSOR",
    "STUDENT_SET",
    "TEACHER_SET",
    "WEIGHTS_SET",
]

GLOBAL_SET = "global"
STUDENT_SET = "student"
TEACHER_SET = "teacher"
HEAD_SET = "head"
GENERATOR_SET = "generator"
PRIOR_SET = "prior"
PRIOR_TENSOR = "label_prior"
"""The one tensor of the ``prior`` set: class probabilities summing to 1."""
WEIGHTS_SET = "weights"
