"""DENSE's device side: as FedAvg's with full sharing (``"global"``, required), once.

From "DENSE: Data-Free One-Shot Federated Learning": each device trains once and
uploads once; the server distils the ensemble of the uploads into a fresh model on
images of its own generator.
"""

from __future__ import annotations

from edge_client.train.strategies.strategy import DeviceStrategy

__all__ = ["Dense"]


class Dense(DeviceStrategy):
    """DENSE: devices train once as in FedAvg and upload once; the server distils the
    ensemble of the uploads into a fresh model on images of its own generator."""

    name = "dense"
