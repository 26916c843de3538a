"""The dashboard's HTTP server: aiohttp on an event loop of its own, in a thread of its
own, reading nothing but the :class:`~coordinator.telemetry.Snapshot` the engine thread
publishes (it never touches the engine).

Routes (GET and HEAD only; any other method is answered 405):

* ``/``: the page (``static/index.html``); ``/?token=TOKEN`` sets the session cookie and
  redirects to ``/`` so the token leaves the address bar.
* ``/static/...``: the page's script, style sheet and the vendored uPlot (served from
  memory, read once at start: nothing else on disk is reachable).
* ``/api/summary``: the compact summary of the latest snapshot (what each SSE event
  carries).
* ``/api/history``: every round the telemetry keeps (the charts' first load).
* ``/api/devices``: one page of the fleet table, sorted and filtered on the server.
* ``/api/events``: server-sent events, one ``summary`` per new snapshot at most
  (:data:`SSE_CLIENTS_MAX` streams at once; more get 503).

With a token every request must carry ``Authorization: Bearer TOKEN`` or the cookie;
without one (loopback only) requests must name a loopback host (``Host``), so a web page
elsewhere cannot reach the dashboard by DNS rebinding. No key, token or payload byte is
ever part of an answer, and the access log is off (a ``?token=`` URL is never logged).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from coordinator.monitor import is_loopback
from coordinator.telemetry import DeviceRow, FleetTelemetry, RoundPoint, Snapshot

__all__ = [
    "COOKIE",
    "DEVICES_LIMIT_DEFAULT",
    "DEVICES_LIMIT_MAX",
    "SORT_KEYS",
    "SSE_CLIENTS_MAX",
    "SSE_HISTORY",
    "SSE_REFUSALS",
    "Dashboard",
    "serve_dashboard",
    "summary",
]

log = logging.getLogger(__name__)

SSE_CLIENTS_MAX = 32
"""Event streams served at once; one more is answered 503."""
SSE_HISTORY = 20
"""Latest rounds each event carries (the page merges them into what it has: an
evaluation arriving a few rounds late still lands on its round)."""
SSE_REFUSALS = 25
"""Latest refusals each event carries (newest last)."""
SSE_MIN_GAP_S = 0.5
"""Events are at least this far apart (the telemetry's snapshots come once a second, and
more often around a round's start and close)."""
SSE_KEEPALIVE_S = 15.0
"""A comment line this often on a quiet stream (proxies and dead peers)."""
SSE_WRITE_TIMEOUT_S = 30.0
"""A client that does not take an event in this long loses its stream (and its slot)."""
DEVICES_LIMIT_DEFAULT = 50
DEVICES_LIMIT_MAX = 200
"""Rows of the fleet table one request may ask for."""
QUERY_MAX_CHARS = 64
"""Longest device-id substring filter (device ids are at most 64 characters)."""
COOKIE = "edgefl_dashboard"
"""The session cookie ``/?token=`` sets (HttpOnly, SameSite=Strict)."""

STATIC = Path(__file__).resolve().parent / "static"
_FILES = {
    "app.js": "text/javascript",
    "app.css": "text/css",
    "vendor/uPlot.iife.min.js": "text/javascript",
    "vendor/uPlot.min.css": "text/css",
}

_SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}


SORT_KEYS = (
    "device_id",
    "group",
    "precisions",
    "online",
    "last_seen",
    "rounds_answered",
    "last_outcome",
    "screening_ratio",
    "bytes_up",
    "bytes_down",
)
"""The fleet table's columns, by which ``/api/devices`` sorts (``sort=``)."""

_STATES = ("all", "online", "offline")


def _number(value: float | None, digits: int = 3) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return round(value, digits)


def _models(models: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float | None]]:
    return {
        str(name): {str(k): _number(v, 2) for k, v in metrics.items()}
        for name, metrics in models.items()
    }


def _point(point: RoundPoint) -> dict[str, Any]:
    return {
        "round": point.round,
        "closed_at": _number(point.closed_at),
        "duration_s": _number(point.duration_s),
        "on_time": point.on_time,
        "selected": point.selected,
        "late": point.late,
        "rejected": point.rejected,
        "bytes_up": point.bytes_up,
        "bytes_down": point.bytes_down,
        "models": _models(point.models),
    }


def _row(row: DeviceRow) -> dict[str, Any]:
    return {
        "device_id": row.device_id,
        "group": row.group,
        "precisions": row.precisions,
        "weight_format": row.weight_format,
        "online": row.online,
        "last_seen": _number(row.last_seen),
        "rounds_answered": row.rounds_answered,
        "last_outcome": row.last_outcome,
        "screening_ratio": _number(row.screening_ratio, 4),
        "bytes_up": row.bytes_up,
        "bytes_down": row.bytes_down,
    }


