"""Test helper: a real Mosquitto running a kit that ``python -m deploy`` wrote.

The broker loads the kit's ``broker/mosquitto.conf`` unchanged, the way Debian's
configuration does, through ``include_dir``; only the test's main file around it is
ours (the process's user, no persistence, logs on stderr). The kit listens on free
loopback ports given to ``init``.
"""

from __future__ import annotations

import getpass
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from deploy.__main__ import main
from protocol.transport.config import MqttConfig, TlsConfig
from tests.protocol.brokers import LOOPBACK, accepts_connections, free_port, require_mosquitto

# Started as root, mosquitto would drop to the `mosquitto` user, which cannot read the
# test's temp files: `user` keeps ours.
_MAIN_CONFIG = "user {user}\npersistence false\nlog_dest stderr\nlog_type all\ninclude_dir {kit}\n"


def deploy(*args: str | Path) -> None:
    """Run ``python -m deploy`` in-process; it must succeed."""
    assert main([str(a) for a in args]) == 0


@dataclass(frozen=True)
class KitBroker:
    """The running broker and the kit it was configured from."""

    kit: Path
    certificate_port: int
    password_port: int
    pid: int

    def reload(self) -> None:
        """SIGHUP: Mosquitto reads its password file and ACL again."""
        os.kill(self.pid, signal.SIGHUP)

    @property
    def log(self) -> str:
        return (self.kit / "mosquitto.log").read_text(errors="replace")

    def client(self, folder: str, **overrides: object) -> MqttConfig:
        """Settings of the client whose certificate the kit wrote to ``folder``."""
        who = self.kit / folder
        tls = TlsConfig(
            ca_file=who / "ca.pem", cert_file=who / "cert.pem", key_file=who / "key.pem"
        )
        return MqttConfig(
            host=LOOPBACK, port=self.certificate_port, tls=tls, connect_timeout_s=5, **overrides
        )

    def password_client(
        self, folder: str, username: str, password: str | None = None
    ) -> MqttConfig:
        """Settings of a password login; ``password`` None: the one the kit wrote."""
        who = self.kit / folder
        if password is None:
            password = (who / "password").read_text().strip()
        return MqttConfig(
            host=LOOPBACK,
            port=self.password_port,
            tls=TlsConfig(ca_file=who / "ca.pem"),
            username=username,
            password=password,
            connect_timeout_s=5,
        )


@contextmanager
def kit_broker(
    kit: Path, fleet: str, *, certificates: Sequence[str], passwords: Sequence[str]
) -> Iterator[KitBroker]:
    """Make the kit of ``fleet`` in ``kit`` (both listeners; a certificate for each of
    ``certificates``, a password for each of ``passwords``) and run a broker on it."""
    binary = require_mosquitto()
    for _ in range(3):  # a port picked free may be taken before mosquitto binds it
        ports = (free_port(), free_port())
        if ports[0] == ports[1]:
            continue
        deploy("init", "--fleet", fleet, "--out", kit, "--auth", "both", "--bind", LOOPBACK,
               "--port", ports[0], "--password-port", ports[1], "--force")  # fmt: skip
        deploy("device", *certificates, "--out", kit, "--force")
        deploy("passwords", *passwords, "--out", kit, "--force")
        process = _start(binary, kit, ports)
        if process is not None:
            try:
                yield KitBroker(kit, *ports, process.pid)
            finally:
                _stop(process)
            return
    raise RuntimeError(f"mosquitto did not start:\n{(kit / 'mosquitto.log').read_text()}")


def _start(binary: str, kit: Path, ports: tuple[int, int]) -> subprocess.Popen[bytes] | None:
    """Start mosquitto on the kit's configuration; None if it did not come up."""
    main_config = kit / "main.conf"
    main_config.write_text(_MAIN_CONFIG.format(user=getpass.getuser(), kit=kit / "broker"))
    with (kit / "mosquitto.log").open("ab") as log:
        process = subprocess.Popen(
            [binary, "-c", str(main_config)], stdout=log, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and process.poll() is None:
        if all(accepts_connections(port) for port in ports):
            return process
        time.sleep(0.02)
    _stop(process)
    return None


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=5)
