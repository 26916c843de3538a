"""Message schemas: one envelope, seven body kinds (pydantic 2, discriminated by ``kind``).

``Message`` is the envelope (protocol version, fleet, round, sender, message id, send
time) around one body. The body's ``kind`` decides its schema:

============== ================================ =========================================
kind           body                             sent by / to
============== ================================ =========================================
hello          :class:`Hello`                   device -> coordinator on (re)connect
task           :class:`RoundTask`               coordinator -> selected device
model          :class:`ModelPayload`            coordinator -> devices (named tensor sets)
update         :class:`Update`                  device -> coordinator, a round's result
ack            :class:`Ack`                     coordinator -> device: accept / reject
device_status  :class:`DeviceStatus`            device, retained (last will: offline)
coord_status   :class:`CoordinatorStatus`       coordinator, retained
============== ================================ =========================================

The round a message belongs to lives in the envelope (``Message.round``; -1 when none).
All models are frozen and forbid unknown fields; strings and collections are bounded.
"""

from __future__ import annotations

import time
import uuid
from enum import Enum
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StringConstraints,
    model_serializer,
    model_validator,
)

from protocol.arrays import architecture_fingerprint
from protocol.tensors import Precision
from protocol.tensorset import TensorSet

__all__ = [
    "PROTOCOL_VERSION",
    "Ack",
    "Body",
    "CoordinatorStatus",
    "DeviceStatus",
    "Hello",
    "MAX_LAYOUT_NAME_CHARS",
    "MAX_LAYOUT_TENSORS",
    "Message",
    "ModelPayload",
    "ReasonCode",
    "RoundTask",
    "UploadSpec",
    "Update",
    "WeightFormat",
]

PROTOCOL_VERSION = 7
"""Version of the message schemas and of the frame layout; decoders reject others.
docs/protocol.md (section 11) lists what each version changed."""

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
Identifier = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
"""Device ids and fleet names: 1-64 of ``A-Z a-z 0-9 _ . -``, starting alphanumeric, so
they can stand in an MQTT topic level (no ``/``, ``+``, ``#``)."""
ShortText = Annotated[str, StringConstraints(max_length=64)]
Text = Annotated[str, StringConstraints(max_length=512)]
HexId = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]
Fingerprint = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{16}$")]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
Scalar = bool | int | FiniteFloat | Text
Metrics = Annotated[dict[ShortText, FiniteFloat], Field(max_length=64)]
Sets = Annotated[dict[ShortText, TensorSet], Field(max_length=16)]
MAX_LAYOUT_TENSORS = 1024
"""Most tensors a hello's ``layout`` may list (a device with more leaves it out)."""
MAX_LAYOUT_NAME_CHARS = 256
"""Longest tensor name a hello's ``layout`` may hold (a device with longer ones leaves
the layout out)."""
Dimension = Annotated[int, Field(ge=0, le=2**31 - 1)]
SampleShape = Annotated[
    tuple[Annotated[int, Field(ge=1, le=2**31 - 1)], ...], Field(min_length=1, max_length=8)
]
Layout = Annotated[
    dict[
        Annotated[str, StringConstraints(min_length=1, max_length=MAX_LAYOUT_NAME_CHARS)],
        Annotated[tuple[Dimension, ...], Field(max_length=8)],
    ],
    Field(min_length=1, max_length=MAX_LAYOUT_TENSORS),
]
WeightFormat = Literal["float", "int8", "binary"]
"""The number format a device runs its classifier's weights at (``models.weight_formats``):
as trained, int8 per output channel (the int8 ONNX model) or binarized per output channel."""


