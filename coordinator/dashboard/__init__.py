"""The coordinator's live web dashboard (docs/dashboard.md): one read-only page over a
:class:`~coordinator.telemetry.FleetTelemetry`, served by aiohttp on a thread of its own.

:func:`serve_dashboard` starts it; :func:`coordinator.monitor.monitoring` calls it as the
``--dashboard`` flag asks (and refuses a host beyond loopback without a token first).
"""

from __future__ import annotations

from coordinator.dashboard.server import (
    DEVICES_LIMIT_MAX,
    SSE_CLIENTS_MAX,
    SSE_HISTORY,
    SSE_REFUSALS,
    Dashboard,
    serve_dashboard,
)

__all__ = [
    "DEVICES_LIMIT_MAX",
    "SSE_CLIENTS_MAX",
    "SSE_HISTORY",
    "SSE_REFUSALS",
    "Dashboard",
    "serve_dashboard",
]
