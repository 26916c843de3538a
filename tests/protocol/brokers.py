"""Test helper: a real Mosquitto on a free loopback port with a throw-away config.

Tests that need it call `require_mosquitto()` (or use the fixtures in conftest.py), which
skips them where the binary is absent; CI installs the Debian `mosquitto` package.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

import pytest

LOOPBACK = "127.0.0.1"
_FALLBACK_BINARY = Path("/usr/sbin/mosquitto")


def mosquitto_binary() -> str | None:
    """Path of the mosquitto executable, or None."""
    found = shutil.which("mosquitto")
    if found:
        return found
    if _FALLBACK_BINARY.exists() and os.access(_FALLBACK_BINARY, os.X_OK):
        return str(_FALLBACK_BINARY)
    return None


def require_mosquitto() -> str:
    """Return the mosquitto binary or skip the calling test.

    With ``EDGEFL_REQUIRE_MOSQUITTO=1`` (set by CI) a missing binary fails instead.
    """
    binary = mosquitto_binary()
    if binary is None:
        if os.environ.get("EDGEFL_REQUIRE_MOSQUITTO") == "1":
            pytest.fail("mosquitto binary not installed but EDGEFL_REQUIRE_MOSQUITTO=1")
        pytest.skip("mosquitto binary not installed")
    return binary


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        port: int = probe.getsockname()[1]
        return port


def accepts_connections(port: int) -> bool:
    """Whether something listens on 127.0.0.1:`port`."""
    try:
        with socket.create_connection((LOOPBACK, port), timeout=0.5):
            return True
    except OSError:
        return False


class Mosquitto:
    """One mosquitto process; `restart()` brings it back on the same port (no persistence,
    so sessions and retained messages are lost, as after a real crash)."""

    def __init__(
        self,
        workdir: Path,
        *,
        extra_config: str = "",
        start_timeout: float = 5.0,
        port: int = 0,
    ) -> None:
        self._binary = require_mosquitto()
        self._workdir = workdir
        self._extra = extra_config
        self._start_timeout = start_timeout
        self._port = port
        """The port (0: a free one, chosen at the first start)."""
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"mqtt://{LOOPBACK}:{self._port}"

    def start(self) -> Mosquitto:
        attempts = 3 if self._port == 0 else 1
        for attempt in range(attempts):
            port = self._port or free_port()
            if self._launch(port):
                self._port = port
                return self
            if attempt == attempts - 1:
                log = (self._workdir / "mosquitto.log").read_text(errors="replace")
                raise RuntimeError(f"mosquitto did not start on port {port}:\n{log}")
        raise AssertionError("unreachable")

    def _launch(self, port: int) -> bool:
        config = self._workdir / "mosquitto.conf"
        config.write_text(
            f"listener {port} {LOOPBACK}\n"
            "allow_anonymous true\n"
            "persistence false\n"
            "log_dest stderr\n"
            "log_type error\n"
            "log_type warning\n"
            f"{self._extra}\n"
        )
        with (self._workdir / "mosquitto.log").open("ab") as log:
            self._process = subprocess.Popen(
                [self._binary, "-c", str(config)], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + self._start_timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                return False  # exited: the port was probably taken meanwhile
            if accepts_connections(port):
                return True
            time.sleep(0.02)
        self.stop()
        return False

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> Mosquitto:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
