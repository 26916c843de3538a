"""``python -m sim devices``: bad input is one line on stderr, exit code 2, before any
connection (the whole path runs against Mosquitto in tests/benchmarks/test_load.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.auth import Keyring, new_key
from protocol.signing import SigningKey
from sim.__main__ import main

BROKER = "mqtt://127.0.0.1:9"  # nothing listens: reaching it would fail with exit code 1


@pytest.fixture
def pub(tmp_path: Path) -> list[str]:
    """The coordinator's public key flag, for a key made here."""
    SigningKey.generate().save(tmp_path / "coordinator.key")
    return ["--coordinator-key-file", str(tmp_path / "coordinator.key.pub")]


def test_unreadable_keyring_is_a_usage_error(
    tmp_path: Path, pub: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text("not json")

    code = main(["devices", "--broker", BROKER, "--device-keys", str(keys), *pub])

    err = capsys.readouterr().err
    assert code == 2
    assert (
        err.startswith("python -m sim devices: error: cannot read keyring") and err.count("\n") == 1
    )


def test_empty_keyring_is_a_usage_error(
    tmp_path: Path, pub: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys.json"
    Keyring({}).save(keys)

    assert main(["devices", "--broker", BROKER, "--device-keys", str(keys), *pub]) == 2
    assert "holds no device" in capsys.readouterr().err


def test_synthetic_options_with_a_file_dataset_are_refused(
    tmp_path: Path, pub: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys.json"
    Keyring({"dev-1": new_key()}).save(keys)

    code = main(
        ["devices", "--broker", BROKER, "--device-keys", str(keys), *pub, "--dataset", "mnist",
         "--image-size", "8"]
    )  # fmt: skip

    assert code == 2
    assert "apply to --dataset synthetic only" in capsys.readouterr().err


def test_missing_broker_flag_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["devices", "--device-keys", str(tmp_path / "keys.json")])

    assert code == 2
    assert "broker_url" in capsys.readouterr().err


def test_missing_or_bad_coordinator_key_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the coordinator's status, which says when its run is finished, is signed: without
    # its public key the devices could never tell
    keys = tmp_path / "keys.json"
    Keyring({"dev-1": new_key()}).save(keys)
    bad = tmp_path / "bad.pub"
    bad.write_text("not hex\n")

    assert main(["devices", "--broker", BROKER, "--device-keys", str(keys)]) == 2
    assert "coordinator_key_file" in capsys.readouterr().err
    code = main(["devices", "--broker", BROKER, "--device-keys", str(keys),
                 "--coordinator-key-file", str(bad)])  # fmt: skip
    assert code == 2
    assert "coordinator public key file" in capsys.readouterr().err


def test_unreachable_broker_is_exit_code_1(
    tmp_path: Path, pub: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys.json"
    Keyring({"dev-1": new_key()}).save(keys)

    assert main(["devices", "--broker", BROKER, "--device-keys", str(keys), *pub]) == 1
    assert "cannot reach the MQTT broker" in capsys.readouterr().err
