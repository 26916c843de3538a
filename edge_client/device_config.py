"""The device's configuration file: ``python -m edge_client [run|follow] --config FILE``.

A flat TOML table whose keys are the command line flags without their dashes:
``--device-id pi-07`` is ``device_id = "pi-07"``, ``--share-label-counts`` is
``share_label_counts = true``. One file serves both commands: each command takes the keys
it has a flag for and leaves the others (``follow`` has no ``data``). Flags given on the
command line win over the file. Relative paths are taken from the file's folder.

Secrets never live in the file: the MQTT password comes from ``password_file`` (for
example systemd's ``LoadCredential=``) or from the environment variable named by
``password_env`` (default ``EDGEFL_MQTT_PASSWORD``, set by an ``EnvironmentFile=``). A
``password`` key is refused. The TLS private key is a file already (``tls_key``).

Example (``/etc/edgefl/edgefl.toml``)::

    broker = "mqtts://broker.lab:8883"
    fleet = "lab"
    device_id = "pi-07"
    data = "/var/lib/edgefl/data.npz"
    state_dir = "/var/lib/edgefl/state"
    username = "pi-07"
    password_file = "/etc/edgefl/mqtt-password"
    tls_ca = "/etc/edgefl/ca.pem"
    threads = 4
    log_format = "journald"

Imports no torch: the inference-only profile reads the same file.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from edge_client.errors import ConfigError
from protocol.messages import WeightFormat
from protocol.tensors import Precision

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (JetPack 6)
    import tomli as tomllib

__all__ = ["DeviceFile", "load_device_file"]

_MAX_FILE_BYTES = 1 << 20
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class DeviceFile(BaseModel):
    """Every key of a device configuration file; all optional (the flags' defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # -- the broker and the device's identity (run and follow)
    broker: str | None = None
    fleet: str | None = None
    device_id: str | None = None
    username: str | None = None
    password_file: Path | None = None
    password_env: str | None = Field(default=None, pattern=_ENV_NAME)
    auth_key_file: Path | None = None
    fleet_token_file: Path | None = None
    insecure_no_auth: bool | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_insecure: bool | None = None
    mqtt_version: Literal["3.1.1", "5"] | None = None
    connect_retry: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    state_dir: Path | None = None
    # -- logs
    verbose: bool | None = None
    log_format: Literal["auto", "text", "journald"] | None = None
    # -- the local ONNX model kept current from the fleet's broadcast (run and follow)
    serve_onnx: Path | None = None
    onnx_template: Path | None = None
    # -- training (run)
    data: Path | None = None
    model: str | None = None
    threads: int | None = Field(default=None, ge=1, le=1024)
    init_seed: int | None = Field(default=None, ge=0)
    precision: Precision | None = None
    downlink_precision: Precision | None = None
    uplink_precision: Precision | None = None
    weight_format: WeightFormat | None = None
    share_label_counts: bool | None = None
    exit_when_finished: bool | None = None
    memory_budget_mb: float | None = Field(default=None, gt=0, allow_inf_nan=False)


_PATH_KEYS = tuple(
    name for name, field in DeviceFile.model_fields.items() if field.annotation == Path | None
)


def load_device_file(path: Path) -> dict[str, Any]:
    """The settings of a device configuration file, as flag values.

    Returns the keys the file sets (validated, relative paths made absolute against the
    file's folder, precisions as their string values).

    Raises:
        ConfigError: the file cannot be read, is not TOML, holds a ``password``, an
            unknown key or an invalid value (every problem is listed).
    """
    try:
        with path.open("rb") as handle:
            raw = handle.read(_MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    if len(raw) > _MAX_FILE_BYTES:
        raise ConfigError(f"config file {path} is larger than {_MAX_FILE_BYTES} bytes")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    if "password" in data:
        raise ConfigError(
            f"config file {path}: no 'password' key, please: keep the MQTT password out of "
            "the file, in password_file or in the environment variable named by "
            "password_env (default EDGEFL_MQTT_PASSWORD)"
        )
    nested = sorted(key for key, value in data.items() if isinstance(value, dict))
    if nested:
        raise ConfigError(
            f"config file {path}: the file is one flat table of flag names; "
            f"unexpected table(s) {', '.join(nested)}"
        )
    try:
        settings = DeviceFile.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'file'}: {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(f"invalid device settings in {path}: {problems}") from exc
    values = settings.model_dump(exclude_unset=True, mode="python")
    folder = path.resolve().parent
    for key in _PATH_KEYS:
        value = values.get(key)
        if value is not None and not value.is_absolute():
            values[key] = folder / value
    for key in ("precision", "downlink_precision", "uplink_precision"):
        if isinstance(values.get(key), Precision):
            values[key] = values[key].value
    return {key: value for key, value in values.items() if value is not None}
