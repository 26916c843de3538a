"""What the bundle tests share: commands, one device's data and the ONNX template of the
fleet's model, and the coordinator of a one-round run that broadcasts its model.

Used by test_bundle.py (bundles for this machine's platform) and test_arm64.py (an
aarch64 bundle on an emulated Debian arm64 root).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from models import build_classifier
from models.onnx_template import export_template
from sim.partition import partition_dataset, save_device_file
from sim.synthetic import make_synthetic

ROOT = Path(__file__).resolve().parents[2]
SIDE, CLASSES = 8, 4
"""The fleet's model: an MLP classifying 8x8 one-channel images into 4 classes."""
MODEL = "mlp"


def run(command: list[str], timeout: float = 600, **kwargs: Any) -> str:
    """Run ``command``, assert it succeeded, return its stdout."""
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, check=False, **kwargs
    )
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    stdout: str = done.stdout
    return stdout


def write_fleet_files(root: Path) -> tuple[Path, Path]:
    """One device's synthetic data (``root/dev-000.npz``) and the ONNX template of the
    fleet's model (``root/template.onnx``)."""
    splits = make_synthetic(
        train_samples=120, test_samples=20, image_size=SIDE, num_classes=CLASSES
    )
    device = partition_dataset(splits, 1, float("inf"), seed=0).devices[0]
    data = root / "dev-000.npz"
    save_device_file(data, device)
    template = root / "template.onnx"
    model = build_classifier(MODEL, num_classes=CLASSES, in_channels=1, image_size=SIDE)
    template.write_bytes(export_template(model, model.input_shape, model_name=MODEL))
    return data, template


def bundle_command(out: Path, profile: str, *flags: str) -> list[str]:
    """``python -m edge_client bundle`` of ``profile`` into ``out``."""
    return [
        sys.executable,
        "-m",
        "edge_client",
        "bundle",
        "--out",
        str(out),
        "--profile",
        profile,
        *flags,
    ]


def coordinator_public_key(root: Path) -> Path:
    """The coordinator's signing key ``root/coordinator.key`` (made when absent, for
    :func:`run_coordinator`); returns its public key file, the devices'."""
    from protocol.signing import load_or_create_signing_key, public_key_path

    load_or_create_signing_key(root / "coordinator.key")
    return public_key_path(root / "coordinator.key")


def provision_keys(root: Path, *device_ids: str) -> Path:
    """Message keys for ``device_ids``: ``root/ID.key`` each, and the coordinator's
    keyring ``root/keys.json`` (returned) and signing key (:func:`coordinator_public_key`)."""
    from protocol.auth import Keyring, new_key, write_key_file

    coordinator_public_key(root)
    keys = {d: new_key() for d in device_ids}
    for device_id, key in keys.items():
        write_key_file(root / f"{device_id}.key", key)
    Keyring(keys).save(root / "keys.json")
    return root / "keys.json"


def run_coordinator(
    broker_url: str, fleet: str, state: Path, device_keys: Path, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """One round of the fleet's model with one device, the model broadcast after it
    (``--broadcast-model``); the final model lands in ``state/final/model.onnx``.
    ``device_keys``: the keyring (:func:`provision_keys`); the coordinator's signing key
    is the one beside it."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "coordinator",
            "--broker",
            broker_url,
            "--fleet",
            fleet,
            "--model",
            MODEL,
            "--num-classes",
            str(CLASSES),
            "--image-size",
            str(SIDE),
            "--rounds",
            "1",
            "--participation",
            "1",
            "--min-devices",
            "1",
            "--local-steps",
            "2",
            "--batch-size",
            "16",
            "--round-timeout",
            "120",
            "--broadcast-model",
            "--state-dir",
            str(state),
            "--device-keys",
            str(device_keys),
            "--signing-key-file",
            str(device_keys.parent / "coordinator.key"),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
    )
