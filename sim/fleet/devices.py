"""An emulated device's session, trainer spec and state folder, as a device's shell has them.

A device with a state dir (``state_dir/devices/ID`` in the sim) keeps what its real
shell keeps there, in its :class:`~edge_client.train.client_state.DeviceStore`: the
handled tasks and rounds done, its trained model and the learning state saved with
it, and (through its
:class:`TransferState`) the model it holds and its uplink residual; a fleet built again
on the same folders resumes from them.
"""

from __future__ import annotations

from typing import Any

from edge_client.config import ClientConfig
from edge_client.train.client_state import DeviceStore
from edge_client.train.data import DeviceData
from edge_client.train.hello import ModelDescription
from edge_client.train.session import DeviceSession
from edge_client.train.trainer import build_device_model, describe_model
from edge_client.train.transfer import TransferState
from sim.fleet.trainer import FleetDevice

__all__ = ["build_device"]


def build_device(
    config: ClientConfig,
    data: DeviceData,
    memory_bytes: int,
    fingerprints: dict[tuple[Any, ...], tuple[str, ModelDescription]],
) -> tuple[FleetDevice, DeviceSession, DeviceStore | None]:
    """A device's trainer spec, session and state folder (None: it has none), resumed
    from that folder if it has one.

    Raises:
        ConfigError: its model cannot be built for its data, or its state dir cannot be
            created.
    """
    store = DeviceStore.of(config)
    # the architecture fingerprint (and the hello's description of the model) depends on
    # the model, the classes and the sample shape: one model built per kind
    key = (config.model, data.num_classes, data.sample_shape)
    if key not in fingerprints:
        model = build_device_model(config, data)
        fingerprints[key] = model.fingerprint(), describe_model(model)
    fingerprint, description = fingerprints[key]
    transfer = TransferState(config.state_dir, fsync=config.fsync_state)
    session = DeviceSession(
        config,
        fingerprint=fingerprint,
        model=description,
        num_samples=data.num_samples,
        label_counts=tuple(int(c) for c in data.label_counts()),
        memory_bytes=memory_bytes,
        held_base=transfer.held_fingerprint,
        saved=None if store is None else store.load_state(),
    )
    saved_model = saved_learning = None
    if session.restored and store is not None:
        saved_model = store.load_model()
        if saved_model is not None:
            saved_learning = store.load_learning_state(saved_model)
    return FleetDevice(config, data, transfer, saved_model, saved_learning), session, store
