"""Who may talk to the coordinator: the keyring, replay rules and refusal logging.

The keyring (``--device-keys FILE``, :class:`~protocol.auth.Keyring`) is the operator's
registration of the fleet; devices flashed with the fleet token (``--fleet-token-file``)
enrol themselves (:mod:`coordinator.enrolment`). The coordinator's
:class:`~protocol.channel.Channel` drops every frame on the topic of a device without a
key, and every frame whose tag does not verify, before decompressing it (docs/protocol.md,
sections 2.3 and 2.4). Only authenticated messages reach
the :class:`~coordinator.engine.RoundEngine`, which applies :class:`ReplayGuard` before
anything else (section 7). Running without keys takes an explicit ``--insecure-no-auth``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from coordinator.config import CoordinatorConfig
from coordinator.enrolment import FleetKeys
from coordinator.errors import ConfigError
from protocol.auth import Keyring, read_fleet_token
from protocol.messages import DeviceStatus, Hello, Message, ReasonCode, Update
from protocol.signing import SigningKey, load_or_create_signing_key, public_key_path

__all__ = ["SIGNING_KEY_NAME", "ReplayGuard", "load_keys", "load_signing_key"]

log = logging.getLogger(__name__)

SIGNING_KEY_NAME = "coordinator-signing.key"
"""The signing key a coordinator with a state dir makes there at its first start."""


def load_keys(config: CoordinatorConfig) -> FleetKeys | None:
    """The keys ``config`` asks for: the operator's keyring (``device_keys``), the devices
    enrolled in ``state_dir`` and the fleet token that enrols more
    (:class:`~coordinator.enrolment.FleetKeys`); None only with ``insecure_no_auth``.

    Raises:
        ConfigError: keys or a token with ``insecure_no_auth``; neither keys, a token,
            enrolled devices nor the opt-out; an unreadable keyring, token or revoked file.
    """
    if config.insecure_no_auth:
        if config.device_keys is not None or config.fleet_token_file is not None:
            raise ConfigError(
                "give --device-keys / --fleet-token-file or --insecure-no-auth, not both"
            )
        log.warning(
            "--insecure-no-auth: messages are not authenticated; anyone on the "
            "broker can join, impersonate devices and poison the model"
        )
        return None
    try:
        registered = Keyring() if config.device_keys is None else Keyring.load(config.device_keys)
        token = None
        if config.fleet_token_file is not None:
            token = read_fleet_token(config.fleet_token_file)
        keys = FleetKeys(
            registered,
            token=token,
            state_dir=config.state_dir,
            max_enrolled=config.max_enrolled,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if config.device_keys is None and token is None and not keys.enrolled:
        raise ConfigError(
            "no device keys: give --device-keys FILE (python -m deploy device ID adds a "
            "device's key to it) or --fleet-token-file FILE (devices enrol with it), or "
            "--insecure-no-auth to accept anyone on the broker"
        )
    if config.device_keys is not None:
        log.info("%d device key(s) from %s", len(registered), config.device_keys)
    if keys.enrolled:
        log.info("%d device(s) enrolled earlier with the fleet token", len(keys.enrolled))
    if token is not None:
        log.info(
            "fleet token from %s: new devices enrol (at most %d)",
            config.fleet_token_file,
            config.max_enrolled,
        )
        if config.state_dir is None:
            log.warning("no --state-dir: enrolments are kept in memory only, lost at exit")
    return keys


def load_signing_key(config: CoordinatorConfig) -> SigningKey | None:
    """The key that signs the coordinator's fleet-wide frames (docs/protocol.md, section
    2.5): ``signing_key_file``, else ``STATE_DIR/coordinator-signing.key`` (made at the
    first start, with its ``.pub``), else one for this run only; None with
    ``insecure_no_auth``.

    Raises:
        ConfigError: the key file cannot be read or written, or is not a key.
    """
    if config.insecure_no_auth:
        return None
    path = config.signing_key_file
    if path is None and config.state_dir is None:
        log.warning(
            "no --signing-key-file or --state-dir: the coordinator signs its status and "
            "broadcast frames with a key made for this run; devices cannot verify them and "
            "drop them (python -m protocol keys --new-signing-key FILE makes a lasting one)"
        )
        return SigningKey.generate()
    try:
        if path is not None:
            key, made = SigningKey.load(path), False
        else:
            assert config.state_dir is not None
            config.state_dir.mkdir(parents=True, exist_ok=True)
            path = config.state_dir / SIGNING_KEY_NAME
            key, made = load_or_create_signing_key(path)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"coordinator signing key: {exc}") from exc
    log.info(
        "%s signing key %s (public key %s: give it to every device, --coordinator-key-file)",
        "made a new" if made else "using the",
        path,
        key.verify_key.fingerprint,
    )
    if made:
        log.info("its public key file: %s", public_key_path(path))
    return key


@dataclass
class _Seen:
    ids: OrderedDict[str, None] = field(default_factory=OrderedDict)
    newest: dict[str, int] = field(default_factory=dict)
    """Kind (hello, device_status) -> newest ``ts`` accepted from the device (ms)."""
    session: str | None = None
    """The session of the device's newest status that is not ``offline`` (None: none
    seen, or one without a session)."""


@dataclass(frozen=True)
class Replayed:
    """Why a message was refused as a replay."""

    reason: ReasonCode
    detail: str


class ReplayGuard:
    """The replay rules of docs/protocol.md, section 7, for authenticated messages.

    Args:
        window_s: largest distance between a hello's or update's ``ts`` and the clock.
        remember: message ids remembered per device.
        max_devices: devices remembered (least recently heard from forgotten first).
    """

    def __init__(self, window_s: float, *, remember: int = 1024, max_devices: int = 65536):
        self.window_ms = int(window_s * 1000)
        self._remember = remember
        self._max_devices = max_devices
        self._devices: OrderedDict[str, _Seen] = OrderedDict()

    def snapshot(self) -> dict[str, list[Any]]:
        """What survives a restart: per device, the newest ``ts`` accepted of a hello, a
        status and an offline status (-1: none) and its current session (the ids seen
        do not: the ``ts`` rules and the stored updates cover them)."""
        return {
            device_id: [
                seen.newest.get("hello", -1),
                seen.newest.get("device_status", -1),
                seen.newest.get("offline", -1),
                seen.session,
            ]
            for device_id, seen in self._devices.items()
        }

    def restore(self, snapshot: Mapping[str, Any]) -> None:
        """Take what :meth:`snapshot` wrote (entries that do not parse are skipped)."""
        for device_id, entry in snapshot.items():
            try:
                hello_ts, status_ts, offline_ts, session = entry
                newest = {"hello": int(hello_ts), "device_status": int(status_ts)}
                newest["offline"] = int(offline_ts)
            except (TypeError, ValueError):
                continue
            seen = _Seen(newest={k: v for k, v in newest.items() if v >= 0})
            seen.session = session if isinstance(session, str) else None
            self._devices[str(device_id)] = seen
        while len(self._devices) > self._max_devices:
            self._devices.popitem(last=False)

    def check(self, message: Message, skew_ms: int) -> Replayed | None:
        """None when ``message`` is fresh (then it is recorded), else why it is refused.

        ``skew_ms``: the message's ``ts`` minus the coordinator's clock at arrival."""
        body, ts = message.body, message.sent_at_ms
        if isinstance(body, (Hello, Update)) and abs(skew_ms) > self.window_ms:
            return Replayed(
                ReasonCode.REPLAYED,
                f"sent {skew_ms / 1000:+.0f} s from the coordinator's clock, outside the "
                f"{self.window_ms / 1000:.0f} s replay window: a replay, or a wrong clock",
            )
        seen = self._devices.get(message.sender)
        if seen is None:
            seen = self._devices[message.sender] = _Seen()
            while len(self._devices) > self._max_devices:
                self._devices.popitem(last=False)
        self._devices.move_to_end(message.sender)
        if isinstance(body, DeviceStatus) and body.state == "offline":
            # a last will is made at connect time, so it is older than what followed it:
            # only the same offline message again, or one not newer than an offline
            # taken before (also after a restart, when the ids seen are forgotten), is
            # known to be a replay
            if message.message_id in seen.ids:
                return Replayed(ReasonCode.REPLAYED, f"offline status {message.message_id} seen")
            if ts <= seen.newest.get("offline", -1):
                return Replayed(
                    ReasonCode.REPLAYED, "offline status older than the device's newest one"
                )
            if seen.session is not None and body.session != seen.session:
                # a genuine will or goodbye of an earlier run of the device, replayed: it
                # would take a live device out of selection (section 7)
                return Replayed(
                    ReasonCode.REPLAYED,
                    f"offline status of session {body.session}, not the device's current "
                    f"session {seen.session}",
                )
            seen.newest["offline"] = ts
        elif isinstance(body, (Hello, DeviceStatus)):
            if message.message_id in seen.ids:
                return Replayed(ReasonCode.REPLAYED, f"{message.kind} {message.message_id} seen")
            if ts < seen.newest.get(message.kind, -1):
                return Replayed(
                    ReasonCode.REPLAYED, f"{message.kind} older than the device's newest one"
                )
            seen.newest[message.kind] = ts
            if isinstance(body, DeviceStatus):
                seen.session = body.session
        seen.ids[message.message_id] = None
        while len(seen.ids) > self._remember:
            seen.ids.popitem(last=False)
        return None
