"""Issue 17: enrolment with a fleet token (coordinator.enrolment, docs/protocol.md 2.4).

The enrolling keyring on its own (real HMAC, real files in a state dir), then a real
coordinator runtime over the in-memory broker with devices and an attacker driven by
hand; tests/coordinator/test_enrolment_e2e.py runs the same over Mosquitto with real
edge-client processes.
"""

from __future__ import annotations

import json
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from coordinator.__main__ import main as coordinator_main
from coordinator.enrolment import (
    ENROLLED_FILE,
    ENROLLED_JOURNAL,
    REVOKED_FILE,
    FleetKeys,
    read_enrolled,
    read_revoked,
    revoke,
)
from coordinator.errors import ConfigError
from coordinator.runtime import Coordinator
from coordinator.store import MemoryStore
from protocol.auth import (
    AuthError,
    Keyring,
    derive_device_key,
    new_key,
    write_fleet_token,
)
from protocol.channel import Channel
from protocol.messages import Ack, RoundTask
from protocol.topics import Topics
from protocol.transport import MemoryBroker, MemoryTransport
from tests.coordinator.helpers import FLEET, config, hello, make_engine, status
from tests.coordinator.test_auth import Inbox

TOPICS = Topics(FLEET)


def enrolled_file(state: Path) -> dict[str, str]:
    """What the state dir holds: the keyring and the journal since the last start."""
    return {device_id: key.hex() for device_id, key in read_enrolled(state).items()}


def test_a_verified_device_is_enrolled_persisted_0600_and_kept_without_the_token(
    tmp_path: Path,
) -> None:
    # Prepare
    token = new_key()
    keys = FleetKeys(Keyring(), token=token, state_dir=tmp_path)
    # Execute: the channel asks for dev-1's key, its frame verifies, it is reported
    key = keys.receive_key("dev-1")
    keys.authenticated("dev-1")
    keys.authenticated("dev-1")  # a second frame: nothing new
    # Assert
    assert key == derive_device_key(token, "dev-1")
    assert enrolled_file(tmp_path) == {"dev-1": key.hex()}
    assert stat.S_IMODE((tmp_path / ENROLLED_JOURNAL).stat().st_mode) == 0o600
    assert keys.enrolments == 1 and "dev-1" in keys
    assert keys.key_for(TOPICS.to_device("dev-1", "ack")) == key
    withdrawn = FleetKeys(Keyring(), token=None, state_dir=tmp_path)  # restart, no token
    assert withdrawn.receive_key("dev-1") == key
    # the restart folded the journal into the keyring, mode 0600
    assert not (tmp_path / ENROLLED_JOURNAL).exists()
    assert json.loads((tmp_path / ENROLLED_FILE).read_text()) == {"dev-1": key.hex()}
    assert stat.S_IMODE((tmp_path / ENROLLED_FILE).stat().st_mode) == 0o600
    with pytest.raises(AuthError, match="not registered"):
        withdrawn.receive_key("dev-2")


def test_a_key_handed_out_for_checking_enrols_nobody_until_the_frame_verifies(
    tmp_path: Path,
) -> None:
    keys = FleetKeys(Keyring(), token=new_key(), state_dir=tmp_path)

    keys.receive_key("dev-1")  # the frame that follows fails its tag: never reported

    assert not (tmp_path / ENROLLED_FILE).exists() and not (tmp_path / ENROLLED_JOURNAL).exists()
    assert "dev-1" not in keys and keys.enrolments == 0
    assert keys.key_for(TOPICS.to_device("dev-1", "ack")) is None  # nothing is sent to it


def test_the_operator_keyring_wins_over_the_token(tmp_path: Path) -> None:
    registered_key = new_key()
    keys = FleetKeys(Keyring({"dev-1": registered_key}), token=new_key(), state_dir=tmp_path)

    assert keys.receive_key("dev-1") == registered_key
    keys.authenticated("dev-1")

    assert not (tmp_path / ENROLLED_FILE).exists() and not (tmp_path / ENROLLED_JOURNAL).exists()


