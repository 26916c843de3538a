"""deploy.passwords: Mosquitto's ``$7$`` PBKDF2-SHA512 format, byte for byte."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from deploy import passwords
from deploy.errors import KitStateError, KitUsageError

# Written by `mosquitto_passwd -b -c FILE dev-1 s3cret` (Mosquitto 2.0.11).
MOSQUITTO_LINE = (
    "dev-1:$7$101$abp65edDwGxGLJB0$d0gyJ7maUQz1qSABW0PI5gZk+An2qBMRSaj866JVSyOB5u6qt+m4"
    "NneBpqr2ywPHhsQ1tTW/+s6vBXRjJJ8ipA=="
)


def test_the_hash_matches_mosquitto_passwd_for_the_same_salt() -> None:
    user, hashed = MOSQUITTO_LINE.split(":", 1)
    assert user == "dev-1"
    salt = base64.b64decode(hashed.split("$")[3])

    assert passwords.hash_password("s3cret", salt=salt) == hashed
    assert passwords.verify("s3cret", hashed)
    assert not passwords.verify("s3cret!", hashed)


def test_a_fresh_hash_verifies_and_is_salted() -> None:
    first, second = passwords.hash_password("pw"), passwords.hash_password("pw")

    assert first != second
    assert first.startswith("$7$101$")
    assert passwords.verify("pw", first) and passwords.verify("pw", second)


def test_new_passwords_are_long_and_distinct() -> None:
    made = {passwords.new_password() for _ in range(100)}

    assert len(made) == 100
    assert all(len(p) == 32 and ":" not in p for p in made)


def test_mosquitto_passwd_output_verifies(tmp_path: Path) -> None:
    tool = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
    if not Path(tool).exists():
        if os.environ.get("EDGEFL_REQUIRE_MOSQUITTO") == "1":
            pytest.fail("mosquitto_passwd not installed but EDGEFL_REQUIRE_MOSQUITTO=1")
        pytest.skip("mosquitto_passwd not installed")
    file = tmp_path / "passwords"
    subprocess.run([tool, "-b", "-c", str(file), "dev-7", "pa:ss word"], check=True)

    entries = passwords.parse_password_file(file.read_text())

    assert list(entries) == ["dev-7"]
    assert passwords.verify("pa:ss word", entries["dev-7"])


def test_the_file_round_trips_in_order() -> None:
    entries = {"coordinator": "$7$101$a$b", "dev-2": "$7$101$c$d", "dev-1": "$7$101$e$f"}

    text = passwords.render_password_file(entries)

    assert text == "coordinator:$7$101$a$b\ndev-2:$7$101$c$d\ndev-1:$7$101$e$f\n"
    assert list(passwords.parse_password_file(text + "\n").items()) == list(entries.items())


@pytest.mark.parametrize("text", ["dev-1\n", ":hash\n", "dev-1:\n", "a:1\na:2\n"])
def test_a_malformed_file_is_refused(text: str) -> None:
    with pytest.raises(KitStateError):
        passwords.parse_password_file(text)


@pytest.mark.parametrize("user", ["a:b", "a\nb", ""])
def test_a_user_name_the_file_cannot_hold_is_refused(user: str) -> None:
    with pytest.raises(KitUsageError):
        passwords.render_password_file({user: "$7$101$a$b"})


@pytest.mark.parametrize("hashed", ["$6$101$a$b", "plain", "$7$x$AAAA$AAAA", "$7$101$!$AAAA"])
def test_verify_refuses_what_is_not_a_pbkdf2_hash(hashed: str) -> None:
    with pytest.raises(KitStateError):
        passwords.verify("pw", hashed)