class _Body(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Hello(_Body):
    """A device announces itself: identity, model, capabilities, data size, consent."""

    kind: Literal["hello"] = "hello"
    device_id: Identifier
    architecture: ShortText
    """Registry name of the device's classifier (e.g. ``lenet5``)."""
    fingerprint: Fingerprint
    """Architecture fingerprint (see protocol.arrays.architecture_fingerprint)."""
    precisions: Annotated[tuple[Precision, ...], Field(min_length=1, max_length=8)]
    """Transfer precisions the device can decode and encode."""
    memory_bytes: Annotated[int, Field(ge=0)]
    threads: Annotated[int, Field(ge=1, le=1024)]
    software_version: ShortText
    num_samples: Annotated[int, Field(ge=0)]
    """Local training samples."""
    share_label_counts: bool = False
    """Consent to send per-class label counts (needed by FedGen). Off by default."""
    platform: ShortText = ""
    downlink_precision: Precision | None = None
    """The precision the device asks models in (None: the fleet's default); one of
    ``precisions``."""
    uplink_precision: Precision | None = None
    """The precision the device asks to upload in (None: the fleet's default); one of
    ``precisions``."""
    held_base: Fingerprint | None = None
    """Content fingerprint of the model the device holds from its last task (the base a
    downlink delta may be taken against), or None when it holds none."""
    weight_format: WeightFormat = "float"
    """The format the device runs its model's weights at; the coordinator trains the
    device through it (``binary``: the ``binarize`` hyperparameter) and FedDF takes the
    device's teacher at it. Absent (older devices): ``float``; left out of the
    encoding when ``float``."""
    input_shape: SampleShape | None = None
    """The shape of one of the device's samples (None: not said). With ``num_classes``
    and ``layout``, what a refusal of the device's model names the difference by."""
    num_classes: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    """The classes of the device's model (None: not said)."""
    layout: Layout | None = None
    """The device model's tensors, name -> shape: what its ``fingerprint`` is computed
    from (section 6), which the layout must give. None: not said (a model of more than
    :data:`MAX_LAYOUT_TENSORS` tensors, or with a longer name)."""

    @model_validator(mode="after")
    def _asks_what_it_speaks(self) -> Hello:
        for asked in (self.downlink_precision, self.uplink_precision):
            if asked is not None and asked not in self.precisions:
                raise ValueError(f"precision {asked.value} asked for but not in precisions")
        if self.layout is not None and architecture_fingerprint(self.layout) != self.fingerprint:
            raise ValueError(
                "the layout does not give the fingerprint (docs/protocol.md, section 6)"
            )
        return self

    @model_serializer(mode="wrap")
    def _defaults_left_out(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Leave ``weight_format`` out when it is ``float``, and the model's description
        (``input_shape``, ``num_classes``, ``layout``) where it is not said: a hello
        without them is then the bytes it was before the fields existed, while a
        coordinator that does not know a field refuses a hello carrying it
        (docs/protocol.md, section 4)."""
        data: dict[str, Any] = handler(self)
        if self.weight_format == "float":
            data.pop("weight_format", None)
        for key in ("input_shape", "num_classes", "layout"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class UploadSpec(_Body):
    """What a device uploads at the end of a round."""

    precision: Precision = Precision.FP32
    mode: Literal["full", "delta", "partial"] = "full"
    subset: Literal["all", "head", "features"] = "all"
    """Which tensors: all, only the prediction head, or only the feature extractor."""
    label_counts: bool = False
    """Whether to attach label counts (only with the device's consent)."""
    base: ShortText | None = None
    """For ``mode`` delta: the received set (of this task's model message) the delta is
    taken against, as the device decoded it; None for other modes."""

    @model_validator(mode="after")
    def _delta_has_base(self) -> UploadSpec:
        if (self.mode == "delta") != (self.base is not None):
            raise ValueError("a delta upload names its base set, and only a delta upload does")
        return self


class RoundTask(_Body):
    """The coordinator asks a device to train in this round."""

    kind: Literal["task"] = "task"
    strategy: ShortText
    hyperparameters: Annotated[dict[ShortText, Scalar], Field(max_length=64)] = {}
    deadline: FiniteFloat
    """Unix time (seconds) by which the update must arrive to count in this round."""
    downlink_precision: Precision = Precision.FP32
    uplink: UploadSpec = UploadSpec()
    payloads: Annotated[tuple[ShortText, ...], Field(max_length=16)] = ()
    """Names of the tensor sets of this round's model message the device uses."""
    model_message: HexId | None = None
    """Message id of the model message carrying those sets (None: keep current)."""


class ModelPayload(_Body):
    """Named tensor sets from the coordinator, e.g. ``student``/``teacher``."""

    kind: Literal["model"] = "model"
    sets: Sets


class Update(_Body):
    """A device's result for one round."""

    kind: Literal["update"] = "update"
    task_message: HexId | None = None
    """Message id of the task this answers."""
    num_samples: Annotated[int, Field(ge=0)]
    sets: Sets
    label_counts: (
        Annotated[tuple[Annotated[int, Field(ge=0)], ...], Field(max_length=65536)] | None
    ) = None
    metrics: Metrics = {}
    """Training metrics (loss, accuracy, ...)."""
    timings: Metrics = {}
    """Seconds spent per phase (download, train, encode, ...)."""


class ReasonCode(str, Enum):
    """Why the coordinator accepted or rejected a message."""

    OK = "ok"
    UNKNOWN_DEVICE = "unknown_device"
    WRONG_ROUND = "wrong_round"
    LATE = "late"
    DUPLICATE = "duplicate"
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"
    SHAPE_MISMATCH = "shape_mismatch"
    DTYPE_MISMATCH = "dtype_mismatch"
    NON_FINITE = "non_finite"
    MALFORMED = "malformed"
    UNSUPPORTED_PRECISION = "unsupported_precision"
    CONSENT_REQUIRED = "consent_required"
    UNKNOWN_BASE = "unknown_base"
    OVERSIZE = "oversize"
    NOT_SELECTED = "not_selected"
    UPDATE_NORM = "update_norm"
    INTERNAL = "internal"
    REPLAYED = "replayed"
    """Outside the replay window (docs/protocol.md, section 7): check the device's clock."""


class Ack(_Body):
    """Accept or reject a device's message, with a reason code."""

    kind: Literal["ack"] = "ack"
    accepted: bool
    reason: ReasonCode = ReasonCode.OK
    ref: HexId | None = None
    """Message id of the message acknowledged."""
    detail: Text = ""


class DeviceStatus(_Body):
    """A device's state; published retained, and as its last will (``offline``)."""

    kind: Literal["device_status"] = "device_status"
    state: Literal["online", "offline", "idle", "training", "uploading", "error"]
    detail: Text = ""
    rss_bytes: Annotated[int, Field(ge=0)] | None = None
    session: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")] | None = None
    """The device's session: 16 random hex digits drawn when it starts, the same in every
    status of that run and in its last will; the coordinator refuses an ``offline`` of
    another session than the device's newest status (docs/protocol.md, section 7)."""


class CoordinatorStatus(_Body):
    """The coordinator's state; published retained, and as its last will."""

    kind: Literal["coord_status"] = "coord_status"
    state: Literal["starting", "waiting", "running", "finished", "stopped"]
    strategy: ShortText = ""
    rounds_total: Annotated[int, Field(ge=0)] = 0
    devices_registered: Annotated[int, Field(ge=0)] = 0
    devices_online: Annotated[int, Field(ge=0)] = 0
    detail: Text = ""


Body = Annotated[
    Hello | RoundTask | ModelPayload | Update | Ack | DeviceStatus | CoordinatorStatus,
    Field(discriminator="kind"),
]
BODY_KINDS: tuple[str, ...] = tuple(
    cls.model_fields["kind"].default for cls in get_args(get_args(Body)[0])
)
"""The body kinds, in the order of :data:`Body`."""


class Message(BaseModel):
    """The envelope around one body; what :class:`protocol.codec.Codec` encodes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fleet: Identifier
    sender: Identifier
    """Device id, or the coordinator's id."""
    body: Body
    round: Annotated[int, Field(ge=-1, le=2**31 - 1)] = -1
    message_id: HexId = Field(default_factory=lambda: uuid.uuid4().hex)
    sent_at_ms: Annotated[int, Field(ge=0, le=2**63 - 1)] = Field(
        default_factory=lambda: time.time_ns() // 1_000_000
    )

    @property
    def kind(self) -> str:
        return self.body.kind

    @model_validator(mode="after")
    def _hello_from_its_device(self) -> Message:
        if isinstance(self.body, Hello) and self.body.device_id != self.sender:
            raise ValueError("a hello's device_id must equal the envelope's sender")
        return self

    def tensor_sets(self) -> dict[str, TensorSet]:
        """The tensor sets the body carries (empty for bodies without tensors)."""
        if isinstance(self.body, (ModelPayload, Update)):
            return dict(self.body.sets)
        return {}
