"""The kit folder of one fleet, and the three things done to it: init, device, passwords.

::

    KIT/
      kit.json                  the settings init was given (later commands read them)
      ca/ca.pem, ca/ca.key      the fleet's lab CA (keep ca.key off the broker)
      broker/                   copy to the broker host, to settings.broker_dir
        mosquitto.conf, acl, ca.pem, server.pem, server.key, passwords
      coordinator/              the coordinator's credentials: ca.pem, cert.pem, key.pem,
                                password (the files its listeners need),
                                device-keys.json, the fleet's keyring (--device-keys), and
                                signing.key / signing.key.pub, the key its fleet-wide
                                frames are signed with (--signing-key-file)
      devices/ID/               one device's: ca.pem, cert.pem, key.pem or password,
                                device.key, its message key (--auth-key-file), and
                                coordinator.pub, the coordinator's public signing key
                                (--coordinator-key-file)

Every device issued (``device`` or ``passwords``) gets a 32-byte message key
(docs/protocol.md, section 2.3): ``devices/ID/device.key`` for the device, and the same
key in ``coordinator/device-keys.json`` for the coordinator (both 0600). A device that has
a key keeps it unless ``force`` issues a new one. With a fleet token (``--fleet-token``)
the device's key is derived from it instead and left out of the keyring: the coordinator
run with ``--fleet-token-file`` enrols the device (docs/protocol.md, section 2.4). Every
device issued also gets the coordinator's public signing key (section 2.5).

Private keys, passwords, the password file and the ACL are written with mode 0600, folders
0700.
Nothing that invalidates credentials is replaced without ``force``: a new CA orphans every
certificate the old one signed, a new password locks the old one out.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from pydantic import ValidationError

from deploy import pki
from deploy.errors import KitExistsError, KitStateError, KitUsageError
from deploy.files import write_file
from deploy.mosquitto import render_acl, render_config
from deploy.passwords import hash_password, new_password, parse_password_file
from deploy.passwords import render_password_file as _render_passwords
from deploy.settings import KitSettings
from protocol.auth import Keyring, derive_device_key, new_key
from protocol.signing import SigningKey, load_or_create_signing_key, public_key_path
from protocol.topics import valid_identifier

DEVICE_KEY = "device.key"
"""A device's message key file, under devices/ID/."""
DEVICE_KEYS = "device-keys.json"
"""The coordinator's keyring, under coordinator/."""
SIGNING_KEY = "signing.key"
"""The coordinator's signing key, under coordinator/ (its public key beside it, .pub)."""
COORDINATOR_PUB = "coordinator.pub"
"""The coordinator's public signing key, under devices/ID/."""

