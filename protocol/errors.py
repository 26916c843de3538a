"""Errors raised by the `protocol` package.

Every error the package raises derives from :class:`ProtocolError`; foreign exceptions
(msgpack, zstandard, pydantic, paho-mqtt, socket errors) are converted at the boundary
where they occur and never escape raw::

    ProtocolError
    ├── DecodeError (also ValueError)    bytes from outside are malformed, too large,
    │   │                                 of an unknown version, fail a checksum or a
    │   │                                 decoder bound. Nothing partial is returned
    │   │                                 and no state is changed.
    │   └── QuotaError                   a chunk the reassembler has no room for (its
    │                                     source is over its quota, or not admitted).
    ├── EncodeError (also ValueError)    a value cannot be encoded as asked (NaN into
    │                                     int8, |x| > 65504 into fp16, a message
    │                                     larger than the codec's limits, ...).
    └── TransportError (also OSError)    connecting, publishing or subscribing failed.
        └── BrokerError                  the embedded broker failed to start or stop.

Callers can catch the package base class or the builtin one (``except ValueError``),
as msgpack-python does with ``FormatError(ValueError, UnpackException)``.
"""

from __future__ import annotations

__all__ = [
    "BrokerError",
    "DecodeError",
    "EncodeError",
    "ProtocolError",
    "QuotaError",
    "TransportError",
]


class ProtocolError(Exception):
    """Base class of every error raised by the `protocol` package."""


class DecodeError(ProtocolError, ValueError):
    """Input bytes could not be decoded: malformed, over a limit, or failing a check.

    The one error type every decoder in this package raises on bad input. It carries
    no partial result; the decoder's state (a reassembler, for instance) is unchanged
    unless the docstring of the method says otherwise.

    Where the envelope could be read before the error, ``message_id`` and ``round``
    name the message (so a receiver can reject it by id); else they are None.
    """

    message_id: str | None = None
    round: int | None = None


class QuotaError(DecodeError):
    """A chunk was refused for want of room: its source is over its quota of pending
    transfers or bytes, or is not admitted at all (the input may be well formed)."""


class EncodeError(ProtocolError, ValueError):
    """A value cannot be encoded as requested (for example a NaN into an int8 tensor)."""


class TransportError(ProtocolError, OSError):
    """A transport operation (connect, publish, subscribe) failed or timed out."""


class BrokerError(TransportError):
    """The embedded MQTT broker could not be started or stopped."""
