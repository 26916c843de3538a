"""Fleet tokens (issue 17): the key derivation of docs/protocol.md section 2.4, token files,
``python -m protocol keys --new-fleet-token / --fleet-token``, and the channel's report of
an authenticated frame to its key source."""

from __future__ import annotations

import queue
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from protocol.auth import (
    KEY_SIZE,
    AuthError,
    Keyring,
    derive_device_key,
    new_key,
    read_fleet_token,
    read_key_file,
    topic_device,
    write_fleet_token,
)
from protocol.channel import Channel
from protocol.errors import DecodeError
from protocol.messages import DeviceStatus, Message
from protocol.transport.memory import MemoryBroker, MemoryTransport
from tests.protocol import independent_decoder as spec


def spec_key(token: bytes, device_id: str) -> bytes:
    """The derivation as docs/protocol.md 2.4 writes it (the independent decoder's)."""
    return spec.derived_key(token, device_id)


def test_a_derived_key_follows_the_documented_formula_and_separates_ids_and_tokens() -> None:
    token, other = new_key(), new_key()

    keys = {d: derive_device_key(token, d) for d in ("dev-1", "dev-10", "dev-2")}

    assert all(keys[d] == spec_key(token, d) for d in keys)
    assert all(len(k) == KEY_SIZE for k in keys.values())
    assert len(set(keys.values())) == 3  # "dev-1" and "dev-10" too
    assert derive_device_key(other, "dev-1") != keys["dev-1"]
    assert keys["dev-1"] != token  # the token itself is never a device's key


@pytest.mark.parametrize(
    ("token", "device_id"), [(bytes(16), "dev-1"), (bytes(32), "../x"), (bytes(32), "")]
)
def test_derivation_refuses_a_short_token_and_an_invalid_device_id(
    token: bytes, device_id: str
) -> None:
    with pytest.raises(ValueError):
        derive_device_key(token, device_id)


def test_fleet_token_files_round_trip_with_mode_0600_and_bad_ones_are_refused(
    tmp_path: Path,
) -> None:
    token = new_key()
    path = tmp_path / "fleet.token"

    write_fleet_token(path, token)

    assert read_fleet_token(path) == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    (tmp_path / "short").write_text("abcd\n")
    (tmp_path / "nothex").write_text("zz" * 32)
    for name in ("short", "nothex", "missing"):
        with pytest.raises(ValueError, match="fleet token file"):
            read_fleet_token(tmp_path / name)
    with pytest.raises(ValueError):
        write_fleet_token(tmp_path / "bad", bytes(31))
    assert not (tmp_path / "bad").exists()


def keys_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "protocol", "keys", *args], capture_output=True, text=True
    )


def test_python_m_protocol_keys_makes_a_token_and_derived_device_keys(tmp_path: Path) -> None:
    token_file = tmp_path / "fleet.token"

    made = keys_cli("--new-fleet-token", str(token_file))
    again = keys_cli("--new-fleet-token", str(token_file))
    derived = keys_cli("dev-1", "dev-2", "--fleet-token", str(token_file), "--out", str(tmp_path))

    assert made.returncode == 0, made.stderr
    assert again.returncode == 2 and "exists" in again.stderr  # never replaced silently
    assert derived.returncode == 0, derived.stderr
    token = read_fleet_token(token_file)
    for device_id in ("dev-1", "dev-2"):
        assert read_key_file(tmp_path / f"{device_id}.key") == spec_key(token, device_id)
    assert token.hex() not in made.stdout + derived.stdout  # secrets are never printed
    both = keys_cli("dev-3", "--fleet-token", str(token_file), "--keyring", "k", "--out", "o")
    assert both.returncode == 2 and not (tmp_path / "dev-3.key").exists()


class Recording(Keyring):
    """A keyring that records which devices the channel reports authenticated, and may
    refuse them there."""

    def __init__(self, keys: dict[str, bytes], refuse: bool = False) -> None:
        super().__init__(keys)
        self.reported: list[str] = []
        self.refuse = refuse

    def authenticated(self, device_id: str) -> None:
        self.reported.append(device_id)
        if self.refuse:
            raise AuthError("refused after verification", device_id)


@pytest.mark.parametrize("refuse", [False, True])
def test_the_channel_reports_only_verified_frames_and_honours_a_late_refusal(
    refuse: bool,
) -> None:
    # Prepare: a receiver whose key source records (and may refuse) verified devices
    broker = MemoryBroker()
    key = new_key()
    received: queue.Queue[Message] = queue.Queue()
    errors: queue.Queue[DecodeError] = queue.Queue()
    source = Recording({"dev-1": key}, refuse=refuse)
    receiver = MemoryTransport(broker, "receiver")
    receiver.connect()
    Channel(receiver, auth=source).subscribe(
        "fl/#", lambda _t, m: received.put(m), on_error=lambda _t, e: errors.put(e)
    )
    topic = "fl/lab/devices/dev-1/status"
    message = Message(fleet="lab", sender="dev-1", body=DeviceStatus(state="idle"))

    # Execute: a forged frame, then the device's own
    for name, sender_key in (("forger", new_key()), ("device", key)):
        transport = MemoryTransport(broker, name)
        transport.connect()
        Channel(transport, auth=Keyring({"dev-1": sender_key})).send(topic, message)

    # Assert: only the device's frame was reported; a refusal there drops it
    first = errors.get(timeout=5)
    assert isinstance(first, AuthError) and "bad authentication tag" in str(first)
    if refuse:
        assert "refused after verification" in str(errors.get(timeout=5))
        assert received.empty()
    else:
        assert received.get(timeout=5).sender == "dev-1"
    assert source.reported == ["dev-1"]
    assert topic_device(topic) == "dev-1"