def test_the_cap_refuses_new_ids_and_keeps_those_enrolled(tmp_path: Path) -> None:
    # Prepare: two enrolled under a cap of two
    token = new_key()
    keys = FleetKeys(Keyring(), token=token, state_dir=tmp_path, max_enrolled=2)
    for device_id in ("dev-1", "dev-2"):
        keys.receive_key(device_id)
        keys.authenticated(device_id)
    before = (tmp_path / ENROLLED_JOURNAL).read_bytes()
    # Execute, Assert: a third is refused before and after verification; nothing changes
    with pytest.raises(AuthError, match="max-enrolled 2"):
        keys.receive_key("dev-3")
    with pytest.raises(AuthError, match="max-enrolled 2"):
        keys.authenticated("dev-3")
    assert (tmp_path / ENROLLED_JOURNAL).read_bytes() == before
    assert keys.receive_key("dev-2") == derive_device_key(token, "dev-2")
    lowered = FleetKeys(Keyring(), token=token, state_dir=tmp_path, max_enrolled=1)
    assert sorted(lowered) == ["dev-1", "dev-2"]  # a lower cap drops nobody


def test_an_enrolment_that_cannot_be_written_is_refused_and_changes_nothing(
    tmp_path: Path,
) -> None:
    keys = FleetKeys(Keyring(), token=new_key(), state_dir=tmp_path)
    (tmp_path / ENROLLED_JOURNAL).mkdir()  # the journal cannot be opened for appending

    keys.receive_key("dev-1")
    with pytest.raises(AuthError, match="cannot write"):
        keys.authenticated("dev-1")

    assert "dev-1" not in keys and keys.enrolments == 0
    assert not (tmp_path / ENROLLED_FILE).exists()


def test_a_revoked_device_is_dropped_at_the_next_start_and_refused_for_good(
    tmp_path: Path,
) -> None:
    # Prepare: dev-1 and dev-2 enrolled; op-1 registered by the operator
    token = new_key()
    keys = FleetKeys(Keyring({"op-1": new_key()}), token=token, state_dir=tmp_path)
    for device_id in ("dev-1", "dev-2"):
        keys.receive_key(device_id)
        keys.authenticated(device_id)
    # Execute
    code = coordinator_main(["revoke", "--state-dir", str(tmp_path), "dev-1", "op-1"])
    restarted = FleetKeys(Keyring({"op-1": new_key()}), token=token, state_dir=tmp_path)
    # Assert
    assert code == 0
    assert read_revoked(tmp_path) == {"dev-1", "op-1"}
    assert stat.S_IMODE((tmp_path / REVOKED_FILE).stat().st_mode) == 0o600
    assert set(enrolled_file(tmp_path)) == {"dev-2"}
    for device_id in ("dev-1", "op-1"):
        with pytest.raises(AuthError, match="revoked"):
            restarted.receive_key(device_id)
        with pytest.raises(AuthError, match="revoked"):
            restarted.authenticated(device_id)  # even so: never enrolled again
    assert set(enrolled_file(tmp_path)) == {"dev-2"}
    assert sorted(restarted) == ["dev-2"]


def test_a_revocation_takes_effect_in_a_running_coordinator(tmp_path: Path) -> None:
    # Prepare: dev-1 enrolled, op-1 registered; a clock the test moves
    now = [0.0]
    token = new_key()
    keys = FleetKeys(
        Keyring({"op-1": new_key()}), token=token, state_dir=tmp_path, clock=lambda: now[0]
    )
    keys.receive_key("dev-1")
    keys.authenticated("dev-1")
    # Execute: the operator revokes both while it runs
    assert coordinator_main(["revoke", "--state-dir", str(tmp_path), "dev-1", "op-1"]) == 0
    now[0] += 1.5  # the file is looked at once a second at most
    # Assert: refused from the next frame on, nothing sent to them, never enrolled again
    for device_id in ("dev-1", "op-1"):
        with pytest.raises(AuthError, match="revoked"):
            keys.receive_key(device_id)
        assert keys.key_for(TOPICS.to_device(device_id, "ack")) is None
    assert "dev-1" not in keys and sorted(keys) == []
    restarted = FleetKeys(Keyring({"op-1": new_key()}), token=token, state_dir=tmp_path)
    assert set(enrolled_file(tmp_path)) == set() and sorted(restarted) == []


