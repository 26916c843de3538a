"""The settings of a fleet's kit: what ``init`` is given, saved as the kit's ``kit.json``.

Apart from :mod:`deploy.kit` so that the command line derives its flags' defaults from
:class:`KitSettings` without importing the ``cryptography`` library first.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from deploy.errors import KitUsageError
from protocol.topics import valid_identifier

__all__ = ["LEAF_DAYS", "Auth", "KitSettings", "make_settings"]

LEAF_DAYS = 825
"""Default validity of the broker's and the clients' certificates (never past the CA's)."""

Auth = Literal["certificate", "password", "both"]


class KitSettings(BaseModel):
    """What ``init`` makes; saved as ``kit.json`` so ``device`` and ``passwords`` issue
    credentials for the same fleet, coordinator and listeners."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fleet: str
    """Fleet name: the topic tree fl/FLEET/ that the ACL grants access to, and no other."""
    coordinator_id: str = "coordinator"
    """The coordinator's MQTT user name (its certificate's CN); no device may take it."""
    hosts: tuple[str, ...] = ("localhost", "127.0.0.1")
    """Names and addresses clients reach the broker by: the server certificate's SANs."""
    auth: Auth = "certificate"
    """How clients authenticate: client certificates, passwords, or both (two listeners)."""
    port: int = Field(default=8883, ge=1, le=65_535)
    """The first listener's port: the certificate one (the password one with auth=password)."""
    password_port: int | None = Field(default=None, ge=1, le=65_535)
    """With auth=both, the password listener's port (default: port + 1)."""
    bind: str | None = None
    """Address the listeners bind to (default: every interface)."""
    broker_dir: str
    """Absolute folder the broker reads its files from (where broker/ is copied to)."""
    days: int = Field(default=LEAF_DAYS, ge=1)
    """Validity in days of the certificates the kit issues (the CA's is ten years)."""

    @field_validator("fleet", "coordinator_id")
    @classmethod
    def _identifier(cls, value: str) -> str:
        if not valid_identifier(value):
            raise ValueError(f"{value!r}: 1-64 of A-Z a-z 0-9 _ . -, starting alphanumeric")
        return value

    @model_validator(mode="after")
    def _password_port_with_both(self) -> KitSettings:
        if self.password_port is not None and self.auth != "both":
            raise ValueError("password_port goes with auth 'both' (two listeners)")
        return self

    @property
    def certificate_port(self) -> int | None:
        """Port of the certificate listener, None without one."""
        return None if self.auth == "password" else self.port

    @property
    def password_listener_port(self) -> int | None:
        """Port of the password listener, None without one."""
        if self.auth == "certificate":
            return None
        if self.auth == "password":
            return self.port
        return self.password_port or self.port + 1


def make_settings(**values: object) -> KitSettings:
    """:class:`KitSettings` from keyword values, with errors as :class:`KitUsageError`."""
    try:
        return KitSettings.model_validate(values)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        raise KitUsageError(f"invalid kit settings: {problems}") from exc