def summary(snapshot: Snapshot | None, version: int) -> dict[str, Any]:
    """What one event carries: the round, its counts, the latest :data:`SSE_HISTORY`
    rounds, the latest models' metrics and :data:`SSE_REFUSALS` refusals. Its size is
    bounded whatever the fleet's size or the refusals' rate: never the fleet table."""
    if snapshot is None:
        return {"version": version, "ready": False, "now": _number(time.time())}
    up = sum(c.payload_bytes for k, c in snapshot.traffic.items() if k.direction == "up")
    down = sum(c.payload_bytes for k, c in snapshot.traffic.items() if k.direction == "down")
    return {
        "version": version,
        "ready": True,
        "at": _number(snapshot.at),
        "fleet": snapshot.fleet,
        "strategy": snapshot.strategy,
        "rounds_planned": snapshot.rounds_planned,
        "round": snapshot.round,
        "phase": snapshot.phase,
        "deadline": _number(snapshot.deadline),
        "registered": snapshot.registered,
        "online": snapshot.online,
        "selected": snapshot.selected,
        "answered": snapshot.answered,
        "rounds_completed": snapshot.rounds_completed,
        "enrolments": snapshot.enrolments,
        "updates": dict(snapshot.updates),
        "refusals": dict(snapshot.refusals),
        "bytes_up": up,
        "bytes_down": down,
        "server_step_s": _number(snapshot.server_step_s),
        "models": _models(snapshot.models),
        "history": [_point(p) for p in list(snapshot.history)[-SSE_HISTORY:]],
        "recent_refusals": [
            {"at": _number(r.at), "kind": r.kind, "text": r.text}
            for r in list(snapshot.recent_refusals)[-SSE_REFUSALS:]
        ],
    }


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


class _QueryError(ValueError):
    pass


