"""An emulated device's session, trainer spec and persistence, as a device's shell has them.

A device with a state dir (``state_dir/devices/ID`` in the sim) keeps what its real
shell keeps there (:mod:`edge_client.train.client_state`): the handled tasks and rounds
done, its trained model, and (through its :class:`TransferState`) the model it holds and
its uplink residual; a fleet built again on the same folders resumes from them.
"""

from __future__ import annotations

import logging
from typing import Any

from edge_client.config import ClientConfig
from edge_client.errors import ConfigError
from edge_client.train.client_state import (
    MODEL_FILE,
    STATE_FILE,
    SavedState,
    read_model,
    read_state,
    write_model,
    write_state,
)
from edge_client.train.data import DeviceData
from edge_client.train.session import DeviceSession
from edge_client.train.trainer import build_device_model
from edge_client.train.transfer import TransferState
from models import Classifier, state_arrays
from sim.fleet.trainer import FleetDevice

__all__ = ["build_device", "save_model", "save_state"]

logger = logging.getLogger(__name__)


def build_device(
    config: ClientConfig,
    data: DeviceData,
    memory_bytes: int,
    fingerprints: dict[tuple[Any, ...], str],
) -> tuple[FleetDevice, DeviceSession]:
    """A device's trainer spec and session, resumed from its state dir if it has one.

    Raises:
        ConfigError: its model cannot be built for its data, or its state dir cannot be
            created.
    """
    if config.state_dir is not None:
        try:
            config.state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create state dir {config.state_dir}: {exc}") from exc
    # the architecture fingerprint depends on the model, the classes and the image shape
    key = (config.model, data.num_classes, data.image_shape)
    if key not in fingerprints:
        fingerprints[key] = build_device_model(config, data).fingerprint()
    transfer = TransferState(config.state_dir, fsync=config.fsync_state)
    session = DeviceSession(
        config,
        fingerprint=fingerprints[key],
        num_samples=data.num_samples,
        label_counts=tuple(int(c) for c in data.label_counts()),
        memory_bytes=memory_bytes,
        held_base=transfer.held_fingerprint,
        saved=_read_state(config),
    )
    saved_model = None
    if session.restored and config.state_dir is not None:
        path = config.state_dir / MODEL_FILE
        if path.exists():
            try:
                saved_model = read_model(path)
            except (OSError, ValueError) as exc:
                logger.warning("ignored the saved model %s: %s", path, exc)
    return FleetDevice(config, data, transfer, saved_model), session


def _read_state(config: ClientConfig) -> SavedState | None:
    if config.state_dir is None:
        return None
    path = config.state_dir / STATE_FILE
    if not path.exists():
        return None
    try:
        return read_state(path)
    except (OSError, ValueError) as exc:  # ValidationError and JSONDecodeError too
        logger.warning("ignored the unreadable client state %s: %s", path, exc)
        return None


def save_state(config: ClientConfig, saved: SavedState) -> None:
    """Persist ``saved`` in the device's state dir, if it has one; failures are logged."""
    if config.state_dir is None:
        return
    path = config.state_dir / STATE_FILE
    try:
        write_state(path, saved, fsync=config.fsync_state)
    except OSError as exc:
        logger.warning("could not save the client state to %s: %s", path, exc)


def save_model(config: ClientConfig, model: Classifier) -> None:
    """Persist the device's trained model (before its update goes out), if it has a state
    dir; failures are logged."""
    if config.state_dir is None:
        return
    path = config.state_dir / MODEL_FILE
    try:
        write_model(path, state_arrays(model), fsync=config.fsync_state)
    except OSError as exc:
        logger.warning("%s: could not save the model to %s: %s", config.device_id, path, exc)
