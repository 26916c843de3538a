"""Configuration of the MQTT transport: broker address, TLS, credentials, timeouts."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from protocol.errors import TransportError
from protocol.transport.base import MqttVersion

__all__ = [
    "DEFAULT_PORT",
    "DEFAULT_TLS_PORT",
    "PASSWORD_ENV",
    "MqttConfig",
    "TlsConfig",
    "parse_broker_url",
    "read_password",
]

PASSWORD_ENV = "EDGEFL_MQTT_PASSWORD"
"""Environment variable the command-line tools read the MQTT password from."""

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 1883
DEFAULT_TLS_PORT = 8883
_SCHEMES = {"mqtt": False, "mqtts": True}


class TlsConfig(BaseModel):
    """TLS settings; all paths are PEM files. No `ca_file` means the system CA store."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ca_file: Path | None = None
    cert_file: Path | None = None  # client certificate, for brokers that require one
    key_file: Path | None = None  # private key of `cert_file`
    insecure: bool = False  # skip the host name check (test setups only)

    @model_validator(mode="after")
    def _cert_and_key_together(self) -> TlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file must be given together")
        return self


class MqttConfig(BaseModel):
    """How to reach and talk to an MQTT broker. Invalid values raise pydantic's
    `ValidationError` (a `ValueError`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = DEFAULT_HOST
    port: int = Field(default=DEFAULT_PORT, ge=1, le=65_535)
    tls: TlsConfig | None = None
    username: str | None = None
    password: SecretStr | None = None
    client_id: str = Field(default_factory=lambda: f"edgefl-{uuid.uuid4().hex[:12]}", min_length=1)
    version: MqttVersion = MqttVersion.V311
    keepalive_s: int = Field(default=30, ge=1, le=65_535)  # PINGREQ interval when idle
    clean_session: bool = True  # MQTT 3.1.1 clean session / MQTT 5 clean start
    reconnect_min_s: float = Field(default=1.0, gt=0)  # first reconnect delay, then doubled
    reconnect_max_s: float = Field(default=30.0, gt=0)  # cap of the reconnect delay
    connect_timeout_s: float = Field(default=10.0, gt=0)  # TCP/TLS connect, each attempt
    max_inflight: int = Field(default=20, ge=1)  # QoS 1 messages awaiting PUBACK at once
    tcp_nodelay: bool = True  # send small packets (PUBACK, PINGREQ) without Nagle's delay

    @model_validator(mode="after")
    def _backoff_order(self) -> MqttConfig:
        if self.reconnect_max_s < self.reconnect_min_s:
            raise ValueError("reconnect_max_s must be >= reconnect_min_s")
        return self

    @classmethod
    def from_url(cls, url: str, **overrides: Any) -> MqttConfig:
        """Build a config from ``mqtt://[user[:password]@]host[:port]`` or ``mqtts://...``.

        `overrides` set any other field. mqtts without an explicit `tls` gets `TlsConfig()`.

        Raises:
            TransportError: the URL or an override is invalid.
        """
        host, port, use_tls = parse_broker_url(url)
        parts = urlsplit(url)
        values: dict[str, Any] = {"host": host, "port": port}
        if use_tls:
            values["tls"] = TlsConfig()
        if parts.username:
            values["username"] = unquote(parts.username)
        if parts.password:
            values["password"] = SecretStr(unquote(parts.password))
        values.update(overrides)
        try:
            return cls(**values)
        except ValidationError as exc:
            raise TransportError(f"invalid MQTT settings for {url!r}: {exc}") from exc


def parse_broker_url(url: str) -> tuple[str, int, bool]:
    """Split ``mqtt://host[:port]`` (port 1883) or ``mqtts://host[:port]`` (8883).

    Returns (host, port, tls).

    Raises:
        TransportError: another scheme, no host, a bad port, or a path / query part.
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise TransportError(f"invalid broker URL {url!r}: {exc}") from exc
    if parts.scheme not in _SCHEMES:
        raise TransportError(f"broker URL must start with mqtt:// or mqtts://, got {url!r}")
    if not parts.hostname:
        raise TransportError(f"broker URL has no host: {url!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise TransportError(f"broker URL must not have a path or query: {url!r}")
    use_tls = _SCHEMES[parts.scheme]
    if port is None:
        port = DEFAULT_TLS_PORT if use_tls else DEFAULT_PORT
    if port == 0:
        raise TransportError(f"broker URL has port 0: {url!r}")
    return parts.hostname, port, use_tls


def read_password(password_file: Path | None, env: str = PASSWORD_ENV) -> SecretStr | None:
    """The MQTT password: the content of ``password_file`` (without its trailing newline)
    when given, else the environment variable ``env`` (``$EDGEFL_MQTT_PASSWORD``), else
    None.

    Raises:
        OSError: the file cannot be read (UnicodeDecodeError, a ValueError, is turned
            into an OSError too).
    """
    if password_file is None:
        value = os.environ.get(env)
        return None if value is None else SecretStr(value)
    try:
        return SecretStr(password_file.read_text(encoding="utf-8").rstrip("\r\n"))
    except UnicodeDecodeError as exc:
        raise OSError(f"{password_file} is not UTF-8 text: {exc}") from exc
