"""``python -m deploy``: the files it writes, their modes, and what it refuses to do."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from deploy.__main__ import EXIT_OK, EXIT_USAGE, main
from deploy.passwords import parse_password_file, verify
from protocol.auth import Keyring, derive_device_key, new_key, read_key_file, write_fleet_token
from protocol.codec import signed_twin
from protocol.signing import SigningKey, VerifyKey

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str | Path) -> int:
    return main([str(a) for a in args])


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def certificate(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def common_name(path: Path) -> str:
    (attribute,) = certificate(path).subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(attribute.value)


@pytest.fixture
def kit(tmp_path: Path) -> Path:
    out = tmp_path / "kit"
    assert run("init", "--fleet", "lab", "--out", out, "--auth", "both") == EXIT_OK
    return out


def test_init_writes_the_ca_broker_and_coordinator_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kit = tmp_path / "kit"
    assert run("init", "--fleet", "lab", "--out", kit, "--auth", "both") == EXIT_OK
    listed = capsys.readouterr().out.split()
    files = sorted(str(p.relative_to(kit)) for p in kit.rglob("*") if p.is_file())

    assert files == sorted(listed)
    assert files == [
        "broker/acl",
        "broker/ca.pem",
        "broker/mosquitto.conf",
        "broker/passwords",
        "broker/server.key",
        "broker/server.pem",
        "ca/ca.key",
        "ca/ca.pem",
        "coordinator/ca.pem",
        "coordinator/cert.pem",
        "coordinator/key.pem",
        "coordinator/password",
        "coordinator/signing.key",
        "coordinator/signing.key.pub",
        "kit.json",
    ]
    for secret in ("ca/ca.key", "broker/server.key", "broker/passwords", "broker/acl",
                   "coordinator/key.pem", "coordinator/password",
                   "coordinator/signing.key"):  # fmt: skip
        assert mode(kit / secret) == 0o600, secret
    assert mode(kit / "ca/ca.pem") == 0o644
    assert {mode(p) for p in kit.rglob("*") if p.is_dir()} == {0o700}
    assert common_name(kit / "coordinator/cert.pem") == "coordinator"
    coordinator_password = (kit / "coordinator/password").read_text().strip()
    entries = parse_password_file((kit / "broker/passwords").read_text())
    assert list(entries) == ["coordinator"]
    assert verify(coordinator_password, entries["coordinator"])
    assert coordinator_password not in " ".join(listed)


def test_the_configuration_names_the_kits_files_and_listeners(kit: Path) -> None:
    conf = (kit / "broker/mosquitto.conf").read_text()
    settings = dict(line.split(" ", 1) for line in conf.splitlines() if line and line[0] != "#")
    broker = (kit / "broker").resolve()

    assert settings["allow_anonymous"] == "false"
    assert settings["acl_file"] == f"{broker}/acl"
    assert settings["password_file"] == f"{broker}/passwords"
    assert [line for line in conf.splitlines() if line.startswith("listener")] == [
        "listener 8883",
        "listener 8884",
    ]
    assert "require_certificate true\nuse_identity_as_username true" in conf
    assert "$" not in conf.replace("$7$", "")  # every placeholder filled


def test_every_acl_rule_names_the_fleet(kit: Path) -> None:
    rules = [
        line.split()
        for line in (kit / "broker/acl").read_text().splitlines()
        if line.startswith(("topic", "pattern"))
    ]

    assert rules == [
        ["topic", "read", "fl/lab/devices/+/#"],
        ["topic", "write", "fl/lab/to/#"],
        ["topic", "write", "fl/lab/broadcast/#"],
        ["topic", "write", "fl/lab/coordinator/status"],
        ["pattern", "write", "fl/lab/devices/%u/#"],
        ["pattern", "read", "fl/lab/to/%u/#"],
        ["pattern", "read", "fl/lab/broadcast/#"],
        ["pattern", "read", "fl/lab/coordinator/status"],
    ]
    assert "user coordinator" in (kit / "broker/acl").read_text()


def test_init_options_reach_the_certificate_and_configuration(tmp_path: Path) -> None:
    out = tmp_path / "kit"

    code = run("init", "--fleet", "plant-7", "--out", out, "--host", "broker.lan", "--host",
               "10.0.0.2", "--coordinator-id", "coord-1", "--port", "9883", "--bind",
               "10.0.0.2", "--broker-dir", "/etc/mosquitto/edgefl", "--days", "90")  # fmt: skip

    assert code == EXIT_OK
    server = certificate(out / "broker/server.pem")
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["broker.lan"]
    conf = (out / "broker/mosquitto.conf").read_text()
    assert "listener 9883 10.0.0.2\ncafile /etc/mosquitto/edgefl/ca.pem" in conf
    assert "password_file" not in conf and not (out / "broker/passwords").exists()
    assert "user coord-1" in (out / "broker/acl").read_text()
    assert common_name(out / "coordinator/cert.pem") == "coord-1"
    assert json.loads((out / "kit.json").read_text())["days"] == 90


def test_init_refuses_to_replace_a_ca_without_force(
    kit: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    before = (kit / "ca/ca.key").read_bytes()

    assert run("init", "--fleet", "lab", "--out", kit) == EXIT_USAGE
    assert "--force" in capsys.readouterr().err
    assert (kit / "ca/ca.key").read_bytes() == before

    assert run("device", "dev-1", "--out", kit) == EXIT_OK
    assert run("init", "--fleet", "lab", "--out", kit, "--force") == EXIT_OK
    assert (kit / "ca/ca.key").read_bytes() != before
    assert "previous kit" in caplog.text and "dev-1" in caplog.text  # signed by the old CA


def test_device_certificates_are_signed_by_the_kits_ca(kit: Path) -> None:
    assert run("device", "dev-1", "dev-2", "--out", kit) == EXIT_OK

    ca = certificate(kit / "ca/ca.pem")
    for device in ("dev-1", "dev-2"):
        folder = kit / "devices" / device
        assert common_name(folder / "cert.pem") == device
        certificate(folder / "cert.pem").verify_directly_issued_by(ca)
        assert (folder / "ca.pem").read_bytes() == (kit / "ca/ca.pem").read_bytes()
        assert mode(folder / "key.pem") == 0o600


def test_a_device_is_issued_again_only_with_force(
    kit: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run("device", "dev-1", "--out", kit) == EXIT_OK
    key = (kit / "devices/dev-1/key.pem").read_bytes()

    assert run("device", "dev-2", "dev-1", "--out", kit) == EXIT_USAGE
    assert "already issued: dev-1" in capsys.readouterr().err
    assert not (kit / "devices/dev-2").exists()  # nothing written when one is refused
    assert run("device", "dev-1", "--out", kit, "--force") == EXIT_OK
    assert (kit / "devices/dev-1/key.pem").read_bytes() != key


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (["dev/1"], "invalid device id"),
        (["+"], "invalid device id"),
        (["-dev"], "invalid device id"),
        (["coordinator"], "the coordinator's account"),
        (["dev-1", "dev-1"], "named twice"),
    ],
)
def test_bad_device_ids_are_refused(
    kit: Path, capsys: pytest.CaptureFixture[str], ids: list[str], message: str
) -> None:
    for command in ("device", "passwords"):
        assert run(command, "--out", kit, "--", *ids) == EXIT_USAGE
        assert message in capsys.readouterr().err
    assert not (kit / "devices").exists()


def test_passwords_are_random_hashed_and_replaced_only_with_force(
    kit: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run("passwords", "dev-1", "dev-2", "--out", kit) == EXIT_OK
    out = capsys.readouterr().out
    first = {d: (kit / "devices" / d / "password").read_text().strip() for d in ("dev-1", "dev-2")}
    entries = parse_password_file((kit / "broker/passwords").read_text())

    assert list(entries) == ["coordinator", "dev-1", "dev-2"]
    assert all(verify(first[d], entries[d]) for d in first)
    assert first["dev-1"] != first["dev-2"] and not any(p in out for p in first.values())
    assert mode(kit / "devices/dev-1/password") == 0o600

    assert run("passwords", "dev-1", "--out", kit) == EXIT_USAGE
    assert "--force" in capsys.readouterr().err
    assert run("passwords", "dev-1", "--out", kit, "--force") == EXIT_OK
    renewed = parse_password_file((kit / "broker/passwords").read_text())
    assert not verify(first["dev-1"], renewed["dev-1"])
    assert renewed["dev-2"] == entries["dev-2"] and renewed["coordinator"] == entries["coordinator"]


def test_a_kit_without_the_listener_refuses_that_kind_of_credential(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    certificates, passwords = tmp_path / "c", tmp_path / "p"
    assert run("init", "--fleet", "lab", "--out", certificates) == EXIT_OK
    assert run("init", "--fleet", "lab", "--out", passwords, "--auth", "password") == EXIT_OK
    capsys.readouterr()

    assert run("passwords", "dev-1", "--out", certificates) == EXIT_USAGE
    assert "certificates only" in capsys.readouterr().err
    assert run("device", "dev-1", "--out", passwords) == EXIT_USAGE
    assert "passwords only" in capsys.readouterr().err
    assert "listener 8883\ncertfile" in (passwords / "broker/mosquitto.conf").read_text()
    assert not (passwords / "coordinator/cert.pem").exists()


def test_issuing_needs_the_ca_key(kit: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (kit / "ca/ca.key").rename(kit.parent / "offline.key")

    assert run("device", "dev-1", "--out", kit) == EXIT_USAGE
    assert "the CA key is not in the kit" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["device", "dev-1"], "no kit in"),
        (["init", "--fleet", "a/b"], "fleet"),
        (["init", "--fleet", "lab", "--host", "bad host"], "neither an IP address"),
        (["init", "--fleet", "lab", "--password-port", "9000"], "auth 'both'"),
        (["init", "--fleet", "lab", "--auth", "both", "--password-port", "8883"], "share port"),
        (["init", "--fleet", "lab", "--port", "70000"], "port"),
        (["init", "--fleet", "lab", "--broker-dir", "relative/dir"], "absolute"),
        (["init", "--fleet", "lab", "--broker-dir", "/with space"], "white space"),
        (["init", "--fleet", "lab", "--days", "0"], "days"),
    ],
)
def test_usage_errors_are_one_line_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    out = tmp_path / "kit"

    assert run(*args, "--out", out) == EXIT_USAGE

    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err
    assert not out.exists()


def test_python_m_deploy_runs_and_says_which_extra_is_missing(tmp_path: Path) -> None:
    helped = subprocess.run(
        [sys.executable, "-m", "deploy", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert helped.returncode == 0 and "init" in helped.stdout

    without = (
        "import sys; sys.modules['cryptography'] = None\n"
        "from deploy.__main__ import main\n"
        f"sys.exit(main(['init', '--fleet', 'lab', '--out', {str(tmp_path / 'k')!r}]))\n"
    )
    done = subprocess.run([sys.executable, "-c", without], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == EXIT_USAGE
    assert "pip install 'edgefl[deploy]'" in done.stderr


def test_each_device_gets_a_message_key_the_coordinators_keyring_holds(kit: Path) -> None:
    # Prepare, Execute: certificates for two devices, then a password for one of them
    assert run("device", "dev-1", "dev-2", "--out", kit) == EXIT_OK
    keyring = Keyring.load(kit / "coordinator/device-keys.json")
    keys = {d: read_key_file(kit / "devices" / d / "device.key") for d in ("dev-1", "dev-2")}
    assert run("passwords", "dev-1", "--out", kit) == EXIT_OK
    # Assert: one random 32-byte key per device, the same on both sides, all 0600; a
    # second credential keeps the key, --force issues a new one
    assert dict(keyring) == keys and keys["dev-1"] != keys["dev-2"]
    assert all(len(k) == 32 for k in keys.values())
    assert mode(kit / "coordinator/device-keys.json") == 0o600
    assert mode(kit / "devices/dev-1/device.key") == 0o600
    assert read_key_file(kit / "devices/dev-1/device.key") == keys["dev-1"]
    assert run("device", "dev-1", "--out", kit, "--force") == EXIT_OK
    renewed = Keyring.load(kit / "coordinator/device-keys.json")
    assert renewed["dev-1"] != keys["dev-1"] and renewed["dev-2"] == keys["dev-2"]
    assert renewed["dev-1"] == read_key_file(kit / "devices/dev-1/device.key")


def test_every_device_gets_the_public_half_of_the_coordinators_signing_key(kit: Path) -> None:
    # Prepare, Execute: a certificate and a password device
    assert run("device", "dev-1", "--out", kit) == EXIT_OK
    assert run("passwords", "dev-2", "--out", kit) == EXIT_OK
    # Assert: the kit's signing key is private, its public half is on every device and
    # checks what the key signs
    signing = SigningKey.load(kit / "coordinator/signing.key")
    assert mode(kit / "coordinator/signing.key") == 0o600
    for device_id in ("dev-1", "dev-2"):
        public = VerifyKey.load(kit / "devices" / device_id / "coordinator.pub")
        assert public.public == signing.verify_key.public
        frame = signing.sign("fl/lab/coordinator/status", signed_twin(b"FL\x07\x01" + bytes(40)))
        public.verify("fl/lab/coordinator/status", frame)
    assert VerifyKey.load(kit / "coordinator/signing.key.pub").public == signing.verify_key.public


def test_with_a_fleet_token_device_keys_are_derived_and_left_out_of_the_keyring(
    kit: Path, tmp_path: Path
) -> None:
    # Prepare: dev-1 issued a random key first; a fleet token
    assert run("device", "dev-1", "--out", kit) == EXIT_OK
    token = new_key()
    write_fleet_token(tmp_path / "fleet.token", token)
    (tmp_path / "bad.token").write_text("short\n")
    # Execute: dev-2 and dev-3 get derived keys; dev-1 keeps its key without --force
    done = run("device", "dev-2", "--out", kit, "--fleet-token", tmp_path / "fleet.token")
    kept = run(
        "passwords", "dev-1", "dev-3", "--out", kit, "--fleet-token", tmp_path / "fleet.token"
    )
    first = read_key_file(kit / "devices/dev-1/device.key")
    forced = run(
        "device", "dev-1", "--out", kit, "--force", "--fleet-token", tmp_path / "fleet.token"
    )
    bad = run("device", "dev-4", "--out", kit, "--fleet-token", tmp_path / "bad.token")
    # Assert
    assert (done, kept, forced, bad) == (EXIT_OK, EXIT_OK, EXIT_OK, EXIT_USAGE)
    for device_id in ("dev-1", "dev-2", "dev-3"):
        key = read_key_file(kit / "devices" / device_id / "device.key")
        assert key == derive_device_key(token, device_id)
        assert mode(kit / "devices" / device_id / "device.key") == 0o600
    assert first != derive_device_key(token, "dev-1")  # the random one, kept until --force
    assert dict(Keyring.load(kit / "coordinator/device-keys.json")) == {}  # all enrol
    assert not (kit / "devices/dev-4").exists()