__all__ = ["KitLayout", "init_kit", "issue_devices", "issue_passwords", "load_settings"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KitLayout:
    """Where each file of a kit lives (see the module docstring)."""

    root: Path

    @property
    def manifest(self) -> Path:
        return self.root / "kit.json"

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca" / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca" / "ca.key"

    @property
    def broker(self) -> Path:
        return self.root / "broker"

    @property
    def password_file(self) -> Path:
        return self.broker / "passwords"

    @property
    def coordinator(self) -> Path:
        return self.root / "coordinator"

    def device(self, device_id: str) -> Path:
        return self.root / "devices" / device_id

    def issued_devices(self) -> list[str]:
        """Device ids with a folder in the kit."""
        folder = self.root / "devices"
        return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []


def load_settings(layout: KitLayout) -> KitSettings:
    """The settings ``init`` saved in ``layout``.

    Raises:
        KitStateError: no kit there, or an unreadable ``kit.json``.
    """
    try:
        text = layout.manifest.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise KitStateError(
            f"no kit in {layout.root} (no kit.json): run `python -m deploy init` first"
        ) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise KitStateError(f"cannot read {layout.manifest}: {exc}") from exc
    try:
        return KitSettings.model_validate_json(text)
    except ValidationError as exc:
        raise KitStateError(f"{layout.manifest} is not a kit manifest: {exc}") from exc


def init_kit(layout: KitLayout, settings: KitSettings, *, force: bool = False) -> list[Path]:
    """Make the CA, the broker's certificate and configuration, the coordinator's
    credentials; returns the files written.

    Raises:
        KitExistsError: ``layout`` already holds a kit (its CA) and ``force`` is false.
        KitUsageError: settings the configuration cannot hold (ports, hosts, folder).
        OSError: a file cannot be written.
    """
    existing = [p for p in (layout.manifest, layout.ca_key, layout.ca_cert) if p.exists()]
    if existing and not force:
        raise KitExistsError(
            f"{layout.root} already holds a kit ({existing[0].name}); --force makes a new CA, "
            "after which every certificate and password issued from it must be issued again"
        )
    config = render_config(
        fleet=settings.fleet,
        broker_dir=PurePosixPath(settings.broker_dir),
        certificate_port=settings.certificate_port,
        password_port=settings.password_listener_port,
        bind=settings.bind,
    )
    acl = render_acl(fleet=settings.fleet, coordinator=settings.coordinator_id)
    ca = pki.make_ca(settings.fleet)
    server = pki.issue_server(ca, settings.hosts, days=settings.days)
    ca_pem = ca.certificate_pem()
    broker = layout.broker
    written = [
        write_file(layout.ca_key, ca.key_pem(), private=True, replace=force),
        write_file(layout.ca_cert, ca_pem, private=False, replace=force),
        write_file(broker / "ca.pem", ca_pem, private=False, replace=force),
        write_file(broker / "server.key", server.key_pem(), private=True, replace=force),
        write_file(broker / "server.pem", server.certificate_pem(), private=False, replace=force),
        write_file(broker / "mosquitto.conf", config.encode(), private=False, replace=force),
        # later Mosquitto 2.0 releases warn about world-readable ACL and password files
        # and announce refusing them; nothing in the ACL is secret, 0600 is for them
        write_file(broker / "acl", acl.encode(), private=True, replace=force),
    ]
    client = layout.coordinator
    signing = SigningKey.generate()
    written += [
        write_file(client / SIGNING_KEY, signing.seed_hex().encode(), private=True, replace=force),
        write_file(
            public_key_path(client / SIGNING_KEY),
            signing.verify_key.public.hex().encode() + b"\n",
            private=False,
            replace=force,
        ),
    ]
    if settings.certificate_port is not None:
        issued = pki.issue_client(ca, settings.coordinator_id, days=settings.days)
        written += _write_certificate(client, ca_pem, issued, replace=force)
    if settings.password_listener_port is not None:
        coordinator = settings.coordinator_id
        hashed = _new_password(client, ca_pem, coordinator, written)
        written.append(_write_passwords(layout, {coordinator: hashed}))
    written.append(
        write_file(
            layout.manifest,
            settings.model_dump_json(indent=2).encode() + b"\n",
            private=False,
            replace=force,
        )
    )
    stale = layout.issued_devices()
    if stale:
        logger.warning(
            "%d device(s) under %s hold credentials of the previous kit: issue them again "
            "with --force (%s)",
            len(stale),
            layout.root / "devices",
            ", ".join(stale[:5]) + (", ..." if len(stale) > 5 else ""),
        )
    return written


def issue_devices(
    layout: KitLayout,
    device_ids: Sequence[str],
    *,
    force: bool = False,
    fleet_token: bytes | None = None,
) -> list[Path]:
    """Issue a key and client certificate (CN = device id) to each device; returns the
    files written. The broker needs no change: it trusts every certificate of the CA.
    With ``fleet_token`` the message keys are derived from it (:func:`_issue_message_keys`).

    Raises:
        KitUsageError: an invalid or repeated id, the coordinator's id, or a kit without a
            certificate listener.
        KitExistsError: a device already has a certificate and ``force`` is false.
        KitStateError: no kit, or its CA key is not there (it stays where the CA lives).
        OSError: a file cannot be written.
    """
    settings = load_settings(layout)
    if settings.certificate_port is None:
        raise KitUsageError(
            "this kit's broker takes passwords only: use `passwords`, or init with --auth both"
        )
    ids = _checked_ids(device_ids, settings)
    if not force:
        taken = [i for i in ids if (layout.device(i) / "cert.pem").exists()]
        if taken:
            raise KitExistsError(
                f"already issued: {', '.join(taken)}; --force issues a new key and certificate"
            )
    ca = _load_ca(layout)
    ca_pem = ca.certificate_pem()
    written: list[Path] = []
    for device_id in ids:
        issued = pki.issue_client(ca, device_id, days=settings.days)
        written += _write_certificate(layout.device(device_id), ca_pem, issued, replace=force)
    written += _issue_message_keys(layout, ids, force=force, fleet_token=fleet_token)
    return written


def issue_passwords(
    layout: KitLayout,
    device_ids: Sequence[str],
    *,
    force: bool = False,
    fleet_token: bytes | None = None,
) -> list[Path]:
    """Give each device a random password: its ``password`` file, and its hash in the
    broker's password file; returns the files written. The broker reads the new password
    file on SIGHUP (or a restart). With ``fleet_token`` the message keys are derived from
    it (:func:`_issue_message_keys`).

    Raises:
        KitUsageError: an invalid or repeated id, the coordinator's id, or a kit without a
            password listener.
        KitExistsError: a device already has a password and ``force`` is false.
        KitStateError: no kit, or an unreadable password file.
        OSError: a file cannot be written.
    """
    settings = load_settings(layout)
    if settings.password_listener_port is None:
        raise KitUsageError(
            "this kit's broker takes certificates only: use `device`, or init with --auth both"
        )
    ids = _checked_ids(device_ids, settings)
    try:
        entries = parse_password_file(layout.password_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise KitStateError(f"cannot read {layout.password_file}: {exc}") from exc
    taken = [i for i in ids if i in entries]
    if taken and not force:
        raise KitExistsError(
            f"already have a password: {', '.join(taken)}; --force gives them new ones"
        )
    ca_pem = _read(layout.ca_cert, "the CA certificate")
    written: list[Path] = []
    for device_id in ids:
        entries[device_id] = _new_password(layout.device(device_id), ca_pem, device_id, written)
    written.append(_write_passwords(layout, entries))
    written += _issue_message_keys(layout, ids, force=force, fleet_token=fleet_token)
    return written


def _issue_message_keys(
    layout: KitLayout, ids: Sequence[str], *, force: bool, fleet_token: bytes | None = None
) -> list[Path]:
    """Give each device without a message key (every one with ``force``) a new one:
    ``devices/ID/device.key``, and the same in the coordinator's keyring. With
    ``fleet_token`` the key is the one derived from the token for the device's id
    (docs/protocol.md, section 2.4) and the device is left out of the keyring (dropped
    from it where it was): the coordinator run with the token enrols it. Every device in
    ``ids`` gets the coordinator's public signing key, ``devices/ID/coordinator.pub``."""
    keyring_path = layout.coordinator / DEVICE_KEYS
    try:
        keyring = Keyring.load(keyring_path) if keyring_path.exists() else Keyring()
    except ValueError as exc:
        raise KitStateError(str(exc)) from exc
    try:  # a kit made before signing keys existed gets one now
        signing, _ = load_or_create_signing_key(layout.coordinator / SIGNING_KEY)
    except ValueError as exc:
        raise KitStateError(str(exc)) from exc
    public = signing.verify_key.public.hex().encode() + b"\n"
    written: list[Path] = []
    for device_id in ids:
        written.append(
            write_file(
                layout.device(device_id) / COORDINATOR_PUB, public, private=False, replace=True
            )
        )
        key_file = layout.device(device_id) / DEVICE_KEY
        if fleet_token is not None:
            if key_file.exists() and not force:
                continue
            key = derive_device_key(fleet_token, device_id)
            keyring = keyring.without({device_id})
        else:
            if key_file.exists() and device_id in keyring and not force:
                continue
            key = new_key()
            keyring = keyring.with_key(device_id, key)
        data = key.hex().encode() + b"\n"
        written.append(write_file(key_file, data, private=True, replace=True))
    if written:
        text = json.dumps({k: v.hex() for k, v in sorted(keyring.items())}, indent=2) + "\n"
        written.append(write_file(keyring_path, text.encode(), private=True, replace=True))
    return written


def _checked_ids(device_ids: Iterable[str], settings: KitSettings) -> list[str]:
    ids = list(device_ids)
    if not ids:
        raise KitUsageError("name at least one device id")
    bad = [i for i in ids if not valid_identifier(i)]
    if bad:
        raise KitUsageError(
            f"invalid device id(s) {', '.join(map(repr, bad))}: "
            "1-64 of A-Z a-z 0-9 _ . -, starting alphanumeric"
        )
    if settings.coordinator_id in ids:
        raise KitUsageError(
            f"{settings.coordinator_id!r} is the coordinator's account, not a device id"
        )
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise KitUsageError(f"device id(s) named twice: {', '.join(repeated)}")
    return ids


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError as exc:
        raise KitStateError(
            f"{what} is not in the kit ({path}): run this where the kit's CA lives"
        ) from exc
    except OSError as exc:
        raise KitStateError(f"cannot read {what} ({path}): {exc}") from exc


def _load_ca(layout: KitLayout) -> pki.Issued:
    key = _read(layout.ca_key, "the CA key")
    return pki.load_issued(key, _read(layout.ca_cert, "the CA certificate"), "CA")


def _write_certificate(
    folder: Path, ca_pem: bytes, issued: pki.Issued, *, replace: bool
) -> list[Path]:
    return [
        write_file(folder / "ca.pem", ca_pem, private=False, replace=True),
        write_file(folder / "key.pem", issued.key_pem(), private=True, replace=replace),
        write_file(folder / "cert.pem", issued.certificate_pem(), private=False, replace=replace),
    ]


def _new_password(folder: Path, ca_pem: bytes, user: str, written: list[Path]) -> str:
    """A new random password for ``user``, written to ``folder/password`` (with the CA's
    certificate beside it); returns its hash for the broker's file. Replaces an old one:
    the caller decided that (the broker's file is what a password is checked against)."""
    password = new_password()
    written.append(write_file(folder / "ca.pem", ca_pem, private=False, replace=True))
    written.append(
        write_file(folder / "password", password.encode() + b"\n", private=True, replace=True)
    )
    return hash_password(password)


def _write_passwords(layout: KitLayout, entries: dict[str, str]) -> Path:
    text = _render_passwords(entries)
    return write_file(layout.password_file, text.encode(), private=True, replace=True)
