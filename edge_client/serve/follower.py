"""Keeping a device's local ONNX model current, and the inference-only device runtime.

After each round the coordinator (``--broadcast-model``) publishes the fleet's model on
``fl/{fleet}/broadcast/model`` as a ``model`` message with one full set ``global``.
:class:`ModelRefresher` writes it into the device's ONNX template (fp32 or int8, made by
``python -m edge_client template``) and replaces the served ONNX file atomically, so
``python -m edge_client infer --model FILE`` always reads a whole model. A training
client refreshes in-process (``serve_onnx``); a device that only serves runs
:class:`Follower` (``python -m edge_client follow``).

Imports no torch: this is what the inference-only profile runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path

from edge_client.config import ClientConfig
from edge_client.errors import ConfigError, ConnectError, EdgeClientError
from edge_client.link import DeviceState, connect_with_retry, new_session, publish_status
from edge_client.serve.template import OnnxTemplate
from protocol.arrays import content_fingerprint
from protocol.auth import Keyring
from protocol.channel import Channel
from protocol.codec import Codec
from protocol.deltas import decode_sets
from protocol.errors import DecodeError, TransportError
from protocol.messages import CoordinatorStatus, DeviceStatus, Message, ModelPayload
from protocol.ratelog import RateLimitedLog
from protocol.sets import GLOBAL_SET
from protocol.topics import Topics
from protocol.transport.base import Transport, Will

__all__ = ["Follower", "ModelRefresher"]

logger = logging.getLogger(__name__)


class ModelRefresher:
    """Writes each newer broadcast model into the template and replaces ``onnx_path``.

    Next to the model, ``NAME.json`` records the round, fleet, precision, content
    fingerprint, the broadcast's send time and the SHA-256 of the file, so a restarted
    device skips the model it has (the broker redelivers the retained broadcast), never
    goes back to an older broadcast (a genuine one of an earlier round, replayed: its
    send time is signed with it), and an operator can see which round a device serves.

    Args:
        template: the ONNX template file (``python -m edge_client template``).
        onnx_path: the served model file; its folder is created.
        fsync: fsync the files and the folder on every refresh (power-loss safe).

    Raises:
        ConfigError: the template cannot be read or is not a template, or the folder
            cannot be created.
    """

    def __init__(self, template: Path, onnx_path: Path, *, fsync: bool = True) -> None:
        try:
            self.template = OnnxTemplate.read(template)
        except (OSError, EdgeClientError) as exc:
            raise ConfigError(f"ONNX template {template}: {exc}") from exc
        try:
            onnx_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create {onnx_path.parent}: {exc}") from exc
        self.onnx_path = onnx_path
        self.info_path = onnx_path.with_name(onnx_path.name + ".json")
        self._fsync = fsync
        self._lock = threading.Lock()
        self._refusals = RateLimitedLog(logger)
        """Replayed broadcasts: one WARNING a minute, the rest at DEBUG."""
        self.round, self._content, self._sent_at_ms = self._read_info()

    @property
    def precision(self) -> str:
        """Precision of the served model (the template's): fp32 or int8."""
        return self.template.precision

    def apply(self, message: Message) -> bool:
        """Refresh the served model from a broadcast ``model`` message; True if written.

        A model whose content is the one served (the broker redelivers the retained
        broadcast at every connection) is skipped (False), and so is one sent before the
        one served (a replay of an earlier broadcast). Any other is served, whatever its
        round: a new coordinator run starts again at round 1.

        Raises:
            DecodeError: the message is not a broadcast model, or its set cannot be
                decoded.
            OnnxTemplateError: its tensors do not fit the template (missing, wrong
                shape, not finite); the served file is unchanged.
            OSError: the file could not be written; the served file is unchanged.
        """
        body = message.body
        if not isinstance(body, ModelPayload):
            raise DecodeError(f"expected a model message, got {message.kind}")
        with self._lock:
            arrays = decode_sets(body.sets, [GLOBAL_SET])[GLOBAL_SET]
            content = content_fingerprint(arrays)
            if content == self._content:
                logger.debug("broadcast model of round %d already served", message.round)
                return False
            if message.sent_at_ms < self._sent_at_ms:
                self._refusals.warning(
                    "replay",
                    "ignored a broadcast model of round %d sent before the one served "
                    "(a replay of an earlier broadcast)",
                    message.round,
                )
                return False
            data = self.template.render(arrays)
            self._replace(self.onnx_path, data)
            info = {
                "round": message.round,
                "fleet": message.fleet,
                "precision": self.precision,
                "content": content,
                "sha256": hashlib.sha256(data).hexdigest(),
                "bytes": len(data),
                "sent_at_ms": message.sent_at_ms,
                "updated_at": time.time(),
            }
            self._replace(self.info_path, (json.dumps(info, indent=1) + "\n").encode())
            self.round, self._content = message.round, content
            self._sent_at_ms = message.sent_at_ms
        logger.info(
            "round %d: served model refreshed (%s, %d bytes) at %s",
            message.round,
            self.precision,
            len(data),
            self.onnx_path,
        )
        return True

    def _replace(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as handle:
            handle.write(data)
            if self._fsync:
                handle.flush()
                os.fsync(handle.fileno())
        tmp.replace(path)
        if self._fsync:
            folder = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(folder)
            finally:
                os.close(folder)

    def _read_info(self) -> tuple[int, str | None, int]:
        """(round, content fingerprint, send time in ms) of the served model, or
        (-1, None, -1)."""
        nothing = -1, None, -1
        if not (self.onnx_path.is_file() and self.info_path.is_file()):
            return nothing
        try:
            info = json.loads(self.info_path.read_text(encoding="utf-8"))
            served = hashlib.sha256(self.onnx_path.read_bytes()).hexdigest()
        except (OSError, ValueError) as exc:
            logger.warning("ignored the unreadable %s: %s", self.info_path, exc)
            return nothing
        if not isinstance(info, dict) or info.get("sha256") != served:
            logger.warning("%s does not describe %s; refreshing", self.info_path, self.onnx_path)
            return nothing
        round_, content, sent = info.get("round"), info.get("content"), info.get("sent_at_ms")
        if info.get("precision") != self.precision or not isinstance(round_, int):
            return nothing
        return (
            round_,
            content if isinstance(content, str) else None,
            sent if isinstance(sent, int) else -1,
        )


class Follower:
    """An inference-only device: keeps its served ONNX model current, trains nothing.

    Subscribes to the fleet's broadcast model and the coordinator's status, and takes
    only what the coordinator signed (``config.coordinator_key``; a forged model is
    dropped with one log line and never served). With a device key it publishes a
    retained status (``idle`` with the round served, ``error`` when a refresh failed,
    ``offline`` as its last will) on its own status topic; it never says hello: the
    coordinator does not select it.

    Args:
        config: identity, broker and connection settings (the training fields are not
            used).
        transport: a not yet connected transport.
        refresher: where the model goes.
        codec: encoder / decoder with its limits; a default :class:`Codec` if None.

    Raises:
        ConfigError: no coordinator public key without ``insecure_no_auth``.
    """

    def __init__(
        self,
        config: ClientConfig,
        transport: Transport,
        refresher: ModelRefresher,
        *,
        codec: Codec | None = None,
    ) -> None:
        self.config = config
        self.transport = transport
        self.refresher = refresher
        self._topics = Topics(config.fleet)
        # the follower reads fleet-wide topics only, which the coordinator signs; a device
        # key, where it has one, seals its own status (without one it publishes none)
        insecure = config.insecure_no_auth
        fleet_key = None if insecure else config.fleet_key()
        if not insecure and fleet_key is None:
            raise ConfigError(
                "follow needs the coordinator's public key to check the models it serves: "
                "give --coordinator-key-file FILE (the .pub of its signing key) or "
                "--insecure-no-auth"
            )
        self._publishes_status = insecure or config.auth_key is not None
        auth = None if insecure else config.keyring() if config.auth_key else Keyring()
        self._channel = Channel(
            transport, codec, max_payload=config.max_payload, auth=auth, fleet_key=fleet_key
        )
        self._status_topic = self._topics.device(config.device_id, "status")
        self._session = new_session()
        self._refusals = RateLimitedLog(logger)
        """Bad or foreign frames anyone on the broker may send: one WARNING per topic a
        minute, the rest at DEBUG."""
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._lifecycle = threading.Lock()

    def start(self) -> None:
        """Connect (with retries), subscribe and publish ``idle``.

        Raises:
            ConnectError: no session within ``connect_retry_s``, or subscribing failed.
        """
        with self._lifecycle:
            will = None
            if self._publishes_status:
                offline = self._message(DeviceStatus(state="offline", session=self._session))
                frame = self._channel.encode(self._status_topic, offline)
                will = Will(self._status_topic, frame, retain=True)
            if not connect_with_retry(self.transport, self.config, will, self._stop):
                self._stopped.set()
                return
            try:
                self._channel.subscribe(
                    self._topics.broadcast_model, self._on_model, on_error=self._on_bad
                )
                self._channel.subscribe(
                    self._topics.coordinator_status, self._on_coordinator, on_error=self._on_bad
                )
            except TransportError as exc:
                self.transport.disconnect()
                self._stopped.set()
                raise ConnectError(f"subscribing failed: {exc}") from exc
            self.transport.on_reconnect(self._idle)
            self._idle()
            logger.info(
                "device %s follows fleet %s: serving %s (%s, round %d)",
                self.config.device_id,
                self.config.fleet,
                self.refresher.onnx_path,
                self.refresher.precision,
                self.refresher.round,
            )

    def stop(self) -> None:
        """Publish ``offline`` and disconnect cleanly. Idempotent."""
        self._stop.set()
        with self._lifecycle:
            if self._stopped.is_set():
                return
            if self.transport.is_connected:
                self._publish_status("offline")
            self.transport.disconnect()
            self._stopped.set()
            logger.info("device %s stopped", self.config.device_id)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until stopped; False if ``timeout`` (seconds) passed first."""
        return self._stopped.wait(timeout)

    def _idle(self) -> None:
        served = self.refresher.round
        self._publish_status("idle", f"serving round {served}" if served >= 0 else "no model yet")

    def _on_model(self, topic: str, message: Message) -> None:
        if message.fleet != self.config.fleet:
            self._refusals.warning(
                f"fleet:{topic}", "ignored a model of fleet %r on %s", message.fleet, topic
            )
            return
        try:
            if self.refresher.apply(message):
                self._idle()
        except (EdgeClientError, DecodeError, OSError) as exc:
            logger.error("round %d: the served model was not refreshed: %s", message.round, exc)
            self._publish_status("error", f"round {message.round}: {exc}")

    def _on_coordinator(self, topic: str, message: Message) -> None:
        if isinstance(message.body, CoordinatorStatus) and message.fleet == self.config.fleet:
            logger.info("coordinator status: %s %s", message.body.state, message.body.detail)

    def _on_bad(self, topic: str, error: DecodeError) -> None:
        self._refusals.warning(f"bad:{topic}", "dropped a message on %s: %s", topic, error)

    def _publish_status(self, state: DeviceState, detail: str = "") -> None:
        if self._publishes_status:
            publish_status(self._channel, self.config, state, detail, self._session)

    def _message(self, body: DeviceStatus) -> Message:
        return Message(fleet=self.config.fleet, sender=self.config.device_id, body=body)