def test_an_enrolment_is_one_appended_line_and_a_line_cut_short_is_ignored(
    tmp_path: Path,
) -> None:
    # Prepare: 50 devices enrolled
    token = new_key()
    keys = FleetKeys(Keyring(), token=token, state_dir=tmp_path)
    for i in range(50):
        keys.receive_key(f"dev-{i}")
        keys.authenticated(f"dev-{i}")
    journal = tmp_path / ENROLLED_JOURNAL
    lines = journal.read_bytes().splitlines()
    # Assert: one line per enrolment, the keyring untouched until the next start
    assert len(lines) == 50 and not (tmp_path / ENROLLED_FILE).exists()
    assert json.loads(lines[7]) == {"id": "dev-7", "key": derive_device_key(token, "dev-7").hex()}
    # Execute: a crash cut the last append short
    with journal.open("ab") as f:
        f.write(b'{"id": "dev-50", "ke')
    restarted = FleetKeys(Keyring(), token=token, state_dir=tmp_path)
    # Assert: the 50 complete ones are kept and folded; the cut one enrolled nobody
    assert sorted(restarted) == sorted(f"dev-{i}" for i in range(50))
    assert set(json.loads((tmp_path / ENROLLED_FILE).read_text())) == set(restarted)
    assert not journal.exists()
    (tmp_path / ENROLLED_JOURNAL).write_bytes(b"not json\n" + lines[0] + b"\n")
    with pytest.raises(ValueError, match="line 1"):
        FleetKeys(Keyring(), token=token, state_dir=tmp_path)


def test_revoke_refuses_bad_ids_and_a_missing_state_dir_writing_nothing(tmp_path: Path) -> None:
    assert coordinator_main(["revoke", "--state-dir", str(tmp_path), "dev-1", "../x"]) == 2
    assert coordinator_main(["revoke", "--state-dir", str(tmp_path / "nope"), "dev-1"]) == 2
    assert not (tmp_path / REVOKED_FILE).exists()
    (tmp_path / REVOKED_FILE).write_text('{"dev-1": true}')
    with pytest.raises(ValueError, match="JSON list"):
        revoke(tmp_path, ["dev-2"])
    assert (tmp_path / REVOKED_FILE).read_text() == '{"dev-1": true}'


def test_the_coordinator_takes_a_token_enrolled_devices_or_keys_and_never_insecure_too(
    tmp_path: Path,
) -> None:
    transport = MemoryTransport(MemoryBroker(), "coordinator")
    token_file = tmp_path / "fleet.token"
    write_fleet_token(token_file, new_key())
    state = tmp_path / "state"
    state.mkdir()
    (tmp_path / "bad.token").write_text("not a token\n")

    with pytest.raises(ConfigError, match="not both"):
        Coordinator(config(insecure_no_auth=True, fleet_token_file=token_file), transport)
    with pytest.raises(ConfigError, match="fleet token file"):
        Coordinator(
            config(insecure_no_auth=False, fleet_token_file=tmp_path / "bad.token"), transport
        )
    with pytest.raises(ConfigError, match="no device keys"):
        Coordinator(config(insecure_no_auth=False, state_dir=state), transport)
    with_token = Coordinator(
        config(insecure_no_auth=False, fleet_token_file=token_file, state_dir=state), transport
    )
    assert isinstance(with_token.keyring, FleetKeys) and with_token.keyring.enrols
    Keyring({"dev-1": new_key()}).save(state / ENROLLED_FILE)  # enrolled in an earlier run
    withdrawn = Coordinator(config(insecure_no_auth=False, state_dir=state), transport)
    assert isinstance(withdrawn.keyring, FleetKeys) and not withdrawn.keyring.enrols
    assert list(withdrawn.keyring) == ["dev-1"]


@dataclass
class TokenFleet:
    """A running coordinator holding the fleet token, over an in-memory broker."""

    coordinator: Coordinator
    store: MemoryStore
    token: bytes
    state: Path
    broker: MemoryBroker


