"""Start what watches a run: the Prometheus exporter (:mod:`coordinator.metrics`) and the
web dashboard (:mod:`coordinator.dashboard`), as :class:`~coordinator.config.
MonitorSettings` ask, over a coordinator's :class:`~coordinator.telemetry.FleetTelemetry`.

Both are read-only views; :func:`monitoring` checks the dashboard's exposure before
anything starts: a host other than loopback without a token file is refused
(:class:`~coordinator.errors.ConfigError`), and so is a token file others may read.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import stat
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Protocol

from coordinator.config import MonitorSettings, parse_address
from coordinator.errors import ConfigError
from coordinator.telemetry import FleetTelemetry

__all__ = ["TOKEN_MIN_CHARS", "Served", "is_loopback", "monitoring", "read_dashboard_token"]

log = logging.getLogger(__name__)

TOKEN_MIN_CHARS = 16
"""A dashboard token is at least this long."""


class Served(Protocol):
    """A running HTTP server of the monitoring."""

    @property
    def url(self) -> str:
        """Where it answers (with the port it got)."""

    def close(self) -> None:
        """Stop serving (and free the port)."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address or ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


def read_dashboard_token(path: Path) -> str:
    """The dashboard's bearer token: the file's first line.

    Raises:
        ConfigError: unreadable, shorter than :data:`TOKEN_MIN_CHARS`, or readable by
            others than its owner (it guards the fleet's view).
    """
    try:
        info = path.stat()
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the dashboard token file {path}: {exc}") from exc
    if os.name == "posix" and stat.S_IMODE(info.st_mode) & 0o077:
        raise ConfigError(
            f"the dashboard token file {path} is readable by others: chmod 600 {path}"
        )
    token = text.strip().splitlines()[0].strip() if text.strip() else ""
    if len(token) < TOKEN_MIN_CHARS or not token.isprintable() or " " in token:
        raise ConfigError(
            f"the dashboard token in {path} must be one word of {TOKEN_MIN_CHARS} characters "
            "at least (python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return token


@contextmanager
def monitoring(telemetry: FleetTelemetry, settings: MonitorSettings) -> Iterator[list[Served]]:
    """Serve the metrics and the dashboard ``settings`` ask for while the block runs.

    Raises:
        ConfigError: the dashboard listens beyond loopback without a token file, the
            token file is unusable, or a port cannot be bound.
    """
    token = None
    if settings.dashboard_token_file is not None:
        token = read_dashboard_token(settings.dashboard_token_file)
    if settings.dashboard is not None:
        host, _ = parse_address(settings.dashboard)
        if token is None and not is_loopback(host):
            raise ConfigError(
                f"the dashboard would listen on {host}, beyond this machine, with no token: "
                "give --dashboard-token-file FILE (or listen on 127.0.0.1)"
            )
    with ExitStack() as stack:
        served: list[Served] = []
        if settings.metrics_port is not None:
            from coordinator.metrics import serve_metrics

            host, port = parse_address(settings.metrics_port)
            server = _started(lambda: serve_metrics(telemetry, host, port), "metrics", host, port)
            stack.callback(server.close)
            served.append(server)
            log.info("Prometheus metrics at %s", server.url)
        if settings.dashboard is not None:
            from coordinator.dashboard import serve_dashboard

            host, port = parse_address(settings.dashboard)
            server = _started(
                lambda: serve_dashboard(telemetry, host, port, token=token), "dashboard", host, port
            )
            stack.callback(server.close)
            served.append(server)
            log.info("dashboard at %s%s", server.url, " (bearer token required)" if token else "")
        if served:
            telemetry.watch()
        yield served


def _started(start: object, what: str, host: str, port: int) -> Served:
    assert callable(start)
    try:
        server: Served = start()
    except OSError as exc:
        raise ConfigError(
            f"cannot serve the {what} on {host}:{port}: {exc.strerror or exc} "
            "(another port, or 0 for a free one)"
        ) from exc
    return server
