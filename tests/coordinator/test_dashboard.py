"""The web dashboard at the HTTP level (no browser): its token, its paged fleet table at
10,000 devices, its event stream's bounds, read-only, and the refusal of a dashboard
beyond loopback without a token. tests/coordinator/test_dashboard_browser.py drives the
page itself in Chromium."""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import pytest

import coordinator.dashboard.server as server
from coordinator.actions import RoundClosed, UpdateOutcome
from coordinator.config import MonitorSettings
from coordinator.dashboard import Dashboard, serve_dashboard
from coordinator.errors import ConfigError
from coordinator.monitor import monitoring
from coordinator.telemetry import REFUSAL_TEXT_MAX, FleetTelemetry
from protocol.messages import Hello, ReasonCode
from protocol.tensors import Precision
from protocol.topics import Topics
from protocol.transport.stats import TrafficStats

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "correct-horse-battery-staple-42"
GROUPS = ("mlp", "lenet5", "resnet8")
OUTCOMES = (None, "ok", "late", "duplicate", "update_norm")


class FakeEngine:
    """What the telemetry reads of an engine: ``n`` registered devices, every third one
    offline."""

    def __init__(self, n: int) -> None:
        self.round, self.phase, self.deadline = 1, "training", 2_000.0
        self.selected, self.answered = min(n, 20), 0
        self.entries = {
            f"dev-{i:05d}": Hello.model_construct(  # unvalidated: 10,000 of them, fast
                device_id=f"dev-{i:05d}",
                architecture=GROUPS[i % 3],
                fingerprint="0" * 64,
                precisions=(Precision.FP32,),
                memory_bytes=0,
                threads=1,
                software_version="test",
                num_samples=100,
                weight_format="float",
            )
            for i in range(n)
        }
        self.online = frozenset(d for i, d in enumerate(self.entries) if i % 3 != 1)

    def progress(self) -> tuple[int, str, float | None, int, int]:
        return self.round, self.phase, self.deadline, self.selected, self.answered

    def devices(self) -> tuple[Mapping[str, Hello], frozenset[str]]:
        return self.entries, self.online

    def link_of(self, device_id: str) -> tuple[str, str]:
        return ("fp16", "int8") if int(device_id[4:]) % 2 else ("fp32", "fp32")


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def fleet(n: int, *, refusals: int = 0) -> tuple[FakeEngine, FleetTelemetry, Clock]:
    """A watched telemetry over ``n`` fake devices of varied activity (some never heard
    from, never answered, never screened), with ``refusals`` refusals logged; its first
    snapshot built."""
    engine, clock, traffic = FakeEngine(n), Clock(), TrafficStats()
    telemetry = FleetTelemetry(
        fleet="dash", strategy="fedavg", rounds=5, engine=engine, traffic=traffic, clock=clock
    )
    topics = Topics("dash")
    for i, device_id in enumerate(engine.entries):
        if i % 5:
            telemetry.heard(device_id, 900.0 + (i * 7919) % 97)
        for _ in range(i % 4):
            telemetry(UpdateOutcome(device_id, 1, ReasonCode.OK, screening_ratio=(i % 13) / 7))
        outcome = OUTCOMES[i % 5]
        if outcome is not None and outcome != "ok":
            telemetry(UpdateOutcome(device_id, 1, ReasonCode(outcome)))
        if i % 7:
            traffic.record("in", topics.device(device_id, "update"), (i * 31) % 1000, 10_000)
            traffic.record("out", topics.to_device(device_id, "model"), (i * 17) % 5000, 10_000)
    for i in range(refusals):
        telemetry.refused("auth", f"refused frame {i} " + "<img src=x onerror=alert(1)>" * 20)
    telemetry.watch()
    telemetry.refresh(force=True)
    return engine, telemetry, clock


@contextmanager
def served(telemetry: FleetTelemetry, *, token: str | None = None) -> Iterator[Dashboard]:
    dashboard = serve_dashboard(telemetry, "127.0.0.1", 0, token=token)
    try:
        yield dashboard
    finally:
        dashboard.close()


