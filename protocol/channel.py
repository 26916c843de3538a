"""Messages over a transport: encode, chunk, publish; reassemble, decode, dispatch.

:class:`Channel` is what the runtimes use: they think in :class:`~protocol.messages.Message`
objects and topics, never in frames or chunks. The chunk size is the smaller of the
configured maximum payload (default 128 KiB) and what the broker's MQTT 5 Maximum
Packet Size leaves after the PUBLISH header.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from protocol.auth import AuthError, KeySource, seal, topic_device, verify
from protocol.chunking import (
    CHUNK_HEADER_SIZE,
    DEFAULT_MAX_PAYLOAD,
    Reassembler,
    SourceFilter,
    split_frame,
)
from protocol.codec import Codec, read_frame_header, signed_twin
from protocol.errors import DecodeError, EncodeError
from protocol.limits import ReassemblyLimits
from protocol.messages import Message
from protocol.signing import SigningKey, VerifyKey
from protocol.topics import parse_topic
from protocol.transport.base import Inbound, Transport
from protocol.transport.wire import publish_packet_size

__all__ = ["Channel", "Sent"]

log = logging.getLogger(__name__)

FRAMES_KEPT = 4
"""Messages whose frame a :class:`Channel` keeps, to send them again without encoding
(a round's model to each of its devices: the group's model messages and the task sent
between two of them)."""

MessageHandler = Callable[[str, Message], None]
ErrorHandler = Callable[[str, DecodeError], None]
Check = Callable[[bytes], None]
"""Checks one frame's tag or signature; raises AuthError."""


@dataclass(frozen=True, slots=True)
class Sent:
    """What one :meth:`Channel.send` put on the wire."""

    frames: int
    """MQTT publishes (1, or the number of chunks)."""
    payload_bytes: int
    """Sum of the MQTT payloads, in bytes."""
    message_bytes: int
    """Size of the unchunked message frame, in bytes."""


