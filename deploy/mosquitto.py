"""The broker's configuration and ACL, rendered from the templates in ``deploy/mosquitto/``.

The templates are the documentation of what the kit configures (each line is commented);
this module only fills in ``${...}`` placeholders (:class:`string.Template`): the fleet
name, the coordinator's account, the folder the broker reads its files from, and the
listeners' ports.

Mosquitto reads a configuration value up to the end of its line and splits some at
spaces, so every value is checked to hold no white space before it is written.
"""

from __future__ import annotations

from importlib import resources
from pathlib import PurePosixPath
from string import Template

from deploy.errors import KitUsageError
from protocol.topics import valid_identifier

__all__ = ["render_acl", "render_config"]

_TEMPLATES = "mosquitto"


def _template(name: str) -> Template:
    text = (resources.files("deploy") / _TEMPLATES / name).read_text(encoding="utf-8")
    return Template(text)


def _plain(what: str, value: str) -> str:
    if not value or any(c.isspace() for c in value):
        raise KitUsageError(f"{what} {value!r} must be non-empty and hold no white space")
    return value


def _listener(name: str, port: int, bind: str | None, broker_dir: str) -> str:
    if not 1 <= port <= 65_535:
        raise KitUsageError(f"port {port} is not in 1..65535")
    where = "" if bind is None else f" {_plain('bind address', bind)}"
    return _template(name).substitute(port=port, bind=where, broker_dir=broker_dir)


def render_config(
    *,
    fleet: str,
    broker_dir: PurePosixPath,
    certificate_port: int | None,
    password_port: int | None,
    bind: str | None = None,
) -> str:
    """The text of ``mosquitto.conf``: a certificate listener on ``certificate_port``
    and / or a password listener on ``password_port`` (None: no such listener), both TLS,
    on ``bind`` (None: every interface). The broker reads ``ca.pem``, ``server.pem``,
    ``server.key``, ``acl`` and ``passwords`` from ``broker_dir``.

    Raises:
        KitUsageError: no listener, both on one port, a port outside 1..65535, a relative
            ``broker_dir``, or white space in a value.
    """
    if not valid_identifier(fleet):
        raise KitUsageError(f"invalid fleet name {fleet!r}")
    if certificate_port is None and password_port is None:
        raise KitUsageError("the broker needs a certificate listener, a password one, or both")
    if certificate_port == password_port:
        raise KitUsageError(f"the two listeners cannot share port {certificate_port}")
    if not broker_dir.is_absolute():
        raise KitUsageError(f"the broker folder must be an absolute path, not {broker_dir}")
    folder = _plain("broker folder", str(broker_dir))
    listeners = [
        _listener(name, port, bind, folder)
        for name, port in (
            ("listener-certificate.conf", certificate_port),
            ("listener-password.conf", password_port),
        )
        if port is not None
    ]
    return _template("mosquitto.conf").substitute(
        fleet=fleet, broker_dir=folder, listeners="".join(listeners)
    )


def render_acl(*, fleet: str, coordinator: str) -> str:
    """The text of the ACL of ``fleet`` whose coordinator logs in as ``coordinator``.

    Raises:
        KitUsageError: the fleet name or the coordinator's id is not a valid identifier.
    """
    for what, name in (("fleet name", fleet), ("coordinator id", coordinator)):
        if not valid_identifier(name):
            raise KitUsageError(f"invalid {what} {name!r}")
    return _template("acl").substitute(fleet=fleet, coordinator=coordinator)