def request(
    dashboard: Dashboard,
    path: str,
    *,
    method: str = "GET",
    headers: Mapping[str, str] | None = None,
) -> tuple[int, http.client.HTTPMessage, bytes]:
    """One request; (status, headers, body). Redirects are not followed."""
    url = urlsplit(dashboard.url)
    connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=10)
    try:
        connection.request(method, path, headers=dict(headers or {}))
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


def bearer(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def devices(dashboard: Dashboard, **query: Any) -> dict[str, Any]:
    status, _, body = request(dashboard, "/api/devices?" + urlencode(query))
    assert status == 200, body
    page: dict[str, Any] = json.loads(body)
    return page


class Stream:
    """A raw event stream: ``/api/events`` over HTTP/1.0 (no chunked encoding: the body
    is the stream itself), read event by event."""

    def __init__(self, dashboard: Dashboard, headers: Mapping[str, str] | None = None) -> None:
        url = urlsplit(dashboard.url)
        self.sock = socket.create_connection((url.hostname or "", url.port or 0), timeout=10)
        lines = ["GET /api/events HTTP/1.0", f"Host: {url.netloc}"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        self.buffer = b""
        while b"\r\n\r\n" not in self.buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            self.buffer += chunk
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        self.status = int(status_line.split()[1])
        self.headers = {
            k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)
        }

    def event(self, timeout: float) -> tuple[str, bytes] | None:
        """The next event (its name and data line), or None if none comes in
        ``timeout`` s (comments and the retry field are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            while b"\n\n" in self.buffer:
                block, _, self.buffer = self.buffer.partition(b"\n\n")
                name, data = "", b""
                for line in block.split(b"\n"):
                    if line.startswith(b"event: "):
                        name = line[7:].decode()
                    elif line.startswith(b"data: "):
                        data = line[6:]
                if data:
                    return name, data
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                return None
            if not chunk:
                return None
            self.buffer += chunk

    def close(self) -> None:
        self.sock.close()


# -- the token -------------------------------------------------------------------------------


def test_with_a_token_every_request_needs_it() -> None:
    _, telemetry, _ = fleet(30)
    with served(telemetry, token=TOKEN) as dashboard:
        for path in ("/", "/static/app.js", "/api/summary", "/api/devices", "/api/events"):
            status, headers, body = request(dashboard, path)
            assert status == 401, path
            assert headers["WWW-Authenticate"].startswith("Bearer")
            assert TOKEN.encode() not in body
            assert request(dashboard, path, headers=bearer("x" + TOKEN[1:]))[0] == 401
            assert request(dashboard, path, headers={"Authorization": TOKEN})[0] == 401
            assert (
                request(dashboard, path, headers={"Cookie": f"edgefl_dashboard={TOKEN}"})[0] == 401
            )
        status, headers, page = request(dashboard, "/", headers=bearer())
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        assert TOKEN.encode() not in page
        status, _, body = request(dashboard, "/api/summary", headers=bearer())
        assert status == 200 and json.loads(body)["fleet"] == "dash"


def test_the_token_url_sets_a_strict_cookie_and_leaves_the_address_bar() -> None:
    _, telemetry, _ = fleet(30)
    with served(telemetry, token=TOKEN) as dashboard:
        assert request(dashboard, "/?token=wrong-token-wrong-token")[0] == 401
        status, headers, body = request(dashboard, "/?" + urlencode({"token": TOKEN}))
        assert status == 303 and headers["Location"] == "/"
        cookie = headers["Set-Cookie"]
        assert re.search(r"(?i)\bhttponly\b", cookie) and re.search(r"(?i)samesite=strict", cookie)
        assert TOKEN not in cookie and TOKEN.encode() not in body  # a derived session value
        value = cookie.split(";", 1)[0]
        assert value.startswith("edgefl_dashboard=")
        for path in ("/", "/static/app.js", "/api/devices?limit=3", "/api/history"):
            assert request(dashboard, path, headers={"Cookie": value})[0] == 200, path
        stream = Stream(dashboard, {"Cookie": value})
        try:
            assert stream.status == 200
            assert stream.event(5) is not None
        finally:
            stream.close()


def test_without_a_token_only_loopback_names_are_answered() -> None:
    """No token (loopback): a page elsewhere reaching it by DNS rebinding names its own
    host, and is refused."""
    _, telemetry, _ = fleet(3)
    with served(telemetry) as dashboard:
        port = urlsplit(dashboard.url).port
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost"):
            assert request(dashboard, "/", headers={"Host": host})[0] == 200, host
        for host in (f"evil.example:{port}", "evil.example", f"10.0.0.1:{port}"):
            assert request(dashboard, "/api/devices", headers={"Host": host})[0] == 403, host


# -- read-only, headers, static files --------------------------------------------------------


def test_it_is_read_only_and_sends_its_security_headers() -> None:
    _, telemetry, _ = fleet(3)
    with served(telemetry, token=TOKEN) as dashboard:
        for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
            for path in ("/", "/api/devices", "/api/events", "/nowhere"):
                status, headers, _ = request(dashboard, path, method=method, headers=bearer())
                assert status == 405, (method, path)
                assert request(dashboard, path, method=method)[0] == 405  # no token either
        status, headers, page = request(dashboard, "/", headers=bearer())
        assert status == 200
        csp = headers["Content-Security-Policy"]
        assert "default-src 'self'" in csp and "unsafe-inline" not in csp
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert headers["Referrer-Policy"] == "no-referrer"
        # no inline script: every script element has a src of its own
        scripts = re.findall(rb"<script\b[^>]*>", page)
        assert scripts and all(b'src="/static/' in s for s in scripts)
        assert b"style=" not in page and b"<style" not in page
        for path, kind in (
            ("/static/app.js", "text/javascript"),
            ("/static/app.css", "text/css"),
            ("/static/vendor/uPlot.iife.min.js", "text/javascript"),
            ("/static/vendor/uPlot.min.css", "text/css"),
        ):
            status, headers, body = request(dashboard, path, headers=bearer())
            assert status == 200 and headers["Content-Type"].startswith(kind) and body, path
            assert headers["X-Content-Type-Options"] == "nosniff"
        for path in ("/static/../server.py", "/static/index.html", "/static/vendor/uPlot.LICENSE"):
            assert request(dashboard, path, headers=bearer())[0] == 404, path
        assert request(dashboard, "/api/devices?sort=__class__", headers=bearer())[0] == 400


def test_the_script_puts_text_in_the_page_as_text_only() -> None:
    """Device ids and refusal texts are the attackers' words: app.js never parses HTML."""
    script = (server.STATIC / "app.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script, sink


# -- the fleet table -------------------------------------------------------------------------


def expected_rows(telemetry: FleetTelemetry, sort: str, order: str) -> list[str]:
    snapshot = telemetry.snapshot()
    assert snapshot is not None
    rows = list(snapshot.devices)  # by id
    known = [r for r in rows if getattr(r, sort) is not None]
    unknown = [r for r in rows if getattr(r, sort) is None]
    known.sort(key=lambda r: getattr(r, sort), reverse=order == "desc")
    return [r.device_id for r in known + unknown]


def test_the_fleet_table_is_paged_sorted_and_filtered_on_the_server() -> None:
    n = 10_000
    _, telemetry, _ = fleet(n)
    snapshot = telemetry.snapshot()
    assert snapshot is not None and len(snapshot.devices) == n
    timings: list[float] = []
    with served(telemetry) as dashboard:

        def page(**query: Any) -> dict[str, Any]:
            started = time.perf_counter()
            body = devices(dashboard, **query)
            timings.append(time.perf_counter() - started)
            return body

        first = page()
        assert first["total"] == first["registered"] == n
        assert [r["device_id"] for r in first["rows"]] == [f"dev-{i:05d}" for i in range(50)]
        row = first["rows"][1]
        assert row == {
            "device_id": "dev-00001",
            "group": "lenet5",
            "precisions": "fp16/int8",
            "weight_format": "float",
            "online": False,
            "last_seen": 900.0 + 7919 % 97,
            "rounds_answered": 1,
            "last_outcome": "ok",
            "screening_ratio": round(1 / 7, 4),
            "bytes_up": 31,
            "bytes_down": 17,
        }
        # every column, both ways: the server's order is the stable sort by the column
        # (ties in id order, unknown values last), paged anywhere
        for sort in server.SORT_KEYS:
            for order in ("asc", "desc"):
                want = expected_rows(telemetry, sort, order)
                for offset in (0, 4_321, n - 7):
                    got = page(sort=sort, order=order, offset=offset, limit=200)
                    assert got["total"] == n
                    ids = [r["device_id"] for r in got["rows"]]
                    assert ids == want[offset : offset + 200], (sort, order, offset)
        # filters: state and an id substring, with the total they leave
        online = page(state="online", limit=200)
        assert online["total"] == sum(1 for r in snapshot.devices if r.online)
        assert all(r["online"] for r in online["rows"])
        offline = page(state="offline", sort="bytes_up", order="desc", offset=100, limit=200)
        want = [d for d in expected_rows(telemetry, "bytes_up", "desc") if int(d[4:]) % 3 == 1]
        assert offline["total"] == len(want) == n - online["total"]
        assert [r["device_id"] for r in offline["rows"]] == want[100:300]
        found = page(q="DEV-0012", state="offline")
        assert [r["device_id"] for r in found["rows"]] == [
            f"dev-0012{i}" for i in range(10) if (120 + i) % 3 == 1
        ]
        assert page(q="nobody")["total"] == 0
        # limits: capped, clamped, and refused when malformed
        assert len(page(limit=100_000)["rows"]) == server.DEVICES_LIMIT_MAX
        assert page(offset=n + 5)["rows"] == []
        for bad in ({"sort": "nope"}, {"order": "up"}, {"state": "gone"}, {"offset": "-1"},
                    {"limit": "ten"}, {"q": "x" * 65}):  # fmt: skip
            assert request(dashboard, "/api/devices?" + urlencode(bad))[0] == 400, bad
    # fast at 10,000 devices (each order sorted once per snapshot, then cached); generous
    # bounds: two CPUs shared with other tests
    assert max(timings) < 2.0, max(timings)
    assert sum(timings) / len(timings) < 0.25, timings


# -- the event stream ------------------------------------------------------------------------


def test_the_stream_sends_one_summary_per_snapshot() -> None:
    engine, telemetry, clock = fleet(50)
    with served(telemetry) as dashboard:
        stream = Stream(dashboard)
        try:
            assert stream.status == 200
            assert stream.headers["content-type"].startswith("text/event-stream")
            first = stream.event(5)
            assert first is not None and first[0] == "summary"
            body = json.loads(first[1])
            assert (body["round"], body["phase"], body["registered"], body["online"]) == (
                1, "training", 50, 33,
            )  # fmt: skip
            assert "devices" not in body
            assert stream.event(1.5) is None  # nothing new: nothing sent
            # a round closes, its evaluation arrives: one event, carrying both
            engine.round, engine.answered = 2, 0
            clock.now += 5
            telemetry(
                RoundClosed(
                    round=1, selected=20, on_time=20, late=0, rejected=0, duration_s=4.0, models={}
                )
            )
            telemetry.evaluated(1, {"aca": {"amp": 61.25, "wlp": 40.0}})
            clock.now += 2
            telemetry.refresh()
            seen = []
            while (event := stream.event(2)) is not None:
                seen.append(json.loads(event[1]))
            assert seen and seen[-1]["round"] == 2
            assert seen[-1]["history"][-1]["round"] == 1
            assert seen[-1]["history"][-1]["models"] == {"aca": {"amp": 61.25, "wlp": 40.0}}
            assert seen[-1]["models"] == {"aca": {"amp": 61.25, "wlp": 40.0}}
            versions = [s["version"] for s in seen]
            assert versions == sorted(set(versions))  # one event per snapshot at most
            assert len(seen) <= 2
        finally:
            stream.close()
        status, _, body = request(dashboard, "/api/history")
        assert status == 200 and [p["round"] for p in json.loads(body)["history"]] == [1]


def first_event_size(telemetry: FleetTelemetry) -> int:
    with served(telemetry) as dashboard:
        stream = Stream(dashboard)
        try:
            event = stream.event(10)
        finally:
            stream.close()
    assert event is not None
    return len(event[1])


def test_an_event_does_not_grow_with_the_fleet_or_a_flood_of_refusals() -> None:
    small = first_event_size(fleet(10)[1])
    large = first_event_size(fleet(10_000)[1])
    assert abs(large - small) < 100, (small, large)  # a few more digits in the counts
    quiet = first_event_size(fleet(10, refusals=3)[1])
    flooded = first_event_size(fleet(10, refusals=5_000)[1])
    # the last SSE_REFUSALS refusals, each cut to REFUSAL_TEXT_MAX characters (JSON
    # escapes at most double them) and nothing else more
    assert flooded - quiet < server.SSE_REFUSALS * (2 * REFUSAL_TEXT_MAX + 60), (quiet, flooded)
    assert flooded < 32_000


def test_event_streams_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "SSE_CLIENTS_MAX", 3)
    _, telemetry, _ = fleet(5)
    with served(telemetry) as dashboard:
        streams = [Stream(dashboard) for _ in range(3)]
        try:
            assert all(s.status == 200 for s in streams)
            assert all(s.event(5) is not None for s in streams)
            status, headers, _ = request(dashboard, "/api/events")
            assert status == 503 and headers["Retry-After"]
            assert request(dashboard, "/api/devices")[0] == 200  # the rest still answers
            streams.pop().close()
            deadline = time.monotonic() + 10
            while dashboard.sse_clients >= 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            again = Stream(dashboard)
            streams.append(again)
            assert again.status == 200
        finally:
            for stream in streams:
                stream.close()


def test_close_ends_the_streams_and_frees_the_port() -> None:
    _, telemetry, _ = fleet(5)
    dashboard = serve_dashboard(telemetry, "127.0.0.1", 0)
    port = urlsplit(dashboard.url).port
    assert dashboard.url == f"http://127.0.0.1:{port}/" and port
    stream = Stream(dashboard)
    assert stream.event(5) is not None
    started = time.monotonic()
    dashboard.close()
    assert time.monotonic() - started < 5
    ended = time.monotonic()
    assert stream.event(5) is None and time.monotonic() - ended < 4  # closed, not quiet
    stream.close()
    with socket.socket() as probe:  # free again (for a server, as aiohttp binds)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))
        probe.listen()
    dashboard.close()  # twice: nothing


# -- exposure --------------------------------------------------------------------------------


def test_a_dashboard_beyond_loopback_needs_a_token(tmp_path: Path) -> None:
    _, telemetry, _ = fleet(1)
    with (
        pytest.raises(ConfigError, match="no token"),
        monitoring(telemetry, MonitorSettings(dashboard="0.0.0.0:0")),
    ):
        pass
    with pytest.raises(ValueError, match="token"):
        serve_dashboard(telemetry, "0.0.0.0", 0)
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    settings = MonitorSettings(dashboard="127.0.0.1:0", dashboard_token_file=token)
    with monitoring(telemetry, settings) as (dashboard,):
        url = urlsplit(dashboard.url)
        connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=10)
        connection.request("GET", "/api/summary")
        assert connection.getresponse().status == 401
        connection.close()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = MonitorSettings(dashboard=f"127.0.0.1:{taken.getsockname()[1]}")
        with (
            pytest.raises(ConfigError, match="cannot serve the dashboard"),
            monitoring(telemetry, busy),
        ):
            pass


def test_the_coordinator_refuses_a_bare_public_dashboard_before_any_broker() -> None:
    """Exit 2 with the reason, before connecting: the broker named does not exist."""
    done = subprocess.run(
        [sys.executable, "-m", "coordinator", "--broker", "mqtt://127.0.0.1:9",
         "--insecure-no-auth", "--rounds", "1", "--dashboard", "0.0.0.0:0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "no token" in done.stderr and "--dashboard-token-file" in done.stderr
    assert "connect" not in done.stderr.lower()
