"""FedAvg's device side: plain local SGD from the received weights.

From "Communication-Efficient Learning of Deep Networks from Decentralized Data"
(McMahan et al.). The model comes as ``"global"`` (full sharing) or ``"head"``
(head-only sharing: the device keeps its own features); the device trains it with the
one loop, no extra term (its batched form is the plain cross-entropy), and uploads the
full state or the head alone.
"""

from __future__ import annotations

from edge_client.train.strategies.strategy import FullOrHeadSharing

__all__ = ["FedAvg"]


class FedAvg(FullOrHeadSharing):
    """FedAvg: plain local SGD from the global weights (or the global head, with the
    device's own features, in head-only sharing)."""

    name = "fedavg"