@pytest.fixture
def token_fleet(tmp_path: Path) -> Iterator[TokenFleet]:
    token = new_key()
    token_file = tmp_path / "fleet.token"
    write_fleet_token(token_file, token)
    state = tmp_path / "state"
    state.mkdir()
    cfg = config(
        min_devices=1,
        rounds=2,
        insecure_no_auth=False,
        fleet_token_file=token_file,
        state_dir=state,
        max_enrolled=2,
    )
    store = MemoryStore()
    broker = MemoryBroker()
    coordinator = Coordinator(cfg, MemoryTransport(broker, "coordinator"), store, tick_s=0.02)
    thread = threading.Thread(target=coordinator.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while store.read_meta("run") is None:
        assert time.monotonic() < deadline, "the coordinator did not start"
        time.sleep(0.02)
    yield TokenFleet(coordinator, store, token, state, broker)
    coordinator.stop()
    thread.join(10)


def device(broker: MemoryBroker, device_id: str, key: bytes) -> tuple[Channel, Inbox]:
    transport = MemoryTransport(broker, device_id)
    transport.connect()
    channel = Channel(transport, auth=Keyring({device_id: key}))
    inbox = Inbox()
    channel.subscribe(TOPICS.device_inbox(device_id), inbox)
    return channel, inbox


def test_over_a_broker_a_token_device_enrols_and_is_selected_and_a_wrong_token_never(
    token_fleet: TokenFleet,
) -> None:
    # Prepare: the attacker holds a token, but not the fleet's
    fleet = token_fleet
    coordinator, store, token, state, broker = (
        fleet.coordinator,
        fleet.store,
        fleet.token,
        fleet.state,
        fleet.broker,
    )
    engine = make_engine(coordinator.config, MemoryStore())
    forger, forger_inbox = device(broker, "dev-bad", derive_device_key(new_key(), "dev-bad"))
    honest, inbox = device(broker, "dev-1", derive_device_key(token, "dev-1"))
    # Execute: the forger says hello first, then the honest device
    for channel, device_id in ((forger, "dev-bad"), (honest, "dev-1")):
        channel.send(TOPICS.device(device_id, "status"), status(device_id, "idle"))
        channel.send(TOPICS.device(device_id, "hello"), hello(engine, device_id))
    task = inbox.wait_for(lambda m: isinstance(m.body, RoundTask))
    # Assert: dev-1 is enrolled, registered and selected; dev-bad left no trace
    assert task.round == 1
    assert inbox.wait_for(lambda m: isinstance(m.body, Ack)).body.accepted  # type: ignore[union-attr]
    assert enrolled_file(state) == {"dev-1": derive_device_key(token, "dev-1").hex()}
    assert set(coordinator.engine.registry.entries) == {"dev-1"}
    assert coordinator.keyring is not None and "dev-bad" not in coordinator.keyring
    assert not [k for k in store.keys() if "dev-bad" in k]  # noqa: SIM118
    assert not forger_inbox.messages  # not even a refusal is sent to it
    # Execute, Assert: the cap of two: a second enrols, a third is refused
    second, second_inbox = device(broker, "dev-2", derive_device_key(token, "dev-2"))
    second.send(TOPICS.device("dev-2", "hello"), hello(engine, "dev-2"))
    second_inbox.wait_for(lambda m: isinstance(m.body, Ack))
    third, third_inbox = device(broker, "dev-3", derive_device_key(token, "dev-3"))
    third.send(TOPICS.device("dev-3", "hello"), hello(engine, "dev-3"))
    time.sleep(0.5)
    assert set(enrolled_file(state)) == {"dev-1", "dev-2"}
    assert "dev-3" not in coordinator.engine.registry and not third_inbox.messages


def test_a_state_dir_not_made_yet_is_made_at_the_first_enrolment(tmp_path: Path) -> None:
    state = tmp_path / "not" / "yet"
    keys = FleetKeys(Keyring(), token=new_key(), state_dir=state)

    keys.receive_key("dev-1")
    keys.authenticated("dev-1")

    assert set(enrolled_file(state)) == {"dev-1"}