class Channel:
    """Sends and receives :class:`Message` objects over one :class:`Transport`.

    Args:
        transport: a connected (or soon connected) transport.
        codec: encoder/decoder with its limits; a default :class:`Codec` if None.
        max_payload: largest MQTT payload to publish, in bytes; larger frames are chunked.
        reassembly: limits of the chunk reassembler.
        admit: which topics may hold incomplete chunked transfers (all when None); see
            :class:`~protocol.chunking.Reassembler`.
        auth: the keys of the devices whose topics this channel authenticates (a
            :class:`~protocol.auth.Keyring`, or any :class:`~protocol.auth.KeySource`);
            None: no authentication (insecure; for tests and trusted networks only).
        fleet_key: the coordinator's key for fleet-wide topics (docs/protocol.md, section
            2.5): its :class:`~protocol.signing.SigningKey` (the coordinator: what it
            publishes there is signed) or its :class:`~protocol.signing.VerifyKey` (a
            device: what it reads there must verify). With ``auth`` set and no key, every
            frame on a fleet-wide topic is refused and publishing there fails; without
            ``auth`` nothing is signed or checked.
    """

    def __init__(
        self,
        transport: Transport,
        codec: Codec | None = None,
        *,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        reassembly: ReassemblyLimits | None = None,
        admit: SourceFilter | None = None,
        auth: KeySource | None = None,
        fleet_key: SigningKey | VerifyKey | None = None,
    ) -> None:
        if max_payload <= CHUNK_HEADER_SIZE:
            raise ValueError(f"max_payload must exceed the {CHUNK_HEADER_SIZE}-byte chunk header")
        self.transport = transport
        self.codec = codec or Codec()
        self.max_payload = max_payload
        self.auth = auth
        self.fleet_key = fleet_key
        self._reassembler = Reassembler(reassembly, admit=admit)
        self._lock = threading.Lock()
        self._frames_lock = threading.Lock()
        self._frames: OrderedDict[int, tuple[Message, bytes]] = OrderedDict()
        """The unsealed frames of the last messages encoded, by identity (each holds its
        message, so an id is not reused while it is here)."""

    def max_payload_for(self, topic: str, qos: int = 1) -> int:
        """Largest payload to publish on ``topic``, honouring the broker's MQTT 5 limit."""
        limit = self.transport.max_packet_size
        if limit is None:
            return self.max_payload
        overhead = publish_packet_size(topic, 0, qos, self.transport.protocol_version)
        # the remaining-length field may grow by up to 3 bytes with the payload
        return max(CHUNK_HEADER_SIZE + 1, min(self.max_payload, limit - overhead - 3))

    def send(
        self,
        topic: str,
        message: Message,
        *,
        qos: int = 1,
        retain: bool = False,
        latest: bool = False,
    ) -> Sent:
        """Encode ``message``, chunk it if needed and publish it on ``topic``.

        ``retain`` keeps the message on the broker for later subscribers; ``latest``
        retains it only when it fits in one frame and else sends its chunks unretained
        (for a topic whose newest value is welcome but not required, like the broadcast
        model).

        Raises:
            EncodeError: the message cannot be encoded, or a retained message would need
                chunks (a broker keeps only the last retained publish of a topic).
            TransportError: publishing failed.
        """
        frame = self.encode(topic, message)
        frames = self.split(topic, frame, self.max_payload_for(topic, qos))
        if retain and len(frames) > 1:
            raise EncodeError("a retained message must fit in one frame")
        retain = retain or (latest and len(frames) == 1)
        for part in frames:
            self.transport.publish(topic, part, qos=qos, retain=retain)
        return Sent(len(frames), sum(len(f) for f in frames), len(frame))

    def split(
        self, topic: str, frame: bytes, max_payload: int, *, transfer_id: bytes | None = None
    ) -> list[bytes]:
        """``frame`` (from :meth:`encode`) as the payloads to publish on ``topic``:
        itself where it fits in ``max_payload``, else its chunk frames, each sealed where
        the channel has a key for the topic, or signed where ``frame`` is.

        Raises:
            EncodeError: ``max_payload`` leaves no room for chunk data.
        """
        parts = split_frame(frame, max_payload, transfer_id=transfer_id)
        if len(parts) == 1 or self.auth is None:
            return parts
        if isinstance(self.fleet_key, SigningKey) and read_frame_header(frame).signed:
            return [self.fleet_key.sign(topic, part) for part in parts]
        key = self.auth.key_for(topic)
        return parts if key is None else [seal(key, topic, part) for part in parts]

    def encode(self, topic: str, message: Message) -> bytes:
        """The message frame of ``message`` for ``topic``, sealed where the channel has a
        key for the topic, signed on a fleet-wide topic (also for a last will, which the
        broker publishes later).

        Raises:
            EncodeError: the message cannot be encoded, or the channel authenticates and
                has no key for the device ``topic`` names, or no signing key for a
                fleet-wide topic.
        """
        frame = self._frame(message)
        if self.auth is None:
            return frame
        if topic_device(topic) is None:
            if not isinstance(self.fleet_key, SigningKey):
                raise EncodeError(
                    f"{topic} is fleet-wide: only the coordinator's signing key may publish there"
                )
            return self.fleet_key.sign(topic, signed_twin(frame))
        key = self.auth.key_for(topic)
        if key is None:
            raise EncodeError(f"no key for the device of {topic}")
        return seal(key, topic, frame)

    def _frame(self, message: Message) -> bytes:
        """``message`` encoded, once while it is among the :data:`FRAMES_KEPT` messages
        sent last: a message sent to many topics (one model to many devices, each copy
        sealed under its device's key) is compressed once."""
        with self._frames_lock:
            kept = self._frames.get(id(message))
            if kept is not None:
                self._frames.move_to_end(id(message))
                return kept[1]
        frame = self.codec.encode(message)
        with self._frames_lock:
            self._frames[id(message)] = (message, frame)
            while len(self._frames) > FRAMES_KEPT:
                self._frames.popitem(last=False)
        return frame

    def subscribe(
        self,
        topic_filter: str,
        handler: MessageHandler,
        *,
        on_error: ErrorHandler | None = None,
        qos: int = 1,
    ) -> None:
        """Call ``handler(topic, message)`` for every complete message on ``topic_filter``.

        Bad input (malformed frames, failed checks, limits) never reaches ``handler``:
        it goes to ``on_error(topic, error)`` if given, else it is logged as a warning.
        With a keyring, a frame that fails authentication is an
        :class:`~protocol.auth.AuthError` and nothing of it is decompressed; so is input
        that fails before its tag can be checked (a bad frame header, a bad chunk, a
        transfer without room) on an authenticated topic, and any input on a topic outside
        the layout (:func:`~protocol.topics.parse_topic`). On a fleet-wide topic the check
        is the coordinator's signature (``fleet_key``): of the frame, or of each of its
        chunks. Input that passes is reported to the key source (``authenticated``) before
        it is decoded.
        """

        def receive(inbound: Inbound) -> None:
            try:
                check = self._check_for(inbound.topic)
                with self._lock:
                    frame = self._feed(inbound.topic, inbound.payload, check)
                if frame is None:
                    return
                if check is not None and not self._checked_whole(inbound.topic, frame, inbound):
                    check(frame)
                    self._authenticated(inbound.topic)
                message = self.codec.decode(frame)
            except DecodeError as exc:
                if on_error is not None:
                    on_error(inbound.topic, exc)
                else:
                    log.warning("dropped bad payload on %s: %s", inbound.topic, exc)
                return
            handler(inbound.topic, message)

        self.transport.subscribe(topic_filter, receive, qos=qos)

    @staticmethod
    def _checked_whole(topic: str, frame: bytes, inbound: Inbound) -> bool:
        """Whether ``frame``, a signed frame reassembled from chunks on a fleet-wide
        topic, needs no check of its own: each of its chunks' signatures verified before
        it took a buffer, each binds the SHA-256 of the whole frame, and the reassembler
        matched it. (Checking the whole again would hash every byte a second time.)"""
        return (
            frame is not inbound.payload
            and topic_device(topic) is None
            and read_frame_header(frame).signed
        )

    def authenticate(self, topic: str, frame: bytes) -> None:
        """Check one whole message frame received on ``topic`` outside :meth:`subscribe`
        (a receiver that decodes it itself), as :meth:`subscribe` would: its tag, or its
        signature on a fleet-wide topic; nothing without ``auth``.

        Raises:
            AuthError: it does not verify, or this channel has no key to check it with.
        """
        check = self._check_for(topic)
        if check is not None:
            with _unauthenticated(topic):
                check(frame)

    def _feed(self, topic: str, payload: bytes, check: Check | None) -> bytes | None:
        """Reassemble; on an authenticated topic a frame that fails before its tag can be
        checked (bad header, bad chunk, no room) is unauthenticated input: AuthError.

        Raises:
            DecodeError: as :meth:`Reassembler.feed`, AuthError where ``check`` is set.
        """
        if check is None:
            return self._reassembler.feed(topic, payload)
        with _unauthenticated(topic):
            if read_frame_header(payload).chunk:
                check(payload)  # a forged chunk never takes a buffer
            return self._reassembler.feed(topic, payload)

    def _check_for(self, topic: str) -> Check | None:
        """How a frame on ``topic`` is checked; None where nothing is (no ``auth``).

        Raises:
            AuthError: the topic names a device this channel has no key for, is
                fleet-wide and the channel has no coordinator key, or (with a keyring) is
                not a topic of the layout at all.
        """
        if self.auth is None:
            return None
        device_id = topic_device(topic)
        if device_id is not None:
            key = self.auth.receive_key(device_id)
            return lambda frame: _check_tag(key, topic, frame)
        try:
            parse_topic(topic)
        except DecodeError:
            raise AuthError(f"topic {topic!r} is outside the layout") from None
        fleet_key = self.fleet_key
        if fleet_key is None:
            raise AuthError(
                f"{topic} is fleet-wide and this peer has no coordinator public key to "
                "check its signature with (refused)"
            )
        return lambda frame: fleet_key.verify(topic, frame)

    def _authenticated(self, topic: str) -> None:
        device_id = topic_device(topic)
        if self.auth is not None and device_id is not None:
            self.auth.authenticated(device_id)

    def unsubscribe(self, topic_filter: str) -> None:
        """Stop receiving on ``topic_filter``."""
        self.transport.unsubscribe(topic_filter)


@contextlib.contextmanager
def _unauthenticated(topic: str) -> Iterator[None]:
    """Input on an authenticated ``topic`` that fails before its tag or signature can be
    checked cannot be told from an attacker's: its DecodeError becomes an AuthError."""
    try:
        yield
    except AuthError:
        raise
    except DecodeError as exc:
        raise AuthError(f"unauthenticated input: {exc}", topic_device(topic)) from exc


def _check_tag(key: bytes, topic: str, frame: bytes) -> None:
    """The tag check of a device topic's frame: only unsigned types carry a tag.

    Raises:
        AuthError: a signed frame, or the tag does not verify.
    """
    if read_frame_header(frame).signed:
        raise AuthError(f"a signed frame on {topic}, a device's topic", topic_device(topic))
    verify(key, topic, frame)
