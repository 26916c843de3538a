"""What the device session exchanges with its shell: the jobs it hands the trainer and
their results, the events it is fed and the actions it returns
(:class:`~edge_client.train.session.DeviceSession`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from edge_client.link import DeviceState
from edge_client.train.client_state import SavedState
from edge_client.train.task import LocalTask
from protocol.messages import Message, RoundTask
from protocol.tensorset import TensorSet

__all__ = [
    "Action",
    "Cancelled",
    "CommitUpload",
    "CoordinatorStatusReceived",
    "DecodeJob",
    "Decoded",
    "Event",
    "Failed",
    "Job",
    "JobDone",
    "JobResult",
    "NeedsBase",
    "Publish",
    "Received",
    "Reconnected",
    "Rejected",
    "RunJob",
    "SaveModel",
    "SaveState",
    "SaveUnacked",
    "SendUpdate",
    "SetStatus",
    "Started",
    "Stop",
    "Tick",
    "TrainJob",
    "Trained",
    "UpdateSent",
]


# -- jobs and their results (the trainer seam) ---------------------------------------------


@dataclass(frozen=True)
class DecodeJob:
    """Decode the task's sets into a :class:`LocalTask` and check it fits the model."""

    message: Message
    task: RoundTask
    sets: dict[str, TensorSet] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainJob:
    """Train ``local`` and encode the upload the task asks for."""

    message: Message
    task: RoundTask
    local: LocalTask
    decode_s: float


Job = DecodeJob | TrainJob


@dataclass(frozen=True)
class Decoded:
    task_id: str
    local: LocalTask
    decode_s: float
    held_base: str | None
    """Content fingerprint of the model the device holds now (None: none)."""


@dataclass(frozen=True)
class NeedsBase:
    """A set is a delta against a model the device does not hold."""

    task_id: str
    reason: str
    held_base: str | None


@dataclass(frozen=True)
class Rejected:
    """The task cannot be run (missing or bad payload, unsupported upload, wrong model)."""

    task_id: str
    reason: str


@dataclass(frozen=True)
class Trained:
    task_id: str
    num_samples: int
    weights: TensorSet
    metrics: dict[str, float]
    timings: dict[str, float]
    """Seconds by phase (``decode_s``, training's own, ``encode_s``)."""


@dataclass(frozen=True)
class Failed:
    """Training or encoding raised ``error``."""

    task_id: str
    error: Exception


@dataclass(frozen=True)
class Cancelled:
    """Training stopped because the device stops."""

    task_id: str


JobResult = Decoded | NeedsBase | Rejected | Trained | Failed | Cancelled


# -- events --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Started:
    """The device is connected and subscribed."""


@dataclass(frozen=True)
class Received:
    """A decoded message on the device's inbox topic ``topic``."""

    topic: str
    message: Message
    now: float
    """Monotonic seconds."""


@dataclass(frozen=True)
class CoordinatorStatusReceived:
    topic: str
    message: Message


@dataclass(frozen=True)
class Reconnected:
    """The connection to the broker was restored."""


@dataclass(frozen=True)
class Tick:
    """Time passes (monotonic seconds): tasks whose model did not come are dropped, an
    update without an ack in time is sent again."""

    now: float


@dataclass(frozen=True)
class JobDone:
    result: JobResult


@dataclass(frozen=True)
class UpdateSent:
    """The :class:`SendUpdate` of ``task_id`` was published (``ok``) or given up."""

    task_id: str
    ok: bool


Event = Started | Received | CoordinatorStatusReceived | Reconnected | Tick | JobDone | UpdateSent


# -- actions -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Publish:
    """Publish once; a failure is logged and changes nothing."""

    topic: str
    message: Message
    retain: bool = False
    latest: bool = False


@dataclass(frozen=True)
class SetStatus:
    """Publish the device's retained :class:`~protocol.messages.DeviceStatus`."""

    state: DeviceState
    detail: str = ""


@dataclass(frozen=True)
class SendUpdate:
    """Publish the update, retrying as the device's
    :class:`~edge_client.train.retry.RetrySchedule` says; answer :class:`UpdateSent` (or
    nothing when the device stops meanwhile)."""

    topic: str
    message: Message
    task_id: str


@dataclass(frozen=True)
class RunJob:
    """Run ``job`` on the trainer (off the transport's thread); answer :class:`JobDone`."""

    job: Job


@dataclass(frozen=True)
class SaveState:
    saved: SavedState


@dataclass(frozen=True)
class SaveUnacked:
    """Persist the update sent and not yet acknowledged (None: it was acknowledged, or
    given up): a device killed before the ack sends it again at its restart."""

    message: Message | None


@dataclass(frozen=True)
class SaveModel:
    """Persist the trainer's model (it was just trained)."""


@dataclass(frozen=True)
class CommitUpload:
    """The update was sent: keep its uplink residual (error feedback)."""


@dataclass(frozen=True)
class Stop:
    """Stop the device: the coordinator finished its run, or (``exit_when_refused``) it
    refused the device's hello or none answered it (the session's ``refusal`` says)."""


Action = (
    Publish
    | SetStatus
    | SendUpdate
    | RunJob
    | SaveState
    | SaveUnacked
    | SaveModel
    | CommitUpload
    | Stop
)
