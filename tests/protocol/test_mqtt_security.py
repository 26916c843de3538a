"""MqttTransport against a real Mosquitto with credentials and with TLS."""

from __future__ import annotations

import datetime
import getpass
import ipaddress
import queue
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from protocol.errors import TransportError
from protocol.transport.base import Inbound, MqttVersion
from protocol.transport.config import MqttConfig, TlsConfig
from protocol.transport.mqtt import MqttTransport
from tests.protocol.brokers import LOOPBACK, Mosquitto, require_mosquitto

# Started as root, mosquitto would drop to the `mosquitto` user, which cannot read the
# test's private temp files; `user` keeps the current one (no effect when not root).
KEEP_USER = f"user {getpass.getuser()}\n"


def round_trip(config: MqttConfig) -> bytes:
    """Connect, subscribe, publish one message to itself and return what arrived."""
    inbox: queue.Queue[Inbound] = queue.Queue()
    with MqttTransport(config) as transport:
        transport.connect(timeout=5)
        transport.subscribe("fl/lab/devices/dev-1/status", inbox.put)
        transport.publish("fl/lab/devices/dev-1/status", b"secure hello")
        return inbox.get(timeout=5).payload


# -- username / password --------------------------------------------------------------


@pytest.fixture(scope="module")
def password_broker(tmp_path_factory: pytest.TempPathFactory) -> Mosquitto:
    binary = Path(require_mosquitto())
    workdir = tmp_path_factory.mktemp("mosquitto-passwords")
    passwords = workdir / "passwords"
    tool = binary.with_name("mosquitto_passwd")
    tool = tool if tool.exists() else Path("/usr/bin/mosquitto_passwd")
    subprocess.run([str(tool), "-b", "-c", str(passwords), "dev-1", "s3cret"], check=True)
    passwords.chmod(0o600)
    broker = Mosquitto(
        workdir, extra_config=f"{KEEP_USER}allow_anonymous false\npassword_file {passwords}\n"
    ).start()
    yield broker  # type: ignore[misc]
    broker.stop()


@pytest.mark.parametrize("version", [MqttVersion.V311, MqttVersion.V5])
def test_right_credentials_connect_and_carry_messages(
    password_broker: Mosquitto, version: MqttVersion
) -> None:
    config = MqttConfig.from_url(
        password_broker.url, username="dev-1", password="s3cret", version=version
    )
    assert round_trip(config) == b"secure hello"


@pytest.mark.parametrize(
    "credentials", [{"username": "dev-1", "password": "wrong"}, {}], ids=["wrong", "anonymous"]
)
def test_wrong_or_missing_credentials_are_refused(
    password_broker: Mosquitto, credentials: dict[str, str]
) -> None:
    config = MqttConfig.from_url(password_broker.url, connect_timeout_s=3, **credentials)  # type: ignore[arg-type]
    transport = MqttTransport(config)
    with pytest.raises(TransportError):
        transport.connect(timeout=3)
    assert not transport.is_connected


# -- TLS ------------------------------------------------------------------------------


def write_pem(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def make_certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name | None,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer or name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address(LOOPBACK))]
            ),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


@pytest.fixture(scope="module")
def tls_setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Mosquitto, Path, Path]:
    require_mosquitto()
    workdir = tmp_path_factory.mktemp("mosquitto-tls")
    ca_key, server_key, other_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca_cert = make_certificate("test CA", ca_key, None, ca_key, ca=True)
    server_cert = make_certificate("localhost", server_key, ca_cert.subject, ca_key, ca=False)
    other_ca = make_certificate("other CA", other_key, None, other_key, ca=True)
    ca_file = write_pem(workdir / "ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM))
    other_file = write_pem(workdir / "other.pem", other_ca.public_bytes(serialization.Encoding.PEM))
    cert_file = write_pem(
        workdir / "server.pem", server_cert.public_bytes(serialization.Encoding.PEM)
    )
    key_file = write_pem(workdir / "server.key", pem_key(server_key))
    broker = Mosquitto(
        workdir,
        extra_config=f"{KEEP_USER}cafile {ca_file}\ncertfile {cert_file}\nkeyfile {key_file}\n",
    ).start()
    yield broker, ca_file, other_file  # type: ignore[misc]
    broker.stop()


@pytest.mark.parametrize("version", [MqttVersion.V311, MqttVersion.V5])
def test_tls_with_the_right_ca_carries_messages(
    tls_setup: tuple[Mosquitto, Path, Path], version: MqttVersion
) -> None:
    broker, ca_file, _ = tls_setup
    config = MqttConfig(
        host=LOOPBACK, port=broker.port, tls=TlsConfig(ca_file=ca_file), version=version
    )
    assert round_trip(config) == b"secure hello"


def test_tls_with_an_untrusted_ca_is_refused(tls_setup: tuple[Mosquitto, Path, Path]) -> None:
    broker, _, other_file = tls_setup
    config = MqttConfig(
        host=LOOPBACK, port=broker.port, tls=TlsConfig(ca_file=other_file), connect_timeout_s=3
    )
    with pytest.raises(TransportError):
        MqttTransport(config).connect(timeout=3)


def test_plain_mqtt_to_a_tls_listener_fails_cleanly(
    tls_setup: tuple[Mosquitto, Path, Path],
) -> None:
    broker, _, _ = tls_setup
    config = MqttConfig(host=LOOPBACK, port=broker.port, connect_timeout_s=2)
    with pytest.raises(TransportError):
        MqttTransport(config).connect(timeout=2)
