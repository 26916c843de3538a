"""deploy.pki: what the certificates hold, and that strict TLS stacks accept them."""

from __future__ import annotations

import datetime
import socket
import ssl
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from deploy import pki
from deploy.errors import KitStateError, KitUsageError

NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)


@pytest.fixture(scope="module")
def ca() -> pki.Issued:
    return pki.make_ca("lab", now=NOW)


def common_name(certificate: x509.Certificate) -> str:
    (attribute,) = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(attribute.value)


def extension(certificate: x509.Certificate, kind: type[x509.ExtensionType]) -> x509.Extension:  # type: ignore[type-arg]
    return certificate.extensions.get_extension_for_class(kind)


def test_the_ca_is_a_ten_year_p256_ca_for_leaves_only(ca: pki.Issued) -> None:
    cert = ca.certificate

    assert isinstance(ca.key.curve, ec.SECP256R1)
    assert common_name(cert) == "edgefl fleet lab CA"
    assert cert.issuer == cert.subject
    assert cert.not_valid_after_utc - NOW == datetime.timedelta(days=3650)
    constraints = extension(cert, x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca and constraints.value.path_length == 0
    assert extension(cert, x509.KeyUsage).value.key_cert_sign
    cert.verify_directly_issued_by(cert)


def test_the_server_certificate_names_every_host(ca: pki.Issued) -> None:
    server = pki.issue_server(ca, ["broker.lan", "10.0.0.2", "::1"], days=90, now=NOW).certificate

    san = extension(server, x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["broker.lan"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.2", "::1"]
    assert common_name(server) == "broker.lan"
    assert list(extension(server, x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert not extension(server, x509.BasicConstraints).value.ca
    server.verify_directly_issued_by(ca.certificate)


def test_a_client_certificate_carries_the_identity_as_cn(ca: pki.Issued) -> None:
    client = pki.issue_client(ca, "dev-1", days=30, now=NOW).certificate

    assert client.subject == x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dev-1")])
    assert list(extension(client, x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert client.not_valid_after_utc - NOW == datetime.timedelta(days=30)
    assert client.not_valid_before_utc < NOW  # a device whose clock lags still accepts it
    aki = extension(client, x509.AuthorityKeyIdentifier).value
    assert aki.key_identifier == extension(ca.certificate, x509.SubjectKeyIdentifier).value.digest
    client.verify_directly_issued_by(ca.certificate)


def test_a_leaf_never_outlives_its_ca() -> None:
    short = pki.make_ca("lab", days=10, now=NOW)

    client = pki.issue_client(short, "dev-1", days=825, now=NOW).certificate

    assert client.not_valid_after_utc == short.certificate.not_valid_after_utc


@pytest.mark.parametrize("host", ["", "bad host", "a/b", "-lead", "x" * 254])
def test_a_bad_host_is_refused(host: str) -> None:
    with pytest.raises(KitUsageError):
        pki.parse_host(host)


def test_no_host_and_no_days_are_refused(ca: pki.Issued) -> None:
    with pytest.raises(KitUsageError):
        pki.issue_server(ca, [], days=90)
    with pytest.raises(KitUsageError):
        pki.issue_client(ca, "dev-1", days=0)


def test_load_issued_reads_back_and_refuses_a_foreign_key(ca: pki.Issued) -> None:
    other = pki.make_ca("lab")

    again = pki.load_issued(ca.key_pem(), ca.certificate_pem(), "CA")

    assert again.certificate == ca.certificate
    with pytest.raises(KitStateError, match="not the EC key"):
        pki.load_issued(other.key_pem(), ca.certificate_pem(), "CA")
    with pytest.raises(KitStateError):
        pki.load_issued(b"not pem", ca.certificate_pem(), "CA")


def write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def test_strict_tls_accepts_the_certificates_both_ways(tmp_path: Path) -> None:
    # VERIFY_X509_STRICT is Python 3.13's default; OpenSSL 3 checks the same extensions
    ca = pki.make_ca("lab")
    server = pki.issue_server(ca, ["localhost"], days=1)
    client = pki.issue_client(ca, "dev-1", days=1)
    ca_file = write(tmp_path / "ca.pem", ca.certificate_pem())

    def context(purpose: ssl.Purpose, issued: pki.Issued, name: str) -> ssl.SSLContext:
        ctx = ssl.create_default_context(purpose, cafile=ca_file)
        ctx.verify_flags |= ssl.VERIFY_X509_STRICT
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_cert_chain(
            write(tmp_path / f"{name}.pem", issued.certificate_pem()),
            write(tmp_path / f"{name}.key", issued.key_pem()),
        )
        return ctx

    server_ctx = context(ssl.Purpose.CLIENT_AUTH, server, "server")
    client_ctx = context(ssl.Purpose.SERVER_AUTH, client, "client")
    left, right = socket.socketpair()
    seen: list[object] = []

    def serve() -> None:
        with server_ctx.wrap_socket(right, server_side=True) as tls:
            seen.append(tls.getpeercert())

    thread = threading.Thread(target=serve)
    thread.start()
    with client_ctx.wrap_socket(left, server_hostname="localhost") as tls:
        assert tls.getpeercert()["subject"] == ((("commonName", "localhost"),),)
    thread.join(5)

    assert seen and seen[0]["subject"] == ((("commonName", "dev-1"),),)  # type: ignore[index]