def _int(query: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    text = query.get(name)
    if text is None or text == "":
        return default
    if not text.isdigit() or len(text) > 9:
        raise _QueryError(f"{name} must be a whole number")
    return max(low, min(high, int(text)))


class _DeviceIndex:
    """The fleet table's rows of one snapshot in each order asked for (a few kept)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sorted: OrderedDict[tuple[int, str, str], Sequence[DeviceRow]] = OrderedDict()

    def rows(self, version: int, snapshot: Snapshot, sort: str, order: str) -> Sequence[DeviceRow]:
        key = (version, sort, order)
        with self._lock:
            found = self._sorted.get(key)
            if found is not None:
                self._sorted.move_to_end(key)
                return found
        rows = snapshot.devices  # sorted by device id: the tie-break of every order
        if sort != "device_id" or order != "asc":
            known = [r for r in rows if getattr(r, sort) is not None]
            unknown = [r for r in rows if getattr(r, sort) is None]  # last either way
            known.sort(key=lambda r: getattr(r, sort), reverse=order == "desc")
            rows = known + unknown
        with self._lock:
            self._sorted[key] = rows
            while len(self._sorted) > 8:
                self._sorted.popitem(last=False)
        return rows


class Dashboard:
    """A running dashboard (see the module docstring); :func:`serve_dashboard` starts it.

    Attributes:
        url: where it answers (the port it got where 0 was asked).
    """

    def __init__(self, telemetry: FleetTelemetry, host: str, port: int, token: str | None) -> None:
        if token is None and not is_loopback(host):
            raise ValueError(f"the dashboard needs a token to listen on {host}")
        self._telemetry = telemetry
        self._host, self._port = host, port
        self._token = token.encode() if token is not None else None
        self._cookie = (
            hmac.new(self._token, b"edgefl dashboard session", hashlib.sha256).hexdigest()
            if self._token is not None
            else None
        )
        self._files = {name: (STATIC / name).read_bytes() for name in _FILES}
        self._index = (STATIC / "index.html").read_bytes()
        self._devices = _DeviceIndex()
        self._sse_clients = 0
        self._closing = False
        self._published: tuple[int, bytes] = (-1, b"")
        """The latest event: (snapshot version, its bytes), set on the loop."""
        self._wake: asyncio.Event | None = None
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._stop_pump = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="dashboard", daemon=True)
        self._pump = threading.Thread(target=self._pump_events, name="dashboard-pump", daemon=True)
        self.url = ""

    # -- life -----------------------------------------------------------------------------

    def start(self) -> Dashboard:
        """Listen; returns once the port is bound.

        Raises:
            OSError: the address cannot be bound.
        """
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            self._thread.join()
            raise self._failure
        self._pump.start()
        return self

    def close(self) -> None:
        """Stop serving: every stream ends, the port is freed, the threads are joined."""
        if not self._thread.is_alive():
            return
        self._stop_pump.set()
        future = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        try:
            future.result(10)
        except Exception:  # closing must not raise
            log.exception("dashboard: stopping failed")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._pump.join(5)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._listen())
        except BaseException as exc:  # handed to start()
            self._failure = exc
            self._ready.set()
            self._loop.close()
            return
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _listen(self) -> None:
        self._wake = asyncio.Event()
        app = web.Application(middlewares=[self._guard], client_max_size=1024)
        app.router.add_get("/", self._page)
        app.router.add_get("/static/{name:.+}", self._static)
        app.router.add_get("/favicon.ico", self._no_icon)
        app.router.add_get("/api/summary", self._summary)
        app.router.add_get("/api/history", self._history)
        app.router.add_get("/api/devices", self._device_page)
        app.router.add_get("/api/events", self._events)
        # no access log: a /?token= request line must never reach a log
        runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=2.0, handler_cancellation=True
        )
        await runner.setup()
        site = web.TCPSite(runner, self._host, self._port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        port = self._port
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        if sockets:
            port = sockets[0].getsockname()[1]
        host = f"[{self._host}]" if ":" in self._host else self._host
        self.url = f"http://{host}:{port}/"

    async def _shutdown(self) -> None:
        self._closing = True
        if self._wake is not None:
            self._wake.set()
        if self._runner is not None:
            await self._runner.cleanup()

    # -- the snapshot pump (a thread: the telemetry's wait is a blocking one) -------------

    def _pump_events(self) -> None:
        version = -1
        while not self._stop_pump.is_set():
            latest, snapshot = self._telemetry.wait_changed(version, 0.5)
            if latest == version or snapshot is None:
                continue
            version = latest
            data = _dumps(summary(snapshot, version))
            event = f"id: {version}\nevent: summary\ndata: {data}\n\n".encode()
            try:
                self._loop.call_soon_threadsafe(self._publish, version, event)
            except RuntimeError:  # the loop is closed: we are stopping
                return
            # snapshots forced by round events may come faster: the next event carries
            # the latest of them
            self._stop_pump.wait(SSE_MIN_GAP_S)

    def _publish(self, version: int, event: bytes) -> None:
        self._published = (version, event)
        wake, self._wake = self._wake, asyncio.Event()
        if wake is not None:
            wake.set()

    # -- the guard: method, host, token, headers ------------------------------------------

    @web.middleware
    async def _guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            response = await self._checked(request, handler)
        except web.HTTPException as exc:
            headers = {
                k: v for k, v in exc.headers.items() if k not in ("Content-Type", "Content-Length")
            }
            response = web.Response(status=exc.status, text=exc.text or "", headers=headers)
        if response.prepared:  # an event stream: sent its headers already
            return response
        for name, value in _SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)
        response.headers.setdefault("Cache-Control", "no-store")
        return response

    async def _checked(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            raise web.HTTPMethodNotAllowed(
                request.method, ["GET", "HEAD"], text="405: the dashboard is read-only\n"
            )
        if self._token is None:
            if not is_loopback(_host_name(request.host)):
                raise web.HTTPForbidden(text="403: this dashboard answers loopback names only\n")
            return await handler(request)
        if request.path == "/" and "token" in request.query:
            return self._login(request)
        if not self._authorised(request):
            raise web.HTTPUnauthorized(
                headers={"WWW-Authenticate": 'Bearer realm="edgefl dashboard"'},
                text="401: give Authorization: Bearer TOKEN, or open /?token=TOKEN once\n",
            )
        return await handler(request)

    def _authorised(self, request: web.Request) -> bool:
        assert self._token is not None and self._cookie is not None
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(_bytes(given.strip()), self._token):
            return True
        cookie = request.cookies.get(COOKIE, "")
        return hmac.compare_digest(_bytes(cookie), self._cookie.encode())

    def _login(self, request: web.Request) -> web.StreamResponse:
        assert self._token is not None and self._cookie is not None
        if not hmac.compare_digest(_bytes(request.query.get("token", "")), self._token):
            raise web.HTTPUnauthorized(
                headers={"WWW-Authenticate": 'Bearer realm="edgefl dashboard"'},
                text="401: wrong token\n",
            )
        response = web.Response(status=303, headers={"Location": "/"})
        response.set_cookie(COOKIE, self._cookie, path="/", httponly=True, samesite="Strict")
        return response

    # -- the routes -----------------------------------------------------------------------

    async def _page(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=self._index, content_type="text/html", charset="utf-8")

    async def _no_icon(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=204)

    async def _static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        body = self._files.get(name)
        if body is None:
            raise web.HTTPNotFound(text="404\n")
        return web.Response(
            body=body,
            content_type=_FILES[name],
            charset="utf-8",
            headers={"Cache-Control": "no-cache"},
        )

    def _current(self) -> tuple[int, Snapshot | None]:
        """The latest snapshot and its version (no wait)."""
        return self._telemetry.wait_changed(2**62, 0)

    def _json(self, value: object) -> web.Response:
        return web.Response(text=_dumps(value), content_type="application/json")

    async def _summary(self, request: web.Request) -> web.StreamResponse:
        version, snapshot = self._current()
        return self._json(summary(snapshot, version))

    async def _history(self, request: web.Request) -> web.StreamResponse:
        _, snapshot = self._current()
        points = [] if snapshot is None else [_point(p) for p in snapshot.history]
        return self._json({"history": points})

    async def _device_page(self, request: web.Request) -> web.StreamResponse:
        query = request.query
        try:
            offset = _int(query, "offset", 0, 0, 10**9)
            limit = _int(query, "limit", DEVICES_LIMIT_DEFAULT, 1, DEVICES_LIMIT_MAX)
            sort = query.get("sort") or "device_id"
            order = query.get("order") or "asc"
            state = query.get("state") or "all"
            text = query.get("q", "")
            if sort not in SORT_KEYS:
                raise _QueryError(f"sort must be one of {', '.join(SORT_KEYS)}")
            if order not in ("asc", "desc"):
                raise _QueryError("order must be asc or desc")
            if state not in _STATES:
                raise _QueryError("state must be online, offline or all")
            if len(text) > QUERY_MAX_CHARS:
                raise _QueryError(f"q must be {QUERY_MAX_CHARS} characters at most")
        except _QueryError as exc:
            raise web.HTTPBadRequest(text=f"400: {exc}\n") from exc
        version, snapshot = self._current()
        if snapshot is None:
            return self._json(
                {"version": version, "at": None, "registered": 0, "total": 0,
                 "offset": offset, "limit": limit, "rows": []}
            )  # fmt: skip
        rows = self._devices.rows(version, snapshot, sort, order)
        if state != "all" or text:
            wanted = state == "online"
            needle = text.lower()
            rows = [
                r
                for r in rows
                if (state == "all" or r.online == wanted)
                and (not needle or needle in r.device_id.lower())
            ]
        return self._json(
            {
                "version": version,
                "at": _number(snapshot.at),
                "registered": snapshot.registered,
                "total": len(rows),
                "offset": offset,
                "limit": limit,
                "rows": [_row(r) for r in rows[offset : offset + limit]],
            }
        )

    async def _events(self, request: web.Request) -> web.StreamResponse:
        if self._sse_clients >= SSE_CLIENTS_MAX or self._closing:
            raise web.HTTPServiceUnavailable(
                headers={"Retry-After": "10"},
                text=f"503: {SSE_CLIENTS_MAX} event streams are open already\n",
            )
        self._sse_clients += 1
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-store",
                "X-Accel-Buffering": "no",
                **_SECURITY_HEADERS,
            }
        )
        try:
            await response.prepare(request)
            await self._send(response, b"retry: 3000\n\n")
            sent = -1
            while not self._closing:
                wake = self._wake
                assert wake is not None
                version, event = self._published
                if version != sent and event:
                    await self._send(response, event)
                    sent = version
                    continue
                try:
                    await asyncio.wait_for(wake.wait(), SSE_KEEPALIVE_S)
                except TimeoutError:
                    await self._send(response, b": keepalive\n\n")
            return response
        except (ConnectionError, TimeoutError):
            return response  # the peer left, or stopped reading: its stream ends
        finally:
            self._sse_clients -= 1

    async def _send(self, response: web.StreamResponse, data: bytes) -> None:
        await asyncio.wait_for(response.write(data), SSE_WRITE_TIMEOUT_S)

    @property
    def sse_clients(self) -> int:
        """Event streams open now."""
        return self._sse_clients


def _bytes(text: str) -> bytes:
    """``text`` as bytes for a comparison (whatever a client sent: never raises)."""
    return text.encode("utf-8", "surrogateescape")


def _host_name(host: str | None) -> str:
    """The host of a ``Host`` header (``name:port``, ``[v6]:port``)."""
    if not host:
        return ""
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def serve_dashboard(
    telemetry: FleetTelemetry, host: str, port: int, *, token: str | None = None
) -> Dashboard:
    """Serve the dashboard of ``telemetry`` on ``host:port`` (0: a free port) until its
    ``close()``; returns once listening. ``token``: the bearer token every request must
    carry (required beyond loopback).

    Raises:
        OSError: the address cannot be bound.
        ValueError: a host beyond loopback without a token.
    """
    return Dashboard(telemetry, host, port, token).start()
