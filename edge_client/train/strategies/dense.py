"""DENSE's device side: as FedAvg's with full sharing (``"global"``, required), once.

From "DENSE: Data-Free One-Shot Federated Learning": each device trains once and
uploads once; the server distils the ensemble of the uploads into a fresh model on
images of its own generator.
"""

from __future__ import annotations

from edge_client.train.strategies.strategy import DeviceStrategy

__all__ = ["Dense", "OneShot"]


class Dense(DeviceStrategy):
    """DENSE: devices train once as in FedAvg and upload once; the server distils the
    ensemble of the uploads into a fresh model on images of its own generator."""

    name = "dense"


class OneShot(Dense):
    """oneshot (:mod:`coordinator.strategies.oneshot`): DENSE's device side; the label
    counts the server weighs the upload by go with it when the task asks and the device
    consents, as every strategy's uploads do."""

    name = "oneshot"
