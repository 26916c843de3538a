"""Wire protocol of the edge FL runtime: schemas, codec, tensor encodings, chunking,
topics and transports. Never imports torch.

Typical use::

    from protocol import Codec, Message, ModelPayload, encode_tensors

    sets = {"global": encode_tensors(state_arrays, "int8")}
    frame = Codec().encode(Message(fleet="lab", sender="coordinator",
                                   body=ModelPayload(sets=sets)))
    message = Codec().decode(frame)           # DecodeError on any bad input
    arrays = message.tensor_sets()["global"].to_arrays()

Transports (MQTT on paho, the in-memory twin, the embedded broker) live in
:mod:`protocol.transport`; :class:`Channel` moves messages over one of them.
See docs/protocol.md for the byte-level format.
"""

from protocol.arrays import apply_delta, architecture_fingerprint, content_fingerprint, delta_arrays
from protocol.channel import Channel, Sent
from protocol.chunking import DEFAULT_MAX_PAYLOAD, Reassembler, split_frame
from protocol.codec import Codec
from protocol.errors import (
    BrokerError,
    DecodeError,
    EncodeError,
    ProtocolError,
    QuotaError,
    TransportError,
)
from protocol.limits import DecodeLimits, ReassemblyLimits
from protocol.messages import (
    PROTOCOL_VERSION,
    Ack,
    CoordinatorStatus,
    DeviceStatus,
    Hello,
    Message,
    ModelPayload,
    ReasonCode,
    RoundTask,
    Update,
    UploadSpec,
)
from protocol.tensors import EncodedTensor, Encoding, Precision, encode_array, encoding_for
from protocol.tensorset import TensorSet, encode_tensors
from protocol.topics import Topics, parse_topic

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MAX_PAYLOAD",
    "PROTOCOL_VERSION",
    "Ack",
    "BrokerError",
    "Channel",
    "Codec",
    "CoordinatorStatus",
    "DecodeError",
    "DecodeLimits",
    "DeviceStatus",
    "EncodeError",
    "EncodedTensor",
    "Encoding",
    "Hello",
    "Message",
    "ModelPayload",
    "Precision",
    "ProtocolError",
    "QuotaError",
    "ReasonCode",
    "ReassemblyLimits",
    "Reassembler",
    "RoundTask",
    "Sent",
    "TensorSet",
    "Topics",
    "TransportError",
    "Update",
    "UploadSpec",
    "apply_delta",
    "architecture_fingerprint",
    "content_fingerprint",
    "delta_arrays",
    "encode_array",
    "encode_tensors",
    "encoding_for",
    "parse_topic",
    "split_frame",
]
