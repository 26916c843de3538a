"""Keys and certificates of a fleet: a lab CA, the broker's certificate, client certificates.

Pure: keys and certificates in, keys and certificates out; :mod:`deploy.kit` writes them.
Every key is EC P-256 (small keys and fast handshakes on a Raspberry Pi, accepted by every
TLS stack the project meets) and every certificate is signed with ECDSA-SHA256. The
certificates carry the extensions that strict verifiers insist on (OpenSSL 3, Python
3.13's ``VERIFY_X509_STRICT``): a critical basic-constraints, key usage, extended key
usage on leaves, and subject / authority key identifiers.

A client certificate's common name (CN) is its MQTT user name on a listener with
``use_identity_as_username``: the device id, or the coordinator's id.
"""

from __future__ import annotations

import datetime
import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from deploy.errors import KitStateError, KitUsageError

__all__ = [
    "CA_DAYS",
    "Issued",
    "issue_client",
    "issue_server",
    "load_issued",
    "make_ca",
    "parse_host",
]

CA_DAYS = 3650
"""Validity of the lab CA: ten years, so that it outlives the devices it vouches for."""
_BACKDATE = datetime.timedelta(minutes=5)
"""Certificates start a little in the past: a device whose clock lags still accepts them."""
_HOST = re.compile(r"^(\*\.)?[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*$")


@dataclass(frozen=True)
class Issued:
    """A private key and the certificate of its public key."""

    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate

    def key_pem(self) -> bytes:
        """The private key as unencrypted PKCS#8 PEM (devices start unattended)."""
        return self.key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def certificate_pem(self) -> bytes:
        """The certificate as PEM."""
        return self.certificate.public_bytes(serialization.Encoding.PEM)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _builder(
    subject: x509.Name,
    issuer: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    now: datetime.datetime,
    not_after: datetime.datetime,
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )


def _key_usage(*, signing: bool, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=signing,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def make_ca(fleet: str, *, days: int = CA_DAYS, now: datetime.datetime | None = None) -> Issued:
    """A self-signed CA for one fleet: ``CN=edgefl fleet <fleet> CA``, valid ``days`` days.

    It may sign leaf certificates only (path length 0).
    """
    now = now or _now()
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "edgefl"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"edgefl fleet {fleet} CA"),
        ]
    )
    certificate = (
        _builder(name, name, key, now, now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(signing=False, ca=True), critical=True)
        .sign(key, hashes.SHA256())
    )
    return Issued(key, certificate)


def _leaf(
    ca: Issued,
    common_name: str,
    usage: x509.ObjectIdentifier,
    extra: Sequence[x509.ExtensionType],
    *,
    days: int,
    now: datetime.datetime | None,
) -> Issued:
    if days < 1:
        raise KitUsageError(f"a certificate must be valid for at least one day, not {days}")
    now = now or _now()
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    not_after = min(now + datetime.timedelta(days=days), ca.certificate.not_valid_after_utc)
    builder = (
        _builder(subject, ca.certificate.subject, key, now, not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(signing=True, ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
            critical=False,
        )
    )
    for extension in extra:
        builder = builder.add_extension(extension, critical=False)
    return Issued(key, builder.sign(ca.key, hashes.SHA256()))


def parse_host(host: str) -> x509.GeneralName:
    """A subject-alternative name: an IP address, else a DNS name (``*.`` allowed first).

    Raises:
        KitUsageError: neither an IP address nor a valid host name.
    """
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    if len(host) > 253 or not _HOST.match(host):
        raise KitUsageError(f"{host!r} is neither an IP address nor a host name")
    return x509.DNSName(host.lower())


def issue_server(
    ca: Issued, hosts: Sequence[str], *, days: int, now: datetime.datetime | None = None
) -> Issued:
    """The broker's certificate: CN = the first host, a SAN entry for each host.

    Clients check the host of their broker URL against the SAN entries, so ``hosts`` must
    name every address devices use (``mqtts://broker.lan`` needs ``broker.lan``).

    Raises:
        KitUsageError: no host, or one that is neither an IP address nor a host name.
    """
    if not hosts:
        raise KitUsageError("the broker certificate needs at least one host name or address")
    names = [parse_host(host) for host in hosts]
    san = x509.SubjectAlternativeName(list(dict.fromkeys(names)))
    return _leaf(ca, hosts[0], ExtendedKeyUsageOID.SERVER_AUTH, [san], days=days, now=now)


def issue_client(
    ca: Issued, identity: str, *, days: int, now: datetime.datetime | None = None
) -> Issued:
    """A client certificate whose CN is ``identity`` (a device id or the coordinator's id).

    The caller validates ``identity``: it becomes an MQTT user name and an ACL's ``%u``.
    """
    return _leaf(ca, identity, ExtendedKeyUsageOID.CLIENT_AUTH, [], days=days, now=now)


def load_issued(key_pem: bytes, certificate_pem: bytes, what: str) -> Issued:
    """Read back a key and certificate written by :meth:`Issued.key_pem` and friends.

    Raises:
        KitStateError: not PEM, not an EC P-256 key, or the key does not match.
    """
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
        certificate = x509.load_pem_x509_certificate(certificate_pem)
    except (ValueError, TypeError) as exc:
        raise KitStateError(f"cannot read the {what} key or certificate: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != (
        certificate.public_key()
    ):
        raise KitStateError(f"the {what} key is not the EC key of its certificate")
    return Issued(key, certificate)
